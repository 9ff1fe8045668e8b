"""The ``diffcurr-fast`` command line.

Each subcommand lives in its own module, which defines ``add_arguments(parser)`` and ``run(args) -> int``;
this file only lists them, so a subcommand appears here once it works.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from diffcurr_fast import __version__

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("diffcurr_fast.train.cli_train", "train a diffusion model (no recipe: the embedded digits demo)"),
    "sample": ("diffcurr_fast.cli_sample", "sample a grid or an .npz from a checkpoint"),
    "export": ("diffcurr_fast.cli_export", "write a checkpoint as a diffusers DiT (--to diffusers OUT)"),
    "tdc": (
        "diffcurr_fast.tdc.cli_tdc",
        "TDC training: stage 1, proxy-pruned experts per timestep group, multi-expert bundle",
    ),
    "analyze": ("diffcurr_fast.analysis.cli_analyze", "difficulty analysis: kl | convergence | clusters"),
    "extract-latents": ("diffcurr_fast.data.cli_extract", "encode an image dataset to latents with a local VAE"),
    "eval": ("diffcurr_fast.eval.cli_eval", "FD / IS / precision-recall of samples against reference statistics"),
    "recipes": ("diffcurr_fast.train.cli_recipes", "list the shipped recipes (train NAME runs one by name)"),
    "info": ("diffcurr_fast.info", "versions, devices, fused-op backends (and why not); --check: op self-check"),
    "study": ("diffcurr_fast.study.cli", "ablation arms over seeds with evaluation: results.csv, report.md, plots"),
}


def _command_of(argv: list[str]) -> str | None:
    """The subcommand named in ``argv`` (the first argument that is one), or None."""
    return next((a for a in argv if a in COMMANDS), None)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` has its module imported (all of them when ``argv`` is
    None), so ``--help`` and argument errors do not wait for torch."""
    wanted = _command_of(argv) if argv is not None else None
    parser = argparse.ArgumentParser(
        prog="diffcurr-fast",
        description="Kernel-optimized diffusion training: difficulty curriculum and TDC training for DiTs.",
    )
    parser.add_argument("--version", action="version", version=f"diffcurr-fast {__version__}")
    # The deepspeed launcher passes --local_rank before the subcommand; the rank is read from the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if argv is None or name == wanted:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_module=mod)
    return parser


def _message(exc: BaseException) -> str:
    """One line for an error: a KeyError's key text, an operating-system error as its cause and file (not
    ``[Errno 13] Permission denied: 'x'``), else the exception's own message."""
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])
    if isinstance(exc, OSError) and exc.errno is not None and exc.strerror:
        files = " -> ".join(repr(str(f)) for f in (exc.filename, exc.filename2) if f is not None)
        return f"{exc.strerror}: {files}" if files else exc.strerror
    return str(exc)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Its errors are one line on stderr and exit status 2; Ctrl-C is one line and 130 (the
    trainer handles it itself, checkpointing first). Under a launcher, only rank 0 prints: every rank runs the same
    checks and would print the same line."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    rank0 = os.environ.get("RANK", "0") in ("", "0")
    try:
        return int(args._module.run(args) or 0)
    except (ValueError, OSError, KeyError, ImportError) as exc:  # OSError: files, ConnectionError
        if rank0:
            print(f"diffcurr-fast {args.command}: error: {_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if rank0:
            print(f"\ndiffcurr-fast {args.command}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
