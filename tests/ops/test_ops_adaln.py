"""adaln_modulate and gated_residual: fused DiT block path against float64 autograd, every backend."""

import pytest
import torch
import torch.nn.functional as F
from conftest import op_backends

from diffcurr_fast.ops import _backend, adaln_modulate, gated_residual

CPU = torch.device("cpu")
SHAPES = [(1, 1, 5), (3, 7, 24), (17, 3, 48), (2, 19, 72)]


def _need(backend: str, op: str) -> None:
    reason = _backend.unavailable_reason(backend, op, CPU)
    if reason is not None:
        pytest.skip(reason)


def _ref_modulate(x, shift, scale, eps=1e-6):
    # DiT modulate(norm(x), shift, scale) with an affine-free LayerNorm
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale[:, None, :]) + shift[:, None, :]


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", SHAPES)
def test_adaln_modulate_matches_float64(backend, shape):
    _need(backend, "adaln_modulate_fwd")
    B, N, D = shape
    x = (torch.randn(shape) * 3 + 1).requires_grad_()
    shift = torch.randn(B, D, requires_grad=True)
    scale = torch.randn(B, D, requires_grad=True)
    y = adaln_modulate(x, shift, scale, backend=backend)
    g = torch.randn_like(y)
    y.backward(g)
    ins = [v.detach().double().requires_grad_() for v in (x, shift, scale)]
    ref = _ref_modulate(*ins)
    ref.backward(g.double())
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip((x, shift, scale), ins):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", SHAPES)
def test_gated_residual_matches_float64(backend, shape):
    _need(backend, "gated_residual_fwd")
    B, N, D = shape
    x = torch.randn(shape, requires_grad=True)
    y = torch.randn(shape, requires_grad=True)
    gate = torch.randn(B, D, requires_grad=True)
    out = gated_residual(x, gate, y, backend=backend)
    g = torch.randn_like(out)
    out.backward(g)
    ins = [v.detach().double().requires_grad_() for v in (x, gate, y)]
    ref = ins[0] + ins[1][:, None, :] * ins[2]
    ref.backward(g.double())
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    for mine, theirs in zip((x, gate, y), ins):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("wanted", ["x", "y", "gate", "gate+y"])
@pytest.mark.parametrize("shape", [(1, 3, 7), (3, 66, 33), (17, 2, 5)])
def test_gated_residual_partial_grads(backend, wanted, shape):
    """Only the requested gradients, from a broadcast grad_out (out.sum()), match float64 autograd."""
    _need(backend, "gated_residual_fwd")
    B, N, D = shape
    x, y, gate = torch.randn(shape), torch.randn(shape), torch.randn(B, D)
    leaves = {"x": x, "y": y, "gate": gate}
    for name in wanted.split("+"):
        leaves[name].requires_grad_()
    out = gated_residual(x, gate, y, backend=backend)
    (out.sum() * 1.5).backward()  # grad_out is a stride-0 broadcast of 1.5
    ins = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in leaves.items()}
    ((ins["x"] + ins["gate"][:, None, :] * ins["y"]).sum() * 1.5).backward()
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            torch.testing.assert_close(leaf.grad.double(), ins[name].grad, rtol=1e-5, atol=1e-5)
        else:
            assert leaf.grad is None


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("wanted", ["x", "shift", "scale+x", "shift+scale"])
@pytest.mark.parametrize("shape", [(1, 3, 7), (3, 66, 33), (17, 2, 5)])
def test_adaln_modulate_partial_grads(backend, wanted, shape):
    """Only the requested gradients, from a broadcast grad_y (y.sum()), match float64 autograd."""
    _need(backend, "adaln_modulate_fwd")
    B, N, D = shape
    x, shift, scale = torch.randn(shape) * 2 + 1, torch.randn(B, D), torch.randn(B, D)
    leaves = {"x": x, "shift": shift, "scale": scale}
    for name in wanted.split("+"):
        leaves[name].requires_grad_()
    (adaln_modulate(x, shift, scale, backend=backend).sum() * 0.5).backward()
    ins = {k: v.detach().double().requires_grad_(v.requires_grad) for k, v in leaves.items()}
    (_ref_modulate(ins["x"], ins["shift"], ins["scale"]).sum() * 0.5).backward()
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            torch.testing.assert_close(leaf.grad.double(), ins[name].grad, rtol=1e-4, atol=1e-5)
        else:
            assert leaf.grad is None


