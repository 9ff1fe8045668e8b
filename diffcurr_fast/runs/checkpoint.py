"""Atomic checkpoints, retention, resume and EMA export.

A checkpoint ``ckpt_<step>.pt`` is written to ``<name>.tmp`` in the same directory, flushed and fsynced, then
renamed over its final name (``os.replace``, atomic on POSIX) and the directory is fsynced; a crash at any point
leaves either the previous complete set or the new one, never a truncated file under a checkpoint name.
Leftover ``*.tmp`` files are ignored (and removed by the next save). Files are loaded with
``torch.load(weights_only=True)``: a checkpoint holds only tensors and plain Python containers.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from diffcurr_fast.runs.config import upgrade_saved

CKPT_DIR = "checkpoints"
_NAME = re.compile(r"^ckpt_(\d{8,})\.pt$")


def ckpt_name(step: int) -> str:
    return f"ckpt_{step:08d}.pt"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not open directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _replace(src: Path, dst: Path) -> None:
    """The commit point of a save (a separate function so tests can fail it)."""
    os.replace(src, dst)


def atomic_save(obj: Any, path: str | Path) -> Path:
    """``torch.save(obj)`` to ``path`` atomically (tmp file in the same directory, fsync, rename, fsync dir)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "wb") as fh:
            torch.save(obj, fh)
            fh.flush()
            os.fsync(fh.fileno())
        _replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return path


def list_checkpoints(run_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints under ``run_dir/checkpoints``, ascending by step."""
    d = Path(run_dir) / CKPT_DIR
    if not d.is_dir():
        return []
    out = []
    for p in d.iterdir():
        m = _NAME.match(p.name)
        if m and p.is_file():
            out.append((int(m.group(1)), p))
    return sorted(out)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """Path of the newest complete checkpoint, or None."""
    ckpts = list_checkpoints(run_dir)
    return ckpts[-1][1] if ckpts else None


class NonFiniteWeightsError(ValueError):
    """A model holds NaN or inf weights: it is not saved, exported or sampled."""


def check_finite_weights(state_dict: dict[str, Any], what: str) -> None:
    """NonFiniteWeightsError naming the first floating-point tensor of ``state_dict`` with a NaN or inf."""
    for name, v in state_dict.items():
        if isinstance(v, dict):
            check_finite_weights(v, what)
        elif isinstance(v, torch.Tensor) and v.is_floating_point() and not bool(torch.isfinite(v).all()):
            bad = int((~torch.isfinite(v)).sum())
            raise NonFiniteWeightsError(
                f"{what}: weight {name!r} has {bad} non-finite value(s) of {v.numel()}; the model diverged "
                "(check optim.lr and the data), so it is not written or sampled"
            )


def save_checkpoint(run_dir: str | Path, step: int, state: dict[str, Any], keep_last: int = 3) -> Path:
    """Write ``state`` as ``checkpoints/ckpt_<step>.pt`` atomically, then keep only the newest ``keep_last``.
    A state whose model or EMA weights are not finite is refused (``NonFiniteWeightsError``): the previous
    checkpoints stay the newest."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1, got {keep_last}")
    for key in ("model", "ema"):
        if isinstance(state.get(key), dict):
            check_finite_weights(state[key], f"refusing to save the checkpoint of step {step} ({key})")
    d = Path(run_dir) / CKPT_DIR
    path = atomic_save(state, d / ckpt_name(step))
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        old.unlink(missing_ok=True)
    for stale in d.glob("*.tmp"):
        stale.unlink(missing_ok=True)
    return path


def _read_checkpoint(path: Path, map_location: str | torch.device) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)`` of a training checkpoint, its config in today's keys."""
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # torch's message may advise an unsafe weights_only=False load: it is not repeated
        raise CorruptCheckpointError(
            f"checkpoint {str(path)!r} is corrupt or not a weights-only torch file ({type(exc).__name__})"
        ) from None
    if not isinstance(state, dict) or "model" not in state or "config" not in state:
        raise ValueError(f"{str(path)!r} is not a diffcurr_fast training checkpoint (no model/config entries)")
    state["config"] = upgrade_saved(state["config"])
    return state


