"""loss_weights: every weighting x prediction against its closed form, including SNR = 0 and SNR = inf."""

from __future__ import annotations

import math

import pytest
import torch

from diffcurr_fast.diffusion import DDPMSchedule, loss_weights

SNR = torch.tensor([0.0, 1e-3, 0.5, 1.0, 4.999, 5.0, 7.5, 1e3, math.inf], dtype=torch.float64)
FINITE = SNR[1:-1]


def _x0_space(weighting, snr, gamma=5.0, k=1.0, g=1.0):
    """Weight on the x0 MSE, the common space: min(SNR, gamma) (Hang et al. Eq. 5); SNR / (k + SNR)^g (P2)."""
    if weighting == "none":
        return None
    if weighting == "min_snr":
        return torch.minimum(snr, torch.full_like(snr, gamma))
    return snr / (k + snr) ** g


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
@pytest.mark.parametrize("weighting", ["none", "min_snr", "p2"])
def test_weights_closed_form(weighting, prediction):
    w = loss_weights(FINITE, prediction, weighting)
    assert w.shape == FINITE.shape and w.dtype == torch.float64
    wx0 = _x0_space(weighting, FINITE)
    if wx0 is None:
        assert torch.equal(w, torch.ones_like(FINITE))
        return
    # ||x0_hat - x0||^2 = ||eps_hat - eps||^2 / SNR = ||v_hat - v||^2 / (SNR + 1) for x_t = a x0 + c eps
    expect = {"x0": wx0, "eps": wx0 / FINITE, "v": wx0 / (FINITE + 1)}[prediction]
    torch.testing.assert_close(w, expect, rtol=1e-12, atol=0)


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
@pytest.mark.parametrize("weighting", ["none", "min_snr", "p2"])
def test_weights_at_snr_zero_and_inf(weighting, prediction):
    w = loss_weights(SNR, prediction, weighting)
    assert not bool(torch.isnan(w).any())
    w0, winf = w[0].item(), w[-1].item()
    expect0 = {
        "none": {"eps": 1.0, "x0": 1.0, "v": 1.0},
        "min_snr": {"eps": 1.0, "x0": 0.0, "v": 0.0},
        "p2": {"eps": 1.0, "x0": 0.0, "v": 0.0},
    }[weighting][prediction]
    expect_inf = {
        "none": {"eps": 1.0, "x0": 1.0, "v": 1.0},
        "min_snr": {"eps": 0.0, "x0": 5.0, "v": 0.0},
        "p2": {"eps": 0.0, "x0": 1.0, "v": 0.0},
    }[weighting][prediction]
    assert w0 == pytest.approx(expect0) and winf == pytest.approx(expect_inf)
    # the limits are continuous: the neighbours 1e-3 and 1e3 are close to them
    if weighting == "min_snr" and prediction == "eps":
        assert w[1].item() == 1.0 and w[-2].item() == pytest.approx(5e-3)


def test_weights_make_prediction_spaces_agree():
    # the weighted losses in eps, x0 and v space are the same number for the same network error
    s = DDPMSchedule(1000)
    t = torch.tensor([3, 100, 400, 999])
    x0 = torch.randn(4, 8, dtype=torch.float64)
    noise = torch.randn_like(x0)
    xt = s.q_sample(x0, t, noise)
    eps_hat = noise + 0.1 * torch.randn_like(noise)
    x0_hat = s.predict_x0_from_eps(xt, t, eps_hat)
    v_hat = s.coef("sqrt_alphas_cumprod", t, xt) * eps_hat - s.coef("sqrt_one_minus_alphas_cumprod", t, xt) * x0_hat
    v = s.target(x0, noise, t, "v")
    snr = s.snr(t)
    for weighting in ("min_snr", "p2"):
        le = loss_weights(snr, "eps", weighting) * ((eps_hat - noise) ** 2).mean(1)
        lx = loss_weights(snr, "x0", weighting) * ((x0_hat - x0) ** 2).mean(1)
        lv = loss_weights(snr, "v", weighting) * ((v_hat - v) ** 2).mean(1)
        torch.testing.assert_close(le, lx, rtol=1e-7, atol=1e-12)
        torch.testing.assert_close(le, lv, rtol=1e-7, atol=1e-12)


def test_weights_options_and_dtypes():
    snr = torch.tensor([0.5, 2.0, 20.0], dtype=torch.float32)
    assert loss_weights(snr, "eps", "min_snr", gamma=1.0).tolist() == pytest.approx([1.0, 0.5, 0.05])
    torch.testing.assert_close(loss_weights(snr, "eps", "p2", p2_k=2.0, p2_gamma=0.5), 1 / (2.0 + snr) ** 0.5)
    assert loss_weights(snr, "eps", "p2").dtype == torch.float32
    assert loss_weights(torch.tensor([1, 2]), "x0", "min_snr").dtype == torch.float32
    inf = torch.tensor([math.inf])
    assert loss_weights(inf, "x0", "p2", p2_gamma=2.0).item() == 0.0


def test_weights_bad_input():
    with pytest.raises(ValueError, match="unknown weighting 'snr'"):
        loss_weights(SNR, "eps", "snr")
    with pytest.raises(ValueError, match="unknown prediction 'score'"):
        loss_weights(SNR, "score", "none")
    with pytest.raises(ValueError, match="non-negative"):
        loss_weights(torch.tensor([-1.0]))
    with pytest.raises(ValueError, match="non-negative"):
        loss_weights(torch.tensor([math.nan]))
    with pytest.raises(ValueError, match="gamma must be positive"):
        loss_weights(SNR, "eps", "min_snr", gamma=0.0)


@pytest.mark.parametrize("beta", ["linear", "cosine"])
@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
def test_speed_change_aware_weighting(beta, prediction):
    """SpeeD: w_eps = 1 + lambda (2 g - 1), g the min-max rescaled |d(1 - abar) / dt|, carried to x0 and v as P2."""
    import numpy as np

    from diffcurr_fast.diffusion.weights import SPEED_LAMBDA

    s = DDPMSchedule(1000, beta)
    abar = s.alphas_cumprod.numpy()
    g = np.abs(np.gradient(1.0 - abar))
    g = (g - g.min()) / (g.max() - g.min())
    w_eps = 1.0 + SPEED_LAMBDA * (2.0 * g - 1.0)
    snr = abar / (1.0 - abar)
    want = {"eps": w_eps, "x0": w_eps * snr, "v": w_eps * snr / (snr + 1.0)}[prediction]
    got = loss_weights(s.snr(torch.arange(1000)), prediction, "speed", schedule=True)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-9)
    assert float(got.min()) >= 0 if prediction != "eps" else 0.5 - 1e-12 <= float(got.min()) < float(got.max()) <= 1.5
    with pytest.raises(ValueError, match="the speed weighting is a function of the whole schedule"):
        loss_weights(s.snr(torch.tensor([3, 7])), prediction, "speed")
    terms = s.training_draw(torch.tensor([0, 500, 999]), 1000, prediction, "speed")  # the trainer's path
    torch.testing.assert_close(terms.w, got[[0, 500, 999]])
