"""Discrete-time DDPM schedule (Ho et al. 2020; Nichol & Dhariwal 2021, "IDDPM").

Betas and every derived quantity are computed in float64 exactly as facebookresearch/DiT's
``gaussian_diffusion.py`` computes them, so a DiT trained here sees the same noise levels as the official
recipe. Tensors are kept in float64 on the CPU; ``coef(name, t)`` gathers a per-sample coefficient and casts
it to the caller's dtype/device.
"""

from __future__ import annotations

import math

import torch

PREDICTIONS = ("eps", "x0", "v")
BETA_SCHEDULES = ("linear", "cosine")


def _linear_betas(num_timesteps: int) -> torch.Tensor:
    # IDDPM get_named_beta_schedule("linear"): 1e-4..0.02 scaled by 1000/T, linspace in float64.
    scale = 1000.0 / num_timesteps
    return torch.linspace(scale * 1e-4, scale * 0.02, num_timesteps, dtype=torch.float64)


def _cosine_betas(num_timesteps: int, max_beta: float = 0.999) -> torch.Tensor:
    # IDDPM Eq. 17: abar(t) = cos^2(((t/T + s) / (1 + s)) * pi/2), s = 0.008; beta_t = 1 - abar(t+1)/abar(t).
    def abar(x: float) -> float:
        return math.cos((x + 0.008) / 1.008 * math.pi / 2) ** 2

    betas = [
        min(1.0 - abar((i + 1) / num_timesteps) / abar(i / num_timesteps), max_beta) for i in range(num_timesteps)
    ]
    return torch.tensor(betas, dtype=torch.float64)


class DDPMSchedule:
    """Variance-preserving discrete schedule: x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, t in [0, T)."""

    def __init__(self, num_timesteps: int = 1000, beta_schedule: str = "linear", betas: torch.Tensor | None = None):
        if betas is None:
            if not isinstance(num_timesteps, int) or num_timesteps < 1:
                raise ValueError(f"num_timesteps must be a positive int, got {num_timesteps!r}")
            if beta_schedule == "linear":
                betas = _linear_betas(num_timesteps)
            elif beta_schedule == "cosine":
                betas = _cosine_betas(num_timesteps)
            else:
                raise ValueError(f"unknown beta_schedule {beta_schedule!r}; choose one of {BETA_SCHEDULES}")
        betas = torch.as_tensor(betas, dtype=torch.float64).cpu()
        if betas.ndim != 1 or not bool(((betas > 0) & (betas <= 1)).all()):
            raise ValueError("betas must be a 1-D tensor with values in (0, 1]")
        self.beta_schedule = beta_schedule
        self.num_timesteps = int(betas.shape[0])
        self.betas = betas
        alphas = 1.0 - betas
        self.alphas_cumprod = torch.cumprod(alphas, dim=0)
        self.alphas_cumprod_prev = torch.cat([torch.ones(1, dtype=torch.float64), self.alphas_cumprod[:-1]])
        self.sqrt_alphas_cumprod = self.alphas_cumprod.sqrt()
        self.sqrt_one_minus_alphas_cumprod = (1.0 - self.alphas_cumprod).sqrt()

    def __repr__(self) -> str:
        return f"DDPMSchedule(num_timesteps={self.num_timesteps}, beta_schedule={self.beta_schedule!r})"

    # ---- validation and gathering -------------------------------------------------------------------
    def check_t(self, t: torch.Tensor) -> torch.Tensor:
        """Return ``t`` as an int64 tensor after checking it lies in [0, T); raises ValueError otherwise."""
        t = torch.as_tensor(t)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"t must be an integer tensor of timestep indices, got dtype {t.dtype}")
        t = t.long()
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.num_timesteps):
            raise ValueError(
                f"t out of range: values must lie in [0, {self.num_timesteps}), got min {int(t.min())}, "
                f"max {int(t.max())}"
            )
        return t

    def coef(self, name: str, t: torch.Tensor, like: torch.Tensor | None = None) -> torch.Tensor:
        """Gather table ``name`` at ``t``; shaped (B, 1, ..., 1) to broadcast against ``like`` when given."""
        t = self.check_t(t)
        out = getattr(self, name)[t.cpu()]
        if like is not None:
            out = out.to(device=like.device, dtype=like.dtype).reshape(t.shape + (1,) * (like.ndim - t.ndim))
        return out

    # ---- the difficulty axis ------------------------------------------------------------------------
    def snr(self, t: torch.Tensor) -> torch.Tensor:
        """SNR(t) = abar_t / (1 - abar_t), float64."""
        ab = self.coef("alphas_cumprod", t)
        return ab / (1.0 - ab)

    def log_snr(self, t: torch.Tensor) -> torch.Tensor:
        """log SNR(t) (natural log), float64."""
        ab = self.coef("alphas_cumprod", t)
        return torch.log(ab) - torch.log1p(-ab)

    # ---- forward process and targets ----------------------------------------------------------------
    def q_sample(self, x0: torch.Tensor, t: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        """Reference forward process: x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps (Ho et al. Eq. 4)."""
        if noise.shape != x0.shape:
            raise ValueError(f"noise shape {tuple(noise.shape)} does not match x0 shape {tuple(x0.shape)}")
        if t.ndim != 1 or t.shape[0] != x0.shape[0]:
            raise ValueError(f"t must have shape ({x0.shape[0]},), got {tuple(t.shape)}")
        return self.coef("sqrt_alphas_cumprod", t, x0) * x0 + self.coef("sqrt_one_minus_alphas_cumprod", t, x0) * noise

    def target(self, x0: torch.Tensor, noise: torch.Tensor, t: torch.Tensor, prediction: str = "eps") -> torch.Tensor:
        """Regression target for ``prediction``: eps, x0, or v = sqrt(abar) eps - sqrt(1 - abar) x0 (Salimans & Ho)."""
        if prediction == "eps":
            return noise
        if prediction == "x0":
            return x0
        if prediction == "v":
            return (
                self.coef("sqrt_alphas_cumprod", t, x0) * noise
                - self.coef("sqrt_one_minus_alphas_cumprod", t, x0) * x0
            )
        raise ValueError(f"unknown prediction {prediction!r}; choose one of {PREDICTIONS}")
