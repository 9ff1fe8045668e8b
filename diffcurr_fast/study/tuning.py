"""The tuning protocol of a study: every tuned arm gets the same number of short trials, one per point of its grid,
and a pick rule fixed in the spec before any result is seen chooses the value its seeds then run with (AlgoPerf,
Dahl et al., arXiv 2306.07179: every entrant, the baseline included, tuned within the same budget of trials, the
tuning counted; Kaddour et al., "No Train No Gain", arXiv 2307.06440).

In the spec::

    tuning: {budget: 375, pick: final, seed: 0}   # engine.max_steps of a trial; the rule; the trials' seed
    arms:
      - {name: official_tuned, set: [...], tune: {optim.lr: [1.0e-4, 3.0e-4, 1.0e-3, 3.0e-3]}}

- ``tune`` maps config keys to lists of values; the grid is their product, in the order written (the first key
  varies slowest). Every arm with a grid has the same number of points (``check_tuning``); an arm without one is
  not tuned, and the report says so.
- A trial is the arm with one grid point and ``engine.max_steps`` = ``budget``, at ``seed``: it runs as the arm
  ``<arm>~t<i>`` of the study (``runs/<arm>~t<i>/seed<seed>``).
- ``pick: final``: the point with the lowest smoothed metric (the trailing mean of ``speedrun.smooth`` evaluations,
  1 without a speedrun) at the trial's last evaluation; ``pick: <number>``: the fewest steps until the smoothed
  metric reaches that number, ties and points that never reach it then by the final smoothed metric. Ties keep the
  grid's order. Lower is better (a study's metric for tuning must be ``fd``).
- When every trial of an arm has finished, the pick is written to ``tuning.json``; the arm's seeds run with the
  picked point's overrides after the arm's own (``tuned_arm``). A rerun recomputes the same pick from the same
  status files.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

from diffcurr_fast._files import read_json, write_json
from diffcurr_fast.study.speedrun import smooth

TUNING_FILE = "tuning.json"
TUNING_KEYS = ("budget", "pick", "seed")
TRIAL = "~t"  # <arm>~t<i>: trial i of the arm's grid


def grid(tune: dict[str, list[Any]]) -> list[list[str]]:
    """The points of a ``tune`` mapping as override lists, the first key varying slowest."""
    keys = list(tune)
    return [[f"{k}={v}" for k, v in zip(keys, values)] for values in itertools.product(*(tune[k] for k in keys))]


def check_tuning(tuning: Any, tunes: dict[str, dict[str, Any]], source: str) -> dict[str, Any]:
    """The checked ``tuning`` mapping ({} when absent), given each arm's ``tune`` grid: a budget >= 1 step, a rule,
    a seed, and the same number of points for every tuned arm."""
    if not tuning:
        if any(tunes.values()):
            raise ValueError(f"{source}: an arm has a tune grid but the spec has no tuning section (budget, pick)")
        return {}
    if not isinstance(tuning, dict):
        raise ValueError(f"{source}: tuning must be a mapping (budget, pick, seed), got {tuning!r}")
    bad = sorted(set(tuning) - set(TUNING_KEYS))
    if bad:
        raise ValueError(f"{source}: unknown tuning keys {bad}; valid keys: {', '.join(TUNING_KEYS)}")
    out = {"pick": "final", "seed": 0, **tuning}
    if isinstance(out.get("budget"), bool) or not isinstance(out.get("budget"), int) or out["budget"] < 1:
        raise ValueError(
            f"{source}: tuning.budget must be an int >= 1 (the steps of a trial), got {out.get('budget')!r}"
        )
    pick = out["pick"]
    if pick != "final" and (isinstance(pick, bool) or not isinstance(pick, (int, float)) or not pick > 0):
        raise ValueError(f"{source}: tuning.pick must be 'final' or a metric value > 0 to reach, got {pick!r}")
    if isinstance(out["seed"], bool) or not isinstance(out["seed"], int) or out["seed"] < 0:
        raise ValueError(f"{source}: tuning.seed must be an int >= 0, got {out['seed']!r}")
    sizes = {}
    for arm, tune in tunes.items():
        if not tune:
            continue
        if not isinstance(tune, dict) or not all(isinstance(v, list) and v for v in tune.values()):
            raise ValueError(f"{source}: arm {arm!r}: tune must map config keys to non-empty lists, got {tune!r}")
        sizes[arm] = len(grid(tune))
    if not sizes:
        raise ValueError(f"{source}: a tuning section but no arm has a tune grid")
    if len(set(sizes.values())) > 1:
        raise ValueError(
            f"{source}: every tuned arm gets the same number of trials, got {sizes}; give each grid as many points"
        )
    return out


def trial_name(arm: str, i: int) -> str:
    return f"{arm}{TRIAL}{i}"


def split_trial(name: str) -> tuple[str, int | None]:
    """(arm, trial index) of ``<arm>~t<i>``; (name, None) for an arm's own name."""
    arm, sep, i = name.rpartition(TRIAL)
    return (arm, int(i)) if sep and i.isdigit() else (name, None)


