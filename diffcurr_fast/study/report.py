"""The study's results: results.csv, report.md with error bars and paired comparisons, and the plots.

* ``results.csv``: one row per evaluation: arm, seed, step, every metric (fd, is, is_std, precision, recall and,
  when the runs recorded it, the conditional accuracy ``cond_acc``), the cumulative training wall time (``train_s``,
  evaluations excluded; our step's) and training FLOPs (3 x forward FLOPs x batch x step; known once the run
  finished).
* a spec with ``speedrun``: the time-to-quality section of ``report.md``, ``speedrun.json``, ``fd_vs_wall.png`` and
  ``fd_vs_step.png`` (the analysis: ``diffcurr_fast.study.speedrun``; its section and plots:
  ``diffcurr_fast.study.speedrun_report``).
* ``report.md``: per arm the final metrics as mean +- std over seeds (sample std, n - 1) and the per-seed values;
  for the spec's metric, the paired difference arm - reference over the seeds both finished, with a 95%
  confidence interval from the paired t distribution (mean +- t_{0.975, n-1} s_d / sqrt(n)) and how many seeds
  improved; training FLOPs and wall time per arm (a tdc arm also its sampling FLOPs per image); with the conditional
  accuracy, its paired difference against the reference arm the same way, naming every arm whose interval lies below
  0 (``accuracy_section``).
* ``metric_vs_step.png`` (mean +- std band over seeds per arm), ``curriculum_timelines.png`` (unlocked clusters
  against step, one panel per curriculum arm, one line per seed), ``cluster_loss.png`` (final training loss per
  timestep cluster, mean over seeds, per arm), and ``samples/<arm>.png`` (an end-of-run grid per arm).
"""

from __future__ import annotations

import csv
import json
import math
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from diffcurr_fast._files import read_json
from diffcurr_fast._lazy import pyplot
from diffcurr_fast.runs.sampling import grid_unavailable
from diffcurr_fast.study import speedrun, speedrun_report
from diffcurr_fast.study.long_reference import folder_of, prepare
from diffcurr_fast.study.posthoc import posthoc_finals, posthoc_picks, posthoc_rows
from diffcurr_fast.study.runner import eval_records, read_status, run_dir_of
from diffcurr_fast.study.spec import METRICS, SPEC_FILE, StudySpec, arm_config, load_study
from diffcurr_fast.study.step_time import STEP_TIME_FILE
from diffcurr_fast.study.tuning import decide, trial_seeds
from diffcurr_fast.train.report import read_metrics

METRIC_COLUMNS = ("fd", "is", "is_std", "precision", "recall")
ACCURACY = "cond_acc"  # a column only when some run recorded it: studies made before it report as they did
CLOCK_COLUMNS = ("train_s", "train_flops")


@dataclass
class Paired:
    """Paired comparison of an arm with its reference over common seeds (differences arm - reference)."""

    n: int
    mean: float
    std: float
    ci_lo: float
    ci_hi: float
    improved: int


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1; 0 for one value; NaN for none)."""
    a = np.asarray(values, dtype=np.float64)
    if a.size == 0:
        return math.nan, math.nan
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def paired_t(diffs: list[float], lower_is_better: bool = True, level: float = 0.95) -> Paired:
    """Mean of the paired differences with its ``level`` t confidence interval; improved = seeds where the arm
    is better (difference < 0 for a lower-is-better metric)."""
    # optional dependency (scipy, a dev extra): imported when a statistic is computed
    from scipy import stats

    d = np.asarray(diffs, dtype=np.float64)
    n = int(d.size)
    if n == 0:
        return Paired(0, math.nan, math.nan, math.nan, math.nan, 0)
    mean, std = mean_std(list(d))
    half = float(stats.t.ppf(0.5 + level / 2, n - 1)) * std / math.sqrt(n) if n > 1 else math.nan
    improved = int((d < 0).sum() if lower_is_better else (d > 0).sum())
    return Paired(n, mean, std, mean - half, mean + half, improved)


def collect(study_dir: str | Path) -> tuple[StudySpec, list[dict[str, Any]], dict[tuple[str, int], dict]]:
    """(spec, evaluation rows, status of every finished run) of the study in ``study_dir``. A tdc run's rows are
    its stage-1 evaluations plus the bundle's at its total step count."""
    study_dir = Path(study_dir)
    spec = load_study(study_dir)
    rows, status = [], {}
    for arm in spec.arms:
        for seed in spec.seeds:
            rd = run_dir_of(study_dir, arm.name, seed)
            recs = eval_records(rd / ("stage1/metrics.jsonl" if arm.kind == "tdc" else "metrics.jsonl"))
            st = read_status(study_dir, arm.name, seed)
            if not recs and st is not None:  # the run folder is gone (not committed, another machine): its status
                recs = st.get("evals", [])
            if st is not None:
                status[(arm.name, seed)] = st
                if arm.kind == "tdc":
                    recs = [r for r in recs if r["step"] < st["steps"]] + [st["final"]]
            per_step = st["train_flops"] / st["steps"] if st and arm.kind == "train" and st["steps"] else None
            for r in recs:
                flops = per_step * int(r["step"]) if per_step is not None else None
                rows.append(
                    {
                        "arm": arm.name,
                        "seed": seed,
                        "step": int(r["step"]),
                        **{k: r.get(k) for k in (*METRIC_COLUMNS, ACCURACY)},
                        "train_s": r.get("train_s"),
                        "train_flops": flops,
                    }
                )
    return spec, rows, status