def intact_before(path: str | Path) -> Path | None:
    """The newest checkpoint of the run holding ``path`` (a ``checkpoints/ckpt_<step>.pt``) that is older than
    ``path`` and loads; None when there is none (or ``path`` is not in a run's checkpoints folder)."""
    path = Path(path)
    if path.parent.name != CKPT_DIR or not _NAME.match(path.name):
        return None
    for _, prev in reversed([(s, p) for s, p in list_checkpoints(path.parent.parent) if p.name < path.name]):
        try:
            _read_checkpoint(prev, "cpu")
        except (CorruptCheckpointError, ValueError):
            continue
        return prev
    return None


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``, its config in today's keys (``upgrade_saved``); FileNotFoundError /
    ValueError with the path on failure. A corrupt checkpoint of a run (a truncated newest one) names the earlier
    checkpoint that loads, to pass instead (``sample``, ``export``, ``eval --ckpt``)."""
    return _read_naming_intact(
        path,
        map_location,
        lambda prev: f"the earlier checkpoint {str(prev)!r} of the run is intact: pass that file instead",
    )


class CorruptCheckpointError(ValueError):
    """A checkpoint file cannot be read with ``weights_only=True`` (truncated, corrupt, or not ours)."""


def load_resume_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """``load_checkpoint`` of the newest checkpoint of a run; when it is corrupt, the error names the previous
    checkpoint that loads (``intact_before``), and how to continue from it."""
    path = Path(path)
    return _read_naming_intact(
        path,
        map_location,
        lambda prev: (
            f"the previous checkpoint {prev.name} is intact: move {path.name} out of {path.parent} and "
            "rerun with --resume to continue from it"
        ),
        f"no earlier intact checkpoint in {path.parent}",
    )


def _read_naming_intact(path: str | Path, map_location: Any, advice: Any, none: str | None = None) -> dict[str, Any]:
    """``_read_checkpoint``; a corrupt one raises with ``advice(the intact earlier checkpoint)`` added, or ``none``
    when there is no such checkpoint (the bare error when ``none`` is None)."""
    path = Path(path)
    try:
        return _read_checkpoint(path, map_location)
    except CorruptCheckpointError as exc:
        prev = intact_before(path)
        if prev is None and none is None:
            raise
        raise CorruptCheckpointError(f"{exc}; {none if prev is None else advice(prev)}") from None


def resolve_checkpoint(path_or_run: str | Path) -> Path:
    """A checkpoint file, or a run directory (its newest checkpoint). A TDC run directory, which has no
    checkpoint of its own, is refused with the bundle to sample instead, also when a training run was written beside
    it (its checkpoint is named: a file is taken as given)."""
    p = Path(path_or_run)
    if p.is_dir():
        latest = latest_checkpoint(p)
        if (p / "tdc.json").is_file() or (latest is None and (p / "bundle").is_dir()):  # tdc/pipeline.py's layout
            bundle = p / "bundle"
            what = (
                f"sample its multi-expert bundle with --bundle {str(bundle)!r}"
                if (bundle / "train_config.json").is_file()
                else "its multi-expert bundle (bundle/) is not written yet"
            )
            stray = (
                f" (its {CKPT_DIR}/ holds a training run written beside the TDC run: pass {str(latest)!r} to sample it)"
                if latest is not None
                else ""
            )
            raise FileNotFoundError(
                f"{str(p)!r} is a TDC run directory, which holds no checkpoint of its own{stray}: {what}, or pass the "
                f"run of its base model ({str(p / 'stage1')!r}) or of an expert ({str(p / 'group_<i>' / 'finetune')!r})"
            )
        if latest is None:
            raise FileNotFoundError(f"run directory {str(p)!r} has no checkpoint under {CKPT_DIR}/")
        return latest
    if not p.is_file():
        raise FileNotFoundError(f"checkpoint {str(p)!r} does not exist")
    return p


TERM_HEADS = "term_heads."  # the training terms' trainable parts (a projector), attached to the model in training


def drop_term_heads(weights: dict[str, Any]) -> dict[str, Any]:
    """``weights`` without the training terms' parts (``term_heads.*``): sampling, export and a fine-tune's start
    never need them."""
    return {k: v for k, v in weights.items() if not k.startswith(TERM_HEADS)}


def load_weights(model: torch.nn.Module, weights: dict[str, Any], what: str) -> torch.nn.Module:
    """Load ``weights`` into ``model`` strictly; ValueError in one line naming ``what`` (the checkpoint and its
    weights) when they hold NaN or inf (``check_finite_weights``) or do not fit the model its config describes: the
    first key of another shape, missing or unexpected, with the counts (torch's error is many lines). The training
    terms' parts (``drop_term_heads``) are left out."""
    weights = drop_term_heads(weights)
    check_finite_weights(weights, what)
    own = model.state_dict()
    shapes = [k for k, v in own.items() if k in weights and tuple(weights[k].shape) != tuple(v.shape)]
    missing = [k for k in own if k not in weights]
    unexpected = [k for k in weights if k not in own]
    if shapes or missing or unexpected:
        if shapes:
            k = shapes[0]
            first = f"{k!r} is {tuple(weights[k].shape)} in the weights but {tuple(own[k].shape)} in the model"
        elif missing:
            first = f"{missing[0]!r} is missing from the weights"
        else:
            first = f"{unexpected[0]!r} is in the weights but not in the model"
        counts = ", ".join(
            f"{len(items)} key{'s' if len(items) > 1 else ''} {kind}"
            for kind, items in (("of another shape", shapes), ("missing", missing), ("unexpected", unexpected))
            if items
        )
        raise ValueError(
            f"{what}: the weights do not match the model the checkpoint's config describes: {first} ({counts}); "
            "the checkpoint's config or weights were changed or damaged"
        )
    model.load_state_dict(weights)
    return model


def export_safetensors(state_dict: dict[str, torch.Tensor], path: str | Path, metadata: dict[str, Any]) -> Path:
    """Write tensors as safetensors (atomically) with ``metadata`` stored as JSON strings."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tensors = {k: v.detach().cpu().contiguous() for k, v in state_dict.items()}
    check_finite_weights(tensors, f"refusing to export {str(path)!r}")
    save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in metadata.items()})
    os.chmod(tmp, 0o666 & ~_umask())  # safetensors creates its file 0600; outputs get the usual mode (0644)
    _replace(tmp, path)
    _fsync_dir(path.parent)
    return path
