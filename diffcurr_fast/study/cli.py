"""``diffcurr-fast study [SPEC.yaml | --preset NAME] [--recipe R] [--workers N] [--out DIR] [--peer-dit PATH]
[--screen DIR] [--launcher local|slurm] [--nodes N] [--gpus-per-node G] [--cpus-per-gpu C] [--partition P]
[--time-min M] [--sbatch KEY=VALUE]``, ``diffcurr-fast study report DIR [--against ARM]``, ``diffcurr-fast study
posthoc DIR``, ``diffcurr-fast study status DIR`` and ``diffcurr-fast study cancel DIR``.

Runs every (arm, seed) of a study as an ordinary run directory under ``--out`` (a rerun keeps the finished runs
and resumes the others), then writes results.csv, report.md and the plots. ``--recipe`` replaces a preset's base
recipe (e.g. the shipped ``dit_b2_curriculum`` for the paper's setting on a GPU cluster; the preset's digits
sizes are then dropped, see ``diffcurr_fast.study.presets``). ``--print-spec`` writes the resolved spec and exits.

A speedrun (``--preset speedrun``) first times every arm's training step side by side (its time axis: steps x that
time) and takes ``--peer-dit PATH``, a local checkout of facebookresearch/DiT whose own training step is timed
beside ours to give the official arm its time axis (without it the report flags that the official arm keeps our
step's time); ``--preset speedrun_mnist5k --screen DIR`` picks its arms from the finished digits screening at DIR.
``study posthoc DIR`` evaluates every run at one grid of post-hoc EMA lengths and each arm at its best
(``diffcurr_fast.study.posthoc``); the report then adds that section. A speedrun with a ``long_reference`` then
trains its official arm that many times longer in that folder (``diffcurr_fast.study.long_reference``), and the
report gives both readings of every speed-up.
A study folder can be carried to another sitting or machine without its ``runs/``: the status files hold every
finished run's evaluations, and the rerun resumes the rest.
``--launcher slurm`` submits each run as a Slurm job through submitit, with the spec's ``slurm`` resources (the
options ``--nodes`` ... ``--sbatch`` replace them; ``diffcurr_fast.study.launch``); ``study status DIR`` prints
each run's state and ``study cancel DIR`` cancels the study's queued and running jobs.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from diffcurr_fast.study.presets import PRESETS, preset_spec
from diffcurr_fast.study.spec import LAUNCHERS, SLURM_DEFAULTS, StudySpec, check_spec, load_spec, spec_from_dict

FOLDER_COMMANDS = ("report", "posthoc", "status", "cancel")  # study <command> DIR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``study``."""
    parser.add_argument(
        "spec",
        nargs="?",
        default=None,
        help="study spec YAML, or 'report' / 'posthoc' / 'status' / 'cancel' followed by a study folder",
    )
    parser.add_argument(
        "folder", nargs="?", default=None, help="with 'report', 'posthoc', 'status' or 'cancel': the study folder"
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a built-in spec instead of SPEC.yaml")
    parser.add_argument("--recipe", default=None, help="base training recipe replacing the spec's (default: its own)")
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="runs at once (default: 1 local, CPU threads split between them; every run with --launcher slurm)",
    )
    parser.add_argument(
        "--threads", type=int, default=None, help="CPU threads per run (default: the cores split between the workers)"
    )
    parser.add_argument("--out", type=Path, default=None, help="study folder (default studies/<name>)")
    parser.add_argument("--no-report", action="store_true", help="run only; write the report later with 'report'")
    parser.add_argument("--print-spec", action="store_true", help="print the resolved spec and exit")
    parser.add_argument(
        "--peer-dit",
        default=None,
        metavar="PATH",
        help="speedrun: a local facebookresearch/DiT checkout; its own training step is timed in the "
        "study (same model, data, batch, threads) and gives the official arm its time axis. Without "
        "it the official arm keeps our step's time and the report flags it",
    )
    parser.add_argument(
        "--official-from",
        default=None,
        metavar="DIR",
        help="with 'report' of a speedrun: also compare every arm with the official-arm runs of the study in DIR "
        "(e.g. --preset speedrun_plateau: the official recipe trained until its FD stops falling)",
    )
    parser.add_argument(
        "--against",
        action="append",
        default=[],
        metavar="ARM",
        help="with 'report' of a speedrun: also every speed-up over this arm (repeatable), and the headline over the "
        "strongest of the official arm and these (lowest mean final smoothed FD)",
    )
    parser.add_argument(
        "--screen",
        default=None,
        metavar="DIR",
        help="speedrun_mnist5k: the finished digits screening (study folder) it takes its best arms from",
    )

    launch = parser.add_argument_group(
        "launcher", "where the runs go; the --nodes ... --sbatch options replace the spec's slurm settings"
    )
    launch.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default=None,
        help="local: worker processes of this machine; slurm: each run a Slurm job through submitit (default: the "
        "spec's launcher, else local)",
    )
    launch.add_argument(
        "--nodes", type=int, default=None, metavar="N", help=f"nodes per run (default {SLURM_DEFAULTS['nodes']})"
    )
    launch.add_argument(
        "--gpus-per-node",
        type=int,
        default=None,
        metavar="G",
        help=f"GPUs per node, one task (rank) each (default {SLURM_DEFAULTS['gpus_per_node']})",
    )
    launch.add_argument(
        "--cpus-per-gpu",
        type=int,
        default=None,
        metavar="C",
        help=f"CPUs per task (default {SLURM_DEFAULTS['cpus_per_gpu']})",
    )
    launch.add_argument("--partition", default=None, metavar="P", help="Slurm partition (default: the cluster's)")
    launch.add_argument(
        "--time-min",
        type=int,
        default=None,
        metavar="M",
        help=f"time limit of a job in minutes (default {SLURM_DEFAULTS['time_min']}); a job that reaches it is "
        "requeued and resumes from its checkpoint",
    )
    launch.add_argument(
        "--sbatch",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="one more of submitit's Slurm parameters (repeatable; VALUE read as YAML), e.g. --sbatch account=lab "
        "--sbatch mem=480GB",
    )


