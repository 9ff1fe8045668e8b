"""token_gather and token_scatter (token routing's route and return) on every backend against the reference.

Both ops and their backwards are row copies, so every backend must match the reference bit for bit, in every
kernel dtype: outputs and gradients, unsorted and sorted indices, odd sizes. Also: torch.library.opcheck of the
custom ops and the raw C++ kernels, torch.compile(fullgraph=True) through the ops, the eager Functions against the
custom ops, a routed DiT step on each backend, and the bad inputs. The CUDA kernels compile in
tests/csrc/test_cuda_compile.py and run in tests/ops/test_ops_gpu.py (skipped without a GPU).
"""

import functools
import importlib

import pytest
import torch
from conftest import op_backends

import diffcurr_fast.models.routing as routing
from diffcurr_fast.models.dit import DiT
from diffcurr_fast.models.routing import draw_route
from diffcurr_fast.ops import _backend, token_gather, token_gather_ref, token_scatter, token_scatter_ref

# the modules (the package's names token_gather / token_scatter are the public functions)
gather_mod = importlib.import_module("diffcurr_fast.ops.token_gather")
scatter_mod = importlib.import_module("diffcurr_fast.ops.token_scatter")

CPU = torch.device("cpu")
SHAPES = [(3, 13, 5, 7), (2, 17, 1, 9), (1, 256, 128, 384), (2, 4, 4, 1), (2, 6, 0, 3)]  # (B, T, K, D)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BACKENDS = op_backends("reference", "cpu", "triton")


def _need(backend: str, op: str = "token_gather") -> None:
    reason = _backend.unavailable_reason(backend, op, CPU)
    if reason is not None:
        pytest.skip(reason)


def _idx(B, T, K, seed=0, sort=False):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(T, generator=g)[:K] for _ in range(B)]).reshape(B, K)  # unsorted
    return idx.sort(dim=1).values if sort else idx


def _leaves(*tensors):
    return [t.detach().clone().requires_grad_() for t in tensors]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gather_matches_the_reference_bitwise(backend, dtype, shape):
    _need(backend)
    B, T, K, D = shape
    x = torch.randn(B, T, D).to(dtype)
    for sort in (False, True):
        idx = _idx(B, T, K, seed=K, sort=sort)
        g = torch.randn(B, K, D).to(dtype)
        (mine,), (ref,) = _leaves(x), _leaves(x)
        out = token_gather(mine, idx, backend=backend)
        want = token_gather_ref(ref, idx)
        out.backward(g)
        want.backward(g)
        assert out.dtype == dtype and out.is_contiguous()
        assert torch.equal(out, want)
        assert torch.equal(mine.grad, ref.grad)  # g at the kept rows, zero elsewhere


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_scatter_matches_the_reference_bitwise(backend, dtype, shape):
    _need(backend, "token_scatter")
    B, T, K, D = shape
    base, src, g = torch.randn(B, T, D).to(dtype), torch.randn(B, K, D).to(dtype), torch.randn(B, T, D).to(dtype)
    for sort in (False, True):
        idx = _idx(B, T, K, seed=T, sort=sort)
        mine, ref = _leaves(base, src), _leaves(base, src)
        out = token_scatter(mine[0], idx, mine[1], backend=backend)
        want = token_scatter_ref(ref[0], idx, ref[1])
        out.backward(g)
        want.backward(g)
        assert out.dtype == dtype and torch.equal(out, want)
        assert torch.equal(mine[0].grad, ref[0].grad)  # grad_out with the kept rows zeroed
        assert torch.equal(mine[1].grad, ref[1].grad)  # grad_out at the kept rows
    assert torch.equal(base, base.clone())  # out of place


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("wanted", ["base", "src", "base+src"])
def test_scatter_partial_grads_from_strided_inputs(backend, wanted):
    """Only the requested gradients; a non-contiguous base and src and a broadcast grad_out (out.sum())."""
    _need(backend, "token_scatter")
    B, T, K, D = 3, 19, 6, 10
    base = torch.randn(B, D, T).transpose(1, 2)  # (B, T, D), not contiguous
    src = torch.randn(B, K, 2 * D)[..., ::2]  # (B, K, D), strided
    idx = _idx(B, T, K, seed=3)
    leaves = {"base": base.clone().requires_grad_("base" in wanted), "src": src.clone().requires_grad_("src" in wanted)}
    refs = {k: v.detach().clone().requires_grad_(v.requires_grad) for k, v in leaves.items()}
    (token_scatter(leaves["base"], idx, leaves["src"], backend=backend).sum() * 1.5).backward()
    (token_scatter_ref(refs["base"], idx, refs["src"]).sum() * 1.5).backward()
    for name, leaf in leaves.items():
        if leaf.requires_grad:
            assert torch.equal(leaf.grad, refs[name].grad), name
        else:
            assert leaf.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_route_and_return_compose(backend):
    """The routed span as DiT runs it: gather, a function of the kept tokens, scatter back onto the tokens before
    the route; the gradient of x sums the scatter's grad_base and the gather's backward."""
    _need(backend)
    B, T, K, D = 4, 16, 8, 12
    x = torch.randn(B, T, D)
    w = torch.randn(D, D)
    idx = draw_route(B, T, K, torch.Generator().manual_seed(1))
    mine, ref = _leaves(x), _leaves(x)
    out = token_scatter(mine[0], idx, torch.tanh(token_gather(mine[0], idx, backend=backend) @ w), backend=backend)
    want = token_scatter_ref(ref[0], idx, torch.tanh(token_gather_ref(ref[0], idx) @ w))
    out.square().sum().backward()
    want.square().sum().backward()
    assert torch.equal(out, want)
    assert torch.equal(mine[0].grad, ref[0].grad)


