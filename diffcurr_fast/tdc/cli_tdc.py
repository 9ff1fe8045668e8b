"""``diffcurr-fast tdc [RECIPE] [--set a.b=value ...] [--set tdc.key=value ...] [--resume] [--overwrite] [--dry-run]
[--help-config]``; under ``torchrun --nproc_per_node N -m diffcurr_fast.cli tdc ...`` or ``deepspeed`` every rank runs
it (stage 1 and the fine-tunes data-parallel, the proxy search spread over the ranks).

Without a recipe it runs a small TDC run on the built-in digits (the demo recipe with ``TDC_DEMO``'s changes): stage 1
trains the demo DiT for a few hundred steps, then N = 3 groups with budget floor k = 0.5 are pruned by a 2-round x
3-candidate proxy search and fine-tuned.
A recipe is a training recipe (the sections of ``diffcurr_fast.runs.config``, its ``tdc:`` section included);
``--set tdc.rounds=4`` overrides a TDC option like any training key.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from diffcurr_fast._files import read_json
from diffcurr_fast.runs.config import TrainConfig, config_from_dict, upgrade_saved
from diffcurr_fast.runs.recipes import (
    DEMO_RECIPE,
    apply_overrides,
    describe_config,
    load_config,
    read_recipe,
    recipes_dir,
    run_dir_overrides,
)
from diffcurr_fast.train.rundir import lock_run_dir

# The default run, as changes to the training demo (recipe demo.yaml), whose model and data it keeps: 800 steps of
# stage 1 without the curriculum (the TDC paper's stage 1; --curriculum turns it on), then three experts (N = 3,
# k = 0.5) with 2 x 3 candidate searches and 200 fine-tuning steps each. A faster EMA (0.995) suits runs this short.
TDC_DEMO: dict[str, dict[str, Any]] = {
    "optim": {"lr": 1e-3, "warmup_steps": 50, "schedule": "constant", "min_lr": 0.0, "ema_decay": 0.995},
    "engine": {"max_steps": 800},
    "logging": {"sample_steps": 50, "progress": False},
    "checkpoint": {"run_dir": "runs/tdc", "keep_last": 1},
    "tdc": {
        "num_groups": 3,
        "budget_floor": 0.5,
        "rounds": 2,
        "candidates": 3,
        "recover_steps": 10,
        "finetune_steps": 200,
        "finetune_lr": 5e-4,
    },
}


def demo_recipe() -> dict[str, dict[str, Any]]:
    """The sections of the TDC demo: the training demo's, each updated with ``TDC_DEMO``'s."""
    data = read_recipe(recipes_dir() / DEMO_RECIPE)
    for section, values in TDC_DEMO.items():
        data[section] = {**data.get(section, {}), **values}
    return data


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``tdc``."""
    parser.add_argument(
        "recipe",
        nargs="?",
        default=None,
        help="YAML training recipe, optionally with a tdc: section (default: digits demo)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override a training key or a tdc option (repeatable), e.g. --set engine.max_steps=500 "
        "--set tdc.proposer=uniform --set tdc.finetune_steps=300",
    )
    parser.add_argument("--run-dir", default=None, help="output directory (default: checkpoint.run_dir)")
    parser.add_argument(
        "--curriculum",
        action="store_true",
        help="stage 1 with the difficulty curriculum (sets curriculum.pacing=patience)",
    )
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue a killed TDC run in its run dir (the stage, group and search round it was in); without "
        "RECIPE, from the run's own config in tdc.json (no --set to repeat)",
    )
    group.add_argument("--overwrite", action="store_true", help="replace the TDC artefacts of a non-empty run dir")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--help-config", action="store_true", help="list every config key (tdc.* too) and exit")


def resolve(args: argparse.Namespace) -> tuple[TrainConfig, Path]:
    """The config (its tdc section included) and run directory of ``args``: recipe, then ``--set`` overrides."""
    overrides = [*args.overrides, *(["curriculum.pacing=patience"] if args.curriculum else [])]
    overrides = run_dir_overrides(overrides, args.run_dir)
    if args.recipe is None:
        cfg = apply_overrides(config_from_dict(demo_recipe()), overrides)
    else:
        cfg = load_config(args.recipe, overrides)
    run_dir = Path(cfg.checkpoint.run_dir)
    saved = run_dir / "tdc.json"
    if args.resume and args.recipe is None and saved.is_file():  # the run's own config, --set on top (as train's)
        record = read_json(saved, "the TDC run's record")
        if not isinstance(record, dict) or not isinstance(record.get("config"), dict):
            raise ValueError(f"{str(saved)!r} holds no TDC run's config; pass the run's recipe and --set values")
        cfg = apply_overrides(config_from_dict(upgrade_saved(record["config"]), source="tdc.json"), overrides)
        cfg.checkpoint.run_dir = str(run_dir)  # the record holds its stage 1's folder
    return cfg, run_dir


def run(args: argparse.Namespace) -> int:
    """Resolve the run and execute ``run_tdc`` (or print it with ``--dry-run``). Returns the exit status."""
    if args.help_config:
        print(describe_config())
        return 0
    if args.dry_run or not _is_main():  # writes nothing / rank 0 holds the lock
        cfg, run_dir = resolve(args)
        if args.dry_run:
            sys.stdout.write(yaml.safe_dump({**cfg.to_dict(), "run_dir": str(run_dir)}, sort_keys=False))
            return 0
        return _run(args, cfg, run_dir)
    with contextlib.ExitStack() as locks:
        if args.run_dir:  # known before the config is resolved (which imports torch): a second start is refused at once
            locks.enter_context(lock_run_dir(args.run_dir.strip(), resume=args.resume))
        cfg, run_dir = resolve(args)
        locks.enter_context(lock_run_dir(run_dir, resume=args.resume))  # held already with --run-dir
        return _run(args, cfg, run_dir)


def _run(args: argparse.Namespace, cfg: TrainConfig, run_dir: Path) -> int:
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.tdc.pipeline import run_tdc

    out = run_tdc(cfg, None, run_dir, overwrite=args.overwrite, resume=args.resume)
    if not _is_main():  # one summary per run, not per rank
        return 0
    print(f"done: TDC run in {out['run_dir']}")
    print(f"  bundle: {out['bundle']} (diffcurr-fast sample --bundle {out['bundle']} --out samples.png)")
    print(f"  accounting: {out['accounting']}")
    if "samples" in out:
        print(f"  sample grid (multi-expert): {out['samples']}")
    print("  proxy-search plots: " + ", ".join(g["search_plot"] for g in out["groups"]))
    print(
        f"  stage 1: {Path(out['run_dir']) / 'stage1'}; experts: " + ", ".join(g["finetune_dir"] for g in out["groups"])
    )
    wall = out["accounting_data"]["wall_time_s"]["total"]
    print(f"  wall time: {wall:.1f} s")
    return 0


def _is_main() -> bool:
    """Whether this process prints the summary (rank 0 of a launcher, or a single process)."""
    return int(os.environ.get("RANK", "0")) == 0