def with_launcher(spec: StudySpec, args: argparse.Namespace) -> StudySpec:
    """``spec`` with the launcher options of the command line in place of its own."""
    given = {
        "nodes": args.nodes,
        "gpus_per_node": args.gpus_per_node,
        "cpus_per_gpu": args.cpus_per_gpu,
        "partition": args.partition,
        "time_min": args.time_min,
    }
    slurm = {**spec.slurm, **{k: v for k, v in given.items() if v is not None}}
    sbatch = dict(slurm.get("sbatch") or {})
    for item in args.sbatch:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise ValueError(f"--sbatch {item!r}: give KEY=VALUE, e.g. --sbatch account=lab")
        sbatch[key] = yaml.safe_load(value)
    if sbatch:
        slurm["sbatch"] = sbatch
    data = {**spec.to_dict(), "launcher": args.launcher or spec.launcher, "slurm": slurm or None}
    return spec_from_dict(data, "the command line")


def run(args: argparse.Namespace) -> int:
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.study.report import write_report

    if args.spec in FOLDER_COMMANDS and args.folder is None:
        raise ValueError(f"study {args.spec} needs the study folder: diffcurr-fast study {args.spec} DIR")
    if args.spec in ("status", "cancel"):
        return _status_or_cancel(args.spec, args.folder)
    if args.spec == "report":
        for name, path in write_report(args.folder, args.official_from, args.against).items():
            print(f"  {name}: {path}")
        return 0
    if args.official_from is not None or args.against:
        raise ValueError("--official-from and --against are options of 'study report DIR'")
    if args.spec == "posthoc":
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.study.posthoc import run_posthoc

        picks = run_posthoc(args.folder, threads=args.threads or 1)
        for arm, p in picks.items():
            print(f"  {arm}: post-hoc EMA length {p['pick']:g}")
        return 0
    if args.folder is not None:
        raise ValueError(
            f"unexpected argument {args.folder!r} (only 'study {'/'.join(FOLDER_COMMANDS)} DIR' take a folder)"
        )
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.study.runner import run_study

    if (args.spec is None) == (args.preset is None):
        raise ValueError("give a spec file or --preset NAME (one of them)")
    if args.screen and not args.preset:
        raise ValueError("--screen picks the arms of --preset speedrun_mnist5k; a spec file lists its own arms")
    spec = preset_spec(args.preset, args.recipe, args.screen) if args.preset else load_spec(args.spec)
    if args.recipe and not args.preset:
        spec = check_spec(spec_from_dict({**spec.to_dict(), "recipe": args.recipe}))
    spec = with_launcher(spec, args)
    if args.print_spec:
        sys.stdout.write(yaml.safe_dump(spec.to_dict(), sort_keys=False))
        return 0
    out = args.out or Path("studies") / spec.name
    if spec.long_reference:  # a long reference folder of other settings is refused before any run, where known
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.study.long_reference import prepare, run_long_reference

        prepare(spec, out)
    try:
        res = run_study(spec, out, args.workers, peer_dit=args.peer_dit, threads=args.threads)
        if spec.long_reference:  # the official arm trained longer, once its pick is known
            long = run_long_reference(spec, out, args.workers, threads=args.threads)
            res["failed"] += long["failed"] if long else []
    except KeyboardInterrupt:  # the workers are stopped; a finished run has its status file, the others resume
        if spec.launcher == "slurm":
            print(
                f"\ndiffcurr-fast study: interrupted (Ctrl-C); the submitted jobs go on (diffcurr-fast study status "
                f"{out}; study cancel {out} stops them): rerun the same command to follow them",
                file=sys.stderr,
            )
            return 130
        print(
            "\ndiffcurr-fast study: interrupted (Ctrl-C); the runs under way were stopped (a training run "
            "checkpoints first): rerun the same command to resume them",
            file=sys.stderr,
        )
        return 130
    if not args.no_report:
        for name, path in write_report(out).items():
            print(f"  {name}: {path}")
    if res["failed"]:
        print(
            f"study: {len(res['failed'])} runs failed: {res['failed']}; rerun the same command to resume them",
            file=sys.stderr,
        )
        return 1
    return 0


def _status_or_cancel(command: str, folder: str) -> int:
    # imported here, not at the top: keeps --help free of submitit
    from diffcurr_fast.study.launch import cancel_study, run_states

    if command == "cancel":
        ids = cancel_study(folder)
        print(f"study cancel: {len(ids)} jobs cancelled{': ' + ', '.join(ids) if ids else ''}")
        if ids:
            print("  a rerun of the study resubmits their runs, which resume from their checkpoints")
        return 0
    states = run_states(folder)
    kinds = ("finished", "running", "queued", "failed", "not started")
    counts = ", ".join(f"{sum(st.startswith(k) for _, _, st, _ in states)} {k}" for k in kinds)
    print(f"study {folder}: {len(states)} runs: {counts}")
    width = max(len(f"{arm} seed {seed}") for arm, seed, _, _ in states)
    for arm, seed, state, details in states:
        line = f"  {f'{arm} seed {seed}':<{width}}  {state}"
        if details:
            line += f": {details}" if state == "failed" else f" ({details})"
        print(line)
    return 0
