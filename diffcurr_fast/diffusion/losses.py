"""Training losses: per-sample weighted MSE and the IDDPM hybrid loss (MSE + VLB in bits/dim).

The likelihood helpers follow IDDPM's ``losses.py`` (Nichol & Dhariwal 2021, openai/improved-diffusion), which
DiT uses unchanged. Every loss is returned per sample, shape (B,), reduced in float32 (float64 inputs stay
float64) whatever the network's dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from diffcurr_fast.diffusion.axis import Formulation
from diffcurr_fast.diffusion.readout import Readout


def _loss_dtype(*tensors: torch.Tensor) -> torch.dtype:
    dtype = torch.float32
    for x in tensors:
        dtype = torch.promote_types(dtype, x.dtype)
    return dtype


def mean_flat(x: torch.Tensor) -> torch.Tensor:
    """Mean over every dimension but the first: (B, ...) -> (B,)."""
    return x.reshape(x.shape[0], -1).mean(dim=1)


def _check_weights(weights: torch.Tensor | None, batch: int, dtype: torch.dtype, device: torch.device):
    if weights is None:
        return None
    weights = torch.as_tensor(weights)
    if weights.shape != (batch,):
        raise ValueError(f"weights must have shape ({batch},), got {tuple(weights.shape)}")
    return weights.to(device=device, dtype=dtype)


def weighted_mse(pred: torch.Tensor, target: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Per-sample loss[b] = w[b] * mean_j (pred[b, j] - target[b, j])^2, reduced in float32 or wider.

    This is the reference form of the fused ``diffusion_loss`` op (see docs/ops.md). ``weights`` is (B,) or None.
    """
    if pred.shape != target.shape:
        raise ValueError(f"pred shape {tuple(pred.shape)} does not match target shape {tuple(target.shape)}")
    dtype = _loss_dtype(pred, target)
    loss = mean_flat((pred.to(dtype) - target.to(dtype)) ** 2)  # (B,)
    w = _check_weights(weights, pred.shape[0], dtype, pred.device)
    return loss if w is None else w * loss


def normal_kl(mean1: torch.Tensor, logvar1: torch.Tensor, mean2: torch.Tensor, logvar2: torch.Tensor) -> torch.Tensor:
    """Elementwise KL(N(mean1, e^logvar1) || N(mean2, e^logvar2)) in nats."""
    # KL of two Gaussians: 0.5 (-1 + logvar2 - logvar1 + e^(logvar1 - logvar2) + (mean1 - mean2)^2 e^-logvar2)
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def approx_standard_normal_cdf(x: torch.Tensor) -> torch.Tensor:
    """Fast approximation of the standard normal CDF (tanh form, Page 1977), as IDDPM uses."""
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


def discretized_gaussian_log_likelihood(x: torch.Tensor, means: torch.Tensor, log_scales: torch.Tensor) -> torch.Tensor:
    """Elementwise log-likelihood (nats) of data ``x`` in [-1, 1] quantised to 256 bins under N(means, e^2 log_scales).

    Ho et al. 2020 Eq. 13: the Gaussian mass of the bin [x - 1/255, x + 1/255], with the edge bins extended to
    -inf / +inf.
    """
    if not (x.shape == means.shape == log_scales.shape):
        raise ValueError(
            f"x, means and log_scales must share a shape, got {tuple(x.shape)}, {tuple(means.shape)}, "
            f"{tuple(log_scales.shape)}"
        )
    centered = x - means
    inv_std = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_std * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_std * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    log_cdf_delta = torch.log((cdf_plus - cdf_min).clamp(min=1e-12))
    return torch.where(x < -0.999, log_cdf_plus, torch.where(x > 0.999, log_one_minus_cdf_min, log_cdf_delta))


def vb_terms_bpd(
    schedule: Formulation,  # a DDPMSchedule: its IDDPM posterior tables
    model_out: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    readout: Readout = Readout(learn_sigma=True),
) -> dict[str, torch.Tensor]:
    """Per-sample variational-bound term in bits/dim (IDDPM ``_vb_terms_bpd``).

    L_{t-1} = KL(q(x_{t-1} | x_t, x0) || p(x_{t-1} | x_t)) for t > 0 and the decoder NLL L_0 = -log p(x0 | x1)
    at t == 0 (Ho et al. Eq. 5), each averaged over dimensions and divided by ln 2, with p read from ``model_out``
    as ``readout`` says (by default an eps prediction followed by the learned variance). Returns ``output`` (B,) and
    ``pred_x0``.
    """
    t = schedule.check_t(t)
    dtype = _loss_dtype(model_out, x_t)
    model_out, x0, x_t = model_out.to(dtype), x0.to(dtype), x_t.to(dtype)
    true_mean, _, true_log_var = schedule.q_posterior_mean_variance(x0, x_t, t)
    out = schedule.p_mean_variance(model_out, x_t, t, readout)
    kl = mean_flat(normal_kl(true_mean, true_log_var, out["mean"], out["log_variance"])) / math.log(2.0)  # (B,)
    nll = -discretized_gaussian_log_likelihood(x0, out["mean"], 0.5 * out["log_variance"])
    nll = mean_flat(nll) / math.log(2.0)  # (B,)
    output = torch.where(t.to(x_t.device) == 0, nll, kl)
    return {"output": output, "pred_x0": out["pred_x0"]}


