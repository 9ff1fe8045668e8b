"""Time to quality (``study --preset speedrun``): the steps, training wall time and training FLOPs each arm needs
until its smoothed FD first falls to a threshold, over seeds, and the speed-up over the official DiT recipe.

The definitions (fixed before any result; ``tests/study/test_study_speedrun.py`` checks them against a hand
computation):

* **smoothing**: the trailing moving average of the last ``smooth`` evaluations of a run (fewer at its start);
* **threshold**: ``reference`` = the largest final smoothed FD over the official arm's seeds (so every one of its
  seeds reaches it, at its end at the latest), or a stated number;
* **reached**: at the first evaluation i whose smoothed FD is <= the threshold; between evaluation i - 1 and i the
  position is interpolated linearly in the smoothed FD, and the step, the wall time and the FLOPs are read at that
  position (each linear between the two evaluations). A run that never gets there has not reached it;
* **at the first evaluation**: a run whose smoothed FD is at the threshold at its first evaluation got there at or
  before that step, so its time is an upper bound and its arm's speed-up a lower bound (``at_first``; the report
  marks it >=, and the two readings count it as a bound);
* **per arm**: mean and 95% interval (mean +- t_{0.975, n-1} s / sqrt(n)) over the seeds that reached it;
* **speed-up** of an arm over the official arm, per axis: the ratio of geometric means T_official / T_arm, with the
  95% Welch interval of the difference of mean logs, exp(d +- t_{0.975, nu} sqrt(s_o^2 / n_o + s_a^2 / n_a))
  (nu: Welch-Satterthwaite). Only when every seed of both arms reached the threshold; otherwise n/a;
* **plateau**: on the official arm's mean smoothed FD curve over seeds, the last ``plateau_share`` of its
  evaluations (the share's count rounded up, at least two) improve it by (f_first - f_last) / f_first; it has
  stopped falling when that is strictly below ``plateau_tol``; ``best_arms`` keeps the file's order on a tie;
* **time axes**: the wall time of an evaluation is its step times the arm's median training step time, measured
  by the study side by side for every arm in one process (alternating blocks, the study's model, data, batch and
  threads; ``step_time.json``). A study's runs train over hours, in several sittings, beside other work or on
  other machines; their own clocks (``train_s``, the loop's time without evaluations, kept in results.csv) would
  compare those conditions as much as the arms. The official arm is trained by our trainer with the official
  recipe (the same math), and its step time is the official code's own (``study --peer-dit PATH``, a
  facebookresearch/DiT checkout, timed beside ours). Without a checkout the official arm keeps our step's time and
  the report says so; without ``step_time.json`` every arm keeps its ``train_s`` and the report says so;
* **FLOPs**: 3 x forward FLOPs x batch per step (the convention of ``diffcurr_fast.tdc.accounting``), cumulative.

Two readings of a speed-up (``both_readings``; the issue of every claim: REPA's 17.5x and TREAD's numbers are the
second):

* **the existing reading**: each arm's time to the reference's final FD (the threshold above) over the reference's
  time to it, at the same budget;
* **the field's reading**: each arm's own final FD (its worst final smoothed FD over its seeds, which every one of
  its seeds reaches by its end: the threshold rule applied to the arm), the time the **long reference** (the
  reference trained ``long_reference.factor`` x the budget, ``diffcurr_fast.study.long_reference``) needs to reach
  it, over the arm's own time to it. Every seed of the long reference must reach it for a ratio with an interval;
  where one never does, its run's end is counted as its time and the reading is a lower **bound** (">"). The long
  reference's time axis is the reference's step time;
* both as ratios of geometric means with the Welch interval on the logs (``speedup``), in steps and wall time, and
  in wall time **with the tuning included**: each seed's time plus its arm's tuning wall time (the reference's for
  the long reference, whose learning rate is the study's pick).

The report's section and plots are ``diffcurr_fast.study.speedrun_report``; the step times are measured by
``diffcurr_fast.study.step_time``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from diffcurr_fast._files import write_json

AXES = ("step", "wall_s", "train_flops")
UNIFORM_ARM = "vanilla"  # uniform t on our step: the baseline of sample efficiency (``efficiency``)
LONG_ARM = "long reference"  # the long reference's runs among a study's (no arm of a spec has a space in its name)


# ---- the arithmetic ---------------------------------------------------------------------------------------------
def smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average: element i is the mean of values[max(0, i - window + 1) : i + 1]."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    return [float(np.mean(values[max(0, i - window + 1) : i + 1])) for i in range(len(values))]


def crossing(points: list[dict[str, float]], threshold: float, window: int) -> dict[str, float] | None:
    """Where the smoothed ``fd`` of one run's evaluations ``points`` (dicts with ``fd`` and the ``AXES``, sorted by
    step) first falls to ``threshold``: the axes interpolated there (module doc), or None when it never does."""
    sm = smooth([p["fd"] for p in points], window)
    for i, f in enumerate(sm):
        if f <= threshold:
            if i == 0:
                return {a: float(points[0][a]) for a in AXES}
            frac = (sm[i - 1] - threshold) / (sm[i - 1] - f)  # in (0, 1]: sm[i - 1] > threshold >= f
            return {a: float(points[i - 1][a] + frac * (points[i][a] - points[i - 1][a])) for a in AXES}
    return None


def mean_ci(values: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(mean, lo, hi): mean +- t_{(1 + level) / 2, n - 1} s / sqrt(n) (NaN interval for fewer than two). A quantity
    that cannot be negative (steps, seconds, FLOPs: every value >= 0) has its lower end clipped at 0."""
    # optional dependency (scipy, a dev extra): imported when a statistic is computed
    from scipy import stats

    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return math.nan, math.nan, math.nan
    m = float(a.mean())
    if a.size < 2:
        return m, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, a.size - 1)) * float(a.std(ddof=1)) / math.sqrt(a.size)
    lo = max(m - half, 0.0) if bool((a >= 0).all()) else m - half
    return m, lo, m + half


