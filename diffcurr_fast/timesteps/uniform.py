"""Uniform timesteps: every cell equally likely (DDPM, IDDPM and DiT train this way; with EDM's cell prior in the
product it is EDM's log-normal sigma, Karras et al. 2022, Table 1)."""

from __future__ import annotations

from typing import Any

from diffcurr_fast.timesteps.base import TimestepSampler


class Uniform(TimestepSampler):
    """p_k = 1 / G (``weights()`` is None: the product's other factors alone decide)."""

    name = "uniform"

    @classmethod
    def from_config(cls, t: Any, formulation: Any, num_cells: int) -> Uniform:
        return cls(num_cells)
