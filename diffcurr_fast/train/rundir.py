"""The run directory: what a run writes there, and the one place that checks, opens, resumes and clears it.

A ``RunLayout`` lists what a kind of run writes, as name patterns relative to its directory: ``files`` (written
by the run), ``owned_dirs`` (directories whose whole content the run writes, e.g. a DeepSpeed checkpoint tag)
and ``subruns`` (subdirectories holding a nested run of another layout, e.g. TDC's ``stage1``). Nothing outside
the layout is ever removed: ``--overwrite`` deletes exactly the run's own files, then the directories of the
layout that are left empty, so a user's ``checkpoints/my_best_model.pt`` survives.

Two steps, so that nothing is written before a run is known to start:

- ``check_run_dir(run_dir, layout, resume=..., overwrite=..., max_steps=...)`` reads only (and probes that the
  directory can be created and written: ``check_writable``); it refuses a path under a file or on a filesystem
  that refuses new files, a non-empty directory without ``--resume`` / ``--overwrite`` (except the
  ``config.yaml`` and empty ``metrics.jsonl`` of a start that failed on its first batch, which the next start
  replaces), a ``--resume`` of a missing directory or of one without a checkpoint, and says when the run has
  already finished. It returns a ``RunStart``.
- ``open_run_dir(start)`` (rank 0) clears the previous run's artifacts on ``--overwrite``, creates the
  directory, and on a resume truncates ``metrics.jsonl`` to the checkpoint's step (the records after it are
  written again by the resumed run).
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from diffcurr_fast._files import LOCK_NAME, WRITE_PROBE, OutputLock
from diffcurr_fast._files import check_writable as _check_writable
from diffcurr_fast.runs.config import config_from_dict
from diffcurr_fast.runs.recipes import load_run_config

__all__ = [
    "TDC_LAYOUT",
    "TRAIN_LAYOUT",
    "RunLayout",
    "RunStart",
    "check_run_dir",
    "check_writable",
    "clear_run",
    "config_drift",
    "holds_run",
    "lock_run_dir",
    "open_run_dir",
    "run_artifacts",
    "truncate_metrics",
    "write_config",
]

METRICS = "metrics.jsonl"
OTHER_RUN_DIR = "choose another checkpoint.run_dir (--run-dir)"  # what to do when a run directory cannot be used
_CKPT = re.compile(r"^ckpt_(\d{8,})\.pt$")


@dataclass(frozen=True)
class RunLayout:
    """What one kind of run writes under its directory: paths relative to it, ``/``-separated, each component a
    regular expression matched against a whole name (``checkpoints/ckpt_\\d{8,}\\.pt`` does not match a user's
    ``checkpoints/ckpt_best.pt``)."""

    files: tuple[str, ...]
    owned_dirs: tuple[str, ...] = ()
    subruns: tuple[tuple[str, RunLayout], ...] = ()
    checkpoints: str = ""  # directory of the ``ckpt_<step>.pt`` files a resume continues ("" = not resumable)
    markers: tuple[str, ...] = ()  # files of which one, as the run writes it, shows that the folder holds such a run
    kind: str = "run"  # its name in messages


TRAIN_LAYOUT = RunLayout(
    files=(
        r"config\.yaml",
        r"config_until_step\d{8,}\.yaml",  # the config a resume replaced (``write_config``)
        r"metrics\.jsonl",
        r"samples\.png",
        r"cluster_loss\.png",
        r"curriculum\.png",
        r"ema\.safetensors",
        r"(ema\.safetensors|metrics\.jsonl|config\.yaml)\.tmp",
        r"checkpoints/ckpt_\d{8,}\.pt(\.tmp)?",
        r"phema/phema-\d{8,}-[0-9.e+-]+\.safetensors(\.tmp)?",  # the post-hoc EMA's snapshots (runs.posthoc_ema)
        r"tb/events\.out\.tfevents\..+",
        r"eval_reference\.npz(\.tmp)?",
        r"wandb_id\.txt",
    ),
    owned_dirs=(r"checkpoints/deepspeed/step_\d{8,}", r"wandb"),
    checkpoints="checkpoints",
    markers=("config.yaml",),
    kind="training run",
)

TDC_LAYOUT = RunLayout(
    files=(
        r"tdc\.json",
        r"accounting\.json",
        r"samples\.png",
        r"group_\d+/search\.(json|png)",
        r"group_\d+/(search_state\.pt|expert\.safetensors)",
        r"stage1/tdc_stage1\.json",
        r"bundle/(bundle\.json|weights\.safetensors|train_config\.json)",
    ),
    subruns=((r"stage1", TRAIN_LAYOUT), (r"group_\d+/finetune", TRAIN_LAYOUT)),
    markers=("tdc.json", "stage1/config.yaml"),
    kind="TDC run",
)


@dataclass(frozen=True)
class RunStart:
    """How a run starts in ``run_dir``: ``mode`` is ``fresh``, ``overwrite``, ``resume`` or ``finished``
    (resumed at or past ``max_steps``: nothing to train); ``checkpoint`` / ``step`` are the resume point."""

    run_dir: Path
    layout: RunLayout
    mode: str
    checkpoint: Path | None = None
    step: int = 0


def _checkpoints(run_dir: Path, layout: RunLayout) -> list[tuple[int, Path]]:
    d = run_dir / layout.checkpoints
    if not layout.checkpoints or not d.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in d.iterdir() if (m := _CKPT.match(p.name)) and p.is_file())


def check_run_dir(
    run_dir: str | Path,
    layout: RunLayout = TRAIN_LAYOUT,
    *,
    resume: bool = False,
    overwrite: bool = False,
    max_steps: int | None = None,
) -> RunStart:
    """How a run would start in ``run_dir`` (reads only). FileExistsError / FileNotFoundError / ValueError in one
    line for a start that is refused; see the module doc."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise ValueError("--resume and --overwrite exclude each other")
    if run_dir.exists() and not run_dir.is_dir():
        raise FileExistsError(f"run directory {str(run_dir)!r} exists and is not a directory")
    check_writable(run_dir)
    if resume:
        if not layout.checkpoints:
            raise ValueError(f"this kind of run cannot be resumed ({str(run_dir)!r})")
        if not run_dir.is_dir():
            raise FileNotFoundError(
                f"cannot resume: run directory {str(run_dir)!r} does not exist (drop --resume to start a new run)"
            )
        ckpts = _checkpoints(run_dir, layout)
        if not ckpts:
            raise FileNotFoundError(
                f"cannot resume: run directory {str(run_dir)!r} has no checkpoint under {layout.checkpoints}/ "
                "(use --overwrite to start it afresh)"
            )
        step, path = ckpts[-1]
        mode = "finished" if max_steps is not None and step >= max_steps else "resume"
        return RunStart(run_dir, layout, mode, path, step)
    if layout is TRAIN_LAYOUT and holds_run(run_dir, TDC_LAYOUT):  # a training run beside tdc.json: no run's own
        raise FileExistsError(
            f"run directory {str(run_dir)!r} holds a TDC run (tdc.json): a training run there would be written beside "
            "it; use `diffcurr-fast tdc --overwrite` to replace the TDC run, or choose another run directory"
        )
    if run_dir.is_dir() and _entries(run_dir):
        if _failed_start(run_dir, layout):  # a start that stopped before its first step: nothing to lose
            return RunStart(run_dir, layout, "overwrite")
        if not overwrite:
            raise FileExistsError(
                f"run directory {str(run_dir)!r} is not empty; pass --resume to continue it or --overwrite to "
                "replace its run artifacts"
            )
        if run_artifacts(run_dir, layout) and not holds_run(run_dir, layout):  # it would remove files of no run
            raise FileExistsError(
                f"run directory {str(run_dir)!r} holds no {layout.kind} (no {' or '.join(layout.markers)} written "
                f"by one), so --overwrite would remove files that are not a run's: choose another run directory"
            )
        return RunStart(run_dir, layout, "overwrite")
    return RunStart(run_dir, layout, "fresh")


