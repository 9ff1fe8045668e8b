"""Denoising Task Routing (Park et al., "Denoising Task Routing for Diffusion Models", ICLR 2024).

DTR gives each timestep (denoising task) its own pathway through the transformer with a fixed binary channel mask
m_t over the hidden dimension D, and no extra parameters. Implemented variant (the paper's "DTR" mask, which the
authors' release builds with ``init_method="DTR"``):

- Sliding window: m_t has ``k = floor(beta * D)`` consecutive ones starting at channel
  ``s_t = round((t / (T - 1)) ** alpha * (D - k))`` (round half to even), zeros elsewhere. Adjacent timesteps share
  most channels (task affinity); small t (fine details) sit at the low channels, large t at the high ones, and
  ``alpha > 1`` spends more distinct windows on small t (task weights).
- The same mask is used in every DiT block: block output = ``Block(x * m_t) + x * (1 - m_t)``, i.e. the block
  (residual connections included) runs on the routed channels and the unrouted channels pass through unchanged.
  The final layer is not routed.
- Defaults beta = 0.8 (the release's ``sharing_ratio``) and alpha = 4 (the release's default).

Timesteps are read on the discrete scale [0, T - 1]; a float t (continuous formulations) is mapped the same way,
``t / (T - 1)``, and clamped to [0, 1], so pass t already scaled to [0, T - 1].
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from diffcurr_fast.diffusion.registry import formulation_class
from diffcurr_fast.options import Options, option, source_of

__all__ = ["DTRConfig", "DTROptions", "dtr_mask", "dtr_window"]


@dataclass
class DTROptions(Options):
    """The switch ``model.dtr``: Denoising Task Routing with the paper's beta and alpha (``DTRConfig``)."""

    SWITCH = "dtr"
    dtr: bool = option(False, "Denoising Task Routing (timestep-dependent channel masks)")

    def active(self) -> bool:
        return self.dtr

    def overruled(self, cfg: Any) -> tuple[int, str] | None:
        form = cfg.diffusion.formulation
        rank, where = source_of(cfg.diffusion, "formulation")
        if formulation_class(form).discrete or source_of(cfg.model, "dtr")[0] >= rank:
            return None
        by = source_of(cfg.model, "dtr")[1]
        return rank, f"auto: diffusion.formulation {form!r} ({where}); True ({by}) does not apply to {form}"

    def validate(self, cfg: Any) -> None:
        form = cfg.diffusion.formulation
        if not formulation_class(form).discrete:  # its masks are defined on the timestep index
            raise ValueError(f"model.dtr=True is not supported with diffusion.formulation {form!r}; use False")

    def dit_kwargs(self, cfg: Any) -> dict[str, Any]:
        return {"dtr": DTRConfig() if self.dtr else None}


@dataclass(frozen=True)
class DTRConfig:
    """Denoising Task Routing settings.

    Attributes:
        beta: fraction of the D channels routed (active) for each task, in (0, 1].
        alpha: exponent of the window position schedule (t / (T - 1)) ** alpha, > 0.
    """

    beta: float = 0.8
    alpha: float = 4.0

    def __post_init__(self) -> None:
        if not (isinstance(self.beta, int | float) and 0.0 < self.beta <= 1.0):
            raise ValueError(f"DTRConfig.beta must be in (0, 1], got {self.beta!r}")
        if not (isinstance(self.alpha, int | float) and math.isfinite(self.alpha) and self.alpha > 0.0):
            raise ValueError(f"DTRConfig.alpha must be a finite number > 0, got {self.alpha!r}")

    def to_dict(self) -> dict[str, float]:
        """Plain dict of the fields (for configs and checkpoints)."""
        return {k: float(v) for k, v in asdict(self).items()}

    @classmethod
    def from_dict(cls, d: dict[str, float]) -> DTRConfig:
        """Inverse of :meth:`to_dict`; unknown keys are an error."""
        unknown = set(d) - {"beta", "alpha"}
        if unknown:
            raise ValueError(f"unknown DTRConfig keys {sorted(unknown)}; valid keys: alpha, beta")
        return cls(**d)


def dtr_window(t: torch.Tensor, dim: int, num_timesteps: int, config: DTRConfig) -> tuple[torch.Tensor, int]:
    """Start channel s_t (int64, shape of t) and window length k of the DTR mask."""
    if dim < 1:
        raise ValueError(f"dtr mask dim must be >= 1, got {dim}")
    if num_timesteps < 2:
        raise ValueError(f"dtr needs num_timesteps >= 2, got {num_timesteps}")
    k = int(math.floor(config.beta * dim))  # window of routed channels
    u = (t.to(torch.float64) / (num_timesteps - 1)).clamp(0.0, 1.0)  # task position in [0, 1]
    start = torch.round(u.pow(config.alpha) * (dim - k)).to(torch.int64)  # s_t = round(u^alpha (D - k))
    return start, k


def dtr_mask(
    t: torch.Tensor, dim: int, num_timesteps: int, config: DTRConfig, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """DTR channel masks m_t for a batch of timesteps.

    Args:
        t: (B,) timesteps on the scale [0, num_timesteps - 1] (integer or float).
        dim: hidden size D.
        num_timesteps: T.
        config: beta and alpha.
        dtype: dtype of the returned mask.

    Returns:
        (B, D) mask of zeros and ones.
    """
    start, k = dtr_window(t, dim, num_timesteps, config)  # (B,)
    channels = torch.arange(dim, device=t.device)  # (D,)
    inside = (channels[None, :] >= start[:, None]) & (channels[None, :] < start[:, None] + k)  # (B, D)
    return inside.to(dtype)
