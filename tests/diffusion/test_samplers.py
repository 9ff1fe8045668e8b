"""Sampler steps against closed-form formulas, guidance, and end-to-end sampling of Gaussian data.

For data x0 ~ N(mu, s^2) (per coordinate) every optimal predictor is known in closed form, so sampling with it
must reproduce mu and s up to Monte-Carlo error plus the sampler's (small) discretisation error.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffcurr_fast.diffusion import (
    DDPMSchedule,
    Readout,
    ddim_sample,
    ddim_step,
    ddpm_sample,
    ddpm_step,
    edm_heun_sample,
    edm_heun_step,
    flow_euler_step,
    flow_heun_step,
    flow_sample,
    guided_model_output,
    karras_sigmas,
    make_generator,
    respace,
)

MU, S = -0.4, 0.6
N, D = 8000, 2  # 16,000 draws: standard error of the mean 0.0047, of the std about 0.5 %


pytestmark = pytest.mark.usefixtures("one_thread")


def _edm_mean(mu, sigma_max=80.0):
    # EDM starts from N(0, sigma_max^2) instead of N(mu, S^2 + sigma_max^2): the exact ODE carries the offset -mu
    # down by the factor S / sqrt(S^2 + sigma_max^2)
    return mu * (1 - S / math.sqrt(S * S + sigma_max**2))


# ---- exact predictors for Gaussian data ----------------------------------------------------------------------


def _posterior_x0(x, a, c, mu):
    # E[x0 | x_t = a x0 + c eps] for x0 ~ N(mu, S^2)
    return mu + a * S * S * (x - a * mu) / (a * a * S * S + c * c)


def _label_mean(y, mu_null=MU, shift=1.0, num_classes=4):
    if y is None:
        return torch.tensor(mu_null)
    return torch.where(y == num_classes, torch.tensor(mu_null), mu_null + shift * (y.double() + 1)).reshape(-1, 1)


def ddpm_eps_model(base: DDPMSchedule, learn_sigma_value: float | None = None, calls: list | None = None):
    def model(x, t, y):
        if calls is not None:
            calls.append(t.clone())
        ab = base.alphas_cumprod[t].to(x.dtype).reshape(-1, 1)
        a, c = ab.sqrt(), (1 - ab).sqrt()
        eps = (x - a * _posterior_x0(x, a, c, _label_mean(y))) / c
        if learn_sigma_value is None:
            return eps
        return torch.cat([eps, torch.full_like(eps, learn_sigma_value)], dim=1)

    return model


def edm_denoiser(x, sigma, y):
    return _posterior_x0(x, 1.0, sigma.reshape(-1, 1), _label_mean(y))


def flow_velocity(x, t, y):
    t = t.reshape(-1, 1)
    a, c = 1 - t, t
    mu = _label_mean(y)
    x0 = _posterior_x0(x, a, c, mu)
    eps = c * (x - a * mu) / (a * a * S * S + c * c)  # E[eps | x_t]
    return eps - x0


def _check_gaussian(x, mu=MU, s=S, std_rel=0.04):
    se_mean = s / math.sqrt(x.numel())
    assert abs(x.mean().item() - mu) < 4.5 * se_mean, (x.mean().item(), mu)
    assert abs(x.std().item() / s - 1) < std_rel, (x.std().item(), s)


# ---- single steps vs closed forms -------------------------------------------------------------------------


@pytest.mark.parametrize("b", [1, 3, 17])
def test_ddpm_step_closed_form(b):
    s = DDPMSchedule(1000)
    x, eps, z = (torch.randn(b, 3, 5, dtype=torch.float64) for _ in range(3))
    t = torch.randint(0, 1000, (b,))
    t[0] = 0
    x_prev, x0 = ddpm_step(s, eps, x, t, z)
    beta = s.betas[t].reshape(-1, 1, 1)
    ab = s.alphas_cumprod[t].reshape(-1, 1, 1)
    mean = (x - beta / (1 - ab).sqrt() * eps) / (1 - beta).sqrt()  # Ho et al. Eq. 11
    var = torch.where(t.reshape(-1, 1, 1) == 0, s.posterior_variance[1], beta)
    nonzero = (t != 0).double().reshape(-1, 1, 1)
    torch.testing.assert_close(x_prev, mean + nonzero * var.sqrt() * z)
    torch.testing.assert_close(x0, (x - (1 - ab).sqrt() * eps) / ab.sqrt())
    torch.testing.assert_close(x_prev[0], mean[0], rtol=1e-12, atol=1e-12)  # no noise at t = 0


def test_ddpm_step_learned_sigma():
    s = DDPMSchedule(1000)
    x, eps, z = (torch.randn(4, 2, 3, dtype=torch.float64) for _ in range(3))
    v = torch.rand(4, 2, 3, dtype=torch.float64) * 2 - 1
    t = torch.tensor([5, 100, 500, 999])
    x_prev, _ = ddpm_step(s, torch.cat([eps, v], dim=1), x, t, z, Readout(learn_sigma=True))
    x_fixed, _ = ddpm_step(s, eps, x, t, torch.zeros_like(z))
    beta = s.betas[t].reshape(-1, 1, 1)
    post = s.posterior_variance[t].reshape(-1, 1, 1)
    frac = (v + 1) / 2
    std = torch.exp(0.5 * (frac * beta.log() + (1 - frac) * post.log()))  # IDDPM Eq. 15
    torch.testing.assert_close(x_prev, x_fixed + std * z)


@pytest.mark.parametrize("eta", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("b", [1, 3, 17])
def test_ddim_step_closed_form(eta, b):
    s, _ = respace(DDPMSchedule(1000), "ddim25")
    x, eps, z = (torch.randn(b, 3, 5, dtype=torch.float64) for _ in range(3))
    t = torch.randint(0, 25, (b,))
    t[0] = 0
    x_prev, x0 = ddim_step(s, eps, x, t, z, eta)
    ab = s.alphas_cumprod[t].reshape(-1, 1, 1)
    abp = torch.cat([torch.ones(1, dtype=torch.float64), s.alphas_cumprod[:-1]])[t].reshape(-1, 1, 1)
    x0_ref = (x - (1 - ab).sqrt() * eps) / ab.sqrt()
    sig = eta * ((1 - abp) / (1 - ab) * (1 - ab / abp)).sqrt()  # Song et al. Eq. 16
    nonzero = (t != 0).double().reshape(-1, 1, 1)
    ref = abp.sqrt() * x0_ref + (1 - abp - sig**2).sqrt() * eps + nonzero * sig * z  # Song et al. Eq. 12
    torch.testing.assert_close(x_prev, ref)
    torch.testing.assert_close(x0, x0_ref)
    if eta == 1.0:  # DDIM with eta = 1 is ancestral sampling with the posterior ("small") variance
        x_anc, _ = ddpm_step(s, eps, x, t, z, Readout(fixed_variance="small"))
        torch.testing.assert_close(x_prev, x_anc)


def test_edm_heun_step_closed_form():
    # linear denoiser D(x; sigma) = k(sigma) x, k = 1 / (1 + sigma^2): both Heun stages by hand
    k = lambda sg: 1.0 / (1.0 + sg**2)
    den = lambda x, sv: k(sv.reshape(-1, 1)) * x
    x, z = torch.randn(3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64)
    s0, s1, gamma, s_noise = 2.0, 0.7, 0.25, 1.007
    sh = s0 * (1 + gamma)
    xh = x + math.sqrt(sh**2 - s0**2) * s_noise * z
    d = (1 - k(sh)) * xh / sh
    xe = xh + (s1 - sh) * d
    d2 = (1 - k(s1)) * xe / s1
    torch.testing.assert_close(edm_heun_step(den, x, s0, s1, gamma, s_noise, z), xh + (s1 - sh) * 0.5 * (d + d2))
    # last step to sigma = 0 is a plain Euler step, which lands on D(x; sigma)
    torch.testing.assert_close(edm_heun_step(den, x, s1, 0.0), k(s1) * x)


def test_flow_steps_closed_form():
    v = lambda x, t: (1.0 + t.reshape(-1, 1)) * x  # v(x, t) = (1 + t) x
    x = torch.randn(5, 3, dtype=torch.float64)
    t0, t1 = 0.8, 0.55
    h = t1 - t0
    torch.testing.assert_close(flow_euler_step(v, x, t0, t1), x + h * (1 + t0) * x)
    xe = x + h * (1 + t0) * x
    torch.testing.assert_close(flow_heun_step(v, x, t0, t1), x + 0.5 * h * ((1 + t0) * x + (1 + t1) * xe))


def test_karras_sigmas():
    sig = karras_sigmas(18)
    assert sig.shape == (19,) and sig[-1].item() == 0.0
    assert sig[0].item() == pytest.approx(80.0) and sig[17].item() == pytest.approx(0.002)
    i = np.arange(18)
    ref = (80 ** (1 / 7) + i / 17 * (0.002 ** (1 / 7) - 80 ** (1 / 7))) ** 7  # EDM Eq. 5
    np.testing.assert_allclose(sig[:-1].numpy(), ref, rtol=1e-12)


# ---- classifier-free guidance ----------------------------------------------------------------------------


def test_guided_model_output_matches_dit():
    calls = []

    def model(x, t, y):
        calls.append((x.shape[0], y.clone(), t.clone()))
        return torch.cat([x * (y.double() + 1).reshape(-1, 1), x - y.double().reshape(-1, 1)], dim=1)

    x = torch.randn(3, 2, dtype=torch.float64)
    y, t = torch.tensor([0, 2, 1]), torch.tensor([7, 7, 7])
    out = guided_model_output(model, x, t, y, cfg_scale=4.0, num_classes=5)
    assert calls[0][0] == 6 and calls[0][1].tolist() == [0, 2, 1, 5, 5, 5] and calls[0][2].tolist() == [7] * 6
    cond = torch.cat([x * (y.double() + 1).reshape(-1, 1), x - y.double().reshape(-1, 1)], dim=1)
    uncond = torch.cat([x * 6, x - 5], dim=1)
    torch.testing.assert_close(out[:, :2], uncond[:, :2] + 4.0 * (cond[:, :2] - uncond[:, :2]))
    torch.testing.assert_close(out[:, 2:], cond[:, 2:])  # non-guided channels from the conditional half
    calls.clear()
    torch.testing.assert_close(guided_model_output(model, x, t, y, cfg_scale=1.0, num_classes=5), cond)
    assert calls[0][0] == 3  # scale 1: one plain conditional call
    with pytest.raises(ValueError, match="num_classes"):
        guided_model_output(model, x, t, y, cfg_scale=2.0)
    with pytest.raises(ValueError, match="needs class labels"):
        guided_model_output(model, x, t, None, cfg_scale=2.0, num_classes=5)


# ---- end to end on Gaussian data --------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["ddpm", "ddim0", "ddim1"])
def test_discrete_samplers_gaussian(kind):
    base = DDPMSchedule(1000)
    sched, tmap = respace(base, "250")
    calls = []
    model = ddpm_eps_model(base, calls=calls)
    if kind == "ddpm":
        x = ddpm_sample(model, sched, (N, D), timestep_map=tmap, seed=1, dtype=torch.float64)
    else:
        x = ddim_sample(model, sched, (N, D), eta=float(kind[-1]), timestep_map=tmap, seed=1, dtype=torch.float64)
    _check_gaussian(x)
    # the model saw every ORIGINAL timestep of the respaced set, from T - 1 down to 0
    assert [int(c[0]) for c in calls] == tmap.flip(0).tolist()


def test_ddpm_learned_sigma_at_upper_end_equals_fixed_large():
    base = DDPMSchedule(1000)
    sched, tmap = respace(base, "ddim40")
    a = ddpm_sample(
        ddpm_eps_model(base, 1.0), sched, (7, 3), readout=Readout(learn_sigma=True), timestep_map=tmap, seed=5
    )
    b = ddpm_sample(ddpm_eps_model(base), sched, (7, 3), timestep_map=tmap, seed=5)
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("churn", [0.0, 10.0])
def test_edm_heun_gaussian(churn):
    x = edm_heun_sample(edm_denoiser, (N, D), num_steps=40, S_churn=churn, seed=2, dtype=torch.float64)
    _check_gaussian(x, mu=_edm_mean(MU))


@pytest.mark.parametrize("method,steps", [("euler", 100), ("heun", 40)])
def test_flow_gaussian(method, steps):
    x = flow_sample(flow_velocity, (N, D), method=method, num_steps=steps, seed=3, dtype=torch.float64)
    _check_gaussian(x)


@pytest.mark.parametrize("sampler", ["ddim", "edm", "flow"])
def test_cfg_sampling_shifts_the_mean(sampler):
    # the exact predictors are affine in mu, so guidance with scale w samples N(mu_u + w (mu_c - mu_u), S^2)
    num_classes, w = 4, 1.5
    y = torch.full((N,), 1)  # mu_c = MU + 2
    target_mu = MU + w * 2.0
    if sampler == "ddim":
        base = DDPMSchedule(1000)
        sched, tmap = respace(base, "250")
        x = ddim_sample(
            ddpm_eps_model(base),
            sched,
            (N, D),
            y,
            cfg_scale=w,
            num_classes=num_classes,
            timestep_map=tmap,
            seed=4,
            dtype=torch.float64,
        )
    elif sampler == "edm":
        x = edm_heun_sample(
            edm_denoiser, (N, D), y, num_steps=40, cfg_scale=w, num_classes=num_classes, seed=4, dtype=torch.float64
        )
    else:
        x = flow_sample(
            flow_velocity, (N, D), y, num_steps=40, cfg_scale=w, num_classes=num_classes, seed=4, dtype=torch.float64
        )
    _check_gaussian(x, mu=_edm_mean(target_mu) if sampler == "edm" else target_mu)


# ---- reproducibility, progress, bad input -------------------------------------------------------------------


def test_seed_generator_noise_and_progress():
    base = DDPMSchedule(25, "cosine")
    m = ddpm_eps_model(base)
    a = ddpm_sample(m, base, (3, 2), seed=9)
    b = ddpm_sample(m, base, (3, 2), generator=make_generator(9), progress=True)
    assert a.dtype == torch.float32 and torch.equal(a, b)
    assert not torch.equal(a, ddpm_sample(m, base, (3, 2), seed=10))
    xT = torch.randn(3, 2, dtype=torch.float64)
    c = ddim_sample(m, base, (3, 2), noise=xT, dtype=torch.float64)
    torch.testing.assert_close(c, ddim_sample(m, base, (3, 2), noise=xT, dtype=torch.float64, seed=1))  # eta = 0
    f1 = flow_sample(flow_velocity, (3, 2), seed=1, progress=True)
    torch.testing.assert_close(f1, flow_sample(flow_velocity, (3, 2), seed=1))


def test_sampler_bad_input():
    base = DDPMSchedule(20)
    m = ddpm_eps_model(base)
    with pytest.raises(ValueError, match="unknown flow sampling method 'rk4'"):
        flow_sample(flow_velocity, (2, 2), method="rk4")
    with pytest.raises(ValueError, match="unknown prediction"):
        ddpm_sample(m, base, (2, 2), readout=Readout("score"))
    with pytest.raises(ValueError, match="either seed or generator"):
        ddpm_sample(m, base, (2, 2), seed=1, generator=torch.Generator())
    with pytest.raises(ValueError, match="timestep_map must have shape"):
        ddpm_sample(m, base, (2, 2), timestep_map=torch.arange(5))
    with pytest.raises(ValueError, match="eta must be non-negative"):
        ddim_sample(m, base, (2, 2), eta=-0.1)
    with pytest.raises(ValueError, match="y must have shape"):
        ddim_sample(m, base, (2, 2), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match="noise shape"):
        ddim_sample(m, base, (2, 2), noise=torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sigma_min < sigma_max"):
        edm_heun_sample(edm_denoiser, (2, 2), sigma_min=5.0, sigma_max=1.0)
    with pytest.raises(ValueError, match="t_end < t_start"):
        flow_sample(flow_velocity, (2, 2), t_start=0.2, t_end=0.5)


# ---- the checkpoint samplers of runs.sampling: heun and euler on DDPM and EDM models -------------------------


class _DDPMGaussianEps(torch.nn.Module):
    """Exact eps-predictor for x0 ~ N(MU, S^2) at the fractional timesteps the ODE samplers query: sigma(t) by
    linear interpolation of the log-sigma table, the inverse of the sampler's t(sigma)."""

    def __init__(self, base: DDPMSchedule):
        super().__init__()
        abar = base.alphas_cumprod
        self.log_sigmas = 0.5 * (torch.log1p(-abar) - torch.log(abar))
        self.times = []

    def forward(self, x, t, y):
        self.times.append(t.detach().double().clone())
        i = t.double().clamp(0, len(self.log_sigmas) - 1)
        lo = i.floor().long().clamp(max=len(self.log_sigmas) - 2)
        ls = self.log_sigmas[lo] + (i - lo) * (self.log_sigmas[lo + 1] - self.log_sigmas[lo])
        abar = (1.0 / (1.0 + torch.exp(2 * ls))).reshape(-1, 1, 1, 1)
        a, c = abar.sqrt(), (1 - abar).sqrt()
        xd = x.double()
        return ((xd - a * _posterior_x0(xd, a, c, MU)) / c).to(x.dtype)


