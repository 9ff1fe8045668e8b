"""Timestep sampling as one component: which cells of the formulation's difficulty axis a step trains on.

A ``TimestepSampler`` gives (G,) weights over the G cells (``weights``), folds each step's per-sample losses into
its statistics (``observe``), and may correct the loss of its draws (``loss_weights``, importance sampling). The
trainer holds one composed sampler, the ``Product`` of the formulation's cell prior, the strategy of
``timesteps.sampler`` (``registry.STRATEGIES``), the curriculum's unlock mask and a TDC timestep range, built by
``build_timesteps``. See docs/training.md for the table of strategies.
"""

from diffcurr_fast._lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "SAMPLERS": "diffcurr_fast.timesteps.registry",
    "STRATEGIES": "diffcurr_fast.timesteps.registry",
    "strategy_class": "diffcurr_fast.timesteps.registry",
    "TimestepSampler": "diffcurr_fast.timesteps.base",
    "Fixed": "diffcurr_fast.timesteps.base",
    "Product": "diffcurr_fast.timesteps.base",
    "range_mask": "diffcurr_fast.timesteps.base",
    "CurriculumMask": "diffcurr_fast.timesteps.curriculum",
    "build_timesteps": "diffcurr_fast.timesteps.build",
}
__getattr__ = lazy_exports(__name__, _EXPORTS)

__all__ = sorted(_EXPORTS)
