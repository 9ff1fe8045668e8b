"""Bad inputs of the modern block's fused ops: one-line ValueErrors that name what is wrong (docs/errors.md)."""

import pytest
import torch

from diffcurr_fast.ops import qk_norm_rope, rmsnorm_modulate, swiglu


def test_rmsnorm_modulate_refuses_bad_shapes_dtypes_weights_and_eps():
    x, v = torch.randn(2, 3, 4), torch.randn(2, 4)
    cases = [
        ((torch.randn(2, 4), v, v), {}, r"x must have shape \(B, N, D\), got \(2, 4\)"),
        ((x, torch.randn(2, 5), v), {}, r"shift must have shape \(2, 4\), got \(2, 5\)"),
        ((x, v, v.double()), {}, r"scale \(torch.float64, cpu\) must match x \(torch.float32, cpu\)"),
        ((x, v, v, torch.ones(5)), {}, r"weight must have shape \(4,\), got \(5,\)"),
        ((x, v, v, torch.ones(4, dtype=torch.float64)), {}, r"weight \(torch.float64, cpu\) must match x"),
        ((x, v, v), {"eps": 0.0}, r"eps must be a positive float, got 0.0"),
        ((x.int(), v, v), {}, r"x has dtype torch.int32; supported dtypes are"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            rmsnorm_modulate(*args, **kw)


def test_qk_norm_rope_refuses_bad_layouts_halves_and_tables():
    qkv, w = torch.randn(2, 9, 3 * 2 * 8), torch.ones(8)
    cos = sin = torch.ones(9, 4)
    cases = [
        ((torch.randn(2, 9, 2, 48), 2), {}, r"qkv must have shape \(B, N, 3 \* heads \* head_dim\)"),
        ((qkv, 5), {}, r"heads must be a positive int that divides qkv's last dimension 48"),
        ((qkv, 2, w), {}, r"give both q_weight and k_weight \(the QK-norm\) or neither"),
        ((qkv, 2, w, torch.ones(6)), {}, r"k_weight must have shape \(8,\), got \(6,\)"),
        ((qkv, 2, None, None, cos), {}, r"give both cos and sin \(the rotation\) or neither"),
        ((qkv, 2, None, None, torch.ones(9, 3), torch.ones(9, 3)), {}, r"cos must have shape \(9, 4\) or \(2, 9, 4\)"),
        ((torch.randn(2, 9, 3 * 2 * 7), 2, None, None, cos, sin), {}, r"the rotation needs an even head dim"),
        ((qkv, 2, None, None, cos.requires_grad_(), sin), {}, r"cos requires grad: the rotary tables are constants"),
        ((qkv, 2, w, w), {"eps": -1.0}, r"eps must be a positive float"),
    ]
    for args, kw, match in cases:
        with pytest.raises(ValueError, match=match):
            qk_norm_rope(*args, **kw)


def test_swiglu_refuses_an_odd_last_dimension():
    with pytest.raises(ValueError, match=r"x must have an even last dimension holding the two halves \[a, b\]"):
        swiglu(torch.randn(3, 7))
    with pytest.raises(ValueError, match=r"x has dtype torch.int64; supported dtypes are"):
        swiglu(torch.ones(3, 4, dtype=torch.long))