def _entries(run_dir: Path) -> set[str]:
    """The names in ``run_dir``, without the lock a command holds on it (``lock_run_dir``) and the write probes of
    the other ranks' checks of it, which they remove at once (``_files.check_writable``)."""
    return {p.name for p in run_dir.iterdir() if not p.name.startswith(WRITE_PROBE)} - {LOCK_NAME}


def lock_run_dir(run_dir: str | Path, *, resume: bool = False) -> OutputLock:
    """The lock of a run directory (``_files.OutputLock``), taken: held by the command that writes the run, from
    before its checks until it ends. A ``--resume`` of a folder that does not exist creates nothing (its check
    refuses it)."""
    return OutputLock(run_dir, "run directory", OTHER_RUN_DIR, directory=True, create=not resume).acquire()


def holds_run(run_dir: Path, layout: RunLayout) -> bool:
    """Whether one of ``layout.markers`` in ``run_dir`` is as a run writes it: a ``config.yaml`` whose top level is
    the config's sections (model, checkpoint, ...), a JSON record holding the run's ``config``. A user's own
    ``config.yaml`` or a folder of another kind of run is not one."""
    for name in layout.markers:
        path = run_dir / name
        try:
            data = yaml.safe_load(path.read_text()) if path.suffix == ".yaml" else json.loads(path.read_text())
        except (OSError, ValueError, yaml.YAMLError):
            continue
        if isinstance(data, dict) and ({"model", "checkpoint"} <= set(data) or isinstance(data.get("config"), dict)):
            return True
    return False