@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_backward(backend, dtype):
    _need(backend, "gated_residual_fwd")
    B, N, D = 3, 67, 24
    x, y = torch.randn(B, N, D, dtype=dtype), torch.randn(B, N, D, dtype=dtype)
    shift, scale, gate = (torch.randn(B, D, dtype=dtype) for _ in range(3))
    leaves = [v.requires_grad_() for v in (x, shift, scale, gate, y)]
    out = gated_residual(x, gate, adaln_modulate(y, shift, scale, backend=backend), backend=backend)
    g = torch.randn_like(out)
    out.backward(g)
    ins = [v.detach().double().requires_grad_() for v in leaves]
    x6, s6, c6, g6, y6 = ins
    (x6 + g6[:, None, :] * _ref_modulate(y6, s6, c6)).backward(g.double())
    for mine, theirs in zip(leaves, ins):
        assert mine.grad.dtype == dtype
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=5e-2, atol=2e-1)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_dit_block_path_composes(backend):
    _need(backend, "adaln_modulate_fwd")
    B, N, D = 3, 5, 40
    x = torch.randn(B, N, D, requires_grad=True)
    mod = torch.randn(B, 3 * D, requires_grad=True)
    shift, scale, gate = mod.chunk(3, dim=1)  # non-contiguous views, as in DiT's adaLN_modulation(c).chunk
    lin = torch.nn.Linear(D, D).double()
    out = gated_residual(
        x, gate, lin(adaln_modulate(x, shift, scale, backend=backend).double()).float(), backend=backend
    )
    out.square().sum().backward()
    x6, m6 = x.detach().double().requires_grad_(), mod.detach().double().requires_grad_()
    s6, c6, g6 = m6.chunk(3, dim=1)
    ref = x6 + g6[:, None, :] * lin(_ref_modulate(x6, s6, c6))
    ref.square().sum().backward()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), x6.grad, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(mod.grad.double(), m6.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    B, N, D = 3, 4, 24
    x = torch.randn(B, N, D, dtype=dtype)
    shift, scale = torch.randn(B, D, dtype=dtype), torch.randn(B, D, dtype=dtype)
    y = adaln_modulate(x, shift, scale)
    assert y.dtype == dtype
    torch.testing.assert_close(
        y.double(), _ref_modulate(x.double(), shift.double(), scale.double()), rtol=2e-2, atol=2e-2
    )


def test_float64_gradcheck_on_reference():
    B, N, D = 2, 3, 5
    args = [torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)]
    args += [torch.randn(B, D, dtype=torch.float64, requires_grad=True) for _ in range(2)]
    torch.autograd.gradcheck(lambda x, a, b: adaln_modulate(x, a, b, backend="reference"), args)
    y = torch.randn(B, N, D, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, g, y: gated_residual(x, g, y, backend="reference"), (args[0], args[1], y))


def test_bad_inputs():
    x = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"\(B, N, D\)"):
        adaln_modulate(torch.randn(2, 4), torch.randn(2, 4), torch.randn(2, 4))
    with pytest.raises(ValueError, match=r"shift must have shape \(2, 4\)"):
        adaln_modulate(x, torch.randn(2, 5), torch.randn(2, 4))
    with pytest.raises(ValueError, match="must match x"):
        adaln_modulate(x, torch.randn(2, 4, dtype=torch.float64), torch.randn(2, 4))
    with pytest.raises(ValueError, match="eps"):
        adaln_modulate(x, torch.randn(2, 4), torch.randn(2, 4), eps=0.0)
    with pytest.raises(ValueError, match="y shape"):
        gated_residual(x, torch.randn(2, 4), torch.randn(2, 3, 5))
    with pytest.raises(ValueError, match="dtype"):
        gated_residual(x.int(), torch.randn(2, 4), x)


