"""Post-hoc EMA in a study (Karras et al. 2024, EDM2, arXiv 2312.02696, Section 3): every arm is evaluated at one
grid of EMA lengths after training, and each arm is then read at its own best length, by one rule for all arms.

The EMA half-life of a run is a hidden setting: one decay for every arm favours the arms it happens to suit. With
post-hoc EMA it is chosen after training, the same way for every arm. ``diffcurr-fast study posthoc DIR``, on a
study whose runs kept snapshots (``optim.phema_every``, every evaluation step):

1. each run of an arm (its seeds, not its tuning trials) is evaluated at its last snapshot step at every length of
   ``GRID`` (sigma_rel, the profile's width relative to the training time; ``runs.posthoc_ema.reconstruct``);
2. an arm's length is the one with the lowest mean final FD over its seeds (ties: the shorter length), its ``pick``;
3. each run is evaluated at its arm's length at every snapshot step: the arm's FD curve, from weights that at step s
   use only the snapshots of steps <= s (so the curve is one a run could have reported at s).

Every evaluation is the run's own (``train.evaluation.Evaluator``: its reference, sampler, seed and sample count),
so a post-hoc FD compares with the FD the run logged. The records are ``posthoc/<arm>-seed<k>.jsonl`` in the study
folder (kept when ``runs/`` is not), one JSON line per (step, sigma_rel); a rerun evaluates only what is missing.
``study report`` adds the grid, the picks, the conditional accuracy at the picks and, for a speedrun, the time to
quality on these curves (``posthoc_rows``). A study with a long reference (``study.long_reference``) has its runs
evaluated the same way, in their own folder, and both readings of the speed-up read each side at its best length.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from diffcurr_fast.runs.checkpoint import load_weights
from diffcurr_fast.runs.posthoc_ema import list_snapshots, reconstruct
from diffcurr_fast.runs.recipes import load_run_config
from diffcurr_fast.runs.sampling import build_model, build_schedule, set_cpu_threads
from diffcurr_fast.study.long_reference import folder_of
from diffcurr_fast.study.runner import read_status, run_dir_of
from diffcurr_fast.study.spec import load_study
from diffcurr_fast.train.evaluation import Evaluator

GRID = (0.025, 0.05, 0.075, 0.1, 0.15, 0.2)  # EDM2 found its optima between 0.05 and 0.15 (Fig. 5)
POSTHOC_DIR = "posthoc"  # in the study folder, beside status/: kept when the run folders are not


def records_path(study_dir: Path, arm: str, seed: int) -> Path:
    """The post-hoc records of run (``arm``, ``seed``): ``posthoc/<arm>-seed<k>.jsonl`` in the study folder."""
    return Path(study_dir) / POSTHOC_DIR / f"{arm}-seed{seed}.jsonl"


def read_records(path: Path) -> dict[tuple[int, float], dict[str, Any]]:
    """{(step, sigma_rel): record} of a run's post-hoc evaluations (``records_path``; a torn last line, from a stop,
    is skipped)."""
    path = Path(path)
    out = {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            r = json.loads(line)
        except json.JSONDecodeError:
            continue
        out[(int(r["step"]), float(r["sigma_rel"]))] = r
    return out


class RunEvaluator:
    """Evaluates one run's post-hoc EMA weights at (step, sigma_rel), appending each record to its file."""

    def __init__(self, run_dir: Path, path: Path):
        self.run_dir, self.path = Path(run_dir), Path(path)
        self.cfg = load_run_config(self.run_dir / "config.yaml")
        self.steps = sorted({s.step for s in list_snapshots(self.run_dir)})
        if not self.steps:
            raise ValueError(
                f"run {str(self.run_dir)!r} kept no post-hoc EMA snapshots: its study needs optim.phema_every > 0"
            )
        self.done = read_records(self.path)
        self._parts: tuple[Any, Any, Any] | None = None

    def record(self, step: int, sigma_rel: float) -> dict[str, Any]:
        key = (int(step), float(sigma_rel))
        if key in self.done:
            return self.done[key]
        if self._parts is None:  # built on first need: a rerun with everything done reads no model
            self._parts = (Evaluator(self.cfg, self.run_dir), build_model(self.cfg), build_schedule(self.cfg))
        evaluator, model, schedule = self._parts
        weights, how = reconstruct(self.run_dir, sigma_rel, step=step)
        load_weights(model, weights, f"post-hoc EMA {sigma_rel} of {self.run_dir} at step {how.step}")
        rec = {**evaluator(how.step, model, schedule), "sigma_rel": float(sigma_rel)}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a") as f:  # one line per record: a stop loses at most the last
            f.write(json.dumps(rec) + "\n")
        self.done[key] = rec
        return rec


def pick_length(finals: dict[float, list[float]]) -> float:
    """The length with the lowest mean final metric over seeds (ties: the shorter); non-finite means rank last."""
    mean = {s: float(np.mean(v)) if v and all(math.isfinite(x) for x in v) else math.inf for s, v in finals.items()}
    return min(sorted(mean), key=lambda s: mean[s])