def write_csv(rows: list[dict[str, Any]], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        acc = [ACCURACY] if any(r.get(ACCURACY) is not None for r in rows) else []
        w = csv.DictWriter(f, fieldnames=["arm", "seed", "step", *METRIC_COLUMNS, *acc, *CLOCK_COLUMNS])
        w.writeheader()
        for r in rows:
            w.writerow(
                {
                    k: ("" if v is None else (f"{v:.6g}" if isinstance(v, float) else v))
                    for k, v in r.items()
                    if k in w.fieldnames
                }
            )
    return path


def _fmt(v: float, digits: int = 4) -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.{digits}g}"


def summarize(spec: StudySpec, status: dict[tuple[str, int], dict]) -> dict[str, Any]:
    """Per arm: final metrics per seed, mean/std, compute and wall time; paired comparisons with the reference."""
    arms: dict[str, Any] = {}
    for arm in spec.arms:
        done = {s: status[(arm.name, s)] for s in spec.seeds if (arm.name, s) in status}
        per_metric = {
            m: {s: st["final"].get(m) for s, st in done.items() if st["final"].get(m) is not None}
            for m in ("fd", "is", "precision", "recall", ACCURACY)
        }
        arms[arm.name] = {
            "kind": arm.kind,
            "seeds": sorted(done),
            "reference": spec.reference_of(arm),
            "final": per_metric,
            "stats": {m: mean_std(list(v.values())) for m, v in per_metric.items()},
            "steps": mean_std([st["steps"] for st in done.values()])[0],
            "train_flops": mean_std([st["train_flops"] for st in done.values()])[0],
            "wall_s": mean_std([st["wall_s"] for st in done.values()]),
            "sampling_flops": next(iter(done.values())).get("sampling_flops_per_image") if done else None,
            "base_sampling_flops": next(iter(done.values())).get("base_sampling_flops_per_image") if done else None,
            "equal_sampling": {s: st["equal_sampling"] for s, st in done.items() if st.get("equal_sampling")},
        }
    lower = METRICS[spec.metric] == "lower"
    for name, a in arms.items():
        ref = arms[a["reference"]]["final"][spec.metric]
        mine = a["final"][spec.metric]
        common = sorted(set(ref) & set(mine))
        a["paired"] = None if name == a["reference"] else paired_t([mine[s] - ref[s] for s in common], lower)
    return arms


def accuracy_difference(mine: dict[int, float], ref: dict[int, float]) -> Paired:
    """The paired difference of two arms' final conditional accuracies ({seed: accuracy}) over their common seeds."""
    common = sorted(set(mine) & set(ref))
    return paired_t([mine[s] - ref[s] for s in common], lower_is_better=False)


def lower_accuracy(mine: dict[int, float], ref: dict[int, float]) -> bool:
    """Whether an arm's conditional accuracy is below the reference's by more than its interval: the 95% paired
    interval of the difference lies below 0 (two common seeds at least)."""
    p = accuracy_difference(mine, ref)
    return p.n > 1 and p.ci_hi < 0


