"""What a TDC run can check before stage 1 trains: the training config, its inputs and backends (as ``train``
checks them: threads and memory too), the timestep groups the options ask for, and the run directory (``TDC_LAYOUT``).

``check_tdc_run(cfg, opts, run_dir, overwrite=...)`` raises in one line, naming the option, and returns the
``RunStart`` that ``open_run_dir`` then prepares; ``check_groups(cfg, num_groups, method)`` is its grouping part.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from diffcurr_fast.runs.sampling import build_schedule
from diffcurr_fast.tdc.grouping import group_timesteps
from diffcurr_fast.train.preflight import check_backends, check_guidance, check_inputs, check_resources
from diffcurr_fast.train.rundir import TDC_LAYOUT, RunStart, check_run_dir

__all__ = ["check_groups", "check_tdc_run"]


def check_groups(cfg: Any, num_groups: int, method: str = "db") -> list[tuple[int, int]]:
    """The [lo, hi) timestep ranges of ``num_groups`` groups on the schedule of ``cfg.diffusion``; ValueError
    naming ``tdc.num_groups`` when they cannot be formed (more groups than timesteps, an empty group)."""
    t = cfg.diffusion.num_timesteps  # the cells of the difficulty axis (DDPM: its timesteps)
    if isinstance(num_groups, bool) or not isinstance(num_groups, int) or not 1 <= num_groups <= t:
        raise ValueError(f"tdc.num_groups must be an int in [1, {t}] (diffusion.num_timesteps), got {num_groups!r}")
    try:
        ranges = [(int(lo), int(hi)) for lo, hi in group_timesteps(build_schedule(cfg), num_groups, method, t)]
    except ValueError as exc:
        raise ValueError(f"tdc.num_groups {num_groups} with tdc.group_method {method!r}: {exc}") from None
    empty = [i for i, (lo, hi) in enumerate(ranges) if hi <= lo]
    if len(ranges) != num_groups or empty:
        raise ValueError(
            f"tdc.num_groups {num_groups} with tdc.group_method {method!r} leaves group(s) {empty} "
            f"without timesteps out of T = {t}; use fewer groups"
        )
    return ranges


def check_tdc_run(
    cfg: Any, opts: Any, run_dir: str | Path, *, overwrite: bool = False, resume: bool = False
) -> RunStart:
    """Validate a whole TDC run before anything is written or trained (module doc); returns how it starts
    (``resume``: a TDC run directory with its ``tdc.json``, continued where it stopped)."""
    cfg.validate()
    opts.validate()
    check_backends(cfg)
    check_inputs(cfg)
    check_guidance(cfg)
    check_groups(cfg, opts.num_groups, opts.group_method)
    check_resources(cfg, int(os.environ.get("WORLD_SIZE", "1")))  # stage 1 trains the whole model
    cfg.check_refusals("tdc")  # what a pruned expert cannot carry (a term's projector, a layer pruning skips)
    if resume:
        if overwrite:
            raise ValueError("--resume and --overwrite exclude each other")
        if not (Path(run_dir) / "tdc.json").is_file():
            raise FileNotFoundError(
                f"cannot resume: {str(run_dir)!r} holds no TDC run (no tdc.json); drop --resume to start one"
            )
        return RunStart(Path(run_dir), TDC_LAYOUT, "resume")
    return check_run_dir(run_dir, TDC_LAYOUT, overwrite=overwrite)