def run_posthoc(
    study_dir: str | Path, grid: tuple[float, ...] = GRID, threads: int | None = 1, progress: bool = True
) -> dict[str, Any]:
    """The pass of the module doc over every finished run of the study; returns ``picks`` (``posthoc_picks``)."""
    study_dir = Path(study_dir)
    spec = load_study(study_dir)
    set_cpu_threads(threads)
    runs = {
        (a.name, s): RunEvaluator(run_dir_of(study_dir, a.name, s), records_path(study_dir, a.name, s))
        for a in spec.arms
        if a.kind == "train"
        for s in spec.seeds
        if read_status(study_dir, a.name, s) is not None
    }
    if not runs:
        raise ValueError(f"study {str(study_dir)!r} has no finished training runs to evaluate")
    todo = len(runs) * len(grid) + sum(len(r.steps) for r in runs.values())
    bar = tqdm(total=todo, desc="post-hoc EMA", unit="eval", disable=not progress, dynamic_ncols=True)
    for run in runs.values():  # 1. every length at the last snapshot
        for s in grid:
            run.record(run.steps[-1], s)
            bar.update(1)
    picks = posthoc_picks(spec, study_dir, tuple(grid))
    for (arm, _), run in runs.items():  # 3. the arm's length at every snapshot
        for step in run.steps:
            run.record(step, picks[arm]["pick"])
            bar.update(1)
    bar.close()
    long = folder_of(spec, study_dir) if spec.long_reference else None
    if long is not None and any((long / "status").glob("*.json")):  # the long reference's runs, the same way
        run_posthoc(long, grid, threads, progress)
    return picks


def posthoc_picks(spec: Any, study_dir: Path, grid: tuple[float, ...] | None = None) -> dict[str, Any]:
    """{arm: {"finals": {sigma_rel: [final fd per seed]}, "pick": sigma_rel}} for the arms whose finished runs were
    all evaluated at their last snapshot; ``grid``: the lengths compared (default: those that every such run of the
    study has, so that every arm picks from the same grid)."""
    runs: dict[str, list[dict[tuple[int, float], dict[str, Any]]]] = {}
    for a in spec.arms:
        recs = [
            read_records(records_path(study_dir, a.name, s))
            for s in spec.seeds
            if read_status(study_dir, a.name, s) is not None
        ]
        if recs and all(recs):
            runs[a.name] = recs
    finals_of = {
        n: [{s: r[k] for k in r if k[0] == max(st for st, _ in r) for s in [k[1]]} for r in rs]
        for n, rs in runs.items()
    }
    if grid is None:
        sets = [set(f) for fs in finals_of.values() for f in fs]
        grid = tuple(sorted(set.intersection(*sets))) if sets else ()
    out: dict[str, Any] = {}
    for name, fs in finals_of.items():
        if not grid or not all(float(s) in f for f in fs for s in grid):
            continue
        finals = {float(s): [float(f[float(s)]["fd"]) for f in fs] for s in grid}
        out[name] = {"finals": finals, "pick": pick_length(finals)}
    return out


def posthoc_rows(spec: Any, study_dir: Path, rows: list[dict[str, Any]], picks: dict[str, Any]) -> list[dict]:
    """``rows`` (``report.collect``) with each picked arm's evaluations replaced by its post-hoc curve at its
    length (the metrics of the post-hoc records; the step's recorded train_s and FLOPs kept); arms without a pick
    are left out."""
    keep = {(r["arm"], r["seed"], r["step"]): r for r in rows}
    out = []
    for arm, p in picks.items():
        for s in spec.seeds:
            for (step, sigma), rec in sorted(read_records(records_path(study_dir, arm, s)).items()):
                base = keep.get((arm, s, step))
                if sigma != p["pick"] or base is None:
                    continue
                out.append({**base, **{k: rec.get(k) for k in ("fd", "is", "precision", "recall", "cond_acc")}})
    return out


def posthoc_finals(spec: Any, study_dir: Path, picks: dict[str, Any], key: str = "cond_acc") -> dict[str, Any]:
    """{arm: {seed: ``key`` of its last post-hoc record at the arm's picked length}} (seeds whose record has it)."""
    out: dict[str, Any] = {}
    for arm, p in picks.items():
        for s in spec.seeds:
            recs = read_records(records_path(study_dir, arm, s))
            at = [r for (_, sigma), r in sorted(recs.items()) if sigma == p["pick"]]
            if at and at[-1].get(key) is not None:
                out.setdefault(arm, {})[s] = float(at[-1][key])
    return out


__all__ = [
    "GRID",
    "POSTHOC_DIR",
    "records_path",
    "pick_length",
    "posthoc_finals",
    "posthoc_picks",
    "posthoc_rows",
    "read_records",
    "run_posthoc",
]
