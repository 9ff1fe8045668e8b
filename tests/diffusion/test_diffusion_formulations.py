"""EDM and flow formulations, and the common log-SNR axis shared with DDPM."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from diffcurr_fast.diffusion import (
    DDPMSchedule,
    EDMDenoiser,
    EDMFormulation,
    EDMPrecond,
    FlowFormulation,
    Formulation,
    edm_loss,
    flow_loss,
    log_snr_to_snr,
    loss_weights,
    snr_to_db,
    snr_to_log_snr,
)
from diffcurr_fast.ops import sample_timesteps
from diffcurr_fast.timesteps.build import build_timesteps

# ---- EDM ---------------------------------------------------------------------------------------------------


def test_edm_precond_values():
    p = EDMPrecond()
    sig = torch.tensor([0.002, 0.5, 1.0, 80.0], dtype=torch.float64)
    sd = 0.5
    # sigma = sigma_data: c_skip = 1/2, c_out = sd / sqrt(2), c_in = 1 / (sd sqrt(2)), lambda = 2 / sd^2
    assert p.c_skip(sig)[1].item() == pytest.approx(0.5, rel=1e-15)
    assert p.c_out(sig)[1].item() == pytest.approx(0.5 / math.sqrt(2), rel=1e-15)
    assert p.c_in(sig)[1].item() == pytest.approx(math.sqrt(2), rel=1e-15)
    assert p.c_noise(sig)[1].item() == pytest.approx(math.log(0.5) / 4, rel=1e-15)
    assert p.loss_weight(sig)[1].item() == pytest.approx(8.0, rel=1e-15)
    s = sig.numpy()
    np.testing.assert_allclose(p.c_skip(sig).numpy(), sd**2 / (s**2 + sd**2), rtol=1e-14)
    np.testing.assert_allclose(p.c_out(sig).numpy(), s * sd / np.sqrt(s**2 + sd**2), rtol=1e-14)
    np.testing.assert_allclose(p.c_in(sig).numpy(), 1 / np.sqrt(s**2 + sd**2), rtol=1e-14)
    np.testing.assert_allclose(p.c_noise(sig).numpy(), np.log(s) / 4, rtol=1e-14)
    np.testing.assert_allclose(p.loss_weight(sig).numpy(), (s**2 + sd**2) / (s * sd) ** 2, rtol=1e-14)
    np.testing.assert_allclose(p.loss_weight(sig).numpy(), 1 / p.c_out(sig).numpy() ** 2, rtol=1e-12)
    # a different sigma_data
    assert EDMPrecond(1.0).c_skip(torch.tensor([1.0])).item() == pytest.approx(0.5)


@pytest.mark.parametrize("b", [1, 3, 17])
def test_edm_denoiser_and_loss(b):
    seen = {}
    weight = torch.randn(7, 7, dtype=torch.float64, requires_grad=True)

    def net(x_in, c_noise, y):
        seen["x_in"], seen["c_noise"] = x_in, c_noise
        return x_in @ weight + c_noise[:, None]

    den = EDMDenoiser(net)
    x0 = torch.randn(b, 7, dtype=torch.float64)
    noise = torch.randn(b, 7, dtype=torch.float64)
    sigma = torch.exp(-1.2 + 1.2 * torch.randn(b, generator=torch.Generator().manual_seed(0), dtype=torch.float64))
    loss = edm_loss(den, x0, sigma, noise)
    # float64 reference of EDM Eq. 2 with Table 1 preconditioning
    sd, s = 0.5, sigma[:, None]
    x = x0 + s * noise
    c_in, c_skip, c_out = 1 / (s**2 + sd**2).sqrt(), sd**2 / (s**2 + sd**2), s * sd / (s**2 + sd**2).sqrt()
    f = (c_in * x) @ weight + (torch.log(s) / 4)
    d = c_skip * x + c_out * f
    lam = (s[:, 0] ** 2 + sd**2) / (s[:, 0] * sd) ** 2
    ref = lam * ((d - x0) ** 2).mean(1)
    torch.testing.assert_close(seen["x_in"], c_in * x)
    torch.testing.assert_close(seen["c_noise"], torch.log(sigma) / 4)
    torch.testing.assert_close(loss, ref)
    # the lambda-weighted D loss equals the unweighted loss on F against its effective target (EDM Eq. 8)
    form = EDMFormulation()
    f_target = form.target(x0, noise, sigma, "F")
    torch.testing.assert_close(loss, ((f - f_target) ** 2).mean(1))
    g_ours = torch.autograd.grad(loss.sum(), weight)[0]
    g_ref = torch.autograd.grad(ref.sum(), weight)[0]
    torch.testing.assert_close(g_ours, g_ref)
    w = torch.rand(b, dtype=torch.float64)
    torch.testing.assert_close(edm_loss(den, x0, sigma, noise, weights=w), w * ref)


def test_edm_formulation_axis():
    f = EDMFormulation()
    sig = torch.tensor([0.002, 0.5, 3.0, 80.0], dtype=torch.float64)
    torch.testing.assert_close(f.snr(sig), 1 / sig**2)
    torch.testing.assert_close(f.log_snr(sig), -2 * torch.log(sig))
    torch.testing.assert_close(f.t_from_log_snr(f.log_snr(sig)), sig)
    a, c = f.coefficients(sig)
    assert torch.equal(a, torch.ones(4, dtype=torch.float64)) and torch.equal(c, sig)
    p, q = f.target_coefficients(sig, "F")
    cs, co = f.precond.c_skip(sig), f.precond.c_out(sig)
    torch.testing.assert_close(p, (1 - cs) / co)
    torch.testing.assert_close(q, -cs * sig / co)
    torch.testing.assert_close(f.loss_weight(sig), f.precond.loss_weight(sig))


# ---- flow --------------------------------------------------------------------------------------------------


def test_flow_formulation_values():
    f = FlowFormulation()
    t = torch.tensor([0.0, 0.25, 0.5, 0.9, 1.0], dtype=torch.float64)
    snr = f.snr(t)
    assert snr[0].item() == math.inf and snr[-1].item() == 0.0
    torch.testing.assert_close(snr[1:4], ((1 - t) ** 2 / t**2)[1:4])
    assert f.snr(torch.tensor([0.5])).item() == 1.0
    lam = f.log_snr(t)
    assert lam[0].item() == math.inf and lam[-1].item() == -math.inf
    torch.testing.assert_close(f.t_from_log_snr(lam), t)
    x0, noise = torch.randn(5, 3, 4, dtype=torch.float64), torch.randn(5, 3, 4, dtype=torch.float64)
    xt = f.q_sample(x0, t, noise)
    torch.testing.assert_close(xt, (1 - t)[:, None, None] * x0 + t[:, None, None] * noise)
    torch.testing.assert_close(f.target(x0, noise, t, "velocity"), noise - x0)
    torch.testing.assert_close(f.target(x0, noise, t, "eps"), noise)
    torch.testing.assert_close(f.target(x0, noise, t, "x0"), x0)


@pytest.mark.parametrize("b", [1, 3, 17])
def test_flow_loss_value_and_grad(b):
    wmat = torch.randn(6, 6, dtype=torch.float64, requires_grad=True)
    model = lambda x, t, y: x @ wmat * (1 + t[:, None])
    x0, noise = torch.randn(b, 6, dtype=torch.float64), torch.randn(b, 6, dtype=torch.float64)
    t = torch.rand(b, dtype=torch.float64)
    loss = flow_loss(model, x0, t, noise)
    xt = (1 - t[:, None]) * x0 + t[:, None] * noise
    ref = (((xt @ wmat) * (1 + t[:, None]) - (noise - x0)) ** 2).mean(1)
    torch.testing.assert_close(loss, ref)
    torch.testing.assert_close(torch.autograd.grad(loss.sum(), wmat)[0], torch.autograd.grad(ref.sum(), wmat)[0])
    # float32 network: reduced in float32
    l32 = flow_loss(lambda x, tt, y: x, x0.float(), t.float(), noise.float())
    assert l32.dtype == torch.float32


# ---- the common axis ---------------------------------------------------------------------------------------


def _formulations():
    return [
        (DDPMSchedule(1000), torch.tensor([0, 1, 250, 500, 998, 999])),
        (DDPMSchedule(1000, "cosine"), torch.tensor([0, 17, 499, 999])),
        (EDMFormulation(), torch.tensor([0.002, 0.1, 1.0, 5.0, 80.0], dtype=torch.float64)),
        (FlowFormulation(), torch.tensor([0.0, 0.01, 0.5, 0.99, 1.0], dtype=torch.float64)),
    ]


@pytest.mark.parametrize("idx", range(4))
def test_common_axis(idx):
    form, t = _formulations()[idx]
    assert isinstance(form, Formulation)
    snr, lam = form.snr(t), form.log_snr(t)
    assert snr.dtype == torch.float64 and lam.dtype == torch.float64
    finite = torch.isfinite(lam)
    torch.testing.assert_close(torch.log(snr)[finite], lam[finite])
    # log SNR is non-increasing along t (t grows towards noise in every formulation)
    assert bool((lam[1:] <= lam[:-1]).all())
    back = form.t_from_log_snr(lam)
    if form.discrete:
        assert torch.equal(back, t)
    else:
        torch.testing.assert_close(back, t.double())
    # SNR = a^2 / c^2 from the coefficients, and the per-sample vectors drive q_sample
    a, c = form.coefficients(t)
    torch.testing.assert_close(snr, a**2 / c**2)
    x0 = torch.randn(t.shape[0], 3, dtype=torch.float64)
    noise = torch.randn_like(x0)
    torch.testing.assert_close(form.q_sample(x0, t, noise), a[:, None] * x0 + c[:, None] * noise)
    for pred in form.predictions:
        p, q = form.target_coefficients(t, pred)
        torch.testing.assert_close(form.target(x0, noise, t, pred), p[:, None] * x0 + q[:, None] * noise)
    # curriculum weights on any formulation's SNR: finite, no NaN, also at SNR 0 and inf
    for weighting in ("none", "min_snr", "p2"):
        w = loss_weights(snr, "eps", weighting)
        assert not bool(torch.isnan(w).any())
    g = form.num_timesteps if form.discrete else 50  # the trainer's draws: cells from the timesteps component
    k = sample_timesteps(64, build_timesteps(None, form, g).weights(), generator=torch.Generator().manual_seed(0))
    n = form.training_draw(k, g, generator=torch.Generator().manual_seed(1)).t
    assert n.shape == (64,)
    form.check_t(n)
    lo, hi = form.t_range()
    assert lo < hi and float(n.min()) >= lo and float(n.max()) <= hi
    ends = form.log_snr(torch.tensor([lo, hi], dtype=torch.float64).to(t.dtype))
    assert ends[0].item() > ends[1].item()  # t_lo is the least noisy end of the axis


def test_axis_helpers():
    snr = torch.tensor([0.0, 1.0, 10.0, math.inf], dtype=torch.float64)
    lam = snr_to_log_snr(snr)
    assert lam.tolist() == [-math.inf, 0.0, math.log(10.0), math.inf]
    torch.testing.assert_close(log_snr_to_snr(lam), snr)
    torch.testing.assert_close(snr_to_db(snr)[1:3], torch.tensor([0.0, 10.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="non-negative"):
        snr_to_log_snr(torch.tensor([-1.0]))


def test_formulation_bad_input():
    edm, flow = EDMFormulation(), FlowFormulation()
    with pytest.raises(ValueError, match="sigma must be positive"):
        edm.snr(torch.tensor([0.0]))
    with pytest.raises(ValueError, match="unknown prediction 'v'"):
        edm.target_coefficients(torch.tensor([1.0]), "v")
    with pytest.raises(ValueError, match="flow t out of range"):
        flow.snr(torch.tensor([1.5]))
    with pytest.raises(ValueError, match="floating"):
        flow.snr(torch.tensor([1]))
    with pytest.raises(ValueError, match="unknown prediction 'v'"):
        flow.target(torch.zeros(1, 2), torch.zeros(1, 2), torch.tensor([0.5]), "v")
    with pytest.raises(ValueError, match="sigma_data must be positive"):
        EDMPrecond(0.0)
    with pytest.raises(ValueError, match="P_std must be positive"):
        EDMFormulation(P_std=0.0)
    with pytest.raises(ValueError, match="t must have shape"):
        flow.q_sample(torch.zeros(2, 3), torch.tensor([0.5]), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="sigma must have shape"):
        edm_loss(lambda x, s, y: x, torch.zeros(2, 3), torch.ones(3))
    with pytest.raises(ValueError, match="weights must have shape"):
        flow_loss(lambda x, t, y: x, torch.zeros(2, 3), torch.full((2,), 0.5), weights=torch.ones(5))
