"""``diffcurr-fast study [SPEC.yaml | --preset NAME] [--recipe R] [--workers N] [--out DIR] [--peer-dit PATH]
[--screen DIR]``, ``diffcurr-fast study report DIR [--against ARM]`` and ``diffcurr-fast study posthoc DIR``.

Runs every (arm, seed) of a study as an ordinary run directory under ``--out`` (a rerun keeps the finished runs
and resumes the others), then writes results.csv, report.md and the plots. ``--recipe`` replaces a preset's base
recipe (e.g. ``recipes/dit_b2_curriculum.yaml`` for the paper's setting on a GPU cluster; the preset's digits
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
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

from diffcurr_fast.study.presets import PRESETS, preset_spec
from diffcurr_fast.study.spec import check_spec, load_spec, spec_from_dict


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``study``."""
    parser.add_argument(
        "spec", nargs="?", default=None, help="study spec YAML, or 'report' / 'posthoc' followed by a study folder"
    )
    parser.add_argument("folder", nargs="?", default=None, help="with 'report' or 'posthoc': the study folder")
    parser.add_argument("--preset", choices=sorted(PRESETS), help="a built-in spec instead of SPEC.yaml")
    parser.add_argument("--recipe", default=None, help="base training recipe replacing the spec's (default: its own)")
    parser.add_argument("--workers", type=int, default=1, help="runs at once (CPU threads are split between them)")
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


def run(args: argparse.Namespace) -> int:
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.study.report import write_report

    if args.spec in ("report", "posthoc") and args.folder is None:
        raise ValueError(f"study {args.spec} needs the study folder: diffcurr-fast study {args.spec} DIR")
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
            f"unexpected argument {args.folder!r} (only 'study report DIR' and 'study posthoc DIR' take a folder)"
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
