"""diffusion_loss: fused target + weighted MSE + one-pass gradient against float64 autograd references."""

import sys

import pytest
import torch
from conftest import op_backends

from diffcurr_fast.diffusion import DDPMSchedule, loss_weights
from diffcurr_fast.ops import _backend, diffusion_loss, diffusion_loss_coef, philox_randn_ref, q_sample

CPU = torch.device("cpu")
SCHED = DDPMSchedule(1000)
SHAPES = [(1, 37), (3, 3, 5, 7), (17, 2, 3, 5)]


def _need(backend: str) -> None:
    reason = _backend.unavailable_reason(backend, "diffusion_loss_fwd", CPU)
    if reason is not None:
        pytest.skip(reason)


def _ref_loss(pred64, x0, noise, t, prediction, weighting, gamma, weights=None):
    # float64 definition: w(SNR_t) * mean_j (pred - target)^2, target per Ho et al. / Salimans & Ho
    tgt = SCHED.target(x0.double(), noise.double(), t, prediction)
    w = loss_weights(SCHED.snr(t), prediction, weighting, gamma)
    if weights is not None:
        w = w * weights.double()
    return w * (pred64 - tgt).square().flatten(1).mean(1)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize(
    "prediction,weighting", [("eps", "none"), ("eps", "min_snr"), ("x0", "min_snr"), ("v", "min_snr"), ("v", "p2")]
)
def test_loss_and_grad_match_float64(backend, shape, prediction, weighting):
    _need(backend)
    B = shape[0]
    x0, noise = torch.randn(shape), torch.randn(shape)
    t = torch.randint(0, 1000, (B,))
    t[0] = 999  # SNR near 0
    pred = torch.randn(shape, requires_grad=True)
    imp = torch.rand(B) + 0.5
    loss = diffusion_loss(
        pred,
        x0,
        noise,
        t,
        SCHED,
        prediction=prediction,
        weighting=weighting,
        gamma=5.0,
        weights=imp,
        reduction="none",
        backend=backend,
    )
    g = torch.rand(B)
    loss.backward(g)
    p64 = pred.detach().double().requires_grad_()
    ref = _ref_loss(p64, x0, noise, t, prediction, weighting, 5.0, imp)
    ref.backward(g.double())
    assert loss.dtype == torch.float32 and loss.shape == (B,)
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(pred.grad.double(), p64.grad, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", [(1, 37), (3, 3, 5, 7)])
def test_seeded_loss_regenerates_q_sample_noise(backend, shape):
    _need(backend)
    B = shape[0]
    x0 = torch.randn(shape)
    t = torch.randint(0, 1000, (B,))
    seed = 31337
    xt = q_sample(x0, t, SCHED, seed=seed, backend=backend)
    pred = (xt * 0.5).requires_grad_()
    loss = diffusion_loss(pred, x0, None, t, SCHED, prediction="v", weighting="min_snr", seed=seed, backend=backend)
    loss.backward()
    noise = philox_randn_ref(seed, shape)
    p64 = pred.detach().double().requires_grad_()
    ref = _ref_loss(p64, x0, noise, t, "v", "min_snr", 5.0).mean()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(pred.grad.double(), p64.grad, rtol=2e-5, atol=1e-7)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_coef_form_flow_and_edm(backend):
    _need(backend)
    B, shape = 3, (3, 4, 6)
    x0, noise = torch.randn(B, *shape), torch.randn(B, *shape)
    pred = torch.randn(B, *shape, requires_grad=True)
    w = torch.rand(B)
    # flow/SiT velocity target: eps - x0 (p = -1, q = 1)
    loss = diffusion_loss_coef(pred, x0, noise, -1.0, 1.0, w, backend=backend)
    loss.backward()
    p64 = pred.detach().double().requires_grad_()
    ref = (w.double() * (p64 - (noise - x0).double()).square().flatten(1).mean(1)).mean()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(pred.grad.double(), p64.grad, rtol=2e-5, atol=1e-7)
    # EDM: x0 target with per-sample lambda(sigma), no gradient tracking -> no gradient buffer
    with torch.no_grad():
        got = diffusion_loss_coef(pred, x0, noise, 1.0, 0.0, w, reduction="none", backend=backend)
    torch.testing.assert_close(got, w * (pred.detach() - x0).square().flatten(1).mean(1), rtol=2e-5, atol=1e-6)


def test_half_precision_pred(each_cpu_isa):
    x0 = torch.randn(3, 33, dtype=torch.bfloat16)
    noise = torch.randn(3, 33, dtype=torch.bfloat16)
    pred = torch.randn(3, 33, dtype=torch.bfloat16, requires_grad=True)
    t = torch.randint(0, 1000, (3,))
    loss = diffusion_loss(pred, x0, noise, t, SCHED)
    assert loss.dtype == torch.float32
    loss.backward()
    assert pred.grad.dtype == torch.bfloat16
    p64 = pred.detach().double().requires_grad_()
    ref = _ref_loss(p64, x0, noise, t, "eps", "none", 5.0).mean()
    ref.backward()
    torch.testing.assert_close(loss.double(), ref, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(pred.grad.double(), p64.grad, rtol=2e-2, atol=1e-3)


def test_float64_gradcheck_on_reference():
    x0, noise = torch.randn(3, 5, dtype=torch.float64), torch.randn(3, 5, dtype=torch.float64)
    pred = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 500, 999])
    f = lambda p: diffusion_loss(p, x0, noise, t, SCHED, prediction="v", weighting="min_snr", reduction="none")
    torch.autograd.gradcheck(f, (pred,))


