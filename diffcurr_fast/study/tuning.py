"""The tuning protocol of a study: every tuned arm gets the same number of short trials, one per point of its grid,
and a pick rule fixed in the spec before any result is seen chooses the value its seeds then run with (AlgoPerf,
Dahl et al., arXiv 2306.07179: every entrant, the baseline included, tuned within the same budget of trials, the
tuning counted; Kaddour et al., "No Train No Gain", arXiv 2307.06440).

In the spec::

    tuning: {budget: 375, pick: final, seeds: [10, 11]}   # engine.max_steps of a trial; the rule; the trials' seeds
    arms:
      - {name: official_tuned, set: [...], tune: {optim.lr: [1.0e-4, 3.0e-4, 1.0e-3, 3.0e-3]}}

- ``tune`` maps config keys to lists of values; the grid is their product, in the order written (the first key
  varies slowest). Every arm with a grid has the same number of points (``check_tuning``); an arm without one is
  not tuned, and the report says so.
- A trial is the arm with one grid point and ``engine.max_steps`` = ``budget``, at each of the trial seeds
  (``seeds``, or the one ``seed``; default 0): it runs as the arm ``<arm>~t<i>`` of the study
  (``runs/<arm>~t<i>/seed<s>``).
- A trial seed's score under ``pick: final`` is its smoothed metric (the trailing mean of ``speedrun.smooth``
  evaluations, 1 without a speedrun) at its last evaluation; under ``pick: <number>``, the steps until the smoothed
  metric reaches that number (never: infinite), then the final smoothed metric. **A point is scored by its worse
  seed** (the larger score), so a rate that breaks one seed loses (a diverged seed, its metric non-finite, scores
  infinite). The pick is the point with the best score; ties keep the grid's order. Lower is better (a study's
  metric for tuning must be ``fd``).
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
TUNING_KEYS = ("budget", "pick", "seed", "seeds")
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
    out = {"pick": "final", **tuning}
    if "seeds" not in out:
        out.setdefault("seed", 0)
    elif "seed" in out:
        raise ValueError(f"{source}: give tuning.seed (one trial seed) or tuning.seeds (several), not both")
    if isinstance(out.get("budget"), bool) or not isinstance(out.get("budget"), int) or out["budget"] < 1:
        raise ValueError(
            f"{source}: tuning.budget must be an int >= 1 (the steps of a trial), got {out.get('budget')!r}"
        )
    pick = out["pick"]
    if pick != "final" and (isinstance(pick, bool) or not isinstance(pick, (int, float)) or not pick > 0):
        raise ValueError(f"{source}: tuning.pick must be 'final' or a metric value > 0 to reach, got {pick!r}")
    if "seed" in out and (isinstance(out["seed"], bool) or not isinstance(out["seed"], int) or out["seed"] < 0):
        raise ValueError(f"{source}: tuning.seed must be an int >= 0, got {out['seed']!r}")
    seeds = out.get("seeds", [0])
    if (
        not isinstance(seeds, list)
        or not seeds
        or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in seeds)
        or len(set(seeds)) != len(seeds)
    ):
        raise ValueError(f"{source}: tuning.seeds must be a non-empty list of distinct ints >= 0, got {seeds!r}")
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


def trial_seeds(tuning: dict[str, Any]) -> list[int]:
    """The seeds every trial runs at: ``tuning.seeds``, or the one ``tuning.seed``."""
    return list(tuning["seeds"]) if "seeds" in tuning else [tuning["seed"]]


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


def worse_seed(scores: list[tuple[float, float]]) -> tuple[float, float]:
    """The score of a point from its seeds' scores: the worse seed's (more steps, then a higher final metric)."""
    return max(scores, key=lambda sc: (sc[0], sc[1]))


def pick_point(scores: list[tuple[float, float]]) -> int:
    """The index of the best trial score (fewest steps, then lowest final; ties: the first in the grid)."""
    return min(range(len(scores)), key=lambda i: (scores[i][0], scores[i][1], i))


def decide(spec: Any, study_dir: Path, read_status) -> dict[str, Any]:
    """{arm: its grid, each trial's score (its worse seed's) and wall time (its seeds', summed), and the pick} for the
    tuned arms whose trials have all finished on every trial seed (``read_status(study_dir, arm, seed)``); written to
    ``tuning.json``, with each seed's score when the trials run on several."""
    window = int(spec.speedrun.get("smooth", 1)) if spec.speedrun else 1
    seeds = trial_seeds(spec.tuning)
    out: dict[str, Any] = {}
    for arm in spec.arms:
        if not arm.tune:
            continue
        points = grid(arm.tune)
        statuses = [[read_status(study_dir, trial_name(arm.name, i), s) for s in seeds] for i in range(len(points))]
        if any(st is None for per_point in statuses for st in per_point):
            continue
        per_seed = [
            [trial_score(st.get("evals", []), spec.metric, window, spec.tuning["pick"]) for st in per_point]
            for per_point in statuses
        ]
        scores = [worse_seed(sc) for sc in per_seed]
        best = pick_point(scores)
        trials = []
        for p, sc, seed_scores, per_point in zip(points, scores, per_seed, statuses):
            trial = {"set": p, "steps_to_pick": sc[0], "final": sc[1], "wall_s": sum(st["wall_s"] for st in per_point)}
            if len(seeds) > 1:
                trial["per_seed"] = [
                    {"seed": s, "steps_to_pick": x[0], "final": x[1], "wall_s": st["wall_s"]}
                    for s, x, st in zip(seeds, seed_scores, per_point)
                ]
            trials.append(trial)
        out[arm.name] = {
            "grid": points,
            "trials": trials,
            "pick": points[best],
            "tuning_wall_s": sum(float(st["wall_s"]) for per_point in statuses for st in per_point),
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
    "trial_seeds",
    "worse_seed",
]
