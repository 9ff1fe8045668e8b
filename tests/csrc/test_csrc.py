"""The raw C++ CPU ops ``torch.ops.diffcurr_fast_C.*`` against float64 formulas written here (docs/ops.md)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

try:
    import diffcurr_fast._C  # noqa: F401

    HAVE_EXT = hasattr(torch.ops.diffcurr_fast_C, "q_sample")
except ImportError:
    HAVE_EXT = False

pytestmark = pytest.mark.skipif(
    not HAVE_EXT, reason="diffcurr_fast._C is not built (python setup.py build_ext --inplace)"
)

M32 = 0xFFFFFFFF
BATCHES = [1, 3, 17]


def ops():
    return torch.ops.diffcurr_fast_C


# ----------------------------------------------------------------------------- float64 / numpy references


def philox_np(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al. 2011) on uint64 numpy arrays holding uint32 values."""
    c0, c1, c2, c3 = (np.asarray(v, dtype=np.uint64) for v in (c0, c1, c2, c3))
    k0, k1 = np.uint64(k0), np.uint64(k1)
    m32 = np.uint64(M32)
    for _ in range(10):
        p0 = np.uint64(0xD2511F53) * c0
        p1 = np.uint64(0xCD9E8D57) * c2
        c0, c1, c2, c3 = (
            (p1 >> np.uint64(32)) ^ c1 ^ k0,
            p1 & m32,
            (p0 >> np.uint64(32)) ^ c3 ^ k1,
            p0 & m32,
        )
        k0 = (k0 + np.uint64(0x9E3779B9)) & m32
        k1 = (k1 + np.uint64(0xBB67AE85)) & m32
    return c0, c1, c2, c3


def uniform_np(r):
    """u(r) of docs/ops.md: float32(r as int32 < 0 ? -r - 1 : r) * 4.6566127342e-10 (float32 product)."""
    s = r.astype(np.uint32).view(np.int32).astype(np.int64)
    m = np.where(s < 0, -s - 1, s)
    return m.astype(np.float32) * np.float32(4.6566127342e-10)