@pytest.mark.parametrize("backend", op_backends("cpu", "triton"))
@pytest.mark.parametrize("shape", [(3, 13, 5, 7), (2, 17, 1, 9)])
def test_eager_functions_equal_the_custom_ops_bitwise(backend, shape):
    """Eager calls go through plain autograd Functions; the custom ops (what torch.compile traces) give the same
    outputs and gradients, bit for bit."""
    _need(backend)
    B, T, K, D = shape
    x, src, g = torch.randn(B, T, D), torch.randn(B, K, D), torch.randn(B, T, D)
    idx = _idx(B, T, K)

    def run(gather, scatter):
        xl, sl = _leaves(x, src)
        out = scatter(xl, idx, gather(xl, idx, backend) + sl, backend)
        out.backward(g)
        return out.detach(), xl.grad, sl.grad

    eager = run(gather_mod.TokenGatherFunction.apply, scatter_mod.TokenScatterFunction.apply)
    ops = run(gather_mod._gather_fwd_op, scatter_mod._scatter_fwd_op)
    assert all(torch.equal(a, b) for a, b in zip(eager, ops))
    assert (
        type(token_gather(x.requires_grad_(), idx, backend=backend).grad_fn).__name__ == "TokenGatherFunctionBackward"
    )


# ---- opcheck: schema, fake tensors, autograd registration, AOT dispatch ------------------------------------
@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_opcheck(backend):
    _need(backend)
    B, T, K, D = 3, 13, 5, 7
    x = torch.randn(B, T, D, requires_grad=True)
    src = torch.randn(B, K, D, requires_grad=True)
    idx = _idx(B, T, K)
    ns = torch.ops.diffcurr_fast
    cases = [
        (ns.token_gather.default, (x, idx, backend)),
        (ns.token_gather_backward.default, (torch.randn(B, K, D), idx, T, backend)),
        (ns.token_scatter.default, (x, idx, src, backend)),
        (ns.token_scatter_backward.default, (torch.randn(B, T, D), idx, backend)),
    ]
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if backend == "triton":
        tests = tests[:3]  # interpreter: keep it short
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=tests)


def test_opcheck_raw_kernels(each_cpu_isa):
    _need("cpu")
    B, T, K, D = 3, 13, 5, 7
    x, src, idx = torch.randn(B, T, D), torch.randn(B, K, D), _idx(B, T, K)
    raw = torch.ops.diffcurr_fast_C
    for op, args in (
        (raw.token_gather.default, (x, idx)),
        (raw.token_scatter.default, (x, idx, src, T)),
        (raw.token_scatter.default, (None, idx, src, T)),
        (raw.token_scatter_bwd.default, (x, idx)),
    ):
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


