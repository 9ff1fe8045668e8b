"""Log-normal timesteps on the formulation's log-SNR axis: SD3's logit-normal t for flow (Esser et al. 2024,
Sec. 3.1, "lognorm(0.00, 1.00)"), EDM's log-normal sigma (Karras et al. 2022, Table 1) for any formulation.

log SNR ~ N(mean, std^2). For flow, log SNR = -2 logit(t), so logit-normal t with (m, s) is mean = -2 m, std = 2 s:
the defaults (mean 0, std 2) are SD3's logit-normal(0, 1). For EDM, log SNR = -2 ln sigma, so ln sigma ~ N(P_mean,
P_std^2) is mean = -2 P_mean, std = 2 P_std (EDM's own prior is already in the product as its cell prior: the two
multiply). Cell k gets the normal mass between its log-SNR edges: the midpoints between neighbouring cells' log SNR
(``cell_log_snr``), the outermost edges at +-inf (the tails go to the end cells); floored at 1e-30 so a cell far in
a tail keeps a positive weight and the product with another factor is never all zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import INF, Options, option
from diffcurr_fast.timesteps.base import TimestepSampler


def cell_log_snr(formulation: Any, num_cells: int) -> torch.Tensor:
    """(G,) float64 log SNR of each cell (its representative t, ``Formulation.cell_grid``; DDPM: t = k)."""
    grid = formulation.cell_grid(num_cells)
    t = torch.arange(num_cells) if grid is None else grid
    return formulation.log_snr(t).to(torch.float64)


def lognormal_cell_mass(log_snr: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """(G,) float64 mass of N(mean, std^2) between the cells' log-SNR edges (module doc), floored at 1e-30."""
    inf = torch.tensor([math.inf], dtype=torch.float64)
    mid = 0.5 * (log_snr[1:] + log_snr[:-1])
    desc = bool(log_snr[0] >= log_snr[-1])  # log SNR falls along the cells for every formulation
    edges = torch.cat([inf, mid, -inf]) if desc else torch.cat([-inf, mid, inf])
    cdf = 0.5 * (1.0 + torch.erf((edges - mean) / (std * math.sqrt(2.0))))
    return (cdf[:-1] - cdf[1:]).abs().clamp(min=1e-30)


@dataclass
class LogNormalOptions(Options):
    """lognormal's options in the ``timesteps`` section (keys ``timesteps.lognormal_*``)."""

    PREFIX = "lognormal_"
    mean: float = option(0.0, "lognormal: mean of log SNR (flow: -2 x the logit-normal mean)", lo=-INF)
    std: float = option(
        2.0, "lognormal: std of log SNR (2 = SD3's logit-normal(0, 1) t for flow)", lo=0.0, lo_open=True
    )


class LogNormal(TimestepSampler):
    """p_k ∝ the N(mean, std^2) mass of cell k's log-SNR interval (module doc)."""

    name = "lognormal"
    Options = LogNormalOptions

    def __init__(self, log_snr: torch.Tensor, mean: float = 0.0, std: float = 2.0):
        super().__init__(log_snr.numel())
        if not std > 0:
            raise ValueError(f"timesteps.lognormal_std must be > 0, got {std}")
        self.mean, self.std = float(mean), float(std)
        self._w = lognormal_cell_mass(log_snr, self.mean, self.std)

    @classmethod
    def from_config(cls, t: Any, formulation: Any, num_cells: int) -> LogNormal:
        return cls(cell_log_snr(formulation, num_cells), t.lognormal_mean, t.lognormal_std)

    def weights(self) -> torch.Tensor:
        return self._w
