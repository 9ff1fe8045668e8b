"""Timestep grouping and FLOPs budgets of TDC training (arXiv 2312.13307, Sec. 3.1-3.2).

Timesteps are grouped on the SNR axis, SNR_dB(t) = 10 log10(abar_t / (1 - abar_t)) (TDC Eq. 1), into N contiguous
ranges. Methods: ``db`` (default) is the ANT interval clustering (``snr_interval_clusters``: contiguous ranges
minimising the L1 deviation from each range's median) applied to SNR_dB; ``uniform``, ``snr`` (the same clustering
on linear SNR, which puts almost every t in the last group) and ``log_snr`` (equal-width ranges of SNR_dB) are
those of ``diffcurr_fast.curriculum.cluster_timesteps``.

Groups are ranked by difficulty: low t (high SNR) is the harder denoising task (Kim et al., ICLR 2025), so in
ascending t the first group is the hardest. The group of difficulty rank i in 1..N (1 = least budget) receives
FLOPs(i) = (i / N + (N - i) / N * k) * F (TDC Eq. 2), k in (0, 1]. ``full_budget`` chooses which end gets rank N
(the full F): ``"hardest"`` (default, the low-t group) or ``"easiest"`` (the high-t group).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import torch

from diffcurr_fast.curriculum.clustering import check_clusters, cluster_timesteps, snr_interval_clusters
from diffcurr_fast.diffusion import snr_to_db
from diffcurr_fast.runs.sections import FULL_BUDGET_ENDS
from diffcurr_fast.runs.sections import GROUP_METHODS as _GROUP_METHODS

GROUP_METHODS = _GROUP_METHODS()  # "db" (TDC's dB grouping) and the curriculum's clustering rules

__all__ = [
    "FULL_BUDGET_ENDS",
    "GROUP_METHODS",
    "TimestepGroup",
    "budget_ratio",
    "cell_snr_db",
    "group_timesteps",
    "make_groups",
    "snr_db",
]


@dataclass(frozen=True)
class TimestepGroup:
    """One group of timesteps ``[lo, hi)`` with its difficulty rank and FLOPs budget.

    Attributes:
        index: position in ascending t (0 = lowest t).
        lo: first timestep (inclusive).
        hi: last timestep + 1 (exclusive).
        rank: budget rank i in 1..N of TDC Eq. 2 (N = full budget).
        ratio: budget ratio i / N + (N - i) / N * k.
        flops: budget in FLOPs per forward of one sample (ratio * F), or 0.0 when F was not given.
        snr_db_range: (SNR_dB at lo, SNR_dB at hi - 1).
    """

    index: int
    lo: int
    hi: int
    rank: int
    ratio: float
    flops: float
    snr_db_range: tuple[float, float]

    def contains(self, t: int) -> bool:
        """Whether timestep ``t`` lies in ``[lo, hi)``."""
        return self.lo <= int(t) < self.hi

    def timesteps(self) -> torch.Tensor:
        """(hi - lo,) int64 timesteps of the group."""
        return torch.arange(self.lo, self.hi, dtype=torch.long)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-serializable dict."""
        d = asdict(self)
        d["snr_db_range"] = list(self.snr_db_range)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TimestepGroup:
        """Inverse of ``to_dict``."""
        return cls(
            index=int(d["index"]),
            lo=int(d["lo"]),
            hi=int(d["hi"]),
            rank=int(d["rank"]),
            ratio=float(d["ratio"]),
            flops=float(d["flops"]),
            snr_db_range=(float(d["snr_db_range"][0]), float(d["snr_db_range"][1])),
        )


def snr_db(schedule: Any, t: torch.Tensor | None = None) -> torch.Tensor:
    """SNR in decibels, 10 log10(abar_t / (1 - abar_t)) (TDC Eq. 1), float64, at ``t`` (default: every t)."""
    t = torch.arange(schedule.num_timesteps) if t is None else torch.as_tensor(t, dtype=torch.long)
    return snr_to_db(schedule.snr(t))


def budget_ratio(rank: int, num_groups: int, k: float) -> float:
    """FLOPs(i) / F = i / N + (N - i) / N * k (TDC Eq. 2) for rank i in 1..N and k in (0, 1]."""
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= num_groups:
        raise ValueError(f"rank must be an int in [1, {num_groups}], got {rank!r}")
    if not (isinstance(k, (int, float)) and 0.0 < float(k) <= 1.0 and math.isfinite(float(k))):
        raise ValueError(f"k must be a number in (0, 1], got {k!r}")
    return rank / num_groups + (num_groups - rank) / num_groups * float(k)