def accuracy_section(spec: StudySpec, finals: dict[str, dict[int, float]], title: str) -> list[str]:
    """The conditional accuracy of each arm's final samples (``finals``: {arm: {seed: accuracy}}) and its paired
    difference against the arm's reference over the seeds both have, with the 95% paired-t interval; every arm whose
    interval lies below 0 is named (it draws the wrong class more often than its reference). [] without accuracies."""
    if not any(finals.values()):
        return []
    lines = [
        f"## {title}",
        "",
        "The share of each arm's final samples that the feature classifier assigns to the class they were generated "
        "for (FD cannot see a recipe that draws good images of the wrong class), and its paired difference arm - "
        "reference over the seeds both finished, with its 95% paired-t interval.",
        "",
        "| arm | reference | accuracy (mean +- std) | n | mean diff | 95% CI (paired t) |",
        "|---|---|---|---|---|---|",
    ]
    lower = []
    for arm in spec.arms:
        mine, ref = finals.get(arm.name, {}), finals.get(spec.reference_of(arm), {})
        if not mine:
            continue
        mean, std = mean_std(list(mine.values()))
        if arm.name == spec.reference_of(arm):
            lines.append(f"| {arm.name} | - | {_fmt(mean)} +- {_fmt(std, 2)} | {len(mine)} | - | - |")
            continue
        p = accuracy_difference(mine, ref)
        lines.append(
            f"| {arm.name} | {spec.reference_of(arm)} | {_fmt(mean)} +- {_fmt(std, 2)} | {p.n} | {_fmt(p.mean)} | "
            f"[{_fmt(p.ci_lo)}, {_fmt(p.ci_hi)}] |"
        )
        if lower_accuracy(mine, ref):
            lower.append(
                f"`{arm.name}` ({_fmt(p.mean)} [{_fmt(p.ci_lo)}, {_fmt(p.ci_hi)}] against `{spec.reference_of(arm)}`)"
            )
    lines.append("")
    lines.append(
        "**Lower conditional accuracy than its reference** (the interval below 0): " + ", ".join(lower) + "."
        if lower
        else "No arm's conditional accuracy is below its reference's by more than its interval."
    )
    return lines


