"""EDM formulation (Karras et al. 2022, "Elucidating the Design Space of Diffusion-Based Generative Models").

x_sigma = x0 + sigma n. The network F is preconditioned (Table 1, "Ours"):
D(x; sigma) = c_skip(sigma) x + c_out(sigma) F(c_in(sigma) x; c_noise(sigma)). Here ``t`` IS sigma (float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.diffusion.axis import Formulation, TrainingDraw, _bshape, t_trusted, trusted_t
from diffcurr_fast.diffusion.losses import weighted_mse
from diffcurr_fast.options import INF, Options, option

EDM_PREDICTIONS = ("x0", "eps", "F")


def _check_sigma(sigma: torch.Tensor) -> torch.Tensor:
    sigma = torch.as_tensor(sigma)
    if not sigma.dtype.is_floating_point:
        sigma = sigma.to(torch.float64)
    if not t_trusted() and (bool(torch.isnan(sigma).any()) or bool((sigma <= 0).any())):
        raise ValueError("sigma must be positive (and not NaN)")
    return sigma


class EDMPrecond:
    """Preconditioning coefficients of EDM Table 1 for a given ``sigma_data`` (default 0.5)."""

    def __init__(self, sigma_data: float = 0.5):
        if not sigma_data > 0:
            raise ValueError(f"sigma_data must be positive, got {sigma_data}")
        self.sigma_data = float(sigma_data)

    def __repr__(self) -> str:
        return f"EDMPrecond(sigma_data={self.sigma_data})"

    def c_skip(self, sigma: torch.Tensor) -> torch.Tensor:
        """c_skip = sigma_data^2 / (sigma^2 + sigma_data^2) (EDM Table 1)."""
        sigma = _check_sigma(sigma)
        return self.sigma_data**2 / (sigma**2 + self.sigma_data**2)

    def c_out(self, sigma: torch.Tensor) -> torch.Tensor:
        """c_out = sigma sigma_data / sqrt(sigma^2 + sigma_data^2) (EDM Table 1)."""
        sigma = _check_sigma(sigma)
        return sigma * self.sigma_data / (sigma**2 + self.sigma_data**2).sqrt()

    def c_in(self, sigma: torch.Tensor) -> torch.Tensor:
        """c_in = 1 / sqrt(sigma^2 + sigma_data^2) (EDM Table 1)."""
        sigma = _check_sigma(sigma)
        return 1.0 / (sigma**2 + self.sigma_data**2).sqrt()

    def c_noise(self, sigma: torch.Tensor) -> torch.Tensor:
        """c_noise = ln(sigma) / 4 (EDM Table 1)."""
        return torch.log(_check_sigma(sigma)) / 4.0

    def loss_weight(self, sigma: torch.Tensor) -> torch.Tensor:
        """lambda(sigma) = (sigma^2 + sigma_data^2) / (sigma sigma_data)^2 = 1 / c_out^2 (EDM Table 1)."""
        sigma = _check_sigma(sigma)
        return (sigma**2 + self.sigma_data**2) / (sigma * self.sigma_data) ** 2

    def denoise(
        self,
        net: Callable[..., torch.Tensor],
        x: torch.Tensor,
        sigma: torch.Tensor,
        y: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """D(x; sigma) = c_skip x + c_out F(c_in x; c_noise, y) (EDM Eq. 7); ``net(x_in, c_noise, y)``."""
        sigma = _check_sigma(sigma)
        if sigma.ndim != 1 or sigma.shape[0] != x.shape[0]:
            raise ValueError(f"sigma must have shape ({x.shape[0]},), got {tuple(sigma.shape)}")
        f = net(_bshape(self.c_in(sigma), x) * x, self.c_noise(sigma).to(device=x.device, dtype=x.dtype), y)
        return _bshape(self.c_skip(sigma), x) * x + _bshape(self.c_out(sigma), x) * f.to(x.dtype)


class EDMDenoiser:
    """Wrap a raw network ``net(x_in, c_noise, y) -> F`` into a denoiser ``D(x, sigma, y) -> x0_hat`` (EDM Eq. 7)."""

    def __init__(self, net: Callable[..., torch.Tensor], sigma_data: float = 0.5):
        self.net = net
        self.precond = EDMPrecond(sigma_data)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.precond.denoise(self.net, x, sigma, y)


def karras_sigmas(
    num_steps: int = 18, sigma_min: float = 0.002, sigma_max: float = 80.0, rho: float = 7.0
) -> torch.Tensor:
    """EDM Eq. 5 time steps sigma_i = (s_max^(1/rho) + i/(N-1) (s_min^(1/rho) - s_max^(1/rho)))^rho, then 0.

    Returns float64 of shape (num_steps + 1,), decreasing, ending in sigma_N = 0.
    """
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not 0 < sigma_min < sigma_max:
        raise ValueError(f"need 0 < sigma_min < sigma_max, got sigma_min={sigma_min}, sigma_max={sigma_max}")
    if not rho > 0:
        raise ValueError(f"rho must be positive, got {rho}")
    i = torch.arange(num_steps, dtype=torch.float64)
    frac = i / max(num_steps - 1, 1)
    s = (sigma_max ** (1 / rho) + frac * (sigma_min ** (1 / rho) - sigma_max ** (1 / rho))) ** rho
    return torch.cat([s, torch.zeros(1, dtype=torch.float64)])


@dataclass
class EDMOptions(Options):
    """EDM's options in the ``diffusion`` section (Karras et al. 2022, Table 1)."""

    sigma_data: float = option(0.5, "EDM: standard deviation of the data", lo=0.0, lo_open=True)
    P_mean: float = option(-1.2, "EDM: mean of ln(sigma) during training", lo=-INF)
    P_std: float = option(1.2, "EDM: standard deviation of ln(sigma) during training", lo=0.0, lo_open=True)
    sigma_min: float = option(0.002, "EDM: smallest sigma (training range and sampling grid)", lo=0.0, lo_open=True)
    sigma_max: float = option(80.0, "EDM: largest sigma (training range and sampling grid)", lo=0.0, lo_open=True)

    def validate(self, cfg: Any) -> None:
        if not self.sigma_min < self.sigma_max:
            raise ValueError(f"diffusion.sigma_min {self.sigma_min} must be < diffusion.sigma_max {self.sigma_max}")


