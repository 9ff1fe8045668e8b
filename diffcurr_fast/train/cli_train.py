"""``diffcurr-fast train [RECIPE] [--set a.b=value ...] [--resume | --overwrite] [--dry-run]``.

Without a recipe it runs the embedded demo (a small DiT with MinSNR-5 on the built-in digits). Under
``torchrun --nproc_per_node N -m diffcurr_fast.cli train ...`` it trains with DDP; with ``engine.kind=deepspeed``
under ``deepspeed --num_gpus N --module diffcurr_fast.cli train ...`` (or torchrun) with ZeRO.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import sys
from pathlib import Path

from diffcurr_fast.runs.config import config_from_dict
from diffcurr_fast.runs.recipes import (
    apply_overrides,
    config_to_yaml,
    describe_config,
    load_config,
    load_run_config,
    run_dir_overrides,
)
from diffcurr_fast.train.rundir import check_run_dir, lock_run_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``train``."""
    parser.add_argument(
        "recipe",
        nargs="?",
        default=None,
        help="YAML recipe, or the name of a shipped one (`diffcurr-fast recipes`; default: the embedded digits demo)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set optim.lr=2e-4 --set engine.max_steps=500",
    )
    parser.add_argument("--run-dir", default=None, help="shorthand for --set checkpoint.run_dir=PATH")
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--resume",
        action="store_true",
        help="continue the newest checkpoint in the run directory; without RECIPE, from the run's own config.yaml "
        "(--set changes on top of it)",
    )
    group.add_argument(
        "--overwrite", action="store_true", help="remove the files a previous run wrote (only those) and start afresh"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check of a real start (files, backends, run dir), print the config, write nothing",
    )
    parser.add_argument("--help-config", action="store_true", help="list every config key with its doc and exit")


def resume_command(args: argparse.Namespace) -> str:
    """The command line that continues the run of ``args``: its recipe and overrides, with ``--resume``."""
    parts = ["diffcurr-fast", "train", *([args.recipe] if args.recipe else [])]
    for o in args.overrides:
        parts += ["--set", o]
    if args.run_dir:
        parts += ["--run-dir", args.run_dir]
    return " ".join(shlex.quote(p) for p in parts) + " --resume"


def describe_model(cfg, num_params: int | None = None) -> str:
    """``DiT-B/2`` or ``custom DiT depth 4, width 64, patch 2, 4 heads``, with the parameter count when known."""
    m = cfg.model
    name = (
        m.preset
        if m.preset != "custom"
        else (f"custom DiT depth {m.depth}, width {m.hidden_size}, patch {m.patch_size}, {m.num_heads} heads")
    )
    return name + (f", {num_params / 1e6:.2f}M parameters" if num_params is not None else "")


def describe_precision(cfg, device) -> str:
    """``precision fp32 (auto)``: what ``engine.precision`` resolves to on ``device`` (``objective.resolve_precision``),
    with ``(auto)`` when it was not given."""
    from diffcurr_fast.objective import resolve_precision  # here: keeps --help free of torch

    p = cfg.engine.precision
    return f"precision {resolve_precision(p, device)}" + (" (auto)" if p == "auto" else "")


def describe_data(cfg) -> str:
    d, m = cfg.data, cfg.model
    src = f"built-in {d.dataset}" if d.dataset in ("digits", "mnist5k") else f"{d.dataset} {d.path}"
    return f"{src} ({m.in_channels}x{m.input_size}x{m.input_size}, {m.num_classes} classes)"


def checkpoint_config(cfg, overrides: list[str]):
    """The config of ``train --resume`` without a recipe when the run's ``config.yaml`` is missing: the one its newest
    checkpoint stores, ``overrides`` on top, said on stderr (``cfg``, the demo's, when there is no checkpoint: the
    start's check refuses that resume)."""
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint

    run_dir = Path(cfg.checkpoint.run_dir)
    ckpt = latest_checkpoint(run_dir) if run_dir.is_dir() else None
    if ckpt is None:
        return cfg
    print(
        f"diffcurr-fast train: {str(run_dir / 'config.yaml')!r} is missing; resuming with the config stored in "
        f"{str(ckpt)!r}",
        file=sys.stderr,
    )
    saved = config_from_dict(load_checkpoint(ckpt)["config"], source=f"{ckpt.name}")
    return apply_overrides(saved, overrides)


