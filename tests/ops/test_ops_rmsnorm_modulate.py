"""rmsnorm_modulate: RMSNorm + adaLN modulation fused, against float64 autograd of its formula, every backend and
every instruction set of the C++ kernels, outputs and gradients on odd sizes."""

import sys

import pytest
import torch
from conftest import assert_near_reference, op_backends

from diffcurr_fast.ops import _backend, rmsnorm_modulate

rms_module = sys.modules[rmsnorm_modulate.__module__]

CPU = torch.device("cpu")
SHAPES = [(1, 1, 5), (3, 7, 24), (2, 19, 72), (5, 3, 37)]


def _need(backend: str) -> None:
    reason = _backend.unavailable_reason(backend, "rmsnorm_modulate_fwd", CPU)
    if reason is not None:
        pytest.skip(reason)


def _formula(x, shift, scale, weight=None, eps=1e-6):
    # Zhang & Sennrich 2019 Eq. 4, then DiT's modulate (Sec. 3.2)
    h = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        h = h * weight
    return h * (1 + scale[:, None, :]) + shift[:, None, :]


def _leaves(shape, weighted, dtype=torch.float32):
    B, N, D = shape
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g) * 3 + 0.5
    out = [x, torch.randn(B, D, generator=g), torch.randn(B, D, generator=g)]
    out.append(1 + 0.5 * torch.randn(D, generator=g) if weighted else None)
    return [None if t is None else t.to(dtype).requires_grad_() for t in out]


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("weighted", [False, True], ids=["no-weight", "weight"])
def test_matches_float64_outputs_and_gradients(backend, shape, weighted):
    _need(backend)
    leaves = _leaves(shape, weighted)
    y = rmsnorm_modulate(*leaves, backend=backend)
    g = torch.randn_like(y)
    y.backward(g)
    ref_leaves = [None if t is None else t.detach().double().requires_grad_() for t in leaves]
    ref = _formula(*ref_leaves)
    ref.backward(g.double())
    assert_near_reference(y, ref, 1e-6, "y")
    for name, mine, theirs in zip(("x", "shift", "scale", "weight"), leaves, ref_leaves):
        if mine is not None:
            assert_near_reference(mine.grad, theirs.grad, 1e-5, f"grad {name}")


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("wanted", ["x", "shift", "scale+x", "weight"])
def test_only_the_requested_gradients(backend, wanted):
    """From a broadcast upstream gradient (y.sum()); the gradients not asked for stay None."""
    _need(backend)
    x, shift, scale, weight = (t.detach() for t in _leaves((3, 66, 33), True))
    leaves = {"x": x, "shift": shift, "scale": scale, "weight": weight}
    for name in wanted.split("+"):
        leaves[name].requires_grad_()
    (rmsnorm_modulate(x, shift, scale, weight, backend=backend).sum() * 0.5).backward()
    ins = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in leaves.items()}
    (_formula(ins["x"], ins["shift"], ins["scale"], ins["weight"]).sum() * 0.5).backward()
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            assert_near_reference(leaf.grad, ins[name].grad, 1e-5, name)
        else:
            assert leaf.grad is None


@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(backend, dtype):
    """float32 arithmetic inside, the result rounded once to the dtype; gradients in the leaves' dtypes."""
    _need(backend)
    leaves = _leaves((3, 17, 40), True, dtype)
    y = rmsnorm_modulate(*leaves, backend=backend)
    assert y.dtype == dtype
    g = torch.randn_like(y)
    y.backward(g)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref = _formula(*ref_leaves)
    ref.backward(g.double())
    assert_near_reference(y, ref, 1e-2, "y")
    for mine, theirs in zip(leaves, ref_leaves):
        assert mine.grad.dtype == dtype
        assert_near_reference(mine.grad, theirs.grad, 2e-2, "grad")


def test_float64_gradcheck_on_the_reference():
    x, shift, scale, weight = (t.detach().double().requires_grad_() for t in _leaves((2, 3, 5), True))
    torch.autograd.gradcheck(lambda *a: rmsnorm_modulate(*a, backend="reference"), (x, shift, scale, weight))


@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
@pytest.mark.parametrize("weighted", [False, True])
def test_eager_function_equals_the_custom_op_bitwise(backend, weighted):
    """Eager calls go through a plain autograd Function; the custom op (what torch.compile traces) gives the same
    outputs and gradients bit for bit."""
    _need(backend)
    g = torch.randn(3, 7, 24)

    def run(fn):
        leaves = _leaves((3, 7, 24), weighted)
        y = fn(*leaves, 1e-6, backend)[0]
        y.backward(g)
        return [y.detach()] + [t.grad for t in leaves if t is not None]

    eager = run(rms_module._RmsNormModulateFunction.apply)
    ops = run(rms_module._fwd_op)
    assert all(torch.equal(a, b) for a, b in zip(eager, ops))


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_opcheck(backend):
    _need(backend)
    x, shift, scale, weight = _leaves((3, 4, 6), True)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if backend == "triton":
        tests = tests[:3]  # the interpreter: keep it short
    op = torch.ops.diffcurr_fast
    for w in (weight, None):
        torch.library.opcheck(op.rmsnorm_modulate.default, (x, shift, scale, w, 1e-6, backend), test_utils=tests)
    _, rstd = op.rmsnorm_modulate(x.detach(), shift.detach(), scale.detach(), weight.detach(), 1e-6, backend)
    for w, affine in ((weight.detach(), True), (None, True), (weight.detach(), False)):
        args = (torch.randn(3, 4, 6), x.detach(), scale.detach(), w, rstd, backend, affine)
        torch.library.opcheck(op.rmsnorm_modulate_backward.default, args, test_utils=tests)


def test_compiles_fullgraph_with_its_gradients():
    x, shift, scale, weight = _leaves((2, 5, 16), True)

    def fn(x, shift, scale, weight):
        return rmsnorm_modulate(x, shift, scale, weight).square().sum()

    eager = torch.autograd.grad(fn(x, shift, scale, weight), (x, shift, scale, weight))
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(x, shift, scale, weight)
    for a, b in zip(eager, torch.autograd.grad(compiled, (x, shift, scale, weight))):
        torch.testing.assert_close(a, b)
