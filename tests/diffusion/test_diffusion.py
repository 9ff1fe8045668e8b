"""DDPM schedule, posterior, targets, hybrid loss and respacing against float64 numpy recomputations."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffcurr_fast.diffusion import (
    DDPMSchedule,
    Readout,
    RespacedModel,
    approx_standard_normal_cdf,
    discretized_gaussian_log_likelihood,
    hybrid_loss,
    normal_kl,
    respace,
    space_timesteps,
    training_losses,
    vb_terms_bpd,
    weighted_mse,
)

# ---- float64 numpy reference (Ho et al. 2020; Nichol & Dhariwal 2021) ---------------------------------------


def np_linear_betas(T: int) -> np.ndarray:
    scale = 1000 / T
    return np.linspace(scale * 1e-4, scale * 0.02, T, dtype=np.float64)


def np_cosine_betas(T: int) -> np.ndarray:
    f = lambda u: np.cos((u + 0.008) / 1.008 * np.pi / 2) ** 2
    i = np.arange(T, dtype=np.float64)
    return np.minimum(1 - f((i + 1) / T) / f(i / T), 0.999)


class NpDDPM:
    def __init__(self, betas: np.ndarray):
        self.betas = betas
        self.abar = np.cumprod(1 - betas)
        self.abar_prev = np.append(1.0, self.abar[:-1])
        self.post_var = betas * (1 - self.abar_prev) / (1 - self.abar)
        self.post_logvar = np.log(np.append(self.post_var[1], self.post_var[1:]))
        self.c1 = betas * np.sqrt(self.abar_prev) / (1 - self.abar)
        self.c2 = (1 - self.abar_prev) * np.sqrt(1 - betas) / (1 - self.abar)

    def x0_from_eps(self, xt, t, eps):
        ab = self.abar[t][:, None]
        return xt / np.sqrt(ab) - np.sqrt(1 / ab - 1) * eps

    def post_mean(self, x0, xt, t):
        return self.c1[t][:, None] * x0 + self.c2[t][:, None] * xt

    def vb_bpd(self, out, x0, xt, t):
        """IDDPM _vb_terms_bpd with learned-range variance, x flattened to (B, M); out is (B, 2M)."""
        m = x0.shape[1]
        eps, v = out[:, :m], out[:, m:]
        frac = (v + 1) / 2
        logvar = frac * np.log(self.betas[t])[:, None] + (1 - frac) * self.post_logvar[t][:, None]
        mean = self.post_mean(self.x0_from_eps(xt, t, eps), xt, t)
        tmean = self.post_mean(x0, xt, t)
        tlog = self.post_logvar[t][:, None]
        kl = 0.5 * (-1 + logvar - tlog + np.exp(tlog - logvar) + (tmean - mean) ** 2 * np.exp(-logvar))
        cdf = lambda z: 0.5 * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))
        inv = np.exp(-0.5 * logvar)
        cp, cm = cdf(inv * (x0 - mean + 1 / 255)), cdf(inv * (x0 - mean - 1 / 255))
        lp = np.where(
            x0 < -0.999,
            np.log(np.maximum(cp, 1e-12)),
            np.where(x0 > 0.999, np.log(np.maximum(1 - cm, 1e-12)), np.log(np.maximum(cp - cm, 1e-12))),
        )
        kl_b, nll_b = kl.mean(1) / np.log(2), -lp.mean(1) / np.log(2)
        return np.where(t == 0, nll_b, kl_b)


# ---- schedule values -------------------------------------------------------------------------------------


def test_linear_schedule_values():
    s, ref = DDPMSchedule(1000, "linear"), np_linear_betas(1000)
    assert s.betas.dtype == torch.float64
    assert s.betas[0].item() == pytest.approx(1e-4, rel=1e-12)
    assert s.betas[999].item() == pytest.approx(0.02, rel=1e-12)
    abar = np.cumprod(1 - ref)
    for t in (0, 499, 999):
        assert s.alphas_cumprod[t].item() == pytest.approx(abar[t], rel=1e-12)
    assert s.alphas_cumprod[0].item() == pytest.approx(1 - 1e-4, rel=1e-14)
    np.testing.assert_allclose(s.alphas_cumprod.numpy(), abar, rtol=1e-12)
    np_ref = NpDDPM(ref)
    for name, val in [
        ("posterior_variance", np_ref.post_var),
        ("posterior_log_variance_clipped", np_ref.post_logvar),
        ("posterior_mean_coef1", np_ref.c1),
        ("posterior_mean_coef2", np_ref.c2),
        ("alphas_cumprod_prev", np_ref.abar_prev),
    ]:
        np.testing.assert_allclose(getattr(s, name).numpy(), val, rtol=1e-10, err_msg=name)
    assert s.posterior_variance[0].item() == 0.0  # beta_tilde_0 = 0, its log clipped to beta_tilde_1
    assert s.posterior_log_variance_clipped[0].item() == s.posterior_log_variance_clipped[1].item()


def test_cosine_schedule_values():
    s, ref = DDPMSchedule(1000, "cosine"), np_cosine_betas(1000)
    np.testing.assert_allclose(s.betas.numpy(), ref, rtol=1e-12)
    f = lambda u: math.cos((u + 0.008) / 1.008 * math.pi / 2) ** 2
    for t in (0, 499, 998):  # abar_t = f(t+1) / f(0) while no beta is clipped
        assert s.alphas_cumprod[t].item() == pytest.approx(f((t + 1) / 1000) / f(0), rel=1e-9)
    assert s.betas[999].item() == pytest.approx(0.999)


def test_snr_and_axis_monotone():
    s = DDPMSchedule(1000)
    t = torch.arange(1000)
    snr, lam = s.snr(t), s.log_snr(t)
    assert snr.dtype == torch.float64 and bool((snr[1:] < snr[:-1]).all())
    torch.testing.assert_close(torch.log(snr), lam, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(s.t_from_log_snr(lam), t)
    torch.testing.assert_close(s.t_from_snr(snr), t)
    # values between table entries map to the nearest index; beyond the ends clamp
    assert s.t_from_log_snr(torch.tensor([1e3, -1e3])).tolist() == [0, 999]
    mid = (lam[10] * 0.7 + lam[11] * 0.3).reshape(1)
    assert s.t_from_log_snr(mid).item() == 10


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
@pytest.mark.parametrize("b", [1, 3, 17])
def test_targets_and_coefficients(prediction, b):
    s = DDPMSchedule(1000)
    x0, noise = torch.randn(b, 3, 5, dtype=torch.float64), torch.randn(b, 3, 5, dtype=torch.float64)
    t = torch.randint(0, 1000, (b,))
    ab = torch.from_numpy(np.cumprod(1 - np_linear_betas(1000)))[t].reshape(b, 1, 1)
    xt = s.q_sample(x0, t, noise)
    torch.testing.assert_close(xt, ab.sqrt() * x0 + (1 - ab).sqrt() * noise)
    expect = {"eps": noise, "x0": x0, "v": ab.sqrt() * noise - (1 - ab).sqrt() * x0}[prediction]
    torch.testing.assert_close(s.target(x0, noise, t, prediction), expect)
    a, c = s.coefficients(t)
    p, q = s.target_coefficients(t, prediction)
    for vec in (a, c, p, q):
        assert vec.shape == (b,) and vec.dtype == torch.float64
    torch.testing.assert_close(a[:, None, None] * x0 + c[:, None, None] * noise, xt)
    torch.testing.assert_close(p[:, None, None] * x0 + q[:, None, None] * noise, expect)
    # the Formulation base-class forms agree with the DDPM-specific ones
    torch.testing.assert_close(super(DDPMSchedule, s).target(x0, noise, t, prediction), expect)
    # reparameterisations invert the forward process
    eps_from_x0 = s.predict_eps_from_x0(xt, t, x0)
    torch.testing.assert_close(eps_from_x0, noise)
    torch.testing.assert_close(s.predict_x0_from_eps(xt, t, noise), x0)
    v = s.target(x0, noise, t, "v")
    torch.testing.assert_close(s.predict_x0_from_v(xt, t, v), x0)
    torch.testing.assert_close(s.predict_eps_from_v(xt, t, v), noise)
    torch.testing.assert_close(s.predict_x0(s.target(x0, noise, t, prediction), xt, t, prediction), x0)


# ---- posterior and p_mean_variance ------------------------------------------------------------------------


@pytest.mark.parametrize("b", [1, 3, 17])
def test_p_mean_variance_learned_range(b):
    s, ref = DDPMSchedule(1000), NpDDPM(np_linear_betas(1000))
    c = 3
    xt = torch.randn(b, c, 5, dtype=torch.float64)
    out = torch.randn(b, 2 * c, 5, dtype=torch.float64)
    t = torch.randint(0, 1000, (b,))
    t[0] = 0
    res = s.p_mean_variance(out, xt, t, Readout(learn_sigma=True))
    tn = t.numpy()
    xn, on = xt.reshape(b, -1).numpy(), out.numpy()
    eps, v = on[:, :c].reshape(b, -1), on[:, c:].reshape(b, -1)
    frac = (v + 1) / 2
    logvar = frac * np.log(ref.betas[tn])[:, None] + (1 - frac) * ref.post_logvar[tn][:, None]
    x0 = ref.x0_from_eps(xn, tn, eps)
    np.testing.assert_allclose(res["log_variance"].reshape(b, -1).numpy(), logvar, rtol=1e-10)
    np.testing.assert_allclose(res["pred_x0"].reshape(b, -1).numpy(), x0, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(res["mean"].reshape(b, -1).numpy(), ref.post_mean(x0, xn, tn), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("fixed_variance", ["large", "small"])
def test_p_mean_variance_fixed(fixed_variance):
    s, ref = DDPMSchedule(1000), NpDDPM(np_linear_betas(1000))
    xt, out = torch.randn(3, 2, dtype=torch.float64), torch.randn(3, 2, dtype=torch.float64)
    t = torch.tensor([0, 1, 999])
    res = s.p_mean_variance(out, xt, t, Readout("x0", clip_denoised=True, fixed_variance=fixed_variance))
    if fixed_variance == "large":
        var = np.append(ref.post_var[1], ref.betas[1:])[t.numpy()]
    else:
        var = ref.post_var[t.numpy()]
    np.testing.assert_allclose(res["variance"][:, 0].numpy(), var, rtol=1e-12)
    assert float(res["pred_x0"].abs().max()) <= 1.0
    torch.testing.assert_close(res["pred_x0"], out.clamp(-1, 1))


def test_q_posterior_matches_bayes():
    # q(x_{t-1} | x_t, x0) from Bayes on q(x_t | x_{t-1}) and q(x_{t-1} | x0) (Ho et al. Eq. 6-7)
    s = DDPMSchedule(100, "cosine")
    t = torch.tensor([1, 40, 99])
    x0, xt = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    mean, var, _ = s.q_posterior_mean_variance(x0, xt, t)
    beta, abp = s.betas[t][:, None], s.alphas_cumprod_prev[t][:, None]
    prec = (1 - beta) / beta + 1 / (1 - abp)
    torch.testing.assert_close(var, (1 / prec).expand(3, 4))
    torch.testing.assert_close(mean, ((1 - beta).sqrt() / beta * xt + abp.sqrt() / (1 - abp) * x0) / prec)


# ---- likelihood helpers and the hybrid loss -----------------------------------------------------------------


def test_normal_kl_and_cdf():
    m1, lv1, m2, lv2 = (torch.randn(7, dtype=torch.float64) for _ in range(4))
    kl = normal_kl(m1, lv1, m2, lv2)
    s1, s2 = torch.exp(0.5 * lv1), torch.exp(0.5 * lv2)
    torch.testing.assert_close(kl, torch.log(s2 / s1) + (s1**2 + (m1 - m2) ** 2) / (2 * s2**2) - 0.5)
    torch.testing.assert_close(normal_kl(m1, lv1, m1, lv1), torch.zeros(7, dtype=torch.float64), atol=1e-15, rtol=0)
    z = torch.linspace(-4, 4, 33, dtype=torch.float64)
    exact = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    assert float((approx_standard_normal_cdf(z) - exact).abs().max()) < 2e-3


def test_discretized_log_likelihood_is_a_distribution():
    # summing the bin probabilities of all 256 levels gives 1
    levels = torch.linspace(-1, 1, 256, dtype=torch.float64)
    for mean, log_scale in [(0.1, math.log(0.3)), (-0.9, math.log(0.05)), (0.0, math.log(2.0))]:
        lp = discretized_gaussian_log_likelihood(
            levels, torch.full_like(levels, mean), torch.full_like(levels, log_scale)
        )
        assert float(lp.exp().sum()) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("b", [1, 3, 17])
def test_hybrid_loss_matches_reference(b):
    s, ref = DDPMSchedule(1000), NpDDPM(np_linear_betas(1000))
    c = 3
    x0 = (torch.rand(b, c, 5, dtype=torch.float64) * 2 - 1).clamp(-0.98, 0.98)
    x0[0, 0, 0], x0[-1, 1, 1] = -1.0, 1.0  # the edge bins of the decoder
    x0[0, 1, 0], x0[-1, 2, 4] = -0.9995, 0.9995  # inside the edge-bin threshold 0.999
    noise = torch.randn_like(x0)
    t = torch.randint(0, 1000, (b,))
    t[0] = 0
    t[-1] = 999 if b > 1 else 0
    if b >= 3:
        t[1] = 1
    xt = s.q_sample(x0, t, noise)
    out = torch.randn(b, 2 * c, 5, dtype=torch.float64).mul_(0.5).requires_grad_(True)
    w = torch.rand(b, dtype=torch.float64) + 0.5
    terms = hybrid_loss(s, out, x0, xt, t, noise, learn_sigma=True, weights=w)
    m = c * 5
    on = out.detach().numpy()
    flat = lambda a: a.reshape(b, -1)
    ref_out = np.concatenate([flat(on[:, :c]), flat(on[:, c:])], axis=1)
    vb_ref = ref.vb_bpd(ref_out, flat(x0.numpy()), flat(xt.detach().numpy()), t.numpy())
    mse_ref = ((flat(on[:, :c]) - flat(noise.numpy())) ** 2).mean(1)
    np.testing.assert_allclose(terms["vb"].detach().numpy(), vb_ref, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(terms["mse"].detach().numpy(), w.numpy() * mse_ref, rtol=1e-12)
    np.testing.assert_allclose(terms["loss"].detach().numpy(), w.numpy() * mse_ref + vb_ref, rtol=1e-9)
    # gradients: the prediction half gets only the MSE gradient (VB sees it detached) ...
    g = torch.rand(b, dtype=torch.float64)
    (terms["loss"] * g).sum().backward()
    gp = (g * w)[:, None, None] * 2.0 / m * (out.detach()[:, :c] - noise)
    torch.testing.assert_close(out.grad[:, :c], gp)
    # ... and the variance half gets the VB gradient: central finite differences of the numpy reference
    for bi, ch, j in [(0, c, 0), (b - 1, 2 * c - 1, 4), (b // 2, c + 1, 2)]:
        h = 1e-6
        vals = []
        for sgn in (1, -1):
            o2 = on.copy()
            o2[bi, ch, j] += sgn * h
            r = np.concatenate([flat(o2[:, :c]), flat(o2[:, c:])], axis=1)
            vals.append(ref.vb_bpd(r, flat(x0.numpy()), flat(xt.detach().numpy()), t.numpy())[bi])
        fd = g[bi].item() * (vals[0] - vals[1]) / (2 * h)
        assert out.grad[bi, ch, j].item() == pytest.approx(fd, rel=1e-5, abs=1e-9)


def test_hybrid_loss_float32_and_plain_mse():
    s = DDPMSchedule(1000)
    x0 = torch.rand(3, 2, 7) * 2 - 1
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 500, 999])
    xt = s.q_sample(x0, t, noise)
    out64 = torch.randn(3, 4, 7, dtype=torch.float64)
    ref = hybrid_loss(s, out64, x0.double(), xt.double(), t, noise.double())
    got = hybrid_loss(s, out64.float(), x0, xt, t, noise)
    for k in ("loss", "mse", "vb"):
        assert got[k].dtype == torch.float32
        torch.testing.assert_close(got[k].double(), ref[k], rtol=2e-4, atol=2e-5)
    # bf16 network output is reduced in float32
    assert hybrid_loss(s, out64.bfloat16(), x0, xt, t, noise)["loss"].dtype == torch.float32
    plain = hybrid_loss(s, out64[:, :2], x0.double(), xt.double(), t, noise.double(), learn_sigma=False)
    assert set(plain) == {"loss", "mse"}
    torch.testing.assert_close(plain["loss"], ((out64[:, :2] - noise.double()) ** 2).mean((1, 2)))
    # x0 and v targets
    for pred in ("x0", "v"):
        r = hybrid_loss(s, out64, x0.double(), xt.double(), t, noise.double(), prediction=pred)
        tgt = s.target(x0.double(), noise.double(), t, pred)
        torch.testing.assert_close(r["mse"], ((out64[:, :2] - tgt) ** 2).mean((1, 2)))
    rescaled = hybrid_loss(DDPMSchedule(4000), out64, x0.double(), xt.double(), t, noise.double(), rescale_vb=True)
    unscaled = hybrid_loss(DDPMSchedule(4000), out64, x0.double(), xt.double(), t, noise.double())
    torch.testing.assert_close(rescaled["vb"], 4.0 * unscaled["vb"])


def test_vb_with_true_posterior_is_zero():
    # with the exact eps and the posterior variance (v = -1) the KL term vanishes for t > 0
    s = DDPMSchedule(1000)
    x0 = torch.rand(3, 2, 4, dtype=torch.float64) * 2 - 1
    noise = torch.randn_like(x0)
    t = torch.tensor([1, 300, 999])
    xt = s.q_sample(x0, t, noise)
    out = torch.cat([noise, -torch.ones_like(noise)], dim=1)
    vb = vb_terms_bpd(s, out, x0, xt, t)["output"]
    torch.testing.assert_close(vb, torch.zeros(3, dtype=torch.float64), atol=1e-9, rtol=0)
    # the same posterior from an exact x0 prediction, read as such
    out_x0 = torch.cat([x0, -torch.ones_like(noise)], dim=1)
    vb = vb_terms_bpd(s, out_x0, x0, xt, t, Readout("x0", learn_sigma=True))["output"]
    torch.testing.assert_close(vb, torch.zeros(3, dtype=torch.float64), atol=1e-9, rtol=0)
    assert float(vb_terms_bpd(s, out_x0, x0, xt, t)["output"].min()) > 1e-3  # read as eps, it is wrong


def test_training_losses_calls_model_with_xt():
    s = DDPMSchedule(1000)
    x0 = torch.rand(5, 3, 2) * 2 - 1
    noise = torch.randn_like(x0)
    t = torch.tensor([0, 1, 7, 500, 999])
    seen = {}

    def model(x, tt, y=None):
        seen["x"], seen["t"], seen["y"] = x, tt, y
        return torch.cat([noise, torch.zeros_like(noise)], dim=1)

    terms = training_losses(s, model, x0, t, noise, {"y": torch.arange(5)})
    torch.testing.assert_close(seen["x"], s.q_sample(x0, t, noise))
    assert torch.equal(seen["t"], t) and torch.equal(seen["y"], torch.arange(5))
    assert torch.equal(terms["mse"], torch.zeros(5))
    assert terms["loss"].shape == (5,) and bool((terms["vb"] >= 0).all())
    # noise drawn from the generator when not given
    g1, g2 = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    m = lambda x, tt: torch.cat([x, x], dim=1)
    a = training_losses(s, m, x0, t, generator=g1)["loss"]
    torch.testing.assert_close(a, training_losses(s, m, x0, t, generator=g2)["loss"])


@pytest.mark.parametrize("b", [1, 3, 17])
def test_weighted_mse_grad(b):
    pred = torch.randn(b, 5, 3, dtype=torch.float64, requires_grad=True)
    tgt, w = torch.randn(b, 5, 3, dtype=torch.float64), torch.rand(b, dtype=torch.float64)
    loss = weighted_mse(pred, tgt, w)
    torch.testing.assert_close(loss, w * ((pred - tgt) ** 2).mean((1, 2)))
    g = torch.randn(b, dtype=torch.float64)
    (loss * g).sum().backward()
    torch.testing.assert_close(pred.grad, (g * w)[:, None, None] * 2 / 15 * (pred - tgt).detach())


# ---- respacing --------------------------------------------------------------------------------------------


def np_space_timesteps(T, counts):
    size_per, extra = T // len(counts), T % len(counts)
    start, out = 0, []
    for i, cnt in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        stride = 1 if cnt <= 1 else (size - 1) / (cnt - 1)
        out += [start + round(k * stride) for k in range(cnt)]
        start += size
    return sorted(set(out))


def test_space_timesteps():
    steps = space_timesteps(1000, "250")
    assert len(steps) == 250 and steps[0] == 0 and steps[-1] == 999
    assert steps == np_space_timesteps(1000, [250])
    assert space_timesteps(1000, "ddim50") == list(range(0, 1000, 20))
    assert space_timesteps(1000, "10,15,20") == np_space_timesteps(1000, [10, 15, 20])
    assert len(space_timesteps(1000, "10,15,20")) == 45
    assert space_timesteps(1000, 1000) == list(range(1000))
    assert space_timesteps(100, [7]) == np_space_timesteps(100, [7])


@pytest.mark.parametrize("spec", ["250", "ddim50", "3,5"])
def test_respace_keeps_alphas_cumprod(spec):
    base = DDPMSchedule(1000)
    new, tmap = respace(base, spec)
    assert new.num_timesteps == len(tmap) and tmap.dtype == torch.int64
    torch.testing.assert_close(new.alphas_cumprod, base.alphas_cumprod[tmap], rtol=1e-12, atol=0)
    torch.testing.assert_close(new.log_snr(torch.arange(len(tmap))), base.log_snr(tmap))
    full, ident = respace(base, range(1000))
    torch.testing.assert_close(full.betas, base.betas)
    assert torch.equal(ident, torch.arange(1000))


def test_respaced_model_receives_original_timesteps():
    _, tmap = respace(DDPMSchedule(1000), "ddim10")
    seen = []
    wrapped = RespacedModel(lambda x, t, y: seen.append(t.clone()) or x, tmap)
    wrapped(torch.zeros(3, 1), torch.tensor([0, 5, 9]), None)
    assert seen[0].tolist() == [0, 500, 900]
    with pytest.raises(ValueError, match="respaced t"):
        wrapped(torch.zeros(1, 1), torch.tensor([10]), None)


# ---- bad input --------------------------------------------------------------------------------------------


def test_bad_input_raises():
    s = DDPMSchedule(1000)
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="out of range"):
        s.q_sample(x, torch.tensor([0, 1000]), x)
    with pytest.raises(ValueError, match="out of range"):
        s.snr(torch.tensor([-1]))
    with pytest.raises(ValueError, match="integer"):
        s.coefficients(torch.tensor([0.5]))
    with pytest.raises(ValueError, match="unknown prediction 'score'"):
        s.target(x, x, torch.tensor([0, 1]), "score")
    with pytest.raises(ValueError, match="unknown prediction"):
        s.target_coefficients(torch.tensor([0]), "noise")
    with pytest.raises(ValueError, match="unknown beta_schedule 'sqrt'"):
        DDPMSchedule(1000, "sqrt")
    with pytest.raises(ValueError, match="num_timesteps"):
        DDPMSchedule(0)
    with pytest.raises(ValueError, match="unknown fixed_variance 'medium'; choose one of"):
        Readout(fixed_variance="medium")
    with pytest.raises(ValueError, match="learn_sigma must be true or false, got 'yes'"):
        Readout(learn_sigma="yes")
    with pytest.raises(ValueError, match="clip_denoised must be true or false"):
        Readout(clip_denoised=1)
    with pytest.raises(ValueError, match="prediction must be a name"):
        Readout(None)
    with pytest.raises(ValueError, match="unknown prediction 'velocity'"):
        s.p_mean_variance(x, x, torch.tensor([0, 1]), Readout("velocity"))
    with pytest.raises(ValueError, match="expected 6 channels"):
        s.p_mean_variance(x, x, torch.tensor([0, 1]), Readout(learn_sigma=True))
    with pytest.raises(ValueError, match="expected 6 channels"):
        hybrid_loss(s, x, x, x, torch.tensor([0, 1]), x)
    with pytest.raises(ValueError, match="weights must have shape"):
        weighted_mse(x, x, torch.ones(3))
    with pytest.raises(ValueError, match="cannot divide"):
        space_timesteps(10, "11")
    with pytest.raises(ValueError, match="exactly 600 steps"):
        space_timesteps(1000, "ddim600")
    with pytest.raises(ValueError, match="bad respacing"):
        space_timesteps(1000, "ddimx")
    with pytest.raises(ValueError, match="bad respacing"):
        space_timesteps(1000, "a,b")
    with pytest.raises(ValueError, match="use_timesteps must lie"):
        respace(s, [0, 1000])
