"""The fused ops on a CUDA device: every GPU backend against the reference (skipped without CUDA)."""

import pytest
import torch
from conftest import assert_near_reference

import diffcurr_fast.ops as ops
from diffcurr_fast.diffusion import DDPMSchedule
from diffcurr_fast.ops import _backend

pytestmark = pytest.mark.gpu
SCHED = DDPMSchedule(1000)


def _dev() -> torch.device:
    return torch.device("cuda")


def _need(backend: str, op: str) -> None:
    reason = _backend.unavailable_reason(backend, op, _dev())
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("shape", [(1, 37), (17, 4, 31, 33), (256, 4, 32, 32)])
def test_noise_q_sample_and_loss(backend, shape):
    _need(backend, "q_sample")
    d = _dev()
    x0 = torch.randn(shape, device=d)
    t = torch.randint(0, 1000, (shape[0],), device=d)
    seed = 2**62 + 12345
    ref_noise = ops.philox_randn_ref(seed, shape, d)
    assert_near_reference(ops.philox_randn(seed, shape, d, backend=backend), ref_noise, 1e-5, "noise")
    xt = ops.q_sample(x0, t, SCHED, seed=seed, backend=backend)
    assert_near_reference(xt, ops.q_sample(x0, t, SCHED, seed=seed, backend="reference"), 1e-5, "x_t")
    pred = torch.randn(shape, device=d, requires_grad=True)
    loss = ops.diffusion_loss(pred, x0, None, t, SCHED, prediction="v", weighting="min_snr", seed=seed, backend=backend)
    loss.backward()
    p64 = pred.detach().double().requires_grad_()
    ab = SCHED.alphas_cumprod.to(d)[t].view(-1, *([1] * (len(shape) - 1)))
    tgt = ab.sqrt() * ref_noise.double() - (1 - ab).sqrt() * x0.double()
    w = ops._common.schedule_table(SCHED, "loss", d, torch.float64, "v", "min_snr", 5.0)[2, t]
    ref = (w * (p64 - tgt).square().flatten(1).mean(1)).mean()
    ref.backward()
    assert_near_reference(loss, ref.detach(), 1e-4, "loss")  # a float32 reduction of 4M terms against float64
    assert_near_reference(pred.grad, p64.grad, 1e-5, "loss gradient")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [37, 1152, 2048])  # scalar fallback; DiT-XL/2's width; the largest register rows
def test_adaln_and_gated_residual(backend, dtype, D):
    _need(backend, "adaln_modulate_fwd")
    d = _dev()
    B, N = 17, 257
    x = torch.randn(B, N, D, device=d, dtype=dtype, requires_grad=True)
    shift, scale, gate = (torch.randn(B, D, device=d, dtype=dtype, requires_grad=True) for _ in range(3))
    out = ops.gated_residual(x, gate, ops.adaln_modulate(x, shift, scale, backend=backend), backend=backend)
    g = torch.randn_like(out)
    out.backward(g)
    leaves = [v.detach().double().requires_grad_() for v in (x, shift, scale, gate)]
    x6, s6, c6, g6 = leaves
    ref = x6 + g6[:, None] * (torch.nn.functional.layer_norm(x6, (D,), eps=1e-6) * (1 + c6[:, None]) + s6[:, None])
    ref.backward(g.double())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)
    for mine, theirs in zip((x, shift, scale, gate), leaves):
        scale_ = float(theirs.grad.abs().max())
        torch.testing.assert_close(mine.grad.double() / scale_, theirs.grad / scale_, rtol=tol, atol=tol)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_sample_timesteps_matches_reference(backend):
    _need(backend, "sample_timesteps")
    d = _dev()
    w = torch.rand(1000, device=d)
    w[::7] = 0
    t, imp = ops.sample_timesteps(4097, w, seed=99, backend=backend, return_importance=True)
    t_ref, imp_ref = ops.sample_timesteps_ref(w, 4097, 99)
    assert torch.equal(t, t_ref)
    torch.testing.assert_close(imp, imp_ref)
    assert bool((w[t] > 0).all())


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [37, 384, 1152])  # odd rows (2- or 4-byte words); 16-byte words at DiT-S/2, DiT-XL/2
def test_token_gather_and_scatter_bitwise(backend, dtype, D):
    """Token routing's route and return, forward and backward, equal the reference bit for bit (row copies)."""
    _need(backend, "token_gather")
    d = _dev()
    B, T, K = 17, 257, 128
    x, src = torch.randn(B, T, D, device=d, dtype=dtype), torch.randn(B, K, D, device=d, dtype=dtype)
    g = torch.randn(B, T, D, device=d, dtype=dtype)
    idx = torch.stack([torch.randperm(T, device=d)[:K] for _ in range(B)])  # unsorted

    def run(gather, scatter):
        xl, sl = x.clone().requires_grad_(), src.clone().requires_grad_()
        out = scatter(xl, idx, gather(xl, idx) * 2 + sl)
        out.backward(g)
        return out, xl.grad, sl.grad

    mine = run(
        lambda a, i: ops.token_gather(a, i, backend=backend),
        lambda a, i, s: ops.token_scatter(a, i, s, backend=backend),
    )
    ref = run(ops.token_gather_ref, ops.token_scatter_ref)
    assert all(torch.equal(a, b) for a, b in zip(mine, ref))
    # no host synchronisation checks the indices: one outside [0, T) moves no row (its gathered row is zero)
    bad = idx.clone()
    bad[0, 0] = T
    out = ops.token_gather(x, bad, backend=backend)
    assert bool((out[0, 0] == 0).all()) and torch.equal(out[1:], ops.token_gather_ref(x, idx)[1:])
    out = ops.token_scatter(x, bad, src, backend=backend)
    assert torch.equal(out[1:], ops.token_scatter_ref(x, idx, src)[1:]) and torch.equal(
        out[0, idx[0, 0]], x[0, idx[0, 0]]
    )