def speedup(reference: list[float], arm: list[float], level: float = 0.95) -> tuple[float, float, float]:
    """(ratio, lo, hi) of geometric means reference / arm with the Welch interval on the logs (module doc)."""
    # optional dependency (scipy, a dev extra): imported when a statistic is computed
    from scipy import stats

    r, a = np.log(np.asarray(reference, dtype=np.float64)), np.log(np.asarray(arm, dtype=np.float64))
    if r.size == 0 or a.size == 0:
        return math.nan, math.nan, math.nan
    d = float(r.mean() - a.mean())
    if r.size < 2 or a.size < 2:
        return math.exp(d), math.nan, math.nan
    vr, va = float(r.var(ddof=1)) / r.size, float(a.var(ddof=1)) / a.size
    se = math.sqrt(vr + va)
    if se == 0.0:
        return math.exp(d), math.exp(d), math.exp(d)
    nu = (vr + va) ** 2 / (vr**2 / (r.size - 1) + va**2 / (a.size - 1))  # Welch-Satterthwaite
    half = float(stats.t.ppf(0.5 + level / 2, nu)) * se
    return math.exp(d), math.exp(d - half), math.exp(d + half)


def plateau(curve: list[tuple[int, float]], share: float, tol: float) -> dict[str, Any]:
    """The plateau rule on a (step, smoothed fd) curve: the relative improvement over its last ``share`` of
    evaluations (at least 2), and whether it is below ``tol``."""
    if len(curve) < 2:
        return {"improvement": math.nan, "plateaued": False, "from_step": None, "to_step": None}
    k = max(2, math.ceil(share * len(curve)))
    (s0, f0), (s1, f1) = curve[-k], curve[-1]
    imp = (f0 - f1) / f0 if f0 else math.nan
    return {"improvement": imp, "plateaued": bool(imp < tol), "from_step": s0, "to_step": s1, "evaluations": k}


# ---- the study's numbers ----------------------------------------------------------------------------------------
def run_points(rows: list[dict[str, Any]], arm: str, seed: int, step_s: float | None) -> list[dict[str, float]]:
    """The evaluations of (arm, seed) with fd, step, wall_s and train_flops, by step. ``step_s``: the arm's time
    axis is steps x that step time (``arm_step_s``); None: the run's own recorded ``train_s``."""
    out = []
    for r in sorted((r for r in rows if r["arm"] == arm and r["seed"] == seed), key=lambda r: r["step"]):
        if r.get("fd") is None or r.get("train_flops") is None:
            continue
        wall = r["step"] * step_s if step_s else r.get("train_s")
        if wall is None:
            continue
        out.append(
            {
                "fd": float(r["fd"]),
                "step": float(r["step"]),
                "wall_s": float(wall),
                "train_flops": float(r["train_flops"]),
            }
        )
    return out


