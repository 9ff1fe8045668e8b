"""The files of a study folder that say where each run stands (``runner`` writes them; ``launch``, ``report`` and
``study status`` read them): a run's directory, its status file once it finished, its log and its latest job.
Torch-free, so that ``study status`` and a cluster job's supervisor stay light."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from diffcurr_fast.study.spec import StudySpec

STEPTIME = ("step-time", -1)  # the queue's job that measures the official step (not an arm: '-' + seed -1)


def run_name(arm: str, seed: int) -> str:
    """The name of run (``arm``, ``seed``) in ``logs/``, ``status/`` and ``jobs/``; the step-time job is ``arm``."""
    return arm if seed < 0 else f"{arm}-seed{seed}"


def run_dir_of(study_dir: Path, arm: str, seed: int) -> Path:
    return Path(study_dir) / "runs" / arm / f"seed{seed}"


def status_path(study_dir: Path, arm: str, seed: int) -> Path:
    return Path(study_dir) / "status" / f"{run_name(arm, seed)}.json"


def read_status(study_dir: Path, arm: str, seed: int) -> dict[str, Any] | None:
    p = status_path(study_dir, arm, seed)
    return json.loads(p.read_text()) if p.is_file() else None


def log_path(study_dir: Path, arm: str, seed: int) -> Path:
    """The output of the run's worker (rank 0 of a multi-GPU job)."""
    return Path(study_dir) / "logs" / f"{run_name(arm, seed)}.log"


def job_path(study_dir: Path, arm: str, seed: int) -> Path:
    """The run's latest job (``launch.write_job``)."""
    return Path(study_dir) / "jobs" / f"{run_name(arm, seed)}.json"


def jobs(spec: StudySpec) -> list[tuple[str, int]]:
    """Every (arm, seed): the trials of the tuning protocol first, then the seeds, seed-major so a partial study has
    every arm at its first seeds."""
    return [*spec.trials(), *((a.name, s) for s in spec.seeds for a in spec.arms)]