@pytest.mark.parametrize("target", [1, 3])
def test_triton_backward_loops_over_rows_with_bounded_partials(monkeypatch, target):
    # few programs: each loops over many row tiles and the partial buffers have `target`-bounded splits
    _need("triton", "adaln_modulate_fwd")
    kern = _backend.kernels("adaln")
    monkeypatch.setattr(kern, "TARGET_PROGRAMS", target)
    B, N, D = 2, 150, 40
    _, rows, _ = kern.row_tile(D)
    splits, per = kern._splits(B, N, rows)
    assert splits <= max(1, -(-target // B)) and per >= rows
    x = torch.randn(B, N, D, requires_grad=True)
    shift, scale, gate = (torch.randn(B, D, requires_grad=True) for _ in range(3))
    y = torch.randn(B, N, D, requires_grad=True)
    out = gated_residual(x, gate, adaln_modulate(x, shift, scale, backend="triton") * y, backend="triton")
    out.square().sum().backward()
    leaves = [x, shift, scale, gate, y]
    grads = [t.grad for t in leaves]
    l6 = [t.detach().double().requires_grad_() for t in leaves]
    ref = l6[0] + l6[3][:, None, :] * (_ref_modulate(l6[0], l6[1], l6[2]) * l6[4])
    ref.square().sum().backward()
    for g, t6 in zip(grads, l6):
        torch.testing.assert_close(g.double(), t6.grad, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_gated_residual_mixed_dtypes(backend):
    # autocast: fp32 residual stream, bf16 gate and attention output; result and grad_x fp32, grad_y bf16
    _need(backend, "gated_residual_fwd")
    B, N, D = 3, 5, 24
    x = torch.randn(B, N, D, requires_grad=True)
    gate = torch.randn(B, D, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randn(B, N, D, dtype=torch.bfloat16, requires_grad=True)
    out = gated_residual(x, gate, y, backend=backend)
    assert out.dtype == torch.float32
    ref = x.double() + gate.double()[:, None, :] * y.double()
    torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)
    g = torch.randn_like(out)
    out.backward(g)
    assert gate.grad.dtype == torch.bfloat16 and y.grad.dtype == torch.bfloat16
    torch.testing.assert_close(x.grad, g)
    torch.testing.assert_close(y.grad.double(), g.double() * gate.double()[:, None, :], rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(gate.grad.double(), (g.double() * y.double()).sum(1), rtol=1e-2, atol=2e-2)
    with pytest.raises(ValueError, match="must match x"):
        gated_residual(x, gate, y.double(), backend=backend)


def test_auto_runs_mixed_dtype_gated_residual_on_triton_instead_of_a_cuda_cast(monkeypatch):
    import sys

    mod = sys.modules[gated_residual.__module__]
    seen = []
    monkeypatch.setattr(mod._common, "backend_for", lambda op, x, backend: backend or "cuda")
    monkeypatch.setattr(mod._backend, "unavailable_reason", lambda b, op, dev: None)
    monkeypatch.setattr(mod, "_gated_apply", lambda x, g, y, name: seen.append(name))
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    x, gate = torch.randn(2, 3, 8), torch.randn(2, 8, dtype=torch.bfloat16)
    y = torch.randn(2, 3, 8, dtype=torch.bfloat16)
    gated_residual(x, gate, y)
    gated_residual(x, gate.float(), y.float())
    gated_residual(x, gate, y, backend="cuda")
    monkeypatch.setenv(_backend.ENV_VAR, "cuda")
    gated_residual(x, gate, y)
    assert seen == ["triton", "cuda", "cuda", "cuda"]


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("wanted", [(True, True, True), (True, False, True), (False, True, False)])
@pytest.mark.parametrize("shape", [(1, 1, 5), (3, 7, 24), (2, 19, 72)])
def test_eager_functions_equal_the_custom_ops_bitwise(backend, wanted, shape):
    """Eager calls go through plain autograd Functions; the custom ops (what torch.compile traces) give the same
    outputs and the same gradients, bit for bit, with every subset of gradients asked for."""
    import sys

    mod = sys.modules[gated_residual.__module__]
    _need(backend, "adaln_modulate_fwd")
    B, N, D = shape
    x, y = torch.randn(shape) * 3 + 1, torch.randn(shape)
    shift, scale, gate = torch.randn(B, D), torch.randn(B, D), torch.randn(B, D)
    g = torch.randn(shape)

    def run(adaln, gated):
        leaves = [v.clone().requires_grad_(w) for v, w in zip((x, shift, scale), wanted)]
        leaves += [v.clone().requires_grad_(w) for v, w in zip((gate, y), wanted[1:])]
        h = adaln(leaves[0], leaves[1], leaves[2], 1e-6, backend)[0]
        out = gated(h, leaves[3], leaves[4], backend)
        out.backward(g)
        return [out.detach()] + [v.grad for v in leaves]

    eager = run(mod._AdalnModulateFunction.apply, mod._GatedResidualFunction.apply)
    ops = run(mod._adaln_fwd_op, mod._gated_fwd_op)
    for a, b in zip(eager, ops):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b)
    h = mod._adaln_apply(x.requires_grad_(), shift, scale, 1e-6, backend)[0]
    assert type(h.grad_fn).__name__ == "_AdalnModulateFunctionBackward"  # eager calls take the Functions
    assert type(mod._gated_apply(h, gate, y, backend).grad_fn).__name__ == "_GatedResidualFunctionBackward"