def arm_step_s(step_time: dict[str, Any] | None, arm: str, official: str) -> float | None:
    """The step time that gives ``arm`` its time axis (module doc): the official code's for the official arm, the
    arm's own side-by-side measurement for ours; None (the recorded ``train_s``) when it was not measured."""
    st = step_time or {}
    if arm == official and st.get("official_s"):
        return float(st["official_s"])
    return st.get("arms", {}).get(arm)


def analyse(
    spec: Any,
    rows: list[dict[str, Any]],
    step_time: dict[str, Any] | None,
    *,
    reference: str | None = None,
    threshold: float | None = None,
) -> dict[str, Any]:
    """Threshold, plateau, per-(arm, seed) crossings, per-arm means and speed-ups (module doc). ``reference``: the
    arm that sets the threshold and the plateau and that speed-ups divide (default: the official arm);
    ``threshold``: a stated FD instead of the spec's rule."""
    sr = spec.speedrun
    window, official = int(sr["smooth"]), sr["official_arm"]
    ref_name = reference or official
    points = {
        (a.name, s): run_points(rows, a.name, s, arm_step_s(step_time, a.name, official))
        for a in spec.arms
        for s in spec.seeds
    }
    points = {k: v for k, v in points.items() if v}
    ref_runs = [v for (a, _), v in points.items() if a == ref_name]
    finals = [smooth([p["fd"] for p in v], window)[-1] for v in ref_runs]
    if threshold is not None:
        threshold, thr_rule = float(threshold), "stated"
    elif sr["threshold"] == "reference":
        threshold = max(finals) if finals else math.nan
        who = "the official arm" if ref_name == official else f"arm {ref_name}"
        thr_rule = f"{who}'s worst final smoothed FD over its {len(finals)} seeds"
    else:
        threshold, thr_rule = float(sr["threshold"]), "stated in the spec"
    curve: list[tuple[int, float]] = []
    if ref_runs:
        by_step: dict[float, list[float]] = {}
        for v in ref_runs:
            for p, f in zip(v, smooth([p["fd"] for p in v], window)):
                by_step.setdefault(p["step"], []).append(f)
        curve = [(int(s), float(np.mean(f))) for s, f in sorted(by_step.items()) if len(f) == len(ref_runs)]
    cross = {k: crossing(v, threshold, window) for k, v in points.items()} if math.isfinite(threshold) else {}
    arms: dict[str, Any] = {}
    for a in spec.arms:
        seeds = [s for s in spec.seeds if (a.name, s) in points]
        hit = {s: cross[(a.name, s)] for s in seeds if cross.get((a.name, s))}
        arms[a.name] = {
            "seeds": seeds,
            "reached": sorted(hit),
            "axes": {ax: mean_ci([h[ax] for h in hit.values()]) for ax in AXES},
            "per_seed": {s: h for s, h in hit.items()},
            "at_first": sorted(s for s, h in hit.items() if h["step"] <= points[(a.name, s)][0]["step"]),
        }
    ref = arms.get(ref_name, {"seeds": [], "reached": []})
    for name, a in arms.items():
        complete = bool(a["seeds"]) and len(a["reached"]) == len(a["seeds"])
        ref_complete = bool(ref["seeds"]) and len(ref["reached"]) == len(ref["seeds"])
        a["speedup"] = {
            ax: speedup([ref["per_seed"][s][ax] for s in ref["reached"]], [a["per_seed"][s][ax] for s in a["reached"]])
            if complete and ref_complete and name != ref_name
            else None
            for ax in AXES
        }
    return {
        "threshold": threshold,
        "threshold_rule": thr_rule,
        "smooth": window,
        "official_arm": official,
        "reference": ref_name,
        "plateau": plateau(curve, sr["plateau_share"], sr["plateau_tol"]),
        "official_curve": curve,
        "step_time": step_time,
        "arms": arms,
    }