def test_non_contiguous_inputs(each_cpu_isa):
    x0 = torch.randn(6, 5).t()
    noise = torch.randn(6, 5).t()
    pred = torch.randn(6, 5).t().requires_grad_()
    t = torch.randint(0, 1000, (5,))
    for backend in _backend.available_backends("diffusion_loss_fwd", CPU):
        pred.grad = None
        loss = diffusion_loss(pred, x0, noise, t, SCHED, backend=backend)
        loss.backward()
        p64 = pred.detach().double().requires_grad_()
        ref = _ref_loss(p64, x0, noise, t, "eps", "none", 5.0).mean()
        ref.backward()
        torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
        torch.testing.assert_close(pred.grad.double(), p64.grad, rtol=2e-5, atol=1e-7)


def test_bad_inputs():
    x0, pred = torch.randn(3, 4), torch.randn(3, 4)
    t = torch.tensor([1, 2, 3])
    with pytest.raises(ValueError, match="neither"):
        diffusion_loss(pred, x0, None, t, SCHED)
    with pytest.raises(ValueError, match="either noise or seed"):
        diffusion_loss(pred, x0, torch.randn(3, 4), t, SCHED, seed=1)
    with pytest.raises(ValueError, match="prediction"):
        diffusion_loss(pred, x0, None, t, SCHED, seed=1, prediction="score")
    with pytest.raises(ValueError, match="weighting"):
        diffusion_loss(pred, x0, None, t, SCHED, seed=1, weighting="max_snr")
    with pytest.raises(ValueError, match="reduction"):
        diffusion_loss(pred, x0, None, t, SCHED, seed=1, reduction="sum")
    with pytest.raises(ValueError, match="x0 shape"):
        diffusion_loss(pred, torch.randn(3, 5), None, t, SCHED, seed=1)
    with pytest.raises(ValueError, match="out of range"):
        diffusion_loss(pred, x0, None, torch.tensor([0, 1, 1000]), SCHED, seed=1)
    with pytest.raises(ValueError, match=r"weights must have shape \(3,\)"):
        diffusion_loss(pred, x0, None, t, SCHED, seed=1, weights=torch.ones(4))
    with pytest.raises(ValueError, match="dtype"):
        diffusion_loss(pred, x0.half(), None, t, SCHED, seed=1)
    with pytest.raises(ValueError, match="x0 is on meta"):
        diffusion_loss(pred, torch.empty(3, 4, device="meta"), None, t, SCHED, seed=1)
    with pytest.raises(ValueError, match="gamma"):
        diffusion_loss(pred, x0, None, t, SCHED, seed=1, weighting="min_snr", gamma=-1.0)


