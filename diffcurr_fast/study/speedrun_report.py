"""The time-to-quality section of a speedrun study's ``report.md`` and its two plots (``fd_vs_wall.png``,
``fd_vs_step.png``), from the analysis of ``diffcurr_fast.study.speedrun`` (where the definitions are). The section
states the measured ratios; whether they meet a goal is a reading of them (docs/results/README.md).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from diffcurr_fast._lazy import pyplot
from diffcurr_fast.study.speedrun import AXES, UNIFORM_ARM, arm_step_s, run_points


def _num(v: float | None, digits: int = 3) -> str:
    """``v`` to ``digits`` significant digits; n/a for None and non-finite values."""
    return "n/a" if v is None or (isinstance(v, float) and not math.isfinite(v)) else f"{v:.{digits}g}"


def markdown(spec: Any, res: dict[str, Any], eff: list[dict[str, Any]] | None = None) -> list[str]:
    """The report's time-to-quality section; ``eff``: the steps over uniform t (``efficiency``)."""
    sr, st, pl = spec.speedrun, res["step_time"], res["plateau"]
    lines = ["## Time to quality", ""]
    lines.append(
        f"Threshold FD {_num(res['threshold'], 4)} ({res['threshold_rule']}); reached when the trailing "
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
    lines += ["", "![FD vs wall time](fd_vs_wall.png)", "", "![FD vs steps](fd_vs_step.png)", ""]
    return lines


def plateau_line(sr: dict[str, Any], pl: dict[str, Any]) -> str:
    k = pl.get("evaluations")
    verdict = "stopped falling" if pl["plateaued"] else "**still falling: the budget is too short for the rule**"
    return (
        f"Plateau rule (the official arm's mean smoothed FD over its last {sr['plateau_share']:.0%} of "
        f"evaluations, {k} evaluations from step {pl['from_step']} to {pl['to_step']}, must improve by "
        f"< {sr['plateau_tol']:.0%}): improved {_num(100 * pl['improvement'], 3)}%: {verdict}."
    )


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
        f"keeps its runs above. Threshold FD {_num(res['threshold'], 4)} ({res['threshold_rule']}).",
        "",
        plateau_line(spec.speedrun, res["plateau"]),
        "",
        *table(res),
        "",
        *decomposition(spec, res),
    ]
    for r in eff or []:
        lines += [
            f"Steps over uniform t at FD {_num(r['threshold'], 4)} (this threshold):",
            "",
            *table(r, ("step",)),
            "",
        ]
    return lines


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
        f"Where `{name}`'s x{_num(wall)} comes from (ratios of geometric means; they multiply to it): the time per "
        f"step x{_num(wall / steps)} (the official arm's over `{name}`'s), the recipe x{_num(uniform[0])} "
        f"(`{UNIFORM_ARM}`, uniform t on the base recipe, over the official recipe, in steps; the official arm "
        f"sets {sets}) and the timestep strategy x{_num(steps / uniform[0])} (`{name}` over `{UNIFORM_ARM}`, in "
        "steps).",
        "",
    ]


def references_section(refs: dict[str, Any], title: str = "Against each reference") -> list[str]:
    """A speedrun's speed-ups over each reference arm (``speedrun.against``), each at its own threshold, and the
    headline: the best arm's wall-time speed-up over the strongest reference (the lowest mean final smoothed FD)."""
    names, strong = list(refs["analyses"]), refs["strongest"]
    finals = ", ".join(f"`{n}` {_num(refs['finals'][n], 4)}" for n in names)
    lines = [
        f"## {title}",
        "",
        f"Mean final smoothed FD of the references: {finals}. The strongest is `{strong}`; the headline divides by it.",
        "",
    ]
    res = refs["analyses"][strong]
    best = _best(res, "wall_s", tuple(names))
    if best is None:
        lines += [
            f"**Headline:** no arm has a wall-time speed-up over `{strong}` (some seed never reached its "
            f"threshold FD {_num(res['threshold'], 4)}).",
            "",
        ]
    else:
        name, (up, lo, hi) = best
        first = res["arms"][name].get("at_first")
        lines += [
            f"**Headline:** `{name}` reaches `{strong}`'s threshold FD {_num(res['threshold'], 4)} "
            f"({res['threshold_rule']}) in {'at most ' if first else ''}1/{_num(up)} of its wall time, 95% interval "
            f"[x{_num(lo)}, x{_num(hi)}], tuning excluded"
            + (f" (a bound: {len(first)} of its seeds were there at their first evaluation)." if first else "."),
            "",
        ]
    for n in names:
        r = refs["analyses"][n]
        lines += [
            f"Over `{n}`, at its threshold FD {_num(r['threshold'], 4)} ({r['threshold_rule']}):",
            "",
            *table(r),
            "",
        ]
    return lines