# ---- torch.compile ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_compile_fullgraph_through_the_ops(backend):
    """fullgraph=True fails on any graph break; the compiled outputs and gradients equal eager bit for bit (inductor
    on the C++ kernels and the reference, aot_eager on the Triton interpreter)."""
    _need(backend)
    B, T, K, D = 3, 13, 5, 8
    x, w = torch.randn(B, T, D), torch.randn(D)
    idx = _idx(B, T, K)

    def span(x, w):
        kept = token_gather(x, idx, backend=backend)  # (B, K, D)
        return token_scatter(x, idx, kept * w, backend=backend)  # (B, T, D)

    compiler = "aot_eager" if backend == "triton" else "inductor"
    fn = torch.compile(span, fullgraph=True, backend=compiler)
    (xe, we), (xc, wc) = _leaves(x, w), _leaves(x, w)
    eager, compiled = span(xe, we), fn(xc, wc)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)
    g = torch.randn_like(eager)
    eager.backward(g)
    compiled.backward(g)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=1e-6, atol=1e-6)  # inductor may fuse the sum differently
    torch.testing.assert_close(wc.grad, we.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", op_backends("cpu", "triton"))
def test_a_routed_dit_step_equals_the_reference_routing(monkeypatch, backend):
    """A float32 DiT with token routing: loss and every gradient bitwise those of the reference routing ops."""
    _need(backend)
    torch.manual_seed(0)
    kw = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=4, num_heads=2, num_classes=5)
    m = DiT(routing=(1, 3), **kw)
    with torch.no_grad():
        for p in m.parameters():  # non-zero everywhere (the release zeroes the adaLN and output layers)
            p.add_(0.05 * torch.randn_like(p))
    m.train()
    x, t, y = torch.randn(3, 3, 8, 8), torch.tensor([3, 500, 999]), torch.arange(3)
    route = draw_route(3, 16, 8, torch.Generator().manual_seed(0))
    force = torch.zeros(3, dtype=torch.long)

    def step(name):
        monkeypatch.setattr(routing, "token_gather", functools.partial(token_gather, backend=name))
        monkeypatch.setattr(routing, "token_scatter", functools.partial(token_scatter, backend=name))
        m.zero_grad(set_to_none=True)
        loss = m(x, t, y, route=route, force_drop_ids=force).square().mean()
        loss.backward()
        return [loss.detach()] + [p.grad.clone() for p in m.parameters() if p.grad is not None]

    ref, mine = step("reference"), step(backend)
    assert len(ref) == len(mine) and all(torch.equal(a, b) for a, b in zip(ref, mine))


# ---- dispatch and bad inputs ------------------------------------------------------------------------------
def test_auto_dispatch(monkeypatch):
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    x, idx = torch.randn(2, 5, 3, requires_grad=True), _idx(2, 5, 2)
    fast = _backend.unavailable_reason("cpu", "token_gather", CPU) is None
    name = type(token_gather(x, idx).grad_fn).__name__
    assert name == ("TokenGatherFunctionBackward" if fast else "GatherBackward0")
    # float64 and integer tokens run on the reference (plain autograd, so double backward works there)
    x64 = x.detach().double().requires_grad_()
    assert type(token_gather(x64, idx).grad_fn).__name__ == "GatherBackward0"
    xi = torch.arange(30).view(2, 5, 3)
    assert torch.equal(token_gather(xi, idx), token_gather_ref(xi, idx))
    assert torch.autograd.gradgradcheck(lambda a: token_scatter(a, idx, token_gather(a, idx) * a[:, :2]), (x64,))


def test_bad_inputs():
    x, idx = torch.zeros(2, 5, 3), torch.tensor([[0, 4], [1, 2]])
    with pytest.raises(ValueError, match=r"takes x \(B, T, D\) and idx \(B, K <= T\)"):
        token_gather(x, torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="indices must be int64"):
        token_gather(x, idx.int())
    with pytest.raises(ValueError, match=r"src must be \(2, 2, 3\)"):
        token_scatter(x, idx, torch.zeros(2, 3, 3))
    with pytest.raises(ValueError, match=r"src \(torch.float16, cpu\) must match base"):
        token_scatter(x, idx, torch.zeros(2, 2, 3, dtype=torch.float16))
    with pytest.raises(ValueError, match="unknown ops backend 'turbo'"):
        token_gather(x, idx, backend="turbo")
    with pytest.raises(RuntimeError, match="'cuda' requested for token_gather.*CUDA tensors"):
        token_gather(x, idx, backend="cuda")
    if _backend.unavailable_reason("cpu", "token_gather", CPU) is None:
        with pytest.raises(ValueError, match="backend 'cpu' takes dtypes"):
            token_gather(x.double(), idx, backend="cpu")


@pytest.mark.parametrize("backend", op_backends("cpu"))
def test_cpu_kernels_check_the_indices(backend):
    _need(backend)
    x, src = torch.randn(2, 5, 3), torch.randn(2, 2, 3)
    with pytest.raises(RuntimeError, match=r"idx\[1, 0\] = 5 is outside \[0, 5\)"):
        token_gather(x, torch.tensor([[0, 4], [5, 2]]), backend=backend)
    with pytest.raises(RuntimeError, match=r"idx\[0, 1\] = -1 is outside"):
        token_scatter(x, torch.tensor([[0, -1], [1, 2]]), src, backend=backend)
    with pytest.raises(RuntimeError, match="the indices of sample 1 must be distinct; token 2 is kept twice"):
        token_scatter(x, torch.tensor([[0, 4], [2, 2]]), src, backend=backend)
    raw = torch.ops.diffcurr_fast_C
    with pytest.raises(RuntimeError, match=r"base must have shape \(2, 5, 3\)"):
        raw.token_scatter(torch.zeros(2, 4, 3), torch.tensor([[0, 4], [1, 2]]), src, 5)
    with pytest.raises(RuntimeError, match="must be float32, bfloat16 or float16"):
        raw.token_gather(x.double(), torch.tensor([[0, 4], [1, 2]]))
