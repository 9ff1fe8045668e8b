"""swiglu: silu(a) * b on the halves of the SwiGLU projection, against float64 autograd of F.silu(a) * b, every
backend and instruction set, outputs and gradients on odd sizes (the lane widths' tails), and saturated inputs."""

import sys

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_near_reference, op_backends

from diffcurr_fast.ops import _backend, swiglu

swiglu_module = sys.modules[swiglu.__module__]
CPU = torch.device("cpu")
SHAPES = [(2,), (3, 10), (2, 7, 34), (4, 3, 2 * 37), (2, 5, 2 * 170), (1, 0, 6)]  # H = 1, 5, 17, 37, 170; empty


def _need(backend: str) -> None:
    reason = _backend.unavailable_reason(backend, "swiglu_fwd", CPU)
    if reason is not None:
        pytest.skip(reason)


def _formula(x):
    a, b = x.chunk(2, dim=-1)
    return F.silu(a) * b  # Shazeer 2020, Eq. 6


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_outputs_and_gradients(backend, shape):
    _need(backend)
    x = (torch.randn(shape) * 3).requires_grad_()
    y = swiglu(x, backend=backend)
    assert y.shape == (*shape[:-1], shape[-1] // 2)
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double().requires_grad_()
    ref = _formula(xd)
    ref.backward(g.double())
    if y.numel():
        assert_near_reference(y, ref, 1e-6, "y")
        assert_near_reference(x.grad, xd.grad, 1e-6, "grad x")


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_saturated_and_tiny_inputs(backend):
    """exp's input is clamped in the C++ kernel: very negative a gives silu(a) ~ 0, large a gives a, no overflow."""
    _need(backend)
    a = torch.tensor([-1e4, -100.0, -20.0, -1e-30, 0.0, 1e-30, 3.0, 20.0, 100.0, 1e4])
    x = torch.cat([a, torch.full_like(a, 1.5)]).requires_grad_()
    y = swiglu(x, backend=backend)
    y.backward(torch.ones_like(y))
    xd = x.detach().double().requires_grad_()
    ref = _formula(xd)
    ref.backward(torch.ones_like(ref))
    assert torch.isfinite(y).all() and torch.isfinite(x.grad).all()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-30)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(backend, dtype):
    """float32 arithmetic, rounded once on store: within about one rounding of the float64 value."""
    _need(backend)
    x = (torch.randn(5, 2 * 301) * 3).to(dtype).requires_grad_()
    y = swiglu(x, backend=backend)
    assert y.dtype == dtype
    torch.testing.assert_close(y, _formula(x.detach().double()).to(dtype))
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double().requires_grad_()
    _formula(xd).backward(g.double())
    assert x.grad.dtype == dtype
    assert_near_reference(x.grad, xd.grad, 1e-2, "grad x")


def test_non_contiguous_input_and_no_second_derivative():
    x = torch.randn(6, 10).t().requires_grad_()  # (10, 6), transposed
    y = swiglu(x)
    torch.testing.assert_close(y, _formula(x.detach()), rtol=1e-5, atol=1e-6)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gx.sum(), x)


def test_float64_gradcheck_on_the_reference():
    x = torch.randn(3, 8, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda t: swiglu(t, backend="reference"), (x,))


@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
def test_eager_function_equals_the_custom_op_bitwise(backend):
    _need(backend)
    x0, g = torch.randn(3, 7, 34), torch.randn(3, 7, 17)

    def run(fn):
        x = x0.clone().requires_grad_()
        y = fn(x, backend)
        y.backward(g)
        return y.detach(), x.grad

    assert all(torch.equal(a, b) for a, b in zip(run(swiglu_module._SwiGLUFunction.apply), run(swiglu_module._fwd_op)))


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_opcheck(backend):
    _need(backend)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if backend == "triton":
        tests = tests[:3]  # the interpreter: keep it short
    x = torch.randn(3, 4, 10, requires_grad=True)
    op = torch.ops.diffcurr_fast
    torch.library.opcheck(op.swiglu.default, (x, backend), test_utils=tests)
    torch.library.opcheck(op.swiglu_backward.default, (torch.randn(3, 4, 5), x.detach(), backend), test_utils=tests)


def test_compiles_fullgraph_with_its_gradient():
    x = torch.randn(2, 5, 12, requires_grad=True)

    def fn(x):
        return swiglu(x).square().sum()

    (eager,) = torch.autograd.grad(fn(x), x)
    (compiled,) = torch.autograd.grad(torch.compile(fn, fullgraph=True, backend="aot_eager")(x), x)
    torch.testing.assert_close(compiled, eager)