def _ratio(v: tuple[float, float, float] | None, ref: bool, bound: bool = False) -> str:
    """A speed-up cell: x ratio [95% interval], >= before it when it is a lower bound (``bound``), - or n/a."""
    if v is None:
        return "-" if ref else "n/a"
    return f"{'>= ' if bound else ''}x{_num(v[0])} [{_num(v[1])}, {_num(v[2])}]"


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
    firsts = []
    for name, a in res["arms"].items():
        first = a.get("at_first", [])
        cells = [f"{_num(m)} [{_num(lo)}, {_num(hi)}]" for m, lo, hi in (a["axes"][ax] for ax in axes)]
        ups = [_ratio(a["speedup"][ax], name == res["reference"], bool(first)) for ax in axes]
        at = f" ({len(first)} at the first evaluation)" if first else ""
        reached = f"{len(a['reached'])}/{len(a['seeds'])}{at}"
        lines.append(f"| {name} | {reached} | " + " | ".join(cells + ups) + " |")
        firsts += [name] if first else []
    if firsts:
        lines += [
            "",
            ">=: " + ", ".join(f"`{n}`" for n in firsts) + " reached the threshold at the first evaluation on the "
            "seeds counted in its row: got there at or before that step, so its time there is an upper bound and its "
            "speed-up (the interval too) a lower bound.",
        ]
    return lines


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
        lines += [f"At FD {_num(res['threshold'], 4)} ({res['threshold_rule']}):", "", *table(res, ("step",)), ""]
    return lines


def _reading(v: dict[str, Any] | None) -> str:
    """A speed-up of ``both_readings``: x ratio [95% interval], a bound (> x ratio), or n/a."""
    if v is None:
        return "n/a"
    return f"> x{_num(v['value'])}" if v["bound"] else f"x{_num(v['value'])} [{_num(v['lo'])}, {_num(v['hi'])}]"


def readings_section(res: dict[str, Any], source: str, factor: int, title: str) -> list[str]:
    """Both readings of every arm's speed-up over the reference (``speedrun.both_readings``), with the long
    reference of ``source`` (its folder), trained ``factor`` x the budget."""
    ref, pl = res["reference"], res["long_plateau"]
    verdict = "stopped falling" if pl["plateaued"] else "still falling"
    lines = [
        f"## {title}",
        "",
        f"- **The existing reading** (the same budget): each arm's time to `{ref}`'s final FD (threshold FD "
        f"{_num(res['threshold'], 4)}, {res['threshold_rule']}) against `{ref}`'s time to it.",
        f"- **The field's reading** (as REPA, TREAD and SiT state theirs): each arm's own final FD (its worst final "
        f"smoothed FD over its seeds, which each of its seeds reaches by its end), the time `{ref}` trained {factor}x "
        f"longer needs to reach it, over the arm's own time to it. The long reference: `{source}` (seeds "
        f"{res['long_seeds']}, {res['long_steps']} steps; the study's pick, its schedule and EMA over its own length). "
        "Where a seed of it never reaches that FD, its run's end counts as its time and the reading is a lower bound "
        "(> x); so is a reading of an arm that reached the FD at its first evaluation on some seed (its time there is "
        "an upper bound).",
        "",
        "Ratios of geometric means over seeds with 95% Welch intervals on the logs; tuning included: each seed's time "
        f"plus its arm's tuning wall time (`{ref}`'s for the long reference), priced as in the Tuning section (whose "
        "point estimate is a ratio of mean times, so it can differ a little from this one). The "
        f"long reference's mean smoothed FD over its last {pl.get('evaluations')} evaluations (from step "
        f"{pl['from_step']} to {pl['to_step']}) improved {_num(100 * pl['improvement'], 3)}%: {verdict} by the plateau "
        "rule.",
        "",
        "| arm | its final FD | its steps to it | the long reference's steps to it (reached) | field's reading: steps "
        "| wall, tuning excluded | wall, tuning included | existing reading: wall, tuning excluded | tuning included |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, a in res["arms"].items():
        m, lo, hi = a["axes"]["step"]
        lm, llo, lhi = a["long_axes"]["step"]
        f, e = a["field"], a["existing"]
        reached, seeds = a["existing_reached"]
        missing = "-" if name == ref else f"{reached}/{seeds} seeds reach it"
        lines.append(
            f"| {name} | {_num(a['threshold'], 4)} | {_num(m)} [{_num(lo)}, {_num(hi)}] | {_num(lm)} [{_num(llo)}, "
            f"{_num(lhi)}] ({len(a['long_reached'])}/{len(res['long_seeds'])}) | {_reading(f['step'])} | "
            f"{_reading(f['wall_s'])} | {_reading(f['wall_tuned'])} | "
            + (f"{_reading(e['wall_s'])} | {_reading(e['wall_tuned'])} |" if e else f"{missing} | {missing} |")
        )
    return [*lines, ""]


def _best(res: dict[str, Any], axis: str, skip: tuple[str, ...]) -> tuple[str, tuple[float, float, float]] | None:
    ups = [(n, a["speedup"][axis]) for n, a in res["arms"].items() if n not in skip and a["speedup"][axis]]
    return max(ups, key=lambda t: t[1][0]) if ups else None


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
