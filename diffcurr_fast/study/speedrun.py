"""Time to quality (``study --preset speedrun``): the steps, training wall time and training FLOPs each arm needs
until its smoothed FD first falls to a threshold, over seeds, and the speed-up over the official DiT recipe.

The definitions (fixed before any result; ``tests/test_study_speedrun.py`` checks them against a hand computation):

* **smoothing**: the trailing moving average of the last ``smooth`` evaluations of a run (fewer at its start);
* **threshold**: ``reference`` = the largest final smoothed FD over the official arm's seeds (so every one of its
  seeds reaches it, at its end at the latest), or a stated number;
* **reached**: at the first evaluation i whose smoothed FD is <= the threshold; between evaluation i - 1 and i the
  position is interpolated linearly in the smoothed FD, and the step, the wall time and the FLOPs are read at that
  position (each linear between the two evaluations). A run that never gets there has not reached it;
* **per arm**: mean and 95% interval (mean +- t_{0.975, n-1} s / sqrt(n)) over the seeds that reached it;
* **speed-up** of an arm over the official arm, per axis: the ratio of geometric means T_official / T_arm, with the
  95% Welch interval of the difference of mean logs, exp(d +- t_{0.975, nu} sqrt(s_o^2 / n_o + s_a^2 / n_a))
  (nu: Welch-Satterthwaite). Only when every seed of both arms reached the threshold; otherwise n/a;
* **plateau**: on the official arm's mean smoothed FD curve over seeds, the last ``plateau_share`` of its
  evaluations (at least two) improve it by (f_first - f_last) / f_first; it has stopped falling when that is below
  ``plateau_tol``;
* **time axes**: the wall time of an evaluation is its step times the arm's median training step time, measured
  by the study side by side for every arm in one process (alternating blocks, the study's model, data, batch and
  threads; ``step_time.json``). A study's runs train over hours, in several sittings, beside other work or on
  other machines; their own clocks (``train_s``, the loop's time without evaluations, kept in results.csv) would
  compare those conditions as much as the arms. The official arm is trained by our trainer with the official
  recipe (the same math), and its step time is the official code's own (``study --peer-dit PATH``, a
  facebookresearch/DiT checkout, timed beside ours). Without a checkout the official arm keeps our step's time and
  the report says so; without ``step_time.json`` every arm keeps its ``train_s`` and the report says so;
* **FLOPs**: 3 x forward FLOPs x batch per step (the convention of ``diffcurr_fast.tdc.accounting``), cumulative.

``python -m diffcurr_fast.study.speedrun STUDY_DIR PEER_DIT_PATH|- [THREADS]`` measures the step times (a study
worker runs it first).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from diffcurr_fast._files import write_json
from diffcurr_fast._lazy import pyplot
from diffcurr_fast.study.spec import arm_config

STEP_TIME_FILE = "step_time.json"
OFFICIAL_CODE = "official code"  # step_time.json's name for the facebookresearch/DiT step
AXES = ("step", "wall_s", "train_flops")


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
    """(mean, lo, hi): mean +- t_{(1 + level) / 2, n - 1} s / sqrt(n) (NaN interval for fewer than two)."""
    # optional dependency (scipy, a dev extra): imported when a statistic is computed
    from scipy import stats

    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return math.nan, math.nan, math.nan
    m = float(a.mean())
    if a.size < 2:
        return m, math.nan, math.nan
    half = float(stats.t.ppf(0.5 + level / 2, a.size - 1)) * float(a.std(ddof=1)) / math.sqrt(a.size)
    return m, m - half, m + half


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


def _f(v: float | None, digits: int = 3) -> str:
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}g}"


def markdown(spec: Any, res: dict[str, Any], eff: list[dict[str, Any]] | None = None) -> list[str]:
    """The report's time-to-quality section; ``eff``: the steps over uniform t (``efficiency``)."""
    sr, st, pl = spec.speedrun, res["step_time"], res["plateau"]
    lines = ["## Time to quality", ""]
    lines.append(
        f"Threshold FD {_f(res['threshold'], 4)} ({res['threshold_rule']}); reached when the trailing "
        f"{res['smooth']}-evaluation moving average of FD first falls to it, interpolated linearly between "
        "evaluations. Mean and 95% t interval over the seeds that reached it; speed-up = ratio of geometric "
        "means over the official arm with a 95% Welch interval on the logs (only when every seed of both "
        "arms reached it). FLOPs: 3 x forward x batch per step."
    )
    lines.append("")
    timed = sorted((st or {}).get("arms", {}))
    if timed:
        lines.append(
            f"Wall time: steps x each arm's median training step, measured side by side in one process "
            f"({st['steps_each']} steps per arm in alternating blocks, {st.get('threads')} CPU threads; "
            "`step_time.json`), so that runs trained at different times, under different loads or on different "
            "machines compare; the wall time each run recorded (`train_s`, evaluations excluded) is in results.csv. "
            "Step times: " + ", ".join(f"{n} {1e3 * st['arms'][n]:.2f} ms" for n in timed) + "."
        )
    else:
        lines.append(
            "Wall time: each run's own recorded training time (`train_s`, evaluations excluded); **no side-by-side "
            "step times were measured, so runs trained under different loads compare only roughly.**"
        )
    lines.append("")
    if st and st.get("official_s"):
        lines.append(
            f"Official arm `{res['official_arm']}`: its time axis is its steps x the official DiT step "
            f"({1e3 * st['official_s']:.2f} ms median; facebookresearch/DiT checkout "
            f"`{st.get('checkout', '?')}` at commit {st.get('commit') or 'unknown'}), measured in this study "
            f"on the same model, data and batch with {st.get('threads')} CPU threads; our "
            f"step at the same recipe measured beside it: {1e3 * st['ours_s']:.2f} ms "
            f"(official / ours = {st['official_s'] / st['ours_s']:.3f})."
        )
    else:
        lines.append(
            f"**Flag: the official step time was not measured (no `--peer-dit`): the official arm "
            f"`{res['official_arm']}` uses our step's time, so its wall-time speed-ups omit the step-speed "
            "difference.**"
        )
    lines.append("")
    lines.append(plateau_line(sr, pl))
    lines += ["", *table(res), "", *decomposition(spec, res)]
    if eff:
        lines += efficiency_section(eff)
    lines += targets_section(res, eff)
    lines += ["", "![FD vs wall time](fd_vs_wall.png)", "", "![FD vs steps](fd_vs_step.png)", ""]
    return lines