@pytest.mark.parametrize("backend", op_backends("cpu", "triton"))
def test_float16_kernels_match_reference(backend):
    _need(backend)
    x0 = torch.randn(3, 37, dtype=torch.float16)
    t = torch.randint(0, 1000, (3,))
    grads = []
    for be in (backend, "reference"):
        pred = torch.randn(3, 37, generator=torch.Generator().manual_seed(1)).half().requires_grad_()
        loss = diffusion_loss(pred, x0, None, t, SCHED, prediction="x0", seed=8, backend=be)
        loss.backward()
        grads.append((loss.detach(), pred.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-4, atol=1e-6)
    assert grads[0][1].dtype == torch.float16
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-3, atol=1e-5)


def _min_snr_weight(snr, prediction, gamma):
    # Hang et al. Eq. 5 in the space of each target: x0 min(SNR, g); eps min(SNR, g) / SNR; v min(SNR, g) / (SNR + 1)
    w = torch.minimum(snr, torch.full_like(snr, gamma))
    return {"x0": w, "eps": w / snr, "v": w / (snr + 1)}[prediction]


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
def test_min_snr_gamma_reaches_every_backend(backend, prediction):
    """gamma in {1, 5, 20}, one after another on the same schedule (a weight table cached per gamma must not be
    reused for another), against min(SNR, gamma) written out here."""
    _need(backend)
    B, shape = 17, (17, 2, 3, 5)
    x0, noise = torch.randn(shape, dtype=torch.float64), torch.randn(shape, dtype=torch.float64)
    t = torch.arange(B) * 58 + 5  # SNR from ~1e4 down to ~1e-3: every gamma clips some of them
    pred = torch.randn(shape, dtype=torch.float64)
    snr = SCHED.alphas_cumprod[t] / (1 - SCHED.alphas_cumprod[t])
    tgt = {
        "eps": noise,
        "x0": x0,
        "v": SCHED.alphas_cumprod[t].sqrt().view(-1, 1, 1, 1) * noise
        - (1 - SCHED.alphas_cumprod[t]).sqrt().view(-1, 1, 1, 1) * x0,
    }[prediction]
    mse = (pred - tgt).square().flatten(1).mean(1)
    got = {}
    for gamma in (1.0, 5.0, 20.0, 1.0):
        p = pred.float().requires_grad_()
        loss = diffusion_loss(
            p,
            x0.float(),
            noise.float(),
            t,
            SCHED,
            prediction=prediction,
            weighting="min_snr",
            gamma=gamma,
            reduction="none",
            backend=backend,
        )
        loss.sum().backward()
        w = _min_snr_weight(snr, prediction, gamma)
        torch.testing.assert_close(loss.double(), w * mse, rtol=2e-5, atol=1e-6)
        grad = w.view(-1, 1, 1, 1) * 2 * (pred - tgt) / (2 * 3 * 5)
        torch.testing.assert_close(p.grad.double(), grad, rtol=2e-5, atol=1e-7)
        got[gamma] = loss.detach()
    assert not torch.allclose(got[1.0], got[20.0])  # gamma is not ignored on these timesteps


# ---- the gradient written by the forward: returned as is, rescaled, retained graphs, second derivatives ------
@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("upstream", ["backward()", "scaled", "retain_graph twice"])
def test_mean_gradient_paths_match_float64(backend, upstream):
    _need(backend)
    shape = (7, 3, 5, 3)
    x0, noise, t = torch.randn(shape), torch.randn(shape), torch.randint(0, 1000, (7,))
    pred = torch.randn(shape, requires_grad=True)
    loss = diffusion_loss(pred, x0, noise, t, SCHED, prediction="v", weighting="min_snr", backend=backend)
    p64 = pred.detach().double().requires_grad_()
    ref = _ref_loss(p64, x0, noise, t, "v", "min_snr", 5.0).mean()
    if upstream == "backward()":  # the buffer the forward wrote is the gradient
        loss.backward()
        ref.backward()
    elif upstream == "scaled":  # a loss scale, gradient accumulation: the buffer is rescaled
        (loss * 0.37).backward()
        (ref * 0.37).backward()
    else:  # the second backward must not see a buffer the first one handed out
        loss.backward(retain_graph=True)
        loss.backward()
        ref.backward(retain_graph=True)
        ref.backward()
    assert loss.shape == ()
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(pred.grad.double(), p64.grad, rtol=2e-5, atol=1e-7)