def hybrid_loss(
    schedule: Formulation,  # a DDPMSchedule: its IDDPM posterior tables
    model_out: torch.Tensor,
    x0: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
    learn_sigma: bool = True,
    prediction: str = "eps",
    weights: torch.Tensor | None = None,
    rescale_vb: bool = False,
) -> dict[str, torch.Tensor]:
    """IDDPM hybrid objective L_simple + L_vlb from an already computed network output (IDDPM Eq. 16).

    With ``learn_sigma`` the output is (B, 2C, ...) split along dim 1 into the ``prediction`` and the variance
    values. The MSE term regresses the prediction on ``schedule.target``; the VB term (bits/dim) is computed with
    the prediction DETACHED, so it trains only the variance (IDDPM's ``frozen_out``). Without ``learn_sigma``
    the loss is the plain MSE. ``weights`` (B,) scale the MSE term only (MinSNR, P2, ...); multiply the returned
    ``loss`` for importance weights that should apply to the whole objective. ``rescale_vb`` multiplies the VB
    term by T / 1000 (IDDPM's RESCALED_MSE). Returns per-sample ``loss``, ``mse`` and (when learned) ``vb``.
    """
    t = schedule.check_t(t)
    if x0.shape != x_t.shape or noise.shape != x0.shape:
        raise ValueError(
            f"x0, x_t and noise must share a shape, got {tuple(x0.shape)}, {tuple(x_t.shape)}, {tuple(noise.shape)}"
        )
    channels = x_t.shape[1]
    expected = 2 * channels if learn_sigma else channels
    if model_out.shape[:1] != x_t.shape[:1] or model_out.shape[1] != expected or model_out.shape[2:] != x_t.shape[2:]:
        raise ValueError(
            f"model_out shape {tuple(model_out.shape)} does not fit x_t shape {tuple(x_t.shape)} "
            f"with learn_sigma={learn_sigma} (expected {expected} channels along dim 1)"
        )
    terms: dict[str, torch.Tensor] = {}
    if learn_sigma:
        pred, var_values = torch.split(model_out, channels, dim=1)  # (B, C, ...) each
        frozen = torch.cat([pred.detach(), var_values], dim=1)  # (B, 2C, ...): VB trains the variance only
        vb = vb_terms_bpd(schedule, frozen, x0, x_t, t, Readout(prediction, learn_sigma=True))["output"]
        if rescale_vb:
            vb = vb * (schedule.num_timesteps / 1000.0)
        terms["vb"] = vb
    else:
        pred = model_out
    target = schedule.target(x0, noise, t, prediction)
    terms["mse"] = weighted_mse(pred, target, weights)
    terms["loss"] = terms["mse"] + terms["vb"] if learn_sigma else terms["mse"]
    return terms


def training_losses(
    schedule: Formulation,  # a DDPMSchedule: its IDDPM posterior tables
    model_fn: Callable[..., torch.Tensor],
    x0: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor | None = None,
    model_kwargs: dict[str, Any] | None = None,
    *,
    learn_sigma: bool = True,
    prediction: str = "eps",
    weights: torch.Tensor | None = None,
    rescale_vb: bool = False,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Draw x_t = q_sample(x0, t, noise), call ``model_fn(x_t, t, **model_kwargs)`` and return ``hybrid_loss``.

    ``noise`` defaults to standard normal (from ``generator`` when given). Per-sample terms, shape (B,).
    """
    schedule.check_prediction(prediction)
    t = schedule.check_t(t).to(x0.device)
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    x_t = schedule.q_sample(x0, t, noise)
    model_out = model_fn(x_t, t, **(model_kwargs or {}))
    return hybrid_loss(
        schedule,
        model_out,
        x0,
        x_t,
        t,
        noise,
        learn_sigma=learn_sigma,
        prediction=prediction,
        weights=weights,
        rescale_vb=rescale_vb,
    )