def plateau_line(sr: dict[str, Any], pl: dict[str, Any]) -> str:
    k = pl.get("evaluations")
    verdict = "stopped falling" if pl["plateaued"] else "**still falling: the budget is too short for the rule**"
    return (
        f"Plateau rule (the official arm's mean smoothed FD over its last {sr['plateau_share']:.0%} of "
        f"evaluations, {k} evaluations from step {pl['from_step']} to {pl['to_step']}, must improve by "
        f"< {sr['plateau_tol']:.0%}): improved {_f(100 * pl['improvement'], 3)}%: {verdict}."
    )


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


def official_runs_section(
    spec: Any, res: dict[str, Any], source: str, eff: list[dict[str, Any]] | None = None
) -> list[str]:
    """The report's section for ``with_official_runs``; ``eff``: the steps over uniform t at its threshold."""
    seeds = res["arms"][res["official_arm"]]["seeds"]
    last = res["official_curve"][-1][0] if res["official_curve"] else "n/a"
    lines = [
        f"## Against the official recipe run longer (`{source}`)",
        "",
        f"The official arm's runs here are those of `{source}` (seeds {seeds}, {last} steps); every other arm "
        f"keeps its runs above. Threshold FD {_f(res['threshold'], 4)} ({res['threshold_rule']}).",
        "",
        plateau_line(spec.speedrun, res["plateau"]),
        "",
        *table(res),
        "",
        *decomposition(spec, res),
    ]
    for r in eff or []:
        lines += [f"Steps over uniform t at FD {_f(r['threshold'], 4)} (this threshold):", "", *table(r, ("step",)), ""]
    return lines + targets_section(res, eff)


