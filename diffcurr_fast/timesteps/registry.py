"""The timestep strategies by name (``timesteps.sampler``): name -> ``module:Class``, imported on first use.

Adding a strategy is one new file in this package (a ``TimestepSampler`` subclass with ``from_config``) and one line
here; the config lists the names from ``SAMPLERS`` and checks the strategy's fields in its ``timesteps`` section.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass

from diffcurr_fast.options import option

STRATEGIES: dict[str, str] = {
    "uniform": "diffcurr_fast.timesteps.uniform:Uniform",
    "lognormal": "diffcurr_fast.timesteps.lognormal:LogNormal",
    "importance": "diffcurr_fast.timesteps.importance:LossSecondMoment",
    "speed": "diffcurr_fast.timesteps.speed:SpeeD",
    "anuts": "diffcurr_fast.timesteps.anuts:ANUTS",
}
SAMPLERS = tuple(STRATEGIES)


def strategy_class(name: str) -> type:
    """The ``TimestepSampler`` class registered as ``name``; ValueError naming the valid ones."""
    if name not in STRATEGIES:
        raise ValueError(f"unknown timesteps.sampler {name!r}; valid choices: {', '.join(SAMPLERS)}")
    module, cls = STRATEGIES[name].split(":")
    return getattr(importlib.import_module(module), cls)


@dataclass
class TimestepsOptions:
    """Timestep sampling: the strategy multiplied with the curriculum's unlock mask (docs/training.md)."""

    sampler: str = option(
        "uniform",
        "timestep strategy (times the curriculum's mask and the formulation's prior)",
        lambda: tuple(STRATEGIES),
    )