def check_writable(run_dir: Path) -> None:
    """ValueError in one line unless ``run_dir`` can be created and written (``_files.check_writable``)."""
    _check_writable(run_dir, "run directory", OTHER_RUN_DIR, directory=True)


def _failed_start(run_dir: Path, layout: RunLayout) -> bool:
    """Whether ``run_dir`` holds only what a training start writes before its first step: ``config.yaml`` and an
    empty ``metrics.jsonl`` (a start that failed on its first batch)."""
    if layout is not TRAIN_LAYOUT:
        return False
    names = _entries(run_dir)
    metrics = run_dir / METRICS
    return names <= {"config.yaml", METRICS} and (not metrics.is_file() or metrics.stat().st_size == 0)


def _glob(run_dir: Path, pattern: str) -> list[Path]:
    """Paths matching ``pattern`` (one regular expression per component), without following links out."""
    out = [run_dir]
    for part in pattern.split("/"):
        rx = re.compile(part)
        nxt = []
        for base in out:
            if not base.is_dir() or base.is_symlink() and base != run_dir:
                continue
            nxt.extend(sorted(p for p in base.iterdir() if rx.fullmatch(p.name)))
        out = nxt
    return out


def run_artifacts(run_dir: str | Path, layout: RunLayout = TRAIN_LAYOUT) -> list[Path]:
    """Every file and owned directory of ``layout`` present under ``run_dir`` (nested runs included)."""
    run_dir = Path(run_dir)
    found: list[Path] = []
    for pattern in layout.files:
        found += [p for p in _glob(run_dir, pattern) if p.is_file() or p.is_symlink()]
    for pattern in layout.owned_dirs:
        found += [p for p in _glob(run_dir, pattern) if p.is_dir() and not p.is_symlink()]
    for pattern, sub in layout.subruns:
        for d in _glob(run_dir, pattern):
            if d.is_dir() and not d.is_symlink():
                found += run_artifacts(d, sub)
    return found


def _layout_dirs(run_dir: Path, layout: RunLayout) -> list[Path]:
    """Directories the layout creates (parents of its patterns, subrun roots), deepest first."""
    dirs: set[Path] = set()
    for pattern in (*layout.files, *layout.owned_dirs):
        parts = pattern.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            dirs.update(p for p in _glob(run_dir, "/".join(parts[:i])) if p.is_dir())
    for pattern, sub in layout.subruns:
        for d in _glob(run_dir, pattern):
            if d.is_dir() and not d.is_symlink():
                dirs.update(_layout_dirs(d, sub))
                dirs.add(d)
                parts = pattern.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    dirs.update(p for p in _glob(run_dir, "/".join(parts[:i])) if p.is_dir())
    return sorted(dirs, key=lambda p: len(p.parts), reverse=True)


def clear_run(run_dir: str | Path, layout: RunLayout = TRAIN_LAYOUT) -> list[Path]:
    """Remove the artifacts of ``layout`` under ``run_dir``, then its directories left empty; returns what was
    removed. Files the layout does not name (a user's) are kept, and so are the directories holding them."""
    run_dir = Path(run_dir)
    removed = run_artifacts(run_dir, layout)
    dirs = _layout_dirs(run_dir, layout)
    for p in removed:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink(missing_ok=True)
    for d in dirs:
        if d.is_dir() and not any(d.iterdir()):
            d.rmdir()
            removed.append(d)
    return removed