def decomposition(spec: Any, res: dict[str, Any]) -> list[str]:
    """The best arm's wall-time speed-up over the official recipe as three factors that multiply to it (ratios of
    geometric means over seeds): the time per step (the official arm's over the arm's), the recipe (uniform t on the
    base recipe, ``UNIFORM_ARM``, over the official recipe, in steps) and the timestep strategy (the arm over
    ``UNIFORM_ARM``, in steps). [] when an arm or a speed-up is missing."""
    best = _best(res, "wall_s", (res["reference"],))
    uniform = res["arms"].get(UNIFORM_ARM, {}).get("speedup", {}).get("step")
    if best is None or uniform is None or res["reference"] != res["official_arm"]:
        return []
    name, (wall, _, _) = best
    steps = res["arms"][name]["speedup"]["step"][0]
    official = next(a for a in spec.arms if a.name == res["official_arm"])
    sets = ", ".join(f"`{s}`" for s in official.set) or "nothing"
    return [
        f"Where `{name}`'s x{_f(wall)} comes from (ratios of geometric means; they multiply to it): the time per "
        f"step x{_f(wall / steps)} (the official arm's over `{name}`'s), the recipe x{_f(uniform[0])} "
        f"(`{UNIFORM_ARM}`, uniform t on the base recipe, over the official recipe, in steps; the official arm "
        f"sets {sets}) and the timestep strategy x{_f(steps / uniform[0])} (`{name}` over `{UNIFORM_ARM}`, in "
        "steps).",
        "",
    ]


def _ratio(v: tuple[float, float, float] | None, ref: bool) -> str:
    return ("-" if ref else "n/a") if v is None else f"x{_f(v[0])} [{_f(v[1])}, {_f(v[2])}]"


def table(res: dict[str, Any], axes: tuple[str, ...] = AXES) -> list[str]:
    """Per arm: seeds that reached the threshold, each axis's mean [95% CI] and the speed-ups over the reference."""
    head = {"step": "steps", "wall_s": "wall s", "train_flops": "FLOPs"}
    lines = [
        "| arm | reached | "
        + " | ".join(f"{head[ax]} (95% CI)" for ax in axes)
        + " | "
        + " | ".join(f"speed-up {head[ax]}" for ax in axes)
        + " |",
        "|---|---|" + "---|" * (2 * len(axes)),
    ]
    for name, a in res["arms"].items():
        cells = [f"{_f(m)} [{_f(lo)}, {_f(hi)}]" for m, lo, hi in (a["axes"][ax] for ax in axes)]
        ups = [_ratio(a["speedup"][ax], name == res["reference"]) for ax in axes]
        lines.append(f"| {name} | {len(a['reached'])}/{len(a['seeds'])} | " + " | ".join(cells + ups) + " |")
    return lines


# ---- the timestep strategy alone and the targets -----------------------------------------------------------
UNIFORM_ARM = "vanilla"  # uniform t on our step: the baseline of sample efficiency
STEP_TARGET, WALL_TARGET, WALL_TARGET_LO = 1.3, 2.0, 1.5  # the targets the report checks (targets_section)


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


def efficiency_section(eff: list[dict[str, Any]]) -> list[str]:
    lines = [
        "### Sample efficiency: steps over uniform t",
        "",
        f"The steps each arm needs against arm `{UNIFORM_ARM}` (uniform t, no weighting, our step), so step speed "
        "drops out; arms with another step (`*_plain`, the official recipe) compare in steps too. Two thresholds: "
        f"the one above, and `{UNIFORM_ARM}`'s own worst final smoothed FD (the quality uniform t ends at).",
        "",
    ]
    for res in eff:
        lines += [f"At FD {_f(res['threshold'], 4)} ({res['threshold_rule']}):", "", *table(res, ("step",)), ""]
    return lines


def _best(res: dict[str, Any], axis: str, skip: tuple[str, ...]) -> tuple[str, tuple[float, float, float]] | None:
    ups = [(n, a["speedup"][axis]) for n, a in res["arms"].items() if n not in skip and a["speedup"][axis]]
    return max(ups, key=lambda t: t[1][0]) if ups else None