def test_in_place_change_of_the_returned_gradient_is_never_silent():
    _need("cpu")
    x0, noise, t = torch.randn(4, 9), torch.randn(4, 9), torch.tensor([1, 50, 500, 999])
    pred = torch.randn(4, 9, requires_grad=True)
    loss = diffusion_loss(pred, x0, noise, t, SCHED, backend="cpu")
    loss.backward(retain_graph=True)
    once = pred.grad.clone()
    pred.grad.zero_()  # zero_grad(set_to_none=False), then the retained graph again: the same gradient
    loss.backward(retain_graph=True)
    torch.testing.assert_close(pred.grad, once)
    (g,) = torch.autograd.grad(loss, pred, retain_graph=True)  # the buffer itself
    g.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        torch.autograd.grad(loss, pred)


def test_no_second_derivative():
    _need("cpu")
    x0, noise, t = torch.randn(2, 5), torch.randn(2, 5), torch.tensor([3, 700])
    pred = torch.randn(2, 5, requires_grad=True)
    loss = diffusion_loss(pred, x0, noise, t, SCHED, backend="cpu")
    with pytest.raises(RuntimeError, match="no second derivative"):
        torch.autograd.grad(loss, pred, create_graph=True)


def test_eps_target_never_reads_x0(each_cpu_isa):
    # p = 0 for eps prediction: the kernels leave x0 unread, so even a non-finite x0 cannot reach the loss
    _need("cpu")
    x0, noise, t = torch.randn(3, 40), torch.randn(3, 40), torch.tensor([0, 400, 999])
    pred = torch.randn(3, 40, requires_grad=True)
    clean = diffusion_loss(pred, x0, noise, t, SCHED, reduction="none", backend="cpu")
    dirty = diffusion_loss(pred, torch.full_like(x0, float("nan")), noise, t, SCHED, reduction="none", backend="cpu")
    torch.testing.assert_close(dirty, clean)
    seeded = diffusion_loss_coef(pred, torch.full_like(x0, float("nan")), None, 0.0, 1.0, seed=5, backend="cpu")
    assert torch.isfinite(seeded)


