"""``diffcurr-fast train [RECIPE] [--set a.b=value ...] [--resume | --overwrite] [--dry-run]``.

Without a recipe it runs the embedded demo (a small DiT with the SNR curriculum on the built-in digits). Under
``torchrun --nproc_per_node N -m diffcurr_fast.cli train ...`` it trains with DDP; with ``engine.kind=deepspeed``
under ``deepspeed --num_gpus N --no_local_rank --module diffcurr_fast.cli train ...`` (or torchrun) with ZeRO.
"""

from __future__ import annotations

import argparse
import sys

from diffcurr_fast.train.config import config_to_yaml, describe_config, load_config


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of ``train``."""
    parser.add_argument("recipe", nargs="?", default=None, help="YAML recipe (default: the embedded digits demo)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
        help="override one config value (repeatable), e.g. --set optim.lr=2e-4 --set engine.max_steps=500",
    )  # fmt: skip
    parser.add_argument("--run-dir", default=None, help="shorthand for --set checkpoint.run_dir=PATH")
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--resume", action="store_true", help="continue the newest checkpoint in the run directory")
    group.add_argument("--overwrite", action="store_true", help="replace the run artifacts in a non-empty run dir")
    parser.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
    parser.add_argument("--help-config", action="store_true", help="list every config key with its doc and exit")
    # launchers (deepspeed, torch.distributed.launch) pass the local rank; it is read from LOCAL_RANK instead
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    """Resolve the config and train (or print it with ``--dry-run``). Returns the exit status."""
    if args.help_config:
        print(describe_config())
        return 0
    overrides = list(args.overrides)
    if args.run_dir:
        overrides.append(f"checkpoint.run_dir={args.run_dir}")
    cfg = load_config(args.recipe, overrides)
    if args.dry_run:
        sys.stdout.write(config_to_yaml(cfg))
        return 0
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import Trainer

    engine = create_engine(cfg.engine.kind, cfg.engine.device)
    try:
        trainer = Trainer(cfg, engine, resume=args.resume, overwrite=args.overwrite)
        if engine.is_main:
            where = f"resuming from {trainer.resumed_from}" if trainer.resumed_from else "starting"
            print(f"diffcurr-fast train: {where} at step {trainer.step} of {cfg.engine.max_steps}; "
                  f"{engine.kind} engine, world size {engine.world_size}, device {engine.device}; "
                  f"run dir {trainer.run_dir}", file=sys.stderr)  # fmt: skip
        summary = trainer.fit()
    finally:
        engine.close()
    if engine.is_main:
        print(f"done: {summary['step']} steps, final loss {summary['loss']:.4f}, {summary['nan_skips']} skipped, "
              f"curriculum stage {summary['stage']}")  # fmt: skip
        for key, label in (("samples", "sample grid"), ("cluster_loss_plot", "loss per cluster"),
                           ("curriculum_plot", "curriculum timeline"), ("ema", "EMA weights")):  # fmt: skip
            if key in summary:
                print(f"  {label}: {summary[key]}")
        print(f"  metrics: {trainer.run_dir / 'metrics.jsonl'}; checkpoints: {trainer.run_dir / 'checkpoints'}")
    return 0