def test_auto_prefers_a_gpu_backend():
    d = _dev()
    assert _backend.resolve("q_sample", d) in ("cuda", "triton")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [37, 1152, 2048])  # scalar fallback; DiT-XL/2's width; the largest register rows
def test_rmsnorm_modulate(backend, dtype, D):
    _need(backend, "rmsnorm_modulate_fwd")
    d = _dev()
    B, N = 17, 257
    x = torch.randn(B, N, D, device=d, dtype=dtype, requires_grad=True)
    shift, scale = (torch.randn(B, D, device=d, dtype=dtype, requires_grad=True) for _ in range(2))
    w = (1 + 0.1 * torch.randn(D, device=d)).requires_grad_()
    y = ops.rmsnorm_modulate(x, shift, scale, w, backend=backend)
    g = torch.randn_like(y)
    y.backward(g)
    leaves = [v.detach().double().requires_grad_() for v in (x, shift, scale, w)]
    x6, s6, c6, w6 = leaves
    ref = x6 * torch.rsqrt(x6.square().mean(-1, keepdim=True) + 1e-6) * w6 * (1 + c6[:, None]) + s6[:, None]
    ref.backward(g.double())
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    assert_near_reference(y, ref, rel, "y")
    for mine, theirs in zip((x, shift, scale, w), leaves):
        assert_near_reference(mine.grad, theirs.grad, 3 * rel, "grad")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 72])  # the digits models' heads, every DiT preset's, a non-power of 2
@pytest.mark.parametrize("per_sample", [False, True])  # one table for the batch; the rows token routing gathers
def test_qk_norm_rope(backend, dtype, head_dim, per_sample):
    from diffcurr_fast.models.modern import apply_rope2d, rope2d_tables

    _need(backend, "qk_norm_rope_fwd")
    d = _dev()
    B, grid, H = 9, 16, 6
    N = grid * grid
    qkv = torch.randn(B, N, 3 * H * head_dim, device=d, dtype=dtype, requires_grad=True)
    wq, wk = ((1 + 0.1 * torch.randn(head_dim, device=d)).requires_grad_() for _ in range(2))
    cos, sin = rope2d_tables(grid, head_dim, device=d)
    if per_sample:
        idx = torch.stack([torch.randperm(N, device=d) for _ in range(B)])
        cos, sin = cos[idx].unsqueeze(1), sin[idx].unsqueeze(1)
    outs = ops.qk_norm_rope(qkv, H, wq, wk, cos, sin, backend=backend)
    grads = [torch.randn_like(o) for o in outs]
    torch.autograd.backward(outs, grads)
    leaves = [t.detach().double().requires_grad_() for t in (qkv, wq, wk)]
    q, k, v = leaves[0].reshape(B, N, 3, H, head_dim).permute(2, 0, 3, 1, 4).unbind(0)
    q = q * torch.rsqrt(q.square().mean(-1, keepdim=True) + 1e-6) * leaves[1]
    k = k * torch.rsqrt(k.square().mean(-1, keepdim=True) + 1e-6) * leaves[2]
    tables = (cos.double(), sin.double())
    ref = (apply_rope2d(q, *tables), apply_rope2d(k, *tables), v)
    torch.autograd.backward(ref, [g.double() for g in grads])
    rel = 1e-5 if dtype == torch.float32 else 1e-2
    for mine, theirs in zip(outs, ref):
        assert_near_reference(mine, theirs, rel, "q, k, v")
    for mine, theirs in zip((qkv, wq, wk), leaves):
        assert_near_reference(mine.grad, theirs.grad, 3 * rel, "grad")


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("H", [37, 1024])  # scalar accesses; 16-byte vectors (DiT-S/2's SwiGLU width)
def test_swiglu(backend, dtype, H):
    _need(backend, "swiglu_fwd")
    x = (3 * torch.randn(17, 257, 2 * H, device=_dev())).to(dtype).requires_grad_()
    y = ops.swiglu(x, backend=backend)
    g = torch.randn_like(y)
    y.backward(g)
    xd = x.detach().double().requires_grad_()
    a, b = xd.chunk(2, dim=-1)
    ref = torch.nn.functional.silu(a) * b
    ref.backward(g.double())
    rel = 1e-6 if dtype == torch.float32 else 1e-2
    assert_near_reference(y, ref, rel, "y")
    assert_near_reference(x.grad, xd.grad, rel, "grad x")