class _EDMGaussianF(torch.nn.Module):
    """Raw EDM network F = (D - c_skip x) / c_out of the exact denoiser, from its inputs (c_in x, c_noise)."""

    def __init__(self, sigma_data=0.5):
        super().__init__()
        self.sd = sigma_data

    def forward(self, x_in, c_noise, y):
        sigma = torch.exp(4.0 * c_noise.double()).reshape(-1, 1, 1, 1)  # c_noise = ln(sigma) / 4
        sd2 = self.sd**2
        x = x_in.double() * (sigma**2 + sd2).sqrt()  # c_in = 1 / sqrt(sigma^2 + sd^2)
        den = _posterior_x0(x, 1.0, sigma, MU)
        c_skip, c_out = sd2 / (sigma**2 + sd2), sigma * self.sd / (sigma**2 + sd2).sqrt()
        return ((den - c_skip * x) / c_out).to(x_in.dtype)


@pytest.mark.parametrize("sampler,steps", [("euler", 120), ("heun", 40)])
@pytest.mark.parametrize("kind", ["ddpm", "edm"])
def test_checkpoint_ode_samplers_gaussian(kind, sampler, steps):
    from diffcurr_fast.diffusion import EDMFormulation
    from diffcurr_fast.runs.sampling import sample

    if kind == "ddpm":
        schedule = DDPMSchedule(1000)
        model = _DDPMGaussianEps(schedule)
        sigma_max = float(model.log_sigmas[-1].exp())
    else:
        schedule = EDMFormulation()
        model, sigma_max = _EDMGaussianF(), schedule.sigma_max
    x = sample(
        model,
        schedule,
        sampler=sampler,
        steps=steps,
        labels=torch.zeros(N // 2, dtype=torch.long),
        channels=1,
        size=2,
        num_classes=4,
        readout=Readout("eps"),
        seed=6,
    )
    assert x.shape == (N // 2, 1, 2, 2)
    _check_gaussian(x.double(), mu=_edm_mean(MU, sigma_max), std_rel=0.03)
    if kind == "ddpm":  # the ODE runs from the largest sigma (t = T - 1) down to the smallest (t = 0)
        ts = torch.stack([t[0] for t in model.times])
        assert ts[0].item() == pytest.approx(999, abs=1e-6) and ts.min().item() == pytest.approx(0, abs=1e-6)
        assert bool((ts[1:] <= ts[:-1] + 1e-9).all())