class EDMFormulation(Formulation):
    """EDM as a ``Formulation``: t = sigma, x_sigma = x0 + sigma n, SNR = 1 / sigma^2.

    Predictions: ``"x0"`` (the denoiser D; with ``loss_weight`` this is the EDM loss), ``"eps"`` (the noise),
    and ``"F"`` (the raw network's effective target (x0 - c_skip x_sigma) / c_out, EDM Eq. 8, whose unweighted
    MSE equals the lambda-weighted D loss).
    """

    discrete = False
    predictions = EDM_PREDICTIONS
    Options = EDMOptions
    # the preconditioned denoiser D (x0), no learned variance or extra loss weighting; EDM Alg. 1 (Heun) on its grid
    defaults = {"prediction": "x0", "learn_sigma": False, "weighting": "none", "sampler": "heun"}
    limits = {"prediction": ("x0",), "learn_sigma": (False,), "weighting": ("none",), "sampler": ("euler", "heun")}

    @classmethod
    def from_options(cls, d: Any) -> EDMFormulation:
        return cls(d.sigma_data, d.P_mean, d.P_std, d.sigma_min, d.sigma_max)

    def __init__(
        self,
        sigma_data: float = 0.5,
        P_mean: float = -1.2,
        P_std: float = 1.2,
        sigma_min: float = 0.002,
        sigma_max: float = 80.0,
    ):
        self.precond = EDMPrecond(sigma_data)
        if not P_std > 0:
            raise ValueError(f"P_std must be positive, got {P_std}")
        if not 0 < sigma_min < sigma_max:
            raise ValueError(f"need 0 < sigma_min < sigma_max, got sigma_min={sigma_min}, sigma_max={sigma_max}")
        self.P_mean, self.P_std = float(P_mean), float(P_std)
        self.sigma_min, self.sigma_max = float(sigma_min), float(sigma_max)

    def __repr__(self) -> str:
        return (
            f"EDMFormulation(sigma_data={self.precond.sigma_data}, P_mean={self.P_mean}, P_std={self.P_std}, "
            f"sigma_min={self.sigma_min}, sigma_max={self.sigma_max})"
        )

    @property
    def sigma_data(self) -> float:
        return self.precond.sigma_data

    def check_t(self, t: torch.Tensor) -> torch.Tensor:
        """sigma as float64; must be positive."""
        return _check_sigma(t).to(torch.float64)

    def log_snr(self, t: torch.Tensor) -> torch.Tensor:
        """log SNR = -2 ln sigma."""
        return -2.0 * torch.log(self.check_t(t))

    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """SNR = 1 / sigma^2."""
        return 1.0 / self.check_t(t) ** 2

    def t_range(self) -> tuple[float, float]:
        """(sigma_min, sigma_max), the sampler's noise range (EDM Table 1)."""
        return self.sigma_min, self.sigma_max

    def t_from_log_snr(self, log_snr: torch.Tensor) -> torch.Tensor:
        """sigma = exp(-log_snr / 2) (monotone decreasing)."""
        lam = torch.as_tensor(log_snr, dtype=torch.float64)
        if bool(torch.isnan(lam).any()):
            raise ValueError("log_snr must not be NaN")
        return torch.exp(-lam / 2.0)

    def log_sigma_edges(self, num_cells: int) -> torch.Tensor:
        """(G + 1,) float64 edges of G equal cells of ln sigma on [ln sigma_min, ln sigma_max]."""
        return torch.linspace(math.log(self.sigma_min), math.log(self.sigma_max), num_cells + 1, dtype=torch.float64)

    def cell_grid(self, num_cells: int) -> torch.Tensor:
        """(G,) sigma at the ln-sigma centres of the cells (ascending)."""
        e = self.log_sigma_edges(num_cells)
        return torch.exp(0.5 * (e[:-1] + e[1:]))

    def cell_input_edges(self, num_cells: int) -> torch.Tensor:
        """(G + 1,) c_noise = ln(sigma) / 4 at the ln-sigma cell edges (the network's time input, EDM Table 1)."""
        return self.precond.c_noise(torch.exp(self.log_sigma_edges(num_cells)))

    def cell_prior(self, num_cells: int) -> torch.Tensor:
        """(G,) mass of each ln-sigma cell under ln sigma ~ N(P_mean, P_std^2) (EDM Table 1), floored at 1e-30."""
        z = (self.log_sigma_edges(num_cells) - self.P_mean) / self.P_std
        cdf = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))  # (G + 1,) normal CDF of ln sigma
        return (cdf[1:] - cdf[:-1]).clamp(min=1e-30)

    def training_draw(
        self,
        k: torch.Tensor,
        num_cells: int,
        prediction: str = "x0",
        weighting: str = "none",
        gamma: float = 5.0,
        generator: torch.Generator | None = None,
    ) -> TrainingDraw:
        """ln sigma uniform in cell k; network input c_in (x0 + sigma eps) at time c_noise (EDM Table 1); the raw
        network's target F (EDM Eq. 8), whose plain MSE is the lambda(sigma)-weighted denoiser loss (Eq. 2)."""
        if prediction != "x0" or weighting != "none":
            raise ValueError("EDM trains the denoiser (prediction 'x0') with its own weight lambda(sigma)")
        lo, hi = math.log(self.sigma_min), math.log(self.sigma_max)
        sigma = torch.exp(lo + self.point_in_cells(k, num_cells, generator) * (hi - lo))  # (B,) on k's device
        pre = self.precond
        with trusted_t():  # sigma > 0 by construction: no read-back
            c_in = pre.c_in(sigma)
            p, q = self.target_coefficients(sigma, "F")
            c_noise = pre.c_noise(sigma)
        return TrainingDraw(
            t=sigma,
            t_in=c_noise,
            a=c_in,
            c=c_in * sigma,
            p=p,
            q=q,
            w=torch.ones(k.shape, dtype=torch.float64, device=k.device),
        )

    def coefficients(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(a, c) = (1, sigma)."""
        sigma = self.check_t(t)
        return torch.ones_like(sigma), sigma

    def target_coefficients(self, t: torch.Tensor, prediction: str = "x0") -> tuple[torch.Tensor, torch.Tensor]:
        """x0 (1, 0); eps (0, 1); F ((1 - c_skip) / c_out, -c_skip sigma / c_out) (EDM Eq. 8)."""
        self.check_prediction(prediction)
        sigma = self.check_t(t)
        one, zero = torch.ones_like(sigma), torch.zeros_like(sigma)
        if prediction == "x0":
            return one, zero
        if prediction == "eps":
            return zero, one
        c_skip, c_out = self.precond.c_skip(sigma), self.precond.c_out(sigma)
        return (1.0 - c_skip) / c_out, -c_skip * sigma / c_out

    def loss_weight(self, t: torch.Tensor) -> torch.Tensor:
        """lambda(sigma) for the x0 (denoiser) loss."""
        return self.precond.loss_weight(self.check_t(t))


def edm_loss(
    denoiser: Callable[..., torch.Tensor],
    x0: torch.Tensor,
    sigma: torch.Tensor,
    noise: torch.Tensor | None = None,
    y: torch.Tensor | None = None,
    *,
    sigma_data: float = 0.5,
    weights: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """EDM training loss per sample: lambda(sigma) mean_j (D(x0 + sigma n; sigma)_j - x0_j)^2 (EDM Eq. 2, Table 1).

    ``denoiser(x, sigma, y) -> x0_hat`` (e.g. an ``EDMDenoiser``); ``sigma`` (B,) the noise levels (the trainer
    draws them through ``diffcurr_fast.timesteps``: EDM's log-normal prior on cells of ln sigma); ``noise`` defaults
    to standard normal; ``weights`` (B,) multiply the result. Reduced in float32 (or wider), shape (B,).
    """
    b = x0.shape[0]
    sigma = _check_sigma(sigma)
    if sigma.shape != (b,):
        raise ValueError(f"sigma must have shape ({b},), got {tuple(sigma.shape)}")
    if noise is None:
        noise = torch.randn(x0.shape, generator=generator, device=x0.device, dtype=x0.dtype)
    if noise.shape != x0.shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} does not match x0 shape {tuple(x0.shape)}")
    x_sigma = x0 + _bshape(sigma, x0) * noise  # (B, ...)
    d = denoiser(x_sigma, sigma.to(device=x0.device, dtype=x0.dtype), y)
    lam = EDMPrecond(sigma_data).loss_weight(sigma).to(device=x0.device)  # (B,)
    if weights is not None:
        weights = torch.as_tensor(weights, device=x0.device)
        if weights.shape != (b,):
            raise ValueError(f"weights must have shape ({b},), got {tuple(weights.shape)}")
        lam = lam * weights.to(lam.dtype)
    loss = weighted_mse(d, x0)  # (B,)
    return loss * lam.to(loss.dtype)


__all__ = [
    "EDMPrecond",
    "EDMDenoiser",
    "EDMFormulation",
    "edm_loss",
    "karras_sigmas",
    "EDM_PREDICTIONS",
]