def trial_score(evals: list[dict[str, Any]], metric: str, window: int, pick: Any) -> tuple[float, float]:
    """(steps to reach ``pick``, or inf / 0 for ``final``; the final smoothed metric) of a trial's evaluations."""
    pts = [(float(e["step"]), float(e[metric])) for e in evals if e.get(metric) is not None]
    if not pts:
        return math.inf, math.inf
    sm = smooth([v for _, v in pts], window)
    final = sm[-1] if math.isfinite(sm[-1]) else math.inf
    if pick == "final":
        return 0.0, final
    reached = next((s for (s, _), v in zip(pts, sm) if v <= float(pick)), math.inf)
    return reached, final


def pick_point(scores: list[tuple[float, float]]) -> int:
    """The index of the best trial score (fewest steps, then lowest final; ties: the first in the grid)."""
    return min(range(len(scores)), key=lambda i: (scores[i][0], scores[i][1], i))


def decide(spec: Any, study_dir: Path, read_status) -> dict[str, Any]:
    """{arm: its grid, each trial's score and wall time, and the pick} for the tuned arms whose trials have all
    finished (``read_status(study_dir, arm, seed)``); written to ``tuning.json``."""
    window = int(spec.speedrun.get("smooth", 1)) if spec.speedrun else 1
    out: dict[str, Any] = {}
    for arm in spec.arms:
        if not arm.tune:
            continue
        points = grid(arm.tune)
        statuses = [read_status(study_dir, trial_name(arm.name, i), spec.tuning["seed"]) for i in range(len(points))]
        if any(s is None for s in statuses):
            continue
        scores = [trial_score(s.get("evals", []), spec.metric, window, spec.tuning["pick"]) for s in statuses]
        best = pick_point(scores)
        out[arm.name] = {
            "grid": points,
            "trials": [
                {"set": p, "steps_to_pick": sc[0], "final": sc[1], "wall_s": st["wall_s"]}
                for p, sc, st in zip(points, scores, statuses)
            ],
            "pick": points[best],
            "tuning_wall_s": sum(float(st["wall_s"]) for st in statuses),
        }
    write_json(_finite(out), Path(study_dir) / TUNING_FILE, indent=1)
    return out


def _finite(data: Any) -> Any:
    """JSON has no inf: steps that never reached the pick's value are written as null."""
    if isinstance(data, dict):
        return {k: _finite(v) for k, v in data.items()}
    if isinstance(data, list):
        return [_finite(v) for v in data]
    return None if isinstance(data, float) and not math.isfinite(data) else data


def picked(study_dir: Path, arm: str) -> list[str]:
    """The overrides picked for ``arm`` (``tuning.json``); ValueError when its trials have not all finished."""
    path = Path(study_dir) / TUNING_FILE
    data = read_json(path, "study tuning record") if path.is_file() else {}
    if arm not in data:
        raise ValueError(f"arm {arm!r} is tuned but its trials have not all finished (no pick in {TUNING_FILE})")
    return list(data[arm]["pick"])


__all__ = [
    "TUNING_FILE",
    "TUNING_KEYS",
    "check_tuning",
    "decide",
    "grid",
    "pick_point",
    "picked",
    "split_trial",
    "trial_name",
    "trial_score",
]
