"""Attention backends against a float64 softmax(q k^T / sqrt(d)) v reference: outputs and gradients."""

import math
import sys

import pytest
import torch

from diffcurr_fast.models.attention import (
    ATTENTION_BACKENDS,
    BackendUnavailableError,
    attention,
    available_backends,
    flash_attn_reason,
)

SHAPES = [(1, 1, 17, 8), (3, 2, 65, 24), (17, 3, 5, 40), (2, 4, 33, 12)]


def _ref(q, k, v, scale=None):
    """Float64 attention written out with einsum (independent of the module under test)."""
    q, k, v = (a.double() for a in (q, k, v))
    s = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    scores = torch.einsum("bhnd,bhmd->bhnm", q, k) * s
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    p = p / p.sum(-1, keepdim=True)
    return torch.einsum("bhnm,bhmd->bhnd", p, v)


def _check_against_ref(out, q, k, v, tol: float, grad_tol: float) -> None:
    """``out`` = attention(q, k, v) and its gradients against the float64 reference (tolerances absolute and
    relative)."""
    qr, kr, vr = (a.detach().double().requires_grad_(True) for a in (q, k, v))
    ref = _ref(qr, kr, vr)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    g = torch.randn_like(ref)
    out.backward(g.to(out.dtype))
    ref.backward(g)
    for a, r in ((q, qr), (k, kr), (v, vr)):
        torch.testing.assert_close(a.grad.double(), r.grad, atol=grad_tol, rtol=grad_tol)


def _inputs(shape, dtype, m=None):
    b, h, n, d = shape
    m = n if m is None else m
    q = torch.randn(b, h, n, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h, m, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h, m, d, dtype=dtype, requires_grad=True)
    return q, k, v


@pytest.mark.parametrize("backend", ["math", "sdpa", "auto"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_backend_matches_float64_reference(backend, shape, dtype):
    q, k, v = _inputs(shape, dtype)
    out = attention(q, k, v, backend)
    assert out.shape == shape and out.dtype == dtype
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    _check_against_ref(out, q, k, v, tol, tol * 10)


@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_cross_attention_lengths_and_scale(backend):
    q, k, v = _inputs((3, 2, 17, 8), torch.float64, m=9)
    out = attention(q, k, v, backend, scale=0.3)
    torch.testing.assert_close(out, _ref(q, k, v, scale=0.3), atol=1e-10, rtol=1e-10)


def test_math_softmax_is_float32_for_bf16_inputs():
    q, k, v = (a.detach().to(torch.bfloat16) for a in _inputs((3, 2, 65, 16), torch.float32))
    out = attention(q, k, v, "math")
    assert out.dtype == torch.bfloat16
    ref = _ref(q, k, v)
    # Only the final cast to bf16 rounds: error is at most half a bf16 ulp of the output, plus float32 noise.
    err = (out.double() - ref).abs()
    assert bool((err <= ref.abs() * 2.0**-8 + 1e-5).all())


def test_math_ignores_autocast():
    q, k, v = (a.detach() for a in _inputs((3, 2, 17, 16), torch.float32))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = attention(q, k, v, "math")
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), _ref(q, k, v), atol=2e-5, rtol=2e-5)


def test_zero_heads():
    q, k, v = _inputs((3, 0, 17, 8), torch.float32)
    for backend in ("math", "sdpa"):
        assert attention(q, k, v, backend).shape == (3, 0, 17, 8)


def test_unknown_backend_is_value_error():
    q, k, v = _inputs((1, 1, 5, 8), torch.float32)
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'.*auto, flash_attn, sdpa, math"):
        attention(q, k, v, "xformers")


@pytest.mark.parametrize(
    "shapes",
    [
        ((2, 1, 5, 8), (2, 1, 5, 8), (2, 1, 5)),
        ((2, 1, 5, 8), (2, 2, 5, 8), (2, 2, 5, 8)),
        ((2, 1, 5, 8),) * 2 + ((2, 1, 4, 8),),
    ],
)
def test_bad_shapes_are_value_errors(shapes):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match="attention"):
        attention(q, k, v, "math")


def test_available_backends_and_flash_reason():
    names = available_backends()
    assert names[:2] == ["math", "sdpa"]
    assert set(names) <= set(ATTENTION_BACKENDS) - {"auto"}
    assert ("flash_attn" in names) == (flash_attn_reason() is None)


def test_explicit_flash_attn_raises_with_reason_when_unusable():
    q, k, v = _inputs((1, 1, 5, 8), torch.float32)  # CPU float32: never usable by flash-attn
    reason = flash_attn_reason(q)
    assert reason is not None and len(reason) > 10
    with pytest.raises(BackendUnavailableError, match="'flash_attn' is unavailable: "):
        attention(q, k, v, "flash_attn")
    # auto falls back to sdpa for the same tensors
    torch.testing.assert_close(attention(q, k, v, "auto"), attention(q, k, v, "sdpa"))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "auto", "flash_attn"])
@pytest.mark.parametrize("shape", [(1, 1, 17, 64), (3, 16, 65, 72), (17, 6, 256, 64)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_cuda_backends_match_reference(backend, shape, dtype):
    if backend == "flash_attn" and flash_attn_reason(torch.empty(1, device="cuda", dtype=dtype)) is not None:
        pytest.skip(f"flash_attn unusable here: {flash_attn_reason(torch.empty(1, device='cuda', dtype=dtype))}")
    q, k, v = (a.detach().cuda().requires_grad_(True) for a in _inputs(shape, dtype))
    out = attention(q, k, v, backend)
    tol = 2e-2 if dtype == torch.bfloat16 else 4e-3
    _check_against_ref(out, q, k, v, tol, tol * 4)


def test_flash_attn_reason_checks_k_and_v(monkeypatch):
    # fake CUDA tensors (no device needed) and a stand-in flash-attn: only the tensor checks are exercised
    from torch._subclasses.fake_tensor import FakeTensorMode

    att = sys.modules[flash_attn_reason.__module__]
    monkeypatch.setattr(att, "_flash_attn_func", lambda: (object(), None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with FakeTensorMode():
        e = lambda dh=64, dtype=torch.bfloat16, device="cuda": torch.empty(1, 2, 5, dh, device=device, dtype=dtype)
        q = e()
        assert flash_attn_reason(q, e(), e()) is None
        assert "k of dtype torch.float32" in flash_attn_reason(q, e(dtype=torch.float32), e())
        assert "v on device cpu" in flash_attn_reason(q, e(), e(device="cpu"))
        assert "one dtype" in flash_attn_reason(q, e(dtype=torch.float16), e())
        assert "head_dim" in flash_attn_reason(q, e(), e(dh=512))
        assert "head dim of v" in flash_attn_reason(q, e(), e(dh=32))