def cell_snr_db(schedule: Any, num_cells: int | None = None) -> torch.Tensor:
    """(G,) SNR_dB of the cells of the formulation's difficulty axis: DDPM's T timesteps, or the G cells of a
    continuous formulation (flow t, EDM ln sigma) at their ``cell_grid`` points."""
    grid = schedule.cell_grid(num_cells) if num_cells is not None and hasattr(schedule, "cell_grid") else None
    return snr_db(schedule) if grid is None else snr_to_db(schedule.snr(grid))


def group_timesteps(
    schedule: Any, num_groups: int, method: str = "db", num_cells: int | None = None
) -> list[tuple[int, int]]:
    """Split the G cells (DDPM: [0, T)) into ``num_groups`` contiguous ranges on the SNR axis (ascending t).

    ``method``: ``db`` (default; interval clustering of SNR_dB), or a ``cluster_timesteps`` method (``uniform``,
    ``snr``, ``log_snr``). ``num_cells``: G of a continuous formulation (default: the schedule's T).
    """
    if method not in GROUP_METHODS:
        raise ValueError(f"unknown grouping method {method!r}; valid choices: {', '.join(GROUP_METHODS)}")
    db = cell_snr_db(schedule, num_cells)
    if method == "db":
        t = int(db.numel())
        if isinstance(num_groups, bool) or not isinstance(num_groups, int) or not 1 <= num_groups <= t:
            raise ValueError(f"num_groups must be an int in [1, {t}], got {num_groups!r}")
        return snr_interval_clusters(db, num_groups)[0]
    grid = schedule.cell_grid(num_cells) if num_cells is not None and hasattr(schedule, "cell_grid") else None
    return cluster_timesteps(schedule, num_groups, method, grid=grid)


def make_groups(
    schedule: Any,
    num_groups: int,
    k: float,
    base_flops: float = 0.0,
    *,
    method: str = "db",
    full_budget: str = "hardest",
    ranges: list[tuple[int, int]] | None = None,
    num_cells: int | None = None,
) -> list[TimestepGroup]:
    """Group the schedule's timesteps and give each group its FLOPs budget (TDC Eq. 1-2).

    Args:
        schedule: a ``DDPMSchedule``, or a flow / EDM formulation with ``num_cells``.
        num_groups: N.
        k: the smallest budget ratio's anchor, in (0, 1]; k = 1 gives every group the full F.
        base_flops: F, the base model's FLOPs per forward of one sample (``dit_flops``); 0 leaves budgets at 0.
        method: grouping rule passed to ``cluster_timesteps``.
        full_budget: ``"hardest"`` (low-t group gets F) or ``"easiest"`` (high-t group gets F).
        ranges: explicit ascending ``[(lo, hi), ...]`` ranges instead of clustering.
        num_cells: G, the cells of a continuous formulation (flow, EDM; ``diffusion.num_timesteps``); groups are
            ranges of cells, as the trainer draws them. Default: DDPM's T timesteps.

    Returns:
        N groups in ascending t.
    """
    if full_budget not in FULL_BUDGET_ENDS:
        raise ValueError(f"unknown full_budget {full_budget!r}; valid choices: {', '.join(FULL_BUDGET_ENDS)}")
    if not (isinstance(base_flops, (int, float)) and base_flops >= 0 and math.isfinite(float(base_flops))):
        raise ValueError(f"base_flops must be a finite number >= 0, got {base_flops!r}")
    db = cell_snr_db(schedule, num_cells)
    if ranges is None:
        ranges = group_timesteps(schedule, num_groups, method, num_cells)
    else:
        ranges = check_clusters(ranges, int(db.numel()))
        if len(ranges) != num_groups:
            raise ValueError(f"got {len(ranges)} ranges for num_groups={num_groups}")
    n = len(ranges)
    groups = []
    for g, (lo, hi) in enumerate(ranges):
        rank = n - g if full_budget == "hardest" else g + 1  # ascending t: g = 0 is the hardest (highest SNR)
        ratio = budget_ratio(rank, n, k)
        groups.append(
            TimestepGroup(
                index=g,
                lo=lo,
                hi=hi,
                rank=rank,
                ratio=ratio,
                flops=ratio * float(base_flops),
                snr_db_range=(float(db[lo]), float(db[hi - 1])),
            )
        )
    return groups
