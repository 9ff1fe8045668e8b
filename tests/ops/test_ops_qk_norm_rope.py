"""qk_norm_rope: the heads' split of the packed qkv projection, the per-head QK-norm and the 2-D rotation fused,
against float64 autograd of the modern block's own eager code (``models/modern.py``: RMSNorm with a weight, then
``apply_rope2d``), every backend and instruction set, outputs and gradients, odd sizes."""

import sys

import pytest
import torch
from conftest import assert_near_reference, op_backends

from diffcurr_fast.models.modern import apply_rope2d, rope2d_tables
from diffcurr_fast.ops import _backend, qk_norm_rope

qk_module = sys.modules[qk_norm_rope.__module__]
CPU = torch.device("cpu")
# (B, grid, heads, head_dim): N = grid^2 tokens; odd batch, token and head counts, head dims below and above the
# instruction sets' lane counts
SIZES = [(1, 1, 1, 4), (3, 3, 2, 12), (2, 4, 3, 16), (1, 5, 1, 68)]
MODES = ["norm+rope", "norm", "rope", "split"]


def _need(backend: str) -> None:
    reason = _backend.unavailable_reason(backend, "qk_norm_rope_fwd", CPU)
    if reason is not None:
        pytest.skip(reason)


def _model_eager(qkv, heads, wq, wk, tables, eps=1e-6):
    """The attention's eager path (models/dit.py Attention.forward): views of qkv, RMSNorm, then the rotation."""
    B, N, C = qkv.shape
    q, k, v = qkv.reshape(B, N, 3, heads, C // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)
    if wq is not None:
        q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + eps) * wq  # Zhang & Sennrich Eq. 4, per head
        k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + eps) * wk
    if tables is not None:
        q, k = apply_rope2d(q, *tables), apply_rope2d(k, *tables)  # RoFormer Eq. 34 in 2-D
    return q, k, v


def _case(size, mode, dtype=torch.float32, per_sample=False):
    B, grid, heads, dh = size
    g = torch.Generator().manual_seed(sum(size))
    qkv = (torch.randn(B, grid * grid, 3 * heads * dh, generator=g) * 2 + 0.3).to(dtype).requires_grad_()
    weights = (None, None)
    if "norm" in mode:
        weights = tuple((1 + 0.3 * torch.randn(dh, generator=g)).requires_grad_() for _ in range(2))
    tables = None
    if "rope" in mode:
        cos, sin = rope2d_tables(grid, dh)
        if per_sample:  # as token routing gathers them: (B, 1, K, Dh/2) rows of the tables, per sample
            idx = torch.stack([torch.randperm(grid * grid, generator=g) for _ in range(B)])
            cos, sin = cos[idx].unsqueeze(1), sin[idx].unsqueeze(1)
        tables = (cos, sin)
    return qkv, heads, weights, tables