def truncate_metrics(path: str | Path, step: int) -> int:
    """Keep the records of ``path`` (``metrics.jsonl``) with ``step <= step`` and drop the rest (and a torn last
    line); atomic. Returns the number of records dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a crash
            dropped += 1
            continue
        if isinstance(rec, dict) and int(rec.get("step", 0)) > step:
            dropped += 1
            continue
        kept.append(line)
    if dropped:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)
    return dropped


def _flat(data: Any, prefix: str = "") -> dict[str, Any]:
    """``{"section.key": value}`` of a nested config dict."""
    if not isinstance(data, dict):
        return {prefix[:-1]: data}
    out: dict[str, Any] = {}
    for key, sub in data.items():
        out.update(_flat(sub, f"{prefix}{key}."))
    return out


def config_drift(run_dir: Path, trained: dict[str, Any]) -> list[str]:
    """How ``run_dir/config.yaml`` differs from ``trained``, the config its newest checkpoint trained with
    (``key: checkpoint OLD, config.yaml NEW``; both read as a config, so ``1e-3`` and ``0.001`` are one value): a
    hand edit, or a resume that stopped before its first checkpoint. [] when the file is missing or agrees; one entry
    naming the file when it no longer reads as a config."""
    path = run_dir / "config.yaml"
    if not path.is_file():
        return []
    try:
        now = _flat(load_run_config(path).to_dict())
    except ValueError as exc:
        return [f"config.yaml no longer reads as a config ({exc})"]
    was = _flat(_as_config(trained))
    return [f"{k}: checkpoint {was.get(k)!r}, config.yaml {v!r}" for k, v in now.items() if was.get(k) != v]


def _as_config(saved: dict[str, Any]) -> dict[str, Any]:
    """``saved`` (a checkpoint's config) with today's defaults for the keys it predates, as ``to_dict`` writes it."""
    try:
        return config_from_dict(copy.deepcopy(saved)).to_dict()
    except ValueError:  # a config today's checks refuse: compared as it is
        return saved


def write_config(run_dir: Path, text: str, step: int, trained: dict[str, Any] | None = None) -> list[str]:
    """Write the resolved config ``text`` as ``run_dir/config.yaml`` (atomically). On a resume (``step`` > 0) whose
    config differs from ``trained`` (the config its checkpoint stores: what the run trained with up to ``step``;
    without it, the ``config.yaml`` there), the earlier one is kept as ``config_until_step{step:08d}.yaml`` (an
    earlier record of the same step is not replaced), so a changed ``optim.lr`` does not erase the earlier one from
    the run's record. That record is the old ``config.yaml`` when it agrees with ``trained`` (``config_drift``), else
    ``trained`` itself: a ``config.yaml`` edited by hand never passes for what the run trained with. Returns the
    changes, ``key: old -> new``."""
    path = run_dir / "config.yaml"
    changes: list[str] = []
    if step > 0 and (trained is not None or path.is_file()):
        before = _as_config(trained) if trained is not None else yaml.safe_load(path.read_text(encoding="utf-8")) or {}
        old, new = _flat(before), _flat(yaml.safe_load(text))
        changes = [f"{k}: {old.get(k)!r} -> {v!r}" for k, v in new.items() if old.get(k) != v]
        keep = run_dir / f"config_until_step{step:08d}.yaml"
        if changes and not keep.exists():
            if trained is None or (path.is_file() and not config_drift(run_dir, trained)):
                os.replace(path, keep)
            else:
                head = f"# the config the run trained with up to step {step}, as its checkpoint stores it\n"
                keep.write_text(head + yaml.safe_dump(before, sort_keys=False, width=math.inf), encoding="utf-8")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")  # load_run_config reads it as UTF-8 on any locale
    os.replace(tmp, path)
    return changes


def open_run_dir(start: RunStart) -> None:
    """Prepare ``start.run_dir`` for writing (rank 0 only): clear the old artifacts on overwrite, create it, and on
    a resume truncate ``metrics.jsonl`` to the checkpoint's step. A finished run is left untouched."""
    if start.mode == "finished":
        return
    if start.mode == "overwrite":
        removed = clear_run(start.run_dir, start.layout)
        if removed:  # said, so that nothing disappears unannounced
            names = ", ".join(str(p.relative_to(start.run_dir)) for p in removed)
            print(f"--overwrite: removed the previous {start.layout.kind}'s files in {start.run_dir}: {names}")
    start.run_dir.mkdir(parents=True, exist_ok=True)
    if start.mode == "resume":
        truncate_metrics(start.run_dir / METRICS, start.step)