def run(args: argparse.Namespace) -> int:
    """Resolve and validate the config, then train (or print it with ``--dry-run``). Returns the exit status."""
    if args.help_config:
        print(describe_config())
        return 0
    overrides = run_dir_overrides(args.overrides, args.run_dir)
    if args.dry_run or int(os.environ.get("RANK", "0")) != 0:  # writes nothing / rank 0 holds the lock
        return _run(args, load_config(args.recipe, overrides), overrides)
    with contextlib.ExitStack() as locks:
        if args.run_dir:  # the folder is known before the config is resolved (which imports torch): a second start
            # on it is refused at once, and so is a start on a folder that the first one has written
            locks.enter_context(lock_run_dir(args.run_dir.strip(), resume=args.resume))
            check_run_dir(args.run_dir.strip(), resume=args.resume, overwrite=args.overwrite)
        cfg = load_config(args.recipe, overrides)
        locks.enter_context(lock_run_dir(cfg.checkpoint.run_dir, resume=args.resume))  # held already with --run-dir
        return _run(args, cfg, overrides)


def _run(args: argparse.Namespace, cfg, overrides: list[str]) -> int:
    saved = Path(cfg.checkpoint.run_dir) / "config.yaml"
    if args.resume and args.recipe is None:  # the run's own config, --set on top
        cfg = load_run_config(saved, overrides) if saved.is_file() else checkpoint_config(cfg, overrides)
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.train.preflight import check_run

    # everything, before anything is written; the data and the initial weights are read here only for --dry-run
    # (a real start reads them in the Trainer, still before anything is written, rather than twice)
    start = check_run(cfg, resume=args.resume, overwrite=args.overwrite, read_inputs=args.dry_run)
    if args.dry_run:
        sys.stdout.write(config_to_yaml(cfg))
        print(
            f"dry run: the config, inputs, backends and run directory {cfg.checkpoint.run_dir!r} are valid "
            f"({start.mode} start); nothing was written",
            file=sys.stderr,
        )
        return 0
    if start.mode == "finished":
        print(
            f"diffcurr-fast train: run {cfg.checkpoint.run_dir!r} already finished (checkpoint at step "
            f"{start.step}, engine.max_steps {cfg.engine.max_steps}); nothing to do, nothing changed. Raise "
            "engine.max_steps with --resume to train further"
        )
        return 0
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import GridInterrupted, Trainer, TrainingInterrupted
    from diffcurr_fast.train.skips import NonFiniteLossError

    engine = create_engine(cfg.engine.kind, cfg.engine.device)
    try:
        trainer = Trainer(cfg, engine, resume=args.resume, overwrite=args.overwrite)
        if engine.is_main:
            where = f"resuming from {trainer.resumed_from}" if trainer.resumed_from else "starting"
            n = sum(p.numel() for p in trainer.model.parameters())
            print(
                f"diffcurr-fast train: {where} at step {trainer.step} of {cfg.engine.max_steps}; "
                f"data {describe_data(cfg)}; model {describe_model(cfg, n)}; "
                f"{engine.kind} engine, world size {engine.world_size}, device {engine.device}, "
                f"{describe_precision(cfg, engine.device)}; run dir {trainer.run_dir}",
                file=sys.stderr,
            )
        try:
            summary = trainer.fit()
        except GridInterrupted as stop:  # training had finished: nothing to resume
            if engine.is_main:
                print(f"diffcurr-fast train: {stop}", file=sys.stderr)
            return stop.exit_code
        except TrainingInterrupted as stop:
            if engine.is_main:
                print(
                    f"diffcurr-fast train: {stop}; resume with (under the same launcher): {resume_command(args)}",
                    file=sys.stderr,
                )
            return stop.exit_code
        except NonFiniteLossError as exc:  # every rank took the same decision
            if engine.is_main:
                print(f"diffcurr-fast train: error: {exc}", file=sys.stderr)
            return 2
    finally:
        engine.close()
    if engine.is_main:
        first = f" (the first at step {summary['first_nan_skip']})" if summary["nan_skips"] else ""
        stage = f", curriculum stage {summary['stage']}" if cfg.curriculum.pacing != "none" else ""
        print(
            f"done: {summary['step']} steps, final loss {summary['loss']:.4f}, {summary['nan_skips']} skipped"
            f"{first}{stage}"
        )
        for key, label in (
            ("samples", "sample grid"),
            ("cluster_loss_plot", "loss per cluster"),
            ("curriculum_plot", "curriculum timeline"),
            ("ema", "EMA weights"),
        ):
            if key in summary:
                print(f"  {label}: {summary[key]}")
            elif key == "samples" and summary.get("no_samples"):
                print(f"  sample grid: none ({summary['no_samples']})")
        print(f"  metrics: {trainer.run_dir / 'metrics.jsonl'}; checkpoints: {trainer.run_dir / 'checkpoints'}")
    return 0