def noise_ref(seed, n):
    """noise[0 .. n) for a 64-bit seed: Box-Muller in float64 on the float32 uniforms and angles."""
    c = np.arange((n + 3) // 4, dtype=np.uint64)
    seed &= (1 << 64) - 1
    r = philox_np(c & np.uint64(M32), c >> np.uint64(32), 0, 0, seed & M32, (seed >> 32) & M32)
    u = [uniform_np(v) for v in r]
    rad_a = np.sqrt(-2.0 * np.log(np.maximum(u[0], np.float32(1e-7)).astype(np.float64)))
    rad_b = np.sqrt(-2.0 * np.log(np.maximum(u[2], np.float32(1e-7)).astype(np.float64)))
    th_a = (np.float32(6.283185307179586) * u[1]).astype(np.float64)
    th_b = (np.float32(6.283185307179586) * u[3]).astype(np.float64)
    out = np.stack([rad_a * np.cos(th_a), rad_a * np.sin(th_a), rad_b * np.cos(th_b), rad_b * np.sin(th_b)], 1)
    return torch.from_numpy(out.reshape(-1)[:n].copy())


def noise_like(seed, shape):
    n = int(np.prod(shape))
    return noise_ref(seed, n).view(shape)


def per_sample(B, low=0.1, high=1.5):
    return torch.rand(B) * (high - low) + low


# ----------------------------------------------------------------------------- Philox and noise


@pytest.mark.parametrize(
    "ctr,key,expected",
    [
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_python_philox_known_answers(ctr, key, expected):
    out = philox_np(*[np.array([v], dtype=np.uint64) for v in ctr], *key)
    assert tuple(int(v[0]) for v in out) == expected


@pytest.mark.parametrize("seed", [0, 1234, (5 << 32) + 7, -3, 2**63 - 1])
@pytest.mark.parametrize("shape", [[1], [3, 5], [17, 7, 3], [4099]])
def test_randn_matches_reference(seed, shape, each_cpu_isa):
    got = ops().randn(seed, shape)
    assert got.dtype == torch.float32 and list(got.shape) == shape
    torch.testing.assert_close(got.double(), noise_like(seed, shape), rtol=2e-6, atol=2e-6)


def test_randn_zero_seed_first_values(each_cpu_isa):
    # counter 0, key 0 -> Philox KAT words; the normals follow from docs/ops.md
    got = ops().randn(0, [4]).double()
    torch.testing.assert_close(got, noise_ref(0, 4), rtol=2e-6, atol=2e-6)


def test_randn_like_and_empty(each_cpu_isa):
    x = torch.empty(3, 5, 7, dtype=torch.bfloat16)
    torch.testing.assert_close(ops().randn_like(x, 99), ops().randn(99, [3, 5, 7]), rtol=0, atol=0)
    assert ops().randn(5, [0, 3]).shape == (0, 3)
    with pytest.raises(RuntimeError, match="shape must be non-negative"):
        ops().randn(5, [-1])


def test_noise_moments(each_cpu_isa):
    n = ops().randn(2024, [1 << 18]).double()
    assert abs(n.mean().item()) < 0.01
    assert abs(n.var().item() - 1.0) < 0.01
    assert abs((n**3).mean().item()) < 0.03
    assert abs((n**4).mean().item() - 3.0) < 0.06
    # the four normals of one Philox call are uncorrelated
    q = n.view(-1, 4)
    corr = torch.corrcoef(q.T)
    assert (corr - torch.eye(4, dtype=torch.float64)).abs().max().item() < 0.02


def test_noise_independent_of_threads(each_cpu_isa):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = ops().randn(7, [3, 40001])
        torch.set_num_threads(2)
        b = ops().randn(7, [3, 40001])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- q_sample


@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("inner", [(1,), (3, 5, 7), (2, 33, 31)])
def test_q_sample_seeded(B, inner, each_cpu_isa):
    x0 = torch.randn(B, *inner)
    a, c = per_sample(B), per_sample(B)
    seed = 31337 + B
    got = ops().q_sample(x0, a, c, None, seed)
    n = noise_like(seed, x0.shape)
    view = (B,) + (1,) * len(inner)
    ref = a.double().view(view) * x0.double() + c.double().view(view) * n  # Ho et al. Eq. 4
    assert got.dtype == torch.float32 and got.shape == x0.shape
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B", BATCHES)
def test_q_sample_given_noise(B, each_cpu_isa):
    x0, noise = torch.randn(B, 3, 7, 5), torch.randn(B, 3, 7, 5)
    a, c = per_sample(B), per_sample(B)
    got = ops().q_sample(x0, a, c, noise, 0)
    ref = a.double().view(B, 1, 1, 1) * x0.double() + c.double().view(B, 1, 1, 1) * noise.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("noise_dtype", ["none", "same", "float32"])
def test_q_sample_half_types(dtype, noise_dtype, each_cpu_isa):
    B, M = 3, 257
    x0 = torch.randn(B, M).to(dtype)
    a, c = per_sample(B), per_sample(B)
    if noise_dtype == "none":
        noise, n64 = None, noise_like(77, (B, M))
    else:
        noise = torch.randn(B, M).to(dtype if noise_dtype == "same" else torch.float32)
        n64 = noise.double()
    got = ops().q_sample(x0, a, c, noise, 77)
    ref = (a.double()[:, None] * x0.double() + c.double()[:, None] * n64).to(dtype)
    assert got.dtype == dtype
    torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_q_sample_non_contiguous_input(each_cpu_isa):
    x0 = torch.randn(5, 9, 3).transpose(1, 2)
    a, c = per_sample(5), per_sample(5)
    got = ops().q_sample(x0, a, c, None, 3)
    ref = ops().q_sample(x0.contiguous(), a, c, None, 3)
    assert torch.equal(got, ref)


# ----------------------------------------------------------------------------- diffusion loss


def loss_ref(pred, x0, noise, p, q, w):
    B = pred.shape[0]
    d = pred.double().reshape(B, -1) - (p.double()[:, None] * x0.double().reshape(B, -1) + q.double()[:, None] * noise)
    M = d.shape[1]
    loss = w.double() * d.pow(2).mean(1)
    grad = (w.double() * 2.0 / M)[:, None] * d
    return loss, grad.view(pred.shape)


@pytest.mark.parametrize(
    "B,inner",
    [(b, inner) for b in BATCHES for inner in [(1,), (3, 5, 7)]] + [(1, (20001,)), (3, (20001,))],
)
@pytest.mark.parametrize("given_noise", [False, True])
def test_diffusion_loss_fwd(B, inner, given_noise, each_cpu_isa):
    pred, x0 = torch.randn(B, *inner), torch.randn(B, *inner)
    p, q, w = torch.randn(B), torch.randn(B), per_sample(B)
    seed = 4242 + B
    noise = torch.randn(B, *inner) if given_noise else None
    n64 = noise.double().reshape(B, -1) if given_noise else noise_ref(seed, pred.numel()).view(B, -1)
    loss, grad = ops().diffusion_loss_fwd(pred, x0, noise, seed, p, q, w, True)
    rl, rg = loss_ref(pred, x0, n64, p, q, w)
    assert loss.dtype == torch.float32 and loss.shape == (B,)
    assert grad.dtype == pred.dtype and grad.shape == pred.shape
    torch.testing.assert_close(loss.double(), rl, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), rg, rtol=1e-5, atol=1e-6)
    loss2, grad2 = ops().diffusion_loss_fwd(pred, x0, noise, seed, p, q, w, False)
    assert grad2.numel() == 0
    assert torch.equal(loss, loss2)


def test_loss_regenerates_q_sample_noise(each_cpu_isa):
    # eps target (p, q) = (0, 1): pred = noise gives zero loss when the noise is regenerated from the seed
    B, M = 3, 1001
    seed = 99
    pred = ops().randn(seed, [B, M])
    x0 = torch.randn(B, M)
    loss, grad = ops().diffusion_loss_fwd(pred, x0, None, seed, torch.zeros(B), torch.ones(B), torch.ones(B), True)
    assert loss.abs().max().item() == 0.0
    assert grad.abs().max().item() == 0.0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_diffusion_loss_half_types(dtype, each_cpu_isa):
    B, M = 3, 515
    pred, x0 = torch.randn(B, M).to(dtype), torch.randn(B, M).to(dtype)
    p, q, w = torch.randn(B), torch.randn(B), per_sample(B)
    loss, grad = ops().diffusion_loss_fwd(pred, x0, None, 5, p, q, w, True)
    rl, rg = loss_ref(pred, x0, noise_ref(5, B * M).view(B, M), p, q, w)
    assert grad.dtype == dtype
    torch.testing.assert_close(loss.double(), rl, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.double(), rg, rtol=1e-2, atol=1e-4)


def test_diffusion_loss_independent_of_threads(each_cpu_isa):
    B, M = 3, 50001
    pred, x0 = torch.randn(B, M), torch.randn(B, M)
    p, q, w = torch.randn(B), torch.randn(B), per_sample(B)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = ops().diffusion_loss_fwd(pred, x0, None, 1, p, q, w, True)
        torch.set_num_threads(2)
        b = ops().diffusion_loss_fwd(pred, x0, None, 1, p, q, w, True)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ----------------------------------------------------------------------------- sample_timesteps


def sample_timesteps_ref(weights, batch, seed):
    w = weights.double().numpy()
    cdf = np.cumsum(w)
    b = np.arange(batch, dtype=np.uint64)
    seed &= (1 << 64) - 1
    r0 = philox_np(b & np.uint64(M32), b >> np.uint64(32), 0, 0, seed & M32, (seed >> 32) & M32)[0]
    target = uniform_np(r0).astype(np.float64) * cdf[-1]
    t = np.searchsorted(cdf, target, side="right")  # smallest k with cdf[k] > target
    t = np.where(t >= len(w), np.nonzero(w > 0)[0][-1], t)
    imp = (cdf[-1] / len(w)) / w[t]
    return torch.from_numpy(t.astype(np.int64)), torch.from_numpy(imp)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("T", [1, 7, 1000])
@pytest.mark.parametrize("batch", [1, 3, 17, 4099])
def test_sample_timesteps_matches_reference(dtype, T, batch, each_cpu_isa):
    g = torch.Generator().manual_seed(T + batch)
    w = torch.rand(T, generator=g, dtype=torch.float64).to(dtype)
    if T > 1:
        w[torch.rand(T, generator=g) < 0.5] = 0.0
        w[T // 2] = 0.7
    t, imp = ops().sample_timesteps(w, batch, 11 + T)
    rt, rimp = sample_timesteps_ref(w, batch, 11 + T)
    assert t.dtype == torch.int64 and imp.dtype == torch.float32
    assert torch.equal(t, rt)
    torch.testing.assert_close(imp.double(), rimp, rtol=1e-6, atol=0)
    assert (w.double()[t] > 0).all()


def test_sample_timesteps_curriculum_mask_and_unbiased(each_cpu_isa):
    T = 1000
    w = torch.zeros(T)
    w[600:] = 1.0  # only the easiest clusters unlocked
    t, imp = ops().sample_timesteps(w, 20000, 3)
    assert t.min().item() >= 600 and t.max().item() <= 999
    torch.testing.assert_close(imp, torch.full_like(imp, 0.4))
    # E[imp * f(t)] equals the uniform mean of f when every weight is positive
    w2 = torch.linspace(0.1, 2.0, T, dtype=torch.float64)
    t2, imp2 = ops().sample_timesteps(w2, 200000, 5)
    f = torch.linspace(0.0, 1.0, T, dtype=torch.float64)
    est = (imp2.double() * f[t2]).mean().item()
    assert abs(est - f.mean().item()) < 0.01


def test_sample_timesteps_bad_weights(each_cpu_isa):
    with pytest.raises(RuntimeError, match="weights must be finite and >= 0"):
        ops().sample_timesteps(torch.tensor([1.0, -1.0]), 4, 0)
    with pytest.raises(RuntimeError, match="weights must have a positive sum"):
        ops().sample_timesteps(torch.zeros(5), 4, 0)
    with pytest.raises(RuntimeError, match="weights must be float32 or float64"):
        ops().sample_timesteps(torch.ones(5, dtype=torch.int64), 4, 0)
    with pytest.raises(RuntimeError, match="batch_size must be >= 0"):
        ops().sample_timesteps(torch.ones(5), -1, 0)


# ----------------------------------------------------------------------------- adaLN modulate / gated residual


def adaln_ref(x, shift, scale, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    xhat = (x - mean) / torch.sqrt(var + eps)
    return xhat * (1 + scale[:, None, :]) + shift[:, None, :], mean.squeeze(-1), (var + eps).rsqrt().squeeze(-1)


@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("N,D", [(1, 7), (5, 65), (33, 130), (70, 3), (130, 33)])
def test_adaln_modulate_fwd_bwd(B, N, D, each_cpu_isa):
    eps = 1e-6
    x = (torch.randn(B, N, D) * 2 + 0.5).requires_grad_(False)
    shift, scale = torch.randn(B, D), torch.randn(B, D) * 0.5
    y, mean, rstd = ops().adaln_modulate_fwd(x, shift, scale, eps)
    x64, sh64, sc64 = (t.double().requires_grad_(True) for t in (x, shift, scale))
    ry, rmean, rrstd = adaln_ref(x64, sh64, sc64, eps)
    torch.testing.assert_close(y.double(), ry.detach(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(mean.double(), rmean.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(rstd.double(), rrstd.detach(), rtol=1e-5, atol=1e-6)
    gy = torch.randn(B, N, D)
    gx, gshift, gscale = ops().adaln_modulate_bwd(gy, x, scale, mean, rstd)
    rgx, rgsh, rgsc = torch.autograd.grad(ry, (x64, sh64, sc64), gy.double())
    torch.testing.assert_close(gx.double(), rgx, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(gshift.double(), rgsh, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gscale.double(), rgsc, rtol=1e-4, atol=1e-4)
    assert gshift.shape == (B, D) and gscale.dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_adaln_half_types(dtype, each_cpu_isa):
    B, N, D = 3, 9, 65
    x = torch.randn(B, N, D).to(dtype)
    shift, scale = torch.randn(B, D), torch.randn(B, D) * 0.5
    y, mean, rstd = ops().adaln_modulate_fwd(x, shift, scale, 1e-6)
    ry, _, _ = adaln_ref(x.double(), shift.double(), scale.double(), 1e-6)
    assert y.dtype == dtype and mean.dtype == torch.float32
    torch.testing.assert_close(y.double(), ry, rtol=2e-2, atol=2e-2)
    gx, gshift, gscale = ops().adaln_modulate_bwd(torch.ones_like(x), x, scale.to(dtype), mean, rstd)
    assert gx.dtype == dtype and gscale.dtype == dtype
    torch.testing.assert_close(gshift.float(), torch.full((B, D), float(N)), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("B", BATCHES)
@pytest.mark.parametrize("N,D", [(1, 7), (5, 65), (70, 130)])
def test_gated_residual_fwd_bwd(B, N, D, each_cpu_isa):
    x, y = torch.randn(B, N, D), torch.randn(B, N, D)
    gate = torch.randn(B, D)
    out = ops().gated_residual_fwd(x, gate, y)
    x64, g64, y64 = (t.double().requires_grad_(True) for t in (x, gate, y))
    ref = x64 + g64[:, None, :] * y64  # out = x + gate * y
    torch.testing.assert_close(out.double(), ref.detach(), rtol=1e-6, atol=1e-6)
    go = torch.randn(B, N, D)
    ggate, gy = ops().gated_residual_bwd(go, gate, y)  # grad_x is grad_out itself (not returned)
    rgx, rgg, rgy = torch.autograd.grad(ref, (x64, g64, y64), go.double())
    torch.testing.assert_close(go.double(), rgx, rtol=0, atol=0)
    torch.testing.assert_close(ggate.double(), rgg, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gy.double(), rgy, rtol=1e-6, atol=1e-6)
    assert ggate.shape == (B, D) and gy.shape == (B, N, D)
    _assert_fresh((ggate, gy), (go, gate, y))


def _assert_fresh(outputs, inputs):
    """Every output owns its storage: no output shares memory with an input or with another output."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    for out in outputs:
        ptr = out.untyped_storage().data_ptr()
        assert ptr not in seen
        seen.add(ptr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", BATCHES)
def test_adaln_bwd_outputs_are_separate(B, dtype, each_cpu_isa):
    x = torch.randn(B, 3, 17).to(dtype)
    scale = torch.randn(B, 17).to(dtype)
    _, mean, rstd = ops().adaln_modulate_fwd(x, scale, scale, 1e-6)
    gy = torch.randn(B, 3, 17).to(dtype)
    gx, gshift, gscale = ops().adaln_modulate_bwd(gy, x, scale, mean, rstd)
    _assert_fresh((gx, gshift, gscale), (gy, x, scale, mean, rstd))
    gshift.zero_()  # writing one gradient leaves the other untouched
    torch.testing.assert_close(
        gscale.double(),
        (gy.double() * (x.double() - mean[..., None]) * rstd[..., None]).sum(1),
        rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
        atol=2e-2 if dtype == torch.bfloat16 else 1e-5,
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B", BATCHES)
def test_adaln_bwd_without_affine_grads(B, dtype, each_cpu_isa):
    """affine_grads=False gives the same grad_x bit for bit and empty shift / scale gradients."""
    x, gy = torch.randn(B, 70, 33).to(dtype), torch.randn(B, 70, 33).to(dtype)
    scale = torch.randn(B, 33).to(dtype)
    _, mean, rstd = ops().adaln_modulate_fwd(x, scale, scale, 1e-6)
    full = ops().adaln_modulate_bwd(gy, x, scale, mean, rstd)
    gx, gshift, gscale = ops().adaln_modulate_bwd(gy, x, scale, mean, rstd, False)
    assert torch.equal(gx, full[0])
    assert gshift.shape == (0,) and gscale.shape == (0,) and gshift.dtype == dtype


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gated_residual_bwd_half_types(dtype, each_cpu_isa):
    B, N, D = 3, 67, 33
    go, y = torch.randn(B, N, D).to(dtype), torch.randn(B, N, D).to(dtype)
    gate = torch.randn(B, D).to(dtype)
    ggate, gy = ops().gated_residual_bwd(go, gate, y)
    assert ggate.dtype == dtype and gy.dtype == dtype
    ref_gy = (gate.double()[:, None, :] * go.double()).to(dtype)  # one rounding of the float32 product
    torch.testing.assert_close(gy, ref_gy, rtol=0, atol=0)
    torch.testing.assert_close(ggate.double(), (go.double() * y.double()).sum(1), rtol=2e-2, atol=5e-2)


def test_block_bwd_independent_of_threads(each_cpu_isa):
    """Column reductions over N use fixed row chunks combined in a fixed order: bitwise equal for 1 or 2 threads."""
    B, N, D = 3, 200, 97
    x, gy = torch.randn(B, N, D), torch.randn(B, N, D)
    scale, gate = torch.randn(B, D), torch.randn(B, D)
    _, mean, rstd = ops().adaln_modulate_fwd(x, scale, scale, 1e-6)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        a = ops().adaln_modulate_bwd(gy, x, scale, mean, rstd) + ops().gated_residual_bwd(gy, gate, x)
        torch.set_num_threads(2)
        b = ops().adaln_modulate_bwd(gy, x, scale, mean, rstd) + ops().gated_residual_bwd(gy, gate, x)
    finally:
        torch.set_num_threads(before)
    for u, v in zip(a, b):
        assert torch.equal(u, v)


def test_gated_residual_half_types(each_cpu_isa):
    B, N, D = 3, 5, 33
    x, y = torch.randn(B, N, D).bfloat16(), torch.randn(B, N, D).bfloat16()
    gate = torch.randn(B, D)
    out = ops().gated_residual_fwd(x, gate, y)
    ref = x.double() + gate.double()[:, None, :] * y.double()
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- bad input


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(3, 8)
    a = torch.ones(3)
    with pytest.raises(RuntimeError, match="x0 must be float32, bfloat16 or float16, got Double"):
        ops().q_sample(x.double(), a, a, None, 0)
    with pytest.raises(RuntimeError, match=r"a must have shape \(3,\)"):
        ops().q_sample(x, torch.ones(4), a, None, 0)
    with pytest.raises(RuntimeError, match="c must be float32"):
        ops().q_sample(x, a, a.double(), None, 0)
    with pytest.raises(RuntimeError, match="noise must have the shape of x0"):
        ops().q_sample(x, a, a, torch.randn(3, 9), 0)
    with pytest.raises(RuntimeError, match="x0 must have the shape of pred"):
        ops().diffusion_loss_fwd(x, torch.randn(3, 9), None, 0, a, a, a, True)
    with pytest.raises(RuntimeError, match="x0 must have a batch dimension"):
        ops().q_sample(torch.tensor(1.0), a, a, None, 0)
    with pytest.raises(RuntimeError, match=r"x must have shape \(B, N, D\)"):
        ops().adaln_modulate_fwd(x, x, x, 1e-6)
    x3 = torch.randn(3, 4, 8)
    with pytest.raises(RuntimeError, match=r"scale must have shape \(3, 8\)"):
        ops().adaln_modulate_fwd(x3, torch.zeros(3, 8), torch.zeros(3, 7), 1e-6)
    with pytest.raises(RuntimeError, match="eps must be finite and >= 0"):
        ops().adaln_modulate_fwd(x3, torch.zeros(3, 8), torch.zeros(3, 8), -1.0)
    with pytest.raises(RuntimeError, match=r"rstd must have shape \(3, 4\)"):
        ops().adaln_modulate_bwd(x3, x3, torch.zeros(3, 8), torch.zeros(3, 4), torch.zeros(3, 5))
    with pytest.raises(RuntimeError, match="y must have the dtype of x"):
        ops().gated_residual_fwd(x3, torch.zeros(3, 8), x3.bfloat16())


# ----------------------------------------------------------------------------- instruction sets


def _cpu_supported_isas() -> list[str]:
    """The variants this CPU can run, from /proc/cpuinfo (as the extension checks them)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = set(next(line for line in f if line.startswith("flags")).split(":", 1)[1].split())
    except (OSError, StopIteration):
        return ["generic"]
    isas = ["generic"]
    if {"avx2", "fma", "f16c", "bmi2"} <= flags:
        isas.append("avx2")
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
            isas.append("avx512")
    return isas


def test_isa_env_var_forces_the_variant(tmp_path):
    """DIFFCURR_CPU_ISA forces a variant the CPU has; one it lacks (or an unknown name) falls back to the best. The
    variants' results are checked against the float64 references above, each test once per variant."""
    script = "import torch, diffcurr_fast._C; print(torch.ops.diffcurr_fast_C.cpu_isa())"
    supported = _cpu_supported_isas()
    for isa in ["generic", "avx2", "avx512", "neon"]:
        env = dict(os.environ, DIFFCURR_CPU_ISA=isa, OMP_NUM_THREADS="1")
        got = subprocess.run(
            [sys.executable, "-c", script], check=True, env=env, timeout=120, capture_output=True, text=True
        ).stdout.strip()
        assert got == (isa if isa in supported else supported[-1]), (isa, got)


def test_every_supported_isa_is_exercised_and_switchable(each_cpu_isa):
    """The sets the extension reports are the ones this CPU has (so the ISA-parametrised op and model tests run
    AVX-512 on a machine with it), and the fixture really switches the kernels, and back."""
    from diffcurr_fast.ops import _backend

    assert _backend.cpu_isas() == _cpu_supported_isas()
    assert ops().cpu_isa() == _backend.cpu_isa() == each_cpu_isa
    first = "generic" if each_cpu_isa != "generic" else _cpu_supported_isas()[-1]
    with _backend.use_cpu_isa(first):
        assert ops().cpu_isa() == _backend.cpu_isa() == first
    assert ops().cpu_isa() == _backend.cpu_isa() == each_cpu_isa
    with pytest.raises(RuntimeError, match="instruction set 'neon' is not supported here; this build and CPU run"):
        with _backend.use_cpu_isa("neon"):
            pass
    assert ops().cpu_isa() == each_cpu_isa


# ----------------------------------------------------------------------------- CUDA kernels (GPU machines only)


def _has_cuda_kernels():
    if not torch.cuda.is_available():
        return False
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("diffcurr_fast_C::q_sample", "CUDA")
    except RuntimeError:
        return False


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,inner", [(1, (7,)), (3, (4, 33, 31)), (17, (4099,))])
def test_cuda_ops_match_cpu(dtype, B, inner):
    if not _has_cuda_kernels():
        pytest.skip("diffcurr_fast._C was built without CUDA kernels")
    dev = torch.device("cuda")
    seed = 123457 + B
    x0, pred = torch.randn(B, *inner).to(dtype), torch.randn(B, *inner).to(dtype)
    a, c, p, q, w = per_sample(B), per_sample(B), torch.randn(B), torch.randn(B), per_sample(B)
    tol = dict(rtol=1e-5, atol=2e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(
        ops().randn_like(x0.to(dev), seed).cpu(), ops().randn(seed, list(x0.shape)), rtol=1e-5, atol=2e-5
    )
    cuda_args = [t.to(dev) for t in (x0, a, c)]
    torch.testing.assert_close(
        ops().q_sample(*cuda_args, None, seed).cpu(), ops().q_sample(x0, a, c, None, seed), **tol
    )
    for noise in (None, torch.randn(B, *inner)):
        got = ops().diffusion_loss_fwd(
            pred.to(dev),
            x0.to(dev),
            None if noise is None else noise.to(dev),
            seed,
            p.to(dev),
            q.to(dev),
            w.to(dev),
            True,
        )
        ref = ops().diffusion_loss_fwd(pred, x0, noise, seed, p, q, w, True)
        torch.testing.assert_close(got[0].cpu(), ref[0], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[1].cpu(), ref[1], **tol)
    N, D = 5, 67
    x, y = torch.randn(B, N, D).to(dtype), torch.randn(B, N, D).to(dtype)
    shift, scale, gate = torch.randn(B, D), torch.randn(B, D), torch.randn(B, D)
    got = ops().adaln_modulate_fwd(x.to(dev), shift.to(dev), scale.to(dev), 1e-6)
    ref = ops().adaln_modulate_fwd(x, shift, scale, 1e-6)
    for g, r in zip(got, ref):
        torch.testing.assert_close(g.cpu(), r, **tol)
    gy = torch.randn(B, N, D).to(dtype)
    got = ops().adaln_modulate_bwd(gy.to(dev), x.to(dev), scale.to(dev), ref[1].to(dev), ref[2].to(dev))
    refb = ops().adaln_modulate_bwd(gy, x, scale, ref[1], ref[2])
    for g, r in zip(got, refb):
        torch.testing.assert_close(g.cpu(), r, rtol=1e-3, atol=1e-3)
    got = ops().adaln_modulate_bwd(gy.to(dev), x.to(dev), scale.to(dev), ref[1].to(dev), ref[2].to(dev), False)
    torch.testing.assert_close(got[0].cpu(), refb[0], rtol=1e-3, atol=1e-3)
    assert got[1].shape == (0,) and got[2].shape == (0,)
    torch.testing.assert_close(
        ops().gated_residual_fwd(x.to(dev), gate.to(dev), y.to(dev)).cpu(), ops().gated_residual_fwd(x, gate, y), **tol
    )
    got = ops().gated_residual_bwd(gy.to(dev), gate.to(dev), y.to(dev))
    refb = ops().gated_residual_bwd(gy, gate, y)
    for g, r in zip(got, refb):
        torch.testing.assert_close(g.cpu(), r, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 1000, 5000])
def test_cuda_sample_timesteps_matches_cpu(T):
    if not _has_cuda_kernels():
        pytest.skip("diffcurr_fast._C was built without CUDA kernels")
    w = torch.rand(T, dtype=torch.float64)
    if T > 1:
        w[: T // 3] = 0.0
    t, imp = ops().sample_timesteps(w.cuda(), 4099, 77)
    rt, rimp = ops().sample_timesteps(w, 4099, 77)
    assert (t.cpu() != rt).sum().item() <= 2  # float64 cdf sums in a different order can move a boundary draw
    assert (w[t.cpu()] > 0).all()
    same = t.cpu() == rt
    torch.testing.assert_close(imp.cpu()[same], rimp[same], rtol=1e-6, atol=0)
    t0, imp0 = ops().sample_timesteps(torch.zeros(5, device="cuda"), 3, 0)
    assert (t0 == -1).all() and imp0.isnan().all()