def targets_section(res: dict[str, Any], eff: list[dict[str, Any]] | None) -> list[str]:
    """The issue's two targets, met or not, from the numbers above."""
    lines = ["### Targets", ""]
    best = _best(res, "wall_s", (res["reference"],))
    if best is None:
        lines.append(
            "- Wall time to the threshold at least 2x faster than the official recipe: **n/a** (no arm has a speed-up)."
        )
    else:
        (name, (up, lo, _)), met = best, best[1][0] >= WALL_TARGET and best[1][1] > WALL_TARGET_LO
        lines.append(
            f"- Best recipe `{name}` reaches the threshold in 1/{_f(up)} of the official recipe's wall time, 95% "
            f"interval lower end x{_f(lo)} (target: x{WALL_TARGET:g} with the interval above x{WALL_TARGET_LO:g}): "
            f"**{'met' if met else 'not met'}** on this dataset."
        )
    for r in eff or []:
        b = _best(r, "step", (r["reference"], r["official_arm"]))
        if b is None:
            lines.append(f"- At FD {_f(r['threshold'], 4)}: no arm has a steps speed-up over `{UNIFORM_ARM}`.")
            continue
        name, (up, lo, _) = b
        verdict = "not met"
        if up >= STEP_TARGET:  # a mean that meets it, with an interval that includes no gain, is not a finding
            verdict = "met" if lo > 1 else "met on the mean only: the 95% interval includes no gain"
        lines.append(
            f"- At FD {_f(r['threshold'], 4)}, the fewest steps: `{name}`, x{_f(up)} fewer than `{UNIFORM_ARM}` "
            f"(95% interval lower end x{_f(lo)}; target x{STEP_TARGET:g}): **{verdict}**."
        )
    return lines + [""]


