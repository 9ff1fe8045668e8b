"""The trainer's composed timestep sampler: prior x strategy x curriculum x range (``build_timesteps``)."""

from __future__ import annotations

from typing import Any

import torch

from diffcurr_fast.curriculum.clustering import cluster_timesteps
from diffcurr_fast.curriculum.pacing import Curriculum
from diffcurr_fast.timesteps.base import Fixed, Product, TimestepSampler, range_mask
from diffcurr_fast.timesteps.curriculum import CurriculumMask
from diffcurr_fast.timesteps.registry import strategy_class


def build_curriculum(c: Any, formulation: Any, num_cells: int, timestep_range: tuple[int, int] | None) -> Curriculum:
    """The curriculum of a ``CurriculumConfig``-like ``c`` on the cells, or on a range [lo, hi) of them (its clusters
    then partition the range; at most hi - lo clusters)."""
    lo, hi = 0, num_cells
    if timestep_range is not None:
        range_mask(num_cells, timestep_range)  # checks the range
        lo, hi = (int(v) for v in timestep_range)
    grid = formulation.cell_grid(num_cells)
    if grid is None and (lo, hi) != (0, num_cells):
        grid = torch.arange(num_cells)
    sub = None if grid is None else grid[lo:hi]
    clusters = cluster_timesteps(formulation, min(c.num_clusters, hi - lo), c.method, grid=sub)
    return Curriculum(
        clusters,
        hi - lo,
        pacing=c.pacing,
        order=c.order,
        patience=c.patience,
        ema=c.ema,
        min_delta=c.min_delta,
        stage_iters=c.stage_iters or None,
        eval_every=c.eval_every,
        adaptive_floor=c.adaptive_floor,
    )


def build_timesteps(
    t: Any,
    formulation: Any,
    num_cells: int,
    curriculum: Curriculum | None = None,
    *,
    timestep_range: tuple[int, int] | None = None,
    process_group: Any = None,
    device: torch.device | str = "cpu",
) -> Product:
    """The product of the formulation's cell prior, the strategy ``t.sampler`` (a ``TimestepsConfig``-like ``t``;
    None: ``uniform``), ``curriculum`` (placed at the range's start) and the indicator of ``timestep_range`` [lo, hi).
    ``process_group``: the ranks of the run, over which every factor's collectives go (the curriculum's too)."""
    parts: list[TimestepSampler] = []
    prior = formulation.cell_prior(num_cells)
    if prior is not None:
        parts.append(Fixed(prior, "prior"))
    strategy = strategy_class("uniform" if t is None else t.sampler).from_config(t, formulation, num_cells)
    parts.append(strategy)
    if curriculum is not None:
        offset = 0 if timestep_range is None else int(timestep_range[0])
        parts.append(CurriculumMask(curriculum, num_cells, offset))
    if timestep_range is not None:
        parts.append(range_mask(num_cells, timestep_range))
    for p in parts:
        p.process_group = process_group
    return Product(parts, device)
