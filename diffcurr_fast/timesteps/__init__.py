"""Timestep sampling as one component: which cells of the formulation's difficulty axis a step trains on.

A ``TimestepSampler`` gives (G,) weights over the G cells (``weights``), folds each step's per-sample losses into
its statistics (``observe``), and may correct the loss of its draws (``loss_weights``, importance sampling). The
trainer holds one composed sampler, the ``Product`` of the formulation's cell prior, the strategy of
``timesteps.sampler`` (``registry.STRATEGIES``), the curriculum's unlock mask and a TDC timestep range, built by
``build_timesteps``. See docs/training.md for the table of strategies.
"""

from diffcurr_fast.timesteps.base import Fixed, Product, TimestepSampler, range_mask
from diffcurr_fast.timesteps.build import build_timesteps
from diffcurr_fast.timesteps.curriculum import CurriculumMask
from diffcurr_fast.timesteps.registry import SAMPLERS, STRATEGIES, strategy_class

__all__ = [
    "CurriculumMask",
    "Fixed",
    "Product",
    "SAMPLERS",
    "STRATEGIES",
    "TimestepSampler",
    "build_timesteps",
    "range_mask",
    "strategy_class",
]
