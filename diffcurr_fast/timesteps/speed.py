"""SpeeD's asymmetric timestep sampling (Wang et al. 2024, "A Closer Look at Time Steps is Worthy of Triple
Speed-Up for Diffusion Model Training", arXiv 2405.17403, Sec. 4; its change-aware weighting is a loss weighting:
``diffusion.weighting: speed``, ``diffusion.weights``).

The process increment's noise level sqrt(1 - abar) = sqrt(1 / (1 + SNR)) rises steeply at first and then saturates
(the paper's convergence area). The boundary tau is the first cell whose increment of that noise level falls below
``threshold`` per 1/1000 of the axis (the official code's 1e-4 per timestep of T = 1000, scaled by 1000 / G for G
cells). Cells below tau are drawn ``k`` times as often as those at or above it (the official code's
tanh(1e6 (grad - 1e-4)) + 1.5, i.e. 2.5 against 0.5: k = 5). The official sampler also draws half of each batch as
the "dual" of the other half (tau - t below tau, t - tau above); a weight vector cannot pair draws, so this
strategy uses the marginal of that scheme: p = (p_asym + p_dual) / 2, with p_dual the asymmetric mass carried to
the dual cells. Choices made here: the noise level is computed for every formulation from its SNR at the cells
(``cell_log_snr``), so flow and EDM reach it too; when no cell falls below the threshold, tau = G: the
asymmetric draw is then uniform, and the dual half, clamped to the last cell, still leans towards the high end.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import Options, option
from diffcurr_fast.timesteps.base import TimestepSampler
from diffcurr_fast.timesteps.lognormal import cell_log_snr


def speed_boundary(log_snr: torch.Tensor, threshold: float = 1e-4) -> int:
    """tau: the first cell whose increment of sqrt(1 / (1 + SNR)) is below ``threshold`` x 1000 / G (module doc)."""
    g = log_snr.numel()
    noise = torch.sigmoid(-log_snr).sqrt()  # sqrt(1 / (1 + SNR)) = sqrt(1 - abar), ascending along the cells
    grad = torch.gradient(noise)[0] if g > 1 else torch.ones(1, dtype=torch.float64)
    flat = (grad < threshold * 1000.0 / g).nonzero()
    return int(flat[0]) + 1 if flat.numel() else g  # the official code's argmax(grad < thr) + 1


def speed_weights(num_cells: int, tau: int, k: float) -> torch.Tensor:
    """(G,) float64 marginal of SpeeD's asymmetric and dual draws (module doc)."""
    idx = torch.arange(num_cells)
    p = torch.ones(num_cells, dtype=torch.float64)
    p[:tau] = float(k)  # below the boundary: k times as likely
    p = p / p.sum()
    dual = torch.where(idx < tau, tau - idx, idx - tau).clamp(0, num_cells - 1)  # the official dual_t
    p_dual = torch.zeros(num_cells, dtype=torch.float64).index_add_(0, dual, p)
    return 0.5 * (p + p_dual)


@dataclass
class SpeeDOptions(Options):
    """speed's options in the ``timesteps`` section (keys ``timesteps.speed_*``)."""

    PREFIX = "speed_"
    k: float = option(5.0, "speed: how many times as likely a cell before the convergence area is", lo=1.0)
    threshold: float = option(
        1e-4,
        "speed: increment of sqrt(1 - abar) per 1/1000 of the axis where the convergence area begins",
        lo=0.0,
        lo_open=True,
    )


class SpeeD(TimestepSampler):
    """SpeeD's asymmetric sampling: cells below the convergence boundary tau drawn ``k`` times as often (module doc)."""

    name = "speed"
    Options = SpeeDOptions

    def __init__(self, log_snr: torch.Tensor, k: float = 5.0, threshold: float = 1e-4):
        super().__init__(log_snr.numel())
        if not k >= 1:
            raise ValueError(f"timesteps.speed_k must be >= 1, got {k}")
        self.k, self.tau = float(k), speed_boundary(log_snr, threshold)
        self._w = speed_weights(self.num_cells, self.tau, self.k)

    @classmethod
    def from_config(cls, t: Any, formulation: Any, num_cells: int) -> SpeeD:
        return cls(cell_log_snr(formulation, num_cells), t.speed_k, t.speed_threshold)

    def weights(self) -> torch.Tensor:
        return self._w