# ---- learned sigma: the loss reads the first C channels of a (B, 2C, H, W) output in place ---------------------
def _sliced(B, C, H, W, offset, dtype=torch.float32):
    out = torch.randn(B, 2 * C + offset, H, W, dtype=dtype, requires_grad=True)
    return out, out[:, offset : offset + C]  # each sample contiguous, (2C + offset) H W elements apart


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", [(1, 3, 5, 7), (5, 3, 5, 7), (4, 4, 4, 4)])
@pytest.mark.parametrize("offset", [0, 1])  # 1: a storage offset, rows not 16-byte aligned
@pytest.mark.parametrize("seeded,reduction", [(False, "none"), (True, "none"), (True, "mean")])
def test_channel_slice_matches_float64(backend, shape, offset, seeded, reduction):
    _need(backend)
    B, C, H, W = shape
    out, pred = _sliced(B, C, H, W, offset)
    assert not pred.is_contiguous() or B == 1
    x0 = torch.randn(shape)
    noise = None if seeded else torch.randn(shape)
    p, q, w = torch.rand(B) - 0.5, torch.rand(B) + 0.5, torch.rand(B) + 0.1
    p[0] = 0.0  # an eps row (x0 unread)
    loss = diffusion_loss_coef(
        pred, x0, noise, p, q, w, reduction=reduction, seed=11 if seeded else None, backend=backend
    )
    g = torch.rand(B) if reduction == "none" else torch.tensor(1.0)
    loss.backward(g)
    eps = philox_randn_ref(11, shape) if seeded else noise
    o64 = out.detach().double().requires_grad_()
    col = (-1, 1, 1, 1)
    tgt = p.double().view(col) * x0.double() + q.double().view(col) * eps.double()
    ref = w.double() * (o64[:, offset : offset + C] - tgt).square().flatten(1).mean(1)
    ref = ref if reduction == "none" else ref.mean()
    ref.backward(g.double())
    torch.testing.assert_close(loss.double(), ref, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(out.grad.double(), o64.grad, rtol=2e-5, atol=1e-7)  # zero outside the slice


@pytest.mark.parametrize("backend", op_backends("cpu", "triton"))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_channel_slice_16bit_matches_contiguous(backend, dtype):
    # the same bits whether pred is the slice or a contiguous copy of it
    _need(backend)
    out, pred = _sliced(3, 3, 7, 5, 1, dtype)
    x0 = torch.randn(3, 3, 7, 5, dtype=dtype)
    p, q = torch.tensor([0.0, 0.3, -0.8]), torch.tensor([1.0, 0.9, 0.6])
    got = diffusion_loss_coef(pred, x0, None, p, q, reduction="none", seed=5, backend=backend)
    got.backward(torch.tensor([0.5, 1.0, 2.0]))
    copy = pred.detach().contiguous().requires_grad_()
    want = diffusion_loss_coef(copy, x0, None, p, q, reduction="none", seed=5, backend=backend)
    want.backward(torch.tensor([0.5, 1.0, 2.0]))
    assert torch.equal(got, want)
    assert torch.equal(out.grad[:, 1:4], copy.grad) and not out.grad[:, 4:].any() and not out.grad[:, :1].any()


def test_channel_slice_is_not_copied():
    _need("cpu")
    out, pred = _sliced(4, 4, 8, 8, 0)
    x0 = torch.randn(4, 4, 8, 8)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        diffusion_loss_coef(pred, x0, None, 0.0, 1.0, reduction="none", seed=3, backend="cpu")
    names = {e.name for e in prof.events()}
    assert "diffcurr_fast_C::diffusion_loss_fwd" in names
    assert not names & {"aten::clone", "aten::contiguous", "aten::copy_"}, names
    # a layout whose samples are not contiguous still works (made contiguous first)
    t = torch.randn(4, 8, 8, 4).permute(0, 3, 1, 2)
    torch.testing.assert_close(
        diffusion_loss_coef(t, x0, None, 0.0, 1.0, reduction="none", seed=3, backend="cpu"),
        diffusion_loss_coef(t.contiguous(), x0, None, 0.0, 1.0, reduction="none", seed=3, backend="cpu"),
        rtol=0,
        atol=0,
    )


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_skipped_rescale_keeps_bits(backend, dtype, monkeypatch):
    """An upstream gradient of exactly one: the CPU hands over the forward's buffer, a GPU (emulated: the check
    off) rescales it by one; the same bits either way, so the skip is a pure saving of one pass."""
    module = sys.modules["diffcurr_fast.ops.diffusion_loss"]  # the package exports a function of that name
    _need(backend)
    x0, noise, t = torch.randn(5, 3, 7, dtype=dtype), torch.randn(5, 3, 7, dtype=dtype), torch.randint(0, 1000, (5,))
    grads = []
    for check in (True, False):
        monkeypatch.setattr(module, "CHECK_UPSTREAM_ON_CPU", check)
        for reduction, upstream in (("mean", None), ("none", torch.ones(5))):
            pred = torch.randn(5, 3, 7, generator=torch.Generator().manual_seed(2)).to(dtype).requires_grad_()
            loss = diffusion_loss(pred, x0, noise, t, SCHED, reduction=reduction, backend=backend)
            loss.backward(upstream)
            grads.append(pred.grad)
    assert torch.equal(grads[0], grads[2]) and torch.equal(grads[1], grads[3])  # (mean, none): skipped vs scaled