def write_markdown(spec: StudySpec, arms: dict[str, Any], path: Path, study_dir: Path) -> Path:
    m, lower = spec.metric, METRICS[spec.metric] == "lower"
    lines = [f"# Study `{spec.name}`", ""]
    if spec.notes:
        lines += [spec.notes.strip(), ""]
    lines += [
        f"Seeds {spec.seeds}; base recipe {spec.recipe or 'the embedded digits demo'}; evaluation every "
        f"{spec.eval_every} steps with {json.dumps(spec.eval)}; metric `{m}` ({'lower' if lower else 'higher'} "
        "is better). The spec (every arm's overrides) is `study.yaml`; each run is an ordinary run directory "
        "under `runs/<arm>/seed<k>/`.",
        "",
    ]
    acc = any(a["final"][ACCURACY] for a in arms.values())  # a column only for runs that recorded it
    shown = ("fd", "is", "precision", "recall", *[ACCURACY] * acc)
    lines += [
        "## Final metrics (mean +- std over seeds)",
        "",
        "| arm | seeds | steps | FD | IS | precision | recall | " + "cond. accuracy | " * acc + "train FLOPs | "
        "wall s per run |",
        "|---|---|---|---|---|---|---|" + "---|" * acc + "---|---|",
    ]
    for name, a in arms.items():
        cells = [f"{_fmt(a['stats'][k][0])} +- {_fmt(a['stats'][k][1], 2)}" for k in shown]
        lines.append(
            f"| {name} | {len(a['seeds'])} | {_fmt(a['steps'], 6)} | "
            + " | ".join(cells)
            + f" | {_fmt(a['train_flops'], 3)} | {_fmt(a['wall_s'][0], 3)} +- {_fmt(a['wall_s'][1], 2)} |"
        )
    lines += [
        "",
        f"## Paired differences in {m} against the reference arm (arm - reference)",
        "",
        "| arm | reference | n | mean diff | 95% CI (paired t) | seeds improved | train FLOPs vs reference |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, a in arms.items():
        p = a["paired"]
        if p is None:
            continue
        ref = arms[a["reference"]]
        ratio = a["train_flops"] / ref["train_flops"] if ref["seeds"] else math.nan
        lines.append(
            f"| {name} | {a['reference']} | {p.n} | {_fmt(p.mean)} | [{_fmt(p.ci_lo)}, {_fmt(p.ci_hi)}] | "
            f"{p.improved}/{p.n} | x{_fmt(ratio, 3)} |"
        )
    lines += [
        "",
        f"## Per-seed final {m}",
        "",
        "| arm | " + " | ".join(f"seed {s}" for s in spec.seeds) + " |",
        "|---|" + "---|" * len(spec.seeds),
    ]
    for name, a in arms.items():
        vals = a["final"][m]
        lines.append(f"| {name} | " + " | ".join(_fmt(vals.get(s)) for s in spec.seeds) + " |")
    acc_lines = accuracy_section(spec, {n: a["final"][ACCURACY] for n, a in arms.items()}, "Conditional accuracy")
    lines += ["", *acc_lines] if acc_lines else []
    tdc = {n: a for n, a in arms.items() if a["sampling_flops"]}
    if tdc:
        lines += ["", "## Sampling FLOPs per image (TDC bundle vs the base model)", ""]
        for name, a in tdc.items():
            for k, v in a["sampling_flops"].items():
                b = a["base_sampling_flops"][k]
                lines.append(f"- {name}, {k}: {v:.3e} vs {b:.3e} for the base (x{b / v:.3f} fewer)")
        lines += equal_sampling_lines(spec, arms, tdc)
    lines += [
        "",
        "## Plots",
        "",
        "![metric vs step](metric_vs_step.png)",
        "",
        "![curriculum timelines](curriculum_timelines.png)",
        "",
        "![loss per cluster](cluster_loss.png)",
        "",
        sample_line(arms, study_dir / "samples", no_grid_reasons(spec, study_dir)),
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


NO_RUN_DIR = (
    "no finished run directory of theirs was here when the report was written (a report keeps the grids it copied "
    "before)"
)


def sample_line(arms: dict[str, Any], samples: Path, reasons: dict[str, str] | None = None) -> str:
    """Links to the arms' end-of-run grids in ``samples`` (``copy_samples``), naming the arms that have none and why:
    ``reasons`` (``no_grid_reasons``) for arms whose finished runs are here, else that none of them is here."""
    have = [n for n in arms if (samples / f"{n}.png").is_file()]
    line = "End-of-run sample grids (the first seed of each arm that had a run directory here): " + (
        ", ".join(f"[{n}](samples/{n}.png)" for n in have) if have else "none"
    )
    why: dict[str, list[str]] = {}
    for n in arms:
        if n not in have:
            why.setdefault((reasons or {}).get(n, NO_RUN_DIR), []).append(n)
    for reason, names in why.items():
        line += f". No grid for {', '.join(names)}: {reason}"
    return line + "."


def no_grid_reasons(spec: StudySpec, study_dir: Path) -> dict[str, str]:
    """Why an arm whose finished runs are here has no end-of-run grid, by arm: its config draws none
    (``logging.num_samples`` 0, a latent model: ``grid_unavailable``), or its runs wrote none."""
    out = {}
    for arm in spec.arms:
        here = [
            s
            for s in spec.seeds
            if read_status(study_dir, arm.name, s) is not None and run_dir_of(study_dir, arm.name, s).is_dir()
        ]
        if not here:
            continue
        try:
            cfg = arm_config(spec, arm, here[0], run_dir_of(study_dir, arm.name, here[0]))
        except (ValueError, OSError):  # the base recipe is not here (a study folder carried to another machine)
            cfg = None
        if cfg is not None and cfg.logging.num_samples == 0:
            out[arm.name] = (
                "its runs finished without drawing one, since logging.num_samples is 0 (set it, e.g. "
                "logging.num_samples=64, in the spec's set for a grid; the metrics come from the evaluations)"
            )
        elif cfg is not None and grid_unavailable(cfg):
            out[arm.name] = f"its runs finished without drawing one ({grid_unavailable(cfg)})"
        else:
            out[arm.name] = f"its finished runs wrote no samples.png (see logs/{arm.name}-seed{here[0]}.log)"
    return out


def equal_sampling_lines(spec: StudySpec, arms: dict[str, Any], tdc: dict[str, Any]) -> list[str]:
    """The TDC bundles evaluated at the base model's sampling FLOPs (``runner._run_tdc``): FD per seed and the paired
    difference with the reference arm's final FD."""
    lines = []
    for name, a in tdc.items():
        eq = a["equal_sampling"]
        if not eq or spec.metric not in next(iter(eq.values())):
            continue
        first = next(iter(eq.values()))
        ref = arms[a["reference"]]["final"][spec.metric]
        common = sorted(set(ref) & set(eq))
        p = paired_t([eq[s][spec.metric] - ref[s] for s in common], METRICS[spec.metric] == "lower")
        mean, std = mean_std([v[spec.metric] for v in eq.values()])
        budget = first["sampling"]
        lines += [
            "",
            f"At equal sampling FLOPs ({name}: {first['sampling_steps']} {spec.eval.get('sampler', '')} steps, "
            f"{budget['multi_expert_flops_per_image']:.3e} FLOPs per image, within the base model's "
            f"{budget['budget_flops_per_image']:.3e} at {budget['budget_base_steps']} steps): {spec.metric} "
            f"{_fmt(mean)} +- {_fmt(std, 2)}; against {a['reference']}: mean diff {_fmt(p.mean)} "
            f"[{_fmt(p.ci_lo)}, {_fmt(p.ci_hi)}], improved {p.improved}/{p.n}.",
        ]
    return lines


def _color(plt, i: int):
    """Distinct colours for up to 20 arms: the dark tab20 shades first, then the light ones."""
    return plt.get_cmap("tab20")((2 * i) % 20 + (2 * i // 20) % 2)


def plot_metric(spec: StudySpec, rows: list[dict[str, Any]], path: Path) -> Path:
    """Mean over seeds of the spec's metric against step, with a +- std band, one line per arm."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, arm in enumerate(spec.arms):
        by_step: dict[int, list[float]] = {}
        for r in rows:
            if r["arm"] == arm.name and r.get(spec.metric) is not None:
                by_step.setdefault(r["step"], []).append(r[spec.metric])
        if not by_step:
            continue
        steps = sorted(by_step)
        mu = np.array([np.mean(by_step[s]) for s in steps])
        sd = np.array([np.std(by_step[s], ddof=1) if len(by_step[s]) > 1 else 0.0 for s in steps])
        color = _color(plt, i)
        ax.plot(steps, mu, color=color, lw=1.2, marker=".", label=arm.name)
        ax.fill_between(steps, mu - sd, mu + sd, color=color, alpha=0.15)
    ax.set_xlabel("training step")
    ax.set_ylabel(spec.metric)
    if spec.metric == "fd":
        ax.set_yscale("log")
    ax.set_title(f"{spec.name}: {spec.metric} of the EMA weights (mean +- std over seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _train_records(study_dir: Path, arm: Any, seed: int) -> list[dict[str, Any]]:
    rd = run_dir_of(study_dir, arm.name, seed)
    p = rd / ("stage1/metrics.jsonl" if arm.kind == "tdc" else "metrics.jsonl")
    if not p.is_file():
        return []
    by_step = {}
    for r in read_metrics(p):
        if "loss" in r:
            by_step[r["step"]] = r
    return [by_step[s] for s in sorted(by_step)]


def plot_timelines(spec: StudySpec, study_dir: Path, path: Path) -> Path:
    """Unlocked clusters against step, one panel per arm, one line per seed."""
    plt = pyplot()
    n = len(spec.arms)
    cols = min(4, n)
    rows_ = math.ceil(n / cols)
    fig, axes = plt.subplots(rows_, cols, figsize=(3.2 * cols, 2.4 * rows_), squeeze=False)
    for ax, arm in zip(axes.flat, spec.arms):
        top = 1
        for seed in spec.seeds:
            recs = _train_records(study_dir, arm, seed)
            if recs:  # the number unlocked at each logged step
                ax.step([r["step"] for r in recs], [r["unlocked"] for r in recs], where="post", lw=0.9, alpha=0.8)
                top = max(top, max(r["unlocked"] for r in recs))
        ax.set_title(arm.name, fontsize=8)
        ax.set_xscale("symlog", linthresh=100)
        ax.set_xlim(left=0)
        ax.set_ylim(0, top + 0.5)
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    fig.supxlabel("step (symlog)", fontsize=8)
    fig.supylabel("unlocked clusters", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_cluster_loss(spec: StudySpec, study_dir: Path, path: Path) -> Path:
    """Final per-cluster training loss (EMA), mean over seeds, against cluster index (0 = lowest t), per arm."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, arm in enumerate(spec.arms):
        finals = []
        for seed in spec.seeds:
            recs = _train_records(study_dir, arm, seed)
            if recs and recs[-1].get("cluster_loss"):
                finals.append([math.nan if v is None else v for v in recs[-1]["cluster_loss"]])
        if finals and len({len(f) for f in finals}) == 1:
            a = np.asarray(finals, dtype=np.float64)  # (seeds, clusters); NaN: a cluster not yet trained
            seen = np.isfinite(a).sum(0)
            mu = np.where(seen > 0, np.nansum(a, 0) / np.maximum(seen, 1), np.nan)  # nanmean without its warning
            ax.plot(range(len(mu)), mu, marker=".", lw=1, color=_color(plt, i), label=arm.name)
    ax.set_yscale("log")
    ax.set_xlabel("timestep cluster (0 = lowest t, hardest)")
    ax.set_ylabel("final training loss (EMA per cluster)")
    ax.set_title("loss per cluster at the end of training (mean over seeds; each arm's own loss weighting)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    else:  # a study reported from its status files alone: the training records stayed in the run folders
        ax.text(0.5, 0.5, "no per-cluster losses: the run folders are not here", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_folder_plots(spec: StudySpec, study_dir: Path) -> dict[str, Path]:
    """The two plots drawn from the run folders' training records. Where some finished runs' folders are not here (a
    study carried without its ``runs/``, or with part of them), an existing plot is kept as it was drawn, with a
    warning, instead of being redrawn from the runs that are here."""
    finished = [(a.name, s) for a in spec.arms for s in spec.seeds if read_status(study_dir, a.name, s) is not None]
    gone = [run for run in finished if not run_dir_of(study_dir, *run).is_dir()]
    out, kept = {}, []
    for key, name, plot in (
        ("timelines", "curriculum_timelines.png", plot_timelines),
        ("cluster_loss", "cluster_loss.png", plot_cluster_loss),
    ):
        path = study_dir / name
        if gone and path.is_file():
            out[key] = path
            kept.append(name)
        else:
            out[key] = plot(spec, study_dir, path)
    if kept:
        warnings.warn(
            f"{' and '.join(kept)} kept as they were: the folders of {len(gone)} of the {len(finished)} finished runs "
            f"are not under {str(study_dir / 'runs')!r} (delete the plots to draw them from the runs that are)",
            stacklevel=2,
        )
    return out


def write_report(
    study_dir: str | Path, official_from: str | Path | None = None, against: list[str] | tuple[str, ...] = ()
) -> dict[str, Path]:
    """results.csv, report.md and the three plots of the study in ``study_dir``; their paths. ``official_from``
    (a speedrun): another study whose official-arm runs the report also compares every arm with
    (``speedrun.with_official_runs``); ``against`` (a speedrun): more reference arms, every speed-up over each and
    the headline over the strongest (``speedrun.against``). Runs evaluated by ``study posthoc`` add that section."""
    study_dir = Path(study_dir)
    spec, rows, status = collect(study_dir)
    if official_from is not None and not spec.speedrun:
        raise ValueError(f"--official-from applies to a speedrun study; {str(study_dir)!r} is not one")
    if against and not spec.speedrun:
        raise ValueError(f"--against applies to a speedrun study; {str(study_dir)!r} is not one")
    unknown = [a for a in against if a not in {x.name for x in spec.arms}]
    if unknown:
        raise ValueError(f"--against {unknown} names no arm of the study; arms: {', '.join(a.name for a in spec.arms)}")
    arms = summarize(spec, status)
    out = {"csv": write_csv(rows, study_dir / "results.csv"), "samples": copy_samples(spec, study_dir)}
    out["report"] = write_markdown(spec, arms, study_dir / "report.md", study_dir)
    out["metric_plot"] = plot_metric(spec, rows, study_dir / "metric_vs_step.png")
    out.update(run_folder_plots(spec, study_dir))
    report = study_dir / "report.md"
    if spec.speedrun:
        out.update(write_speedrun(spec, rows, study_dir, official_from))
        if against:
            refs = speedrun.against(spec, rows, read_step_time(study_dir), list(against))
            report.write_text(report.read_text() + "\n" + "\n".join(speedrun_report.references_section(refs)))
    if spec.tuning:
        report.write_text(report.read_text() + "\n" + "\n".join(tuning_section(spec, study_dir)) + "\n")
    if spec.speedrun and spec.long_reference:
        report.write_text(report.read_text() + "\n" + "\n".join(readings_lines(spec, study_dir, rows)))
    picks = posthoc_picks(spec, study_dir)
    if picks:
        report.write_text(report.read_text() + "\n" + "\n".join(posthoc_section(spec, study_dir, rows, picks, against)))
    return out


def read_step_time(study_dir: str | Path) -> dict[str, Any] | None:
    """The study's side-by-side step times (``step_time.json``), or None when they were not measured."""
    path = Path(study_dir) / STEP_TIME_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def posthoc_section(
    spec: StudySpec, study_dir: Path, rows: list[dict[str, Any]], picks: dict[str, Any], against: Any = ()
) -> list[str]:
    """The post-hoc EMA pass (``study.posthoc``): every arm's final FD at each length of the grid (mean +- std over
    seeds), its pick, and for a speedrun the time to quality on the picked curves against each reference."""
    grid = sorted({s for p in picks.values() for s in p["finals"]})
    lines = [
        "## Post-hoc EMA: every arm at its best EMA length",
        "",
        "Each run evaluated at its last snapshot for every EMA length (EDM2 sigma_rel) of one grid, with the run's "
        "own evaluation; an arm's length is the one with the lowest mean final FD over its seeds (ties: the "
        "shorter), the same rule for every arm; its curve is then evaluated at that length at every snapshot step "
        "(weights from the snapshots up to that step only).",
        "",
        "| arm | " + " | ".join(f"FD at {s:g}" for s in grid) + " | picked |",
        "|---|" + "---|" * (len(grid) + 1),
    ]
    for arm, p in picks.items():
        cells = [" +- ".join(_fmt(v) for v in mean_std(p["finals"][s])) if s in p["finals"] else "n/a" for s in grid]
        lines.append(f"| {arm} | " + " | ".join(cells) + f" | {p['pick']:g} |")
    missing = [a.name for a in spec.arms if a.name not in picks]
    if missing:
        lines += ["", f"Not evaluated post hoc (no finished runs with every length): {', '.join(missing)}."]
    lines.append("")
    acc = accuracy_section(spec, posthoc_finals(spec, study_dir, picks), "Conditional accuracy with post-hoc EMA")
    lines += [*acc, ""] if acc else []
    if spec.speedrun:
        prow = posthoc_rows(spec, study_dir, rows, picks)
        refs = speedrun.against(spec, prow, read_step_time(study_dir), list(against))
        lines += speedrun_report.references_section(refs, "Time to quality with post-hoc EMA")
    if spec.speedrun and spec.long_reference:
        lines += readings_lines(spec, study_dir, prow, posthoc=True)
    return lines


def readings_lines(spec: StudySpec, study_dir: Path, rows: list[dict[str, Any]], posthoc: bool = False) -> list[str]:
    """Both readings of every arm's speed-up (``speedrun.both_readings``) with the long reference's runs; ``posthoc``:
    ``rows`` are the post-hoc curves, and the long reference's are its own at its best length."""
    title = "Both readings of the speed-up" + (" with post-hoc EMA" if posthoc else "")
    source = spec.long_reference["folder"]
    long = prepare(spec, study_dir)  # a folder of another reference is refused in one line
    folder = folder_of(spec, study_dir)
    long_rows = collect(folder)[1] if long is not None and (folder / SPEC_FILE).is_file() else []
    if posthoc and long_rows:
        picks = posthoc_picks(long, folder)
        long_rows = posthoc_rows(long, folder, long_rows, picks) if picks else []
    if not long_rows:
        what = "no post-hoc records (`study posthoc` on this study evaluates it too)" if posthoc else "no finished runs"
        return [f"## {title}", "", f"The long reference (`{source}`) has {what} yet: only the existing reading.", ""]
    costs = tuning_costs(spec, study_dir, decide(spec, study_dir, read_status))[0] if spec.tuning else None
    res = speedrun.both_readings(spec, rows, long_rows, read_step_time(study_dir), costs)
    return speedrun_report.readings_section(res, source, spec.long_reference["factor"], title)


def tuning_section(spec: StudySpec, study_dir: Path) -> list[str]:
    """The tuning protocol (``study.tuning``): each trial's result, each arm's pick and tuning wall time, and in a
    speedrun each arm's speed-up over the reference with the tuning excluded and included (AlgoPerf's view): the
    mean wall time to the threshold, plus the arm's tuning wall time (every trial's, summed) for the second."""
    tu = spec.tuning
    done = decide(spec, study_dir, read_status)
    pick = tu["pick"] if tu["pick"] == "final" else f"fewest steps to {spec.metric} {tu['pick']:g}"
    seeds = trial_seeds(tu)
    at = (
        f"seed {seeds[0]}"
        if len(seeds) == 1
        else f"seeds {', '.join(map(str, seeds))}, each point scored by its worse seed (its seeds' values in brackets)"
    )
    lines = [
        "## Tuning",
        "",
        f"Every tuned arm ran one trial per point of its grid: {tu['budget']} steps, {at}; the pick rule, "
        f"fixed in the spec: {pick} (smoothed over {spec.speedrun.get('smooth', 1) if spec.speedrun else 1} "
        "evaluations; ties keep the grid's order).",
        "",
        f"| arm | trial | overrides | steps to the pick's {spec.metric} | final smoothed {spec.metric} | wall s "
        "| picked |",
        "|---|---|---|---|---|---|---|",
    ]

    def steps_cell(t: dict[str, Any]) -> str:
        v = t["steps_to_pick"]
        return "-" if tu["pick"] == "final" else ("never" if v is None or not math.isfinite(v) else f"{v:g}")

    def final_cell(t: dict[str, Any]) -> str:
        return "n/a" if t["final"] is None or not math.isfinite(t["final"]) else f"{t['final']:.4g}"

    for name, d in done.items():
        for i, t in enumerate(d["trials"]):
            steps, final = steps_cell(t), final_cell(t)
            if "per_seed" in t:
                steps += "" if tu["pick"] == "final" else f" ({', '.join(steps_cell(x) for x in t['per_seed'])})"
                final += f" ({', '.join(final_cell(x) for x in t['per_seed'])})"
            mark = "yes" if t["set"] == d["pick"] else ""
            lines.append(f"| {name} | {i} | {' '.join(t['set'])} | {steps} | {final} | {t['wall_s']:.0f} | {mark} |")
    waiting = [a.name for a in spec.arms if a.tune and a.name not in done]
    untuned = [a.name for a in spec.arms if not a.tune]
    lines.append("")
    if waiting:
        lines.append(f"Trials not all finished (no pick yet): {', '.join(waiting)}.")
    if untuned:
        lines.append(f"Not tuned (no grid; no tuning time): {', '.join(untuned)}.")
    if not spec.speedrun:
        return lines
    path = study_dir / "speedrun.json"
    res = read_json(path, "speedrun analysis") if path.is_file() else {}
    ref = res.get("reference")
    wall = {n: (a.get("axes") or {}).get("wall_s", [None])[0] for n, a in (res.get("arms") or {}).items()}
    cost, how = tuning_costs(spec, study_dir, done)
    lines += [
        "",
        f"Speed-up over {ref} in wall time to the threshold, tuning excluded and included (the arm's mean wall time "
        f"to the threshold plus its tuning wall time: {how}; point estimates):",
        "",
        "| arm | mean wall s to the threshold | tuning wall s | speed-up, tuning excluded "
        "| speed-up, tuning included |",
        "|---|---|---|---|---|",
    ]
    for name, w in wall.items():
        if w is None or not math.isfinite(w) or wall.get(ref) is None or not math.isfinite(wall[ref]):
            lines.append(f"| {name} | n/a | {cost.get(name, 0.0):.0f} | n/a | n/a |")
            continue
        excl = wall[ref] / w
        incl = (wall[ref] + cost.get(ref, 0.0)) / (w + cost.get(name, 0.0))
        lines.append(f"| {name} | {w:.0f} | {cost.get(name, 0.0):.0f} | x{excl:.3g} | x{incl:.3g} |")
    return lines


def tuning_costs(spec: StudySpec, study_dir: Path, done: dict[str, Any]) -> tuple[dict[str, float], str]:
    """({arm: its tuning wall time}, how it was priced): every trial's steps (each point at each trial seed) x the
    arm's side-by-side step time, as the arms' time axes; the trials' own recorded wall time without step times. An
    arm without a finished grid costs 0."""
    st = read_step_time(study_dir)
    priced = {a.name: speedrun.arm_step_s(st, a.name, spec.speedrun["official_arm"]) for a in spec.arms}
    runs = len(trial_seeds(spec.tuning)) * spec.tuning["budget"]
    cost = {
        a.name: (
            0.0
            if a.name not in done
            else len(done[a.name]["trials"]) * runs * priced[a.name]
            if priced[a.name]
            else done[a.name]["tuning_wall_s"]
        )
        for a in spec.arms
    }
    how = (
        "its trials' steps x the arm's side-by-side step time, as the arms' time axes"
        if all(priced[n] for n in done)
        else "the trials' own recorded wall time (no side-by-side step times)"
    )
    return cost, how


def write_speedrun(
    spec: StudySpec, rows: list[dict[str, Any]], study_dir: Path, official_from: str | Path | None = None
) -> dict[str, Path]:
    """The time-to-quality section (appended to report.md), speedrun.json and the two FD plots; with
    ``official_from`` a section against that study's official runs too (``speedrun_official.json``)."""
    st = read_step_time(study_dir)
    res = speedrun.analyse(spec, rows, st)
    eff = speedrun.efficiency(spec, rows, st, res["threshold"])
    text = speedrun_report.markdown(spec, res, eff)
    extra = {}
    if official_from is not None:
        other, other_rows, _ = collect(official_from)
        if not other.speedrun or not any(r["arm"] == spec.speedrun["official_arm"] for r in other_rows):
            raise ValueError(
                f"{str(official_from)!r} has no finished runs of arm {spec.speedrun['official_arm']!r} of a speedrun"
            )
        ext = speedrun.with_official_runs(spec, rows, st, other_rows)
        ext_eff = speedrun.efficiency(spec, speedrun.merged_rows(spec, rows, other_rows), st, ext["threshold"])
        text += speedrun_report.official_runs_section(spec, ext, str(official_from), ext_eff[:1])
        extra["speedrun_official"] = speedrun.write_analysis(ext, study_dir / "speedrun_official.json")
    report = study_dir / "report.md"
    report.write_text(report.read_text() + "\n" + "\n".join(text) + "\n")
    plots = speedrun_report.plot(spec, rows, res, study_dir)
    return {
        **extra,
        "speedrun": speedrun.write_analysis(res, study_dir / "speedrun.json"),
        "fd_vs_wall": plots["wall_s"],
        "fd_vs_step": plots["step"],
    }


def copy_samples(spec: StudySpec, study_dir: Path) -> Path:
    """``samples/<arm>.png``: the end-of-run sample grid of each arm's first finished seed whose run directory is
    here. A grid copied before is replaced only by the arm's first seed (a later seed's grid does not replace an
    earlier seed's, kept after its run directory was removed)."""
    dest = study_dir / "samples"
    dest.mkdir(exist_ok=True)
    for arm in spec.arms:
        for seed in spec.seeds:
            grid = run_dir_of(study_dir, arm.name, seed) / "samples.png"
            if grid.is_file() and read_status(study_dir, arm.name, seed) is not None:
                if seed == spec.seeds[0] or not (dest / f"{arm.name}.png").is_file():
                    shutil.copyfile(grid, dest / f"{arm.name}.png")
                break
    return dest


__all__ = ["Paired", "collect", "mean_std", "paired_t", "summarize", "write_report"]