def _check(backend, size, mode, per_sample=False, rel=1e-5):
    qkv, heads, (wq, wk), tables = _case(size, mode, per_sample=per_sample)
    outs = qk_norm_rope(qkv, heads, wq, wk, *(tables or (None, None)), backend=backend)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    leaves = [qkv, wq, wk]
    ref_leaves = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    ref_tables = None if tables is None else tuple(t.double() for t in tables)
    ref = _model_eager(ref_leaves[0], heads, ref_leaves[1], ref_leaves[2], ref_tables)
    torch.autograd.backward(ref, [g.double() for g in grads])
    for name, mine, theirs in zip("qkv", outs, ref):
        assert mine.is_contiguous() and mine.shape == theirs.shape
        assert_near_reference(mine, theirs, rel, name)
    for name, mine, theirs in zip(("qkv", "q_weight", "k_weight"), leaves, ref_leaves):
        if mine is not None:
            assert_near_reference(mine.grad, theirs.grad, 10 * rel, f"grad {name}")


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("mode", MODES)
def test_matches_the_models_eager_path_in_float64(backend, size, mode):
    _need(backend)
    _check(backend, size, mode)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_per_sample_tables_rotate_each_sample_by_its_own_positions(backend):
    """Token routing gathers the tables' rows per sample: (B, 1, K, Dh/2) tables give each sample its rotation."""
    _need(backend)
    _check(backend, (3, 3, 2, 12), "norm+rope", per_sample=True)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(backend, dtype):
    """float32 arithmetic inside and one rounding to the dtype (the eager path rounds after the norm and again after
    the rotation); float32 weights and tables, gradients in the leaves' dtypes."""
    _need(backend)
    qkv, heads, (wq, wk), tables = _case((2, 4, 3, 16), "norm+rope")
    qkv = qkv.detach().to(dtype).requires_grad_()
    outs = qk_norm_rope(qkv, heads, wq, wk, *tables, backend=backend)
    assert all(o.dtype == dtype for o in outs)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    ref_leaves = [t.detach().double().requires_grad_() for t in (qkv, wq, wk)]
    ref = _model_eager(ref_leaves[0], heads, ref_leaves[1], ref_leaves[2], tuple(t.double() for t in tables))
    torch.autograd.backward(ref, [g.double() for g in grads])
    for mine, theirs in zip(outs, ref):
        assert_near_reference(mine, theirs, 1e-2, "output")
    assert qkv.grad.dtype == dtype and wq.grad.dtype == torch.float32
    for mine, theirs in zip((qkv, wq, wk), ref_leaves):
        assert_near_reference(mine.grad, theirs.grad, 3e-2, "grad")


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_only_the_requested_gradients_and_unused_outputs(backend):
    """Frozen weights get no gradient; an output that no loss reads (v here) counts as a zero gradient."""
    _need(backend)
    qkv, heads, (wq, wk), tables = _case((2, 3, 2, 8), "norm+rope")
    wq.requires_grad_(False)
    wk.requires_grad_(False)
    q, k, _ = qk_norm_rope(qkv, heads, wq, wk, *tables, backend=backend)
    (q.sum() + 2 * k.square().sum()).backward()
    r = qkv.detach().double().requires_grad_()
    rq, rk, _ = _model_eager(r, heads, wq.double(), wk.double(), tuple(t.double() for t in tables))
    (rq.sum() + 2 * rk.square().sum()).backward()
    assert wq.grad is None and wk.grad is None
    assert_near_reference(qkv.grad, r.grad, 1e-5, "grad qkv")
    assert bool((qkv.grad[..., 2 * heads * 8 :] == 0).all())  # v's part


def test_float64_gradcheck_on_the_reference():
    qkv, heads, (wq, wk), (cos, sin) = _case((2, 2, 1, 8), "norm+rope")
    leaves = [t.detach().double().requires_grad_() for t in (qkv, wq, wk)]
    torch.autograd.gradcheck(
        lambda *a: qk_norm_rope(a[0], heads, a[1], a[2], cos.double(), sin.double(), backend="reference"), leaves
    )


@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
def test_eager_function_equals_the_custom_op_bitwise(backend):
    _need(backend)
    qkv, heads, (wq, wk), (cos, sin) = _case((3, 3, 2, 12), "norm+rope")
    grads = [torch.randn(3, 2, 9, 12) for _ in range(3)]

    def run(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (qkv, wq, wk)]
        outs = fn(leaves[0], heads, leaves[1], leaves[2], cos, sin, 1e-6, backend)
        torch.autograd.backward(outs, grads)
        return [o.detach() for o in outs] + [t.grad for t in leaves]

    eager = run(qk_module._QkNormRopeFunction.apply)
    ops = run(qk_module._fwd_op)
    assert all(torch.equal(a, b) for a, b in zip(eager, ops))


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_opcheck(backend):
    _need(backend)
    qkv, heads, (wq, wk), (cos, sin) = _case((2, 2, 2, 8), "norm+rope")
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if backend == "triton":
        tests = tests[:3]  # the interpreter: keep it short
    op = torch.ops.diffcurr_fast
    for args in ((wq, wk, cos, sin), (None, None, cos, sin), (wq, wk, None, None)):
        torch.library.opcheck(op.qk_norm_rope.default, (qkv, heads, *args, 1e-6, backend), test_utils=tests)
    grads = [torch.randn(2, 2, 4, 8) for _ in range(3)]
    weights = (wq.detach(), wk.detach())
    for w, wgrad in ((weights, True), (weights, False), ((None, None), True)):
        args = (*grads, qkv.detach(), heads, *w, cos, sin, 1e-6, backend, wgrad)
        torch.library.opcheck(op.qk_norm_rope_backward.default, args, test_utils=tests)


def test_compiles_fullgraph_with_its_gradients():
    qkv, heads, (wq, wk), (cos, sin) = _case((2, 3, 2, 8), "norm+rope")

    def fn(qkv, wq, wk):
        q, k, v = qk_norm_rope(qkv, heads, wq, wk, cos, sin)
        return (q * k).sum() + v.square().sum()

    eager = torch.autograd.grad(fn(qkv, wq, wk), (qkv, wq, wk))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(qkv, wq, wk)
    for a, b in zip(eager, torch.autograd.grad(compiled, (qkv, wq, wk))):
        torch.testing.assert_close(a, b)