def mean_final(rows: list[dict[str, Any]], spec: Any, arm: str) -> float:
    """The mean over an arm's seeds of its final smoothed FD (the strength of a reference); nan without runs."""
    window = int(spec.speedrun["smooth"])
    finals = [smooth([p["fd"] for p in pts], window)[-1] for s in spec.seeds if (pts := run_points(rows, arm, s, 1.0))]
    return float(np.mean(finals)) if finals else math.nan


def against(
    spec: Any, rows: list[dict[str, Any]], step_time: dict[str, Any] | None, references: list[str]
) -> dict[str, Any]:
    """{reference: the analysis with that arm as the reference} for the official arm and ``references``, and the
    strongest of them (``strongest``: the lowest ``mean_final``), which a headline divides by."""
    names = [spec.speedrun["official_arm"], *(r for r in references if r != spec.speedrun["official_arm"])]
    res = {n: analyse(spec, rows, step_time, reference=n) for n in names}
    finals = {n: mean_final(rows, spec, n) for n in names}
    strongest = min(names, key=lambda n: finals[n] if math.isfinite(finals[n]) else math.inf)
    return {"analyses": res, "finals": finals, "strongest": strongest}


def with_official_runs(
    spec: Any, rows: list[dict[str, Any]], step_time: dict[str, Any] | None, official_rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """The analysis with the official arm's runs taken from another study (``official_rows``, e.g. the official
    recipe trained longer, ``speedrun_plateau``) in place of this study's: its threshold, plateau and time to it;
    this study's step times give every time axis."""
    return analyse(spec, merged_rows(spec, rows, official_rows), step_time)


def merged_rows(spec: Any, rows: list[dict[str, Any]], official_rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` with the official arm's runs taken from ``official_rows`` (``with_official_runs``)."""
    official = spec.speedrun["official_arm"]
    return [r for r in rows if r["arm"] != official] + [r for r in official_rows if r["arm"] == official]


# ---- the two readings ------------------------------------------------------------------------------------------
def _ratio(reference: list[float], arm: list[float], bound: bool) -> dict[str, Any]:
    """A speed-up (``speedup``) with its interval, or, where the reference's times are censored, its lower bound."""
    up, lo, hi = speedup(reference, arm)
    return {"value": up, "bound": True} if bound else {"value": up, "lo": lo, "hi": hi, "bound": False}


def _readings(reference: list[dict], arm: list[dict], costs: tuple[float, float], bound: bool) -> dict[str, Any]:
    """The speed-up in steps and in wall time, tuning excluded and included (``costs``: the reference's and the
    arm's tuning wall time, added to each seed's time), from the per-seed crossings of each side."""
    return {
        "step": _ratio([r["step"] for r in reference], [a["step"] for a in arm], bound),
        "wall_s": _ratio([r["wall_s"] for r in reference], [a["wall_s"] for a in arm], bound),
        "wall_tuned": _ratio([r["wall_s"] + costs[0] for r in reference], [a["wall_s"] + costs[1] for a in arm], bound),
    }


def both_readings(
    spec: Any,
    rows: list[dict[str, Any]],
    long_rows: list[dict[str, Any]],
    step_time: dict[str, Any] | None,
    costs: dict[str, float] | None = None,
) -> dict[str, Any]:
    """The existing and the field's reading of every arm's speed-up over the official arm (module doc); ``long_rows``:
    the evaluations of the long reference's runs (its arm named as the official arm); ``costs``: each arm's tuning
    wall time (None: no tuning)."""
    window, ref = int(spec.speedrun["smooth"]), spec.speedrun["official_arm"]
    costs = costs or {}
    ext = dataclasses.replace(spec, arms=[*spec.arms, dataclasses.replace(spec.arm(ref), name=LONG_ARM)])
    st = step_time and {**step_time, "arms": {**step_time.get("arms", {}), LONG_ARM: arm_step_s(step_time, ref, ref)}}
    every = rows + [{**r, "arm": LONG_ARM} for r in long_rows if r["arm"] == ref]
    ends = {s: pts[-1] for s in spec.seeds if (pts := run_points(every, LONG_ARM, s, arm_step_s(st, LONG_ARM, ref)))}
    existing = analyse(spec, rows, step_time)
    arms: dict[str, Any] = {}
    for a in spec.arms:
        runs = [pts for s in spec.seeds if (pts := run_points(rows, a.name, s, 1.0))]
        if not runs or not ends:
            continue
        threshold = max(smooth([p["fd"] for p in pts], window)[-1] for pts in runs)  # every seed of it reaches it
        res = analyse(ext, every, st, reference=LONG_ARM, threshold=threshold)
        mine, long = res["arms"][a.name], res["arms"][LONG_ARM]
        times = [long["per_seed"].get(s, end) for s, end in ends.items()]  # a seed that never got there: its end
        pair = (costs.get(ref, 0.0), costs.get(a.name, 0.0))
        ex = existing["arms"][a.name]
        arms[a.name] = {
            "threshold": threshold,
            "axes": mine["axes"],
            "long_reached": long["reached"],
            "long_axes": {ax: mean_ci([t[ax] for t in times]) for ax in ("step", "wall_s")},
            "field": _readings(
                times, list(mine["per_seed"].values()), pair, len(long["reached"]) < len(ends) or bool(mine["at_first"])
            ),
            "existing_reached": (len(ex["reached"]), len(ex["seeds"])),
            "existing": None
            if a.name == ref or ex["speedup"]["wall_s"] is None
            else _readings(
                list(existing["arms"][ref]["per_seed"].values()),
                list(ex["per_seed"].values()),
                pair,
                bool(ex["at_first"]),
            ),
        }
    long_run = analyse(ext, every, st, reference=LONG_ARM)
    return {
        "reference": ref,
        "threshold": existing["threshold"],
        "threshold_rule": existing["threshold_rule"],
        "long_seeds": sorted(ends),
        "long_steps": int(max(p["step"] for p in ends.values())) if ends else None,
        "long_plateau": long_run["plateau"],
        "arms": arms,
    }


# ---- the timestep strategy alone --------------------------------------------------------------------------------
def efficiency(
    spec: Any, rows: list[dict[str, Any]], step_time: dict[str, Any] | None, threshold: float
) -> list[dict[str, Any]]:
    """Steps to a threshold over the uniform-t arm (``UNIFORM_ARM``) at equal step speed: at ``threshold`` (the
    main one) and at the uniform arm's own worst final smoothed FD. [] without that arm."""
    if UNIFORM_ARM not in {a.name for a in spec.arms}:
        return []
    main = analyse(spec, rows, step_time, reference=UNIFORM_ARM, threshold=threshold)
    main["threshold_rule"] = "the threshold above"
    return [main, analyse(spec, rows, step_time, reference=UNIFORM_ARM)]


# ---- the analysis file ------------------------------------------------------------------------------------------
def write_analysis(res: dict[str, Any], path: Path) -> Path:
    """``speedrun.json``: the analysis (the screening's input to the second stage)."""
    arms = {
        n: {"seeds": a["seeds"], "reached": a["reached"], "axes": a["axes"], "speedup": a["speedup"]}
        for n, a in res["arms"].items()
    }
    data = {k: v for k, v in res.items() if k != "arms"} | {"arms": arms}
    return write_json(json.loads(json.dumps(data, default=float)), path, indent=1)  # numpy scalars as floats


def best_arms(path: str | Path, count: int) -> list[str]:
    """The ``count`` arms of a finished screening (its ``speedrun.json``) with the largest wall-time speed-up over
    its official arm (arms without one rank last, by mean wall time to the threshold; the official arm is left out)."""
    p = Path(path)
    p = p / "speedrun.json" if p.is_dir() else p
    if not p.is_file():
        raise FileNotFoundError(f"{str(p)!r} does not exist: run the screening study and its report first")
    data = json.loads(p.read_text())

    def key(item: tuple[str, dict]) -> tuple[int, float]:
        up, wall = item[1]["speedup"].get("wall_s"), item[1]["axes"]["wall_s"][0]
        if up and math.isfinite(up[0]):
            return 0, -up[0]
        return 1, wall if wall is not None and math.isfinite(wall) else math.inf

    ranked = sorted(((n, a) for n, a in data["arms"].items() if n != data["official_arm"]), key=key)
    return [n for n, _ in ranked[:count]]