def plot(spec: Any, rows: list[dict[str, Any]], res: dict[str, Any], study_dir: Path) -> dict[str, Path]:
    """FD against wall time and against steps: per arm the mean over seeds with a +- std band, the threshold."""
    plt = pyplot()
    out = {}
    for axis, fname, label in (
        ("wall_s", "fd_vs_wall.png", "training wall time (s)"),
        ("step", "fd_vs_step.png", "training step"),
    ):
        fig, ax = plt.subplots(figsize=(8, 5))
        for i, arm in enumerate(spec.arms):
            runs = [
                run_points(rows, arm.name, s, arm_step_s(res["step_time"], arm.name, res["official_arm"]))
                for s in spec.seeds
            ]
            runs = [r for r in runs if r]
            if not runs:
                continue
            n = min(len(r) for r in runs)
            x = np.mean([[p[axis] for p in r[:n]] for r in runs], axis=0)
            f = np.asarray([[p["fd"] for p in r[:n]] for r in runs])
            mu, sd = f.mean(0), f.std(0, ddof=1) if len(runs) > 1 else np.zeros(n)
            color = plt.get_cmap("tab20")((2 * i) % 20 + (2 * i // 20) % 2)
            ax.plot(x, mu, color=color, lw=1.2, marker=".", label=arm.name)
            ax.fill_between(x, mu - sd, mu + sd, color=color, alpha=0.15)
        if math.isfinite(res["threshold"]):
            ax.axhline(res["threshold"], color="k", ls="--", lw=0.8, label="threshold")
        ax.set_xlabel(label + (" (mean over seeds)" if axis == "wall_s" else ""))
        ax.set_ylabel("FD")
        ax.set_yscale("log")
        ax.set_title(f"{spec.name}: FD of the EMA weights (mean +- std over seeds)")
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(study_dir / fname, dpi=120)
        plt.close(fig)
        out[axis] = study_dir / fname
    return out


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


# ---- the step times ---------------------------------------------------------------------------------------------
def _time_steps(step: Any, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        out.append(time.perf_counter() - t0)
    return out


def measure_step_times(
    cfgs: dict[str, Any],
    peer_dit: str | Path | None,
    official_arm: str,
    *,
    rounds: int = 3,
    reps: int = 20,
    warmup: int = 5,
) -> dict[str, Any]:
    """Median step time of our trainer at every arm's config ``cfgs`` (arm name -> config) and, with ``peer_dit``,
    of the official DiT step (that checkout) at ``cfgs[official_arm]``'s model, batch and threads, on the training
    data, measured side by side in one process in alternating blocks of ``reps`` steps (after ``warmup`` steps per
    block). Measured together, the arms' times compare whatever the load and the machine were when each run
    trained."""
    # imported here, not at the top: study.presets imports this module, and --help stays free of torch
    import torch

    from diffcurr_fast.train.loop import Trainer

    ref = cfgs[official_arm]
    if ref.engine.cpu_threads:
        torch.set_num_threads(ref.engine.cpu_threads)
    steps: dict[str, Any] = {}
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        batches = None
        for name, cfg in cfgs.items():
            cfg.checkpoint.run_dir = str(Path(tmp) / name)
            tr = Trainer(cfg)
            batches = batches or [next(tr.loader) for _ in range(4)]
            steps[name] = tr.train_step
        if peer_dit is not None:
            from diffcurr_fast.study.peer_dit import official_step

            m = ref.model
            dims = {
                "patch_size": m.patch_size,
                "hidden_size": m.hidden_size,
                "depth": m.depth,
                "num_heads": m.num_heads,
                "mlp_ratio": m.mlp_ratio,
                "class_dropout_prob": m.class_dropout_prob,
            }
            steps[OFFICIAL_CODE], info = official_step(
                peer_dit,
                preset=m.preset,
                input_size=m.input_size,
                in_channels=m.in_channels,
                num_classes=m.num_classes,
                seed=ref.engine.seed,
                dims=dims if m.preset == "custom" else None,
                ema_decay=ref.optim.ema_decay,
            )
        state = {"i": 0}

        def block(fn: Any, n: int) -> list[float]:
            def one() -> None:
                x, y = batches[state["i"] % 4]
                state["i"] += 1
                fn(x, y)

            return _time_steps(one, n)

        times: dict[str, list[float]] = {name: [] for name in steps}
        for _ in range(rounds):
            for name, fn in steps.items():
                block(fn, warmup)
                times[name] += block(fn, reps)
    med = {n: float(np.median(t)) for n, t in times.items()}
    res: dict[str, Any] = {
        "arms": {n: v for n, v in med.items() if n != OFFICIAL_CODE},
        "arms_p20_p80": {n: [float(np.percentile(t, q)) for q in (20, 80)] for n, t in times.items()},
        "ours_s": med[official_arm],
        "steps_each": rounds * reps,
        "batch": ref.data.batch_size,
        "threads": torch.get_num_threads(),
    }
    if peer_dit is not None:
        res |= {
            "official_s": med[OFFICIAL_CODE],
            "checkout": Path(peer_dit).resolve().name,
            "commit": _git_commit(peer_dit),
            "timm_stubbed": bool(info["timm_stubbed"]),
        }
    return res


def _git_commit(path: str | Path) -> str:
    """The checked-out commit of a git checkout ('' when it is not one); the report names the peer by it."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def main(argv: list[str] | None = None) -> int:
    """The worker: ``python -m diffcurr_fast.study.speedrun STUDY_DIR PEER_DIT_PATH|- [THREADS]``."""
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.study.runner import load_study

    argv = sys.argv[1:] if argv is None else argv
    study_dir, peer = Path(argv[0]), (None if argv[1] == "-" else argv[1])
    threads = int(argv[2]) if len(argv) > 2 else 0
    spec = load_study(study_dir)
    seed = spec.seeds[0]
    cfgs = {
        a.name: arm_config(spec, a, seed, study_dir / "steptime-run" / a.name, threads)
        for a in spec.arms
        if a.kind == "train"
    }
    res = measure_step_times(cfgs, peer, spec.speedrun["official_arm"])
    write_json(res, study_dir / STEP_TIME_FILE, indent=1)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
