"""gelu_tanh: the CPU kernel against the float64 definition (values and gradients), and its dispatch rules."""

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_near_reference

from diffcurr_fast import ops
from diffcurr_fast.models.dit import DiT
from diffcurr_fast.ops import _backend, gelu

CPU = torch.device("cpu")
SHAPES = [(1,), (15,), (3, 17), (2, 7, 33), (4, 1031), (2, 0, 5)]  # tails of every lane width, odd sizes, empty


def _need_cpu():
    reason = _backend.unavailable_reason("cpu", "gelu_tanh_fwd", CPU)
    if reason is not None:
        pytest.skip(reason)


def _f64(x):
    u = (2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3)
    return 0.5 * x * (1 + torch.tanh(u))  # Hendrycks & Gimpel 2016, the tanh form


@pytest.mark.parametrize("shape", SHAPES)
def test_cpu_kernel_matches_float64(shape, each_cpu_isa):
    _need_cpu()
    x = (torch.randn(shape) * 4).requires_grad_()
    y = ops.gelu_tanh(x, backend="cpu")
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double().requires_grad_()
    ref = _f64(xd)
    ref.backward(g.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(x.grad.double(), xd.grad, rtol=1e-5, atol=2e-5)
    torch.testing.assert_close(y, F.gelu(x.detach(), approximate="tanh"), rtol=1e-5, atol=2e-6)


def test_cpu_kernel_extremes(each_cpu_isa):
    # saturation on both sides (exp's input is clamped), zero, tiny values, and where 1 + tanh(u) cancels
    _need_cpu()
    x = torch.tensor([-1e4, -100.0, -20.0, -9.0, -5.0, -3.0, -1e-30, 0.0, 1e-30, 3.0, 9.0, 100.0, 1e4])
    y = ops.gelu_tanh(x, backend="cpu")
    gx = torch.ops.diffcurr_fast_C.gelu_tanh_bwd(torch.ones_like(x), x)
    xd = x.double().requires_grad_()
    ref = _f64(xd)
    ref.sum().backward()
    assert torch.isfinite(y).all() and torch.isfinite(gx).all()
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gx.double(), xd.grad, rtol=1e-5, atol=1e-6)
    assert y[-1] == 1e4 and y[7] == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cpu_kernel_low_precision(dtype, each_cpu_isa):
    # float32 arithmetic, rounded once on store
    _need_cpu()
    x = (torch.randn(5, 301) * 3).to(dtype)
    y = ops.gelu_tanh(x, backend="cpu")
    assert y.dtype == dtype
    torch.testing.assert_close(y, _f64(x.double()).to(dtype))  # the dtype's default tolerance: about one rounding
    g = torch.randn_like(x)
    gx = torch.ops.diffcurr_fast_C.gelu_tanh_bwd(g, x)
    xd = x.double().requires_grad_()
    _f64(xd).backward(g.double())
    torch.testing.assert_close(gx.double(), xd.grad, rtol=1e-2, atol=1e-2)


def test_non_contiguous_input_and_no_second_derivative(each_cpu_isa):
    _need_cpu()
    x = torch.randn(6, 10).t().requires_grad_()  # (10, 6), transposed
    y = ops.gelu_tanh(x, backend="cpu")
    torch.testing.assert_close(y, F.gelu(x.detach(), approximate="tanh"), rtol=1e-5, atol=2e-6)
    (gx,) = torch.autograd.grad(y.sum(), x, create_graph=True)
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gx.sum(), x)


def test_dispatch_rules(each_cpu_isa):
    x = torch.randn(8)
    assert torch.equal(ops.gelu_tanh(x, backend="reference"), F.gelu(x, approximate="tanh"))
    assert torch.equal(ops.gelu_tanh(x.double()), F.gelu(x.double(), approximate="tanh"))  # float64: torch
    with pytest.raises(ValueError, match="cpu backend takes"):
        if _backend.unavailable_reason("cpu", "gelu_tanh_fwd", CPU) is not None:
            raise ValueError("cpu backend takes (skipped: no extension)")
        ops.gelu_tanh(x.double(), backend="cpu")
    with pytest.raises(ValueError, match="unknown ops backend 'bogus'"):
        ops.gelu_tanh(x, backend="bogus")
    fast = gelu._cpu_kernel_is_faster()
    assert fast == (each_cpu_isa in ("avx2", "avx512"))  # the baseline build is slower than torch's: not used
    y = ops.gelu_tanh(x.requires_grad_())
    assert (type(y.grad_fn).__name__ == "GeluTanhFunctionBackward") == fast


def test_compiled_uses_torch_gelu():
    # under torch.compile the activation is F.gelu, which inductor fuses (no graph break either way)
    x = torch.randn(4, 9, requires_grad=True)
    fn = torch.compile(lambda v: ops.gelu_tanh(v) * 2, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(fn(x), 2 * F.gelu(x, approximate="tanh"))


def test_opcheck_raw_kernels(each_cpu_isa):
    _need_cpu()
    raw = torch.ops.diffcurr_fast_C
    x = torch.randn(3, 37)
    for op, args in ((raw.gelu_tanh_fwd.default, (x,)), (raw.gelu_tanh_bwd.default, (torch.randn(3, 37), x))):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("seed", [0, 1])
def test_dit_fused_blocks_match_the_plain_model(each_cpu_isa, seed):
    # float32 on the CPU kernels of each instruction set: fused_adaln swaps in the block fast paths (adaLN, gated
    # residual, tanh-GELU). Fused and plain are two float32 paths whose rounding differs by CPU and instruction
    # set, so each is held to a float64 copy of the model with a tolerance scaled to each tensor, not to the other.
    kw = dict(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2, num_classes=10)
    torch.manual_seed(seed)
    plain, fused, ref = DiT(**kw), DiT(**kw, fused_adaln=True), DiT(**kw).double()
    with torch.no_grad():
        for p in plain.parameters():  # the zero-initialised adaLN and final layers would hide the blocks
            p.normal_(std=0.1)
    fused.load_state_dict(plain.state_dict())
    ref.load_state_dict(plain.state_dict())
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([1, 500, 999]), torch.tensor([0, 3, 9])
    results = {}
    for name, m in (("plain", plain), ("fused", fused), ("float64", ref)):
        m.eval()  # no class dropout: the three see the same labels
        out = m(x.to(m.x_embedder.proj.weight.dtype), t, y)
        out.square().sum().backward()
        results[name] = (out, [(n, p.grad) for n, p in m.named_parameters() if p.requires_grad])
    want_out, want_grads = results["float64"]
    for name in ("plain", "fused"):
        out, grads = results[name]
        # measured on AMD EPYC (AVX-512), every set, seeds 0-2: outputs 1.4e-6 to 3.0e-6, gradients up to 1.1e-5
        # (relative to each tensor, fused and plain alike): the limits leave about 7x
        assert_near_reference(out, want_out, 2e-5, f"{name} output")
        for (n, g), (_, g64) in zip(grads, want_grads):
            assert_near_reference(g, g64, 1e-4, f"{name} grad of {n}")
