"""Trainer-side data and weights: the training batches of a run (``build_loader``: the built-in datasets and .npz
arrays in memory, latent directories and image folders through ``diffcurr_fast.data``), and the initial weights of a
fine-tuning run (``model.init_from``).

``data.dataset`` ``latents`` (fast-DiT or sharded layout, ``open_latents``) and ``images`` (ImageNet-layout
folder, ADM centre crop, optional random flip) are read by a ``ShardedLoader`` (DALI or torch DataLoader backend):
rank r of W reads shard r of every epoch's permutation (``ShardedOrder``), the permutation is reshuffled
deterministically per epoch, and the position (epoch, samples consumed on this rank) is the resume state stored
in the trainer's checkpoint. ``TrainBatches`` turns it into the infinite stream of full per-rank batches the
loop consumes.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from diffcurr_fast._files import read_safetensors
from diffcurr_fast.data import pipeline
from diffcurr_fast.data.builtin import BUILTIN_DATASETS, load_builtin
from diffcurr_fast.data.errors import BadDataError
from diffcurr_fast.data.images import ImageFolder
from diffcurr_fast.data.latents import ShardedLatents, open_latents
from diffcurr_fast.data.loader import ArrayDataset, ResumableLoader, load_npz
from diffcurr_fast.data.pipeline import ShardedLoader
from diffcurr_fast.data.section import SHARDED_DATASETS
from diffcurr_fast.models.diffusers_dit import from_diffusers_state, is_diffusers_dir, read_diffusers_dir
from diffcurr_fast.runs.checkpoint import drop_term_heads

if TYPE_CHECKING:
    from diffcurr_fast.runs.config import TrainConfig


def usable_workers(n: int) -> int:
    """``data.num_workers``, at most the CPUs this process may run on (a recipe's 4 workers on a 2-core machine
    only compete for the cores: PyTorch warns twice, and the step slows). Said once when it is lowered."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if n > cpus:
        warnings.warn(
            f"data.num_workers {n} is more than the {cpus} CPU(s) this process may use; using {cpus}",
            UserWarning,
            stacklevel=2,
        )
    return min(n, cpus)


def build_dataset(cfg: TrainConfig):
    """The in-memory training dataset of ``cfg.data`` (built-in or .npz), checked against the model's input shape
    and classes and against one batch."""
    d, m = cfg.data, cfg.model
    if d.dataset in BUILTIN_DATASETS:  # mnist5k: its training split (the held-out one is the evaluator's)
        x, y = load_builtin(d.dataset)
        ds = ArrayDataset(x, y, d.scale, source=f"built-in {d.dataset}")
    else:
        ds = load_npz(d.path, d.scale)
    c, h, w = (int(s) for s in ds.x.shape[1:])
    if (c, h, w) != (m.in_channels, m.input_size, m.input_size):
        raise ValueError(
            f"data.dataset {d.dataset!r} has images {c}x{h}x{w} but model.in_channels x model.input_size^2 is "
            f"{m.in_channels}x{m.input_size}x{m.input_size}; set the model fields to match"
        )
    ymax = int(ds.y[:].max()) if len(ds) else 0
    if ymax >= m.num_classes:
        raise ValueError(f"data has label {ymax} but model.num_classes is {m.num_classes}")
    if len(ds) < d.batch_size:
        raise ValueError(
            f"data.dataset {d.dataset!r} has {len(ds)} samples, fewer than one batch of data.batch_size "
            f"{d.batch_size}; lower data.batch_size"
        )
    return ds


def build_loader(cfg: TrainConfig, rank: int, world: int, device: torch.device, dataset: Any = None):
    """(the resumable stream of this rank's batches, the dataset it reads): ``dataset`` when given, else the
    dataset of ``cfg.data`` (``ShardedLoader`` for latents and images, an in-memory ``ResumableLoader`` otherwise)."""
    if dataset is None and cfg.data.dataset in SHARDED_DATASETS:
        loader = build_train_batches(cfg, rank, world, device)
        return loader, loader.source
    dataset = dataset if dataset is not None else build_dataset(cfg)
    loader = ResumableLoader(
        dataset,
        cfg.data.batch_size,
        rank=rank,
        world=world,
        seed=cfg.engine.seed,
        num_workers=usable_workers(cfg.data.num_workers),
        pin_memory=device.type == "cuda",
    )
    return loader, dataset


class TrainBatches:
    """Infinite per-rank batches ``(x (b, C, H, W) float32, y (b,) int64)`` of a ``ShardedLoader``, resumable.

    Every batch holds exactly ``b = data.batch_size / world`` samples: the loader drops each epoch's tail that
    does not fill a batch on every rank, and a batch that lost samples to unreadable files (``on_bad='skip'``)
    is dropped whole (counted in ``dropped_batches``), so every step sees the configured batch.
    ``state_dict`` / ``load_state_dict`` hold the loader position, so a resumed run reads the same batches.
    """

    def __init__(self, loader: Any, factor: float, num_classes: int) -> None:
        self.loader = loader
        self.factor = float(factor)
        self.num_classes = int(num_classes)
        self.dropped_batches = 0
        self._it: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None

    @property
    def source(self) -> Any:
        """The ``LatentDataset`` or ``ImageFolder`` read."""
        return self.loader.source

    def __iter__(self) -> TrainBatches:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        b, empty_epochs = self.loader.batch_size, 0
        while True:
            if self._it is None:
                self._it = iter(self.loader)
            try:
                x, y = next(self._it)
            except StopIteration:  # the loader moved on to the next epoch
                self._it = None
                empty_epochs += 1
                if empty_epochs > 2:
                    raise ValueError(
                        f"the training data yields no full batch of {b} samples per rank (every batch lost samples "
                        f"to unreadable files); {self.loader.skipped} file(s) skipped"
                    ) from None
                continue
            if x.shape[0] != b:
                self.dropped_batches += 1
                if self.dropped_batches == 1:
                    warnings.warn(
                        f"dropped a batch that lost {b - x.shape[0]} unreadable sample(s) (on_bad='skip')",
                        UserWarning,
                        stacklevel=2,
                    )
                continue
            y = y.long()
            if len(y) and (int(y.min()) < 0 or int(y.max()) >= self.num_classes):
                bad = int(y.max()) if int(y.max()) >= self.num_classes else int(y.min())
                raise ValueError(
                    f"data has label {bad} but model.num_classes is {self.num_classes} (valid 0.."
                    f"{self.num_classes - 1})"
                )
            x = x.float()
            if not bool(torch.isfinite(x).all()):  # readers that bypass the dataset's own check (DALI's numpy reader)
                pos = self.loader.state_dict()
                raise BadDataError(
                    f"{getattr(self.source, 'root', 'the data')}: a batch of epoch {pos.get('epoch')} (ending at "
                    f"position {pos.get('start')} of this rank's shard) holds NaN or inf values; data.backend=torch "
                    "names the file"
                )
            return (x * self.factor if self.factor != 1.0 else x), y

    def state_dict(self) -> dict[str, Any]:
        """The position: the loader's (epoch, start, seed, shard) and the dropped-batch count."""
        return {"kind": "sharded", **self.loader.state_dict(), "dropped_batches": self.dropped_batches}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state_dict()``; ValueError when the checkpoint's data position is of another loader."""
        if state.get("kind") != "sharded":
            raise ValueError(
                "cannot resume: the checkpoint's data position is of the digits/npz loader, this run reads "
                "data.dataset latents/images"
            )
        self.loader.load_state_dict({k: state[k] for k in ("epoch", "start", "seed", "shard_id", "num_shards")})
        self.dropped_batches = int(state.get("dropped_batches", 0))
        self._it = None


def dali_placement(backend: str, device: torch.device | None, kind: str) -> tuple[int | None, str]:
    """(device_id, decoder_device) of the loader: with DALI on a GPU run the pipeline on that GPU and decode
    JPEGs there (``mixed``); otherwise CPU-only pipelines."""
    if (
        device is None
        or torch.device(device).type != "cuda"
        or pipeline.resolve_backend(backend, on_gpu=True) != "dali"
    ):
        return None, "cpu"
    index = torch.device(device).index
    return (torch.cuda.current_device() if index is None else index), ("mixed" if kind == "images" else "cpu")


def open_sharded(cfg: TrainConfig, world: int = 1) -> tuple[Any, float, int | None, int]:
    """(the source, the scale factor, the decode size, the per-rank batch) of ``cfg.data`` (``latents`` or
    ``images``), checked against the model's input shape and classes and against one per-rank batch."""
    d, m = cfg.data, cfg.model
    if d.dataset not in SHARDED_DATASETS:
        raise ValueError(f"data.dataset {d.dataset!r} is not read by the sharded loader; valid: latents, images")
    if d.batch_size % world:
        raise ValueError(f"data.batch_size {d.batch_size} is not divisible by the world size {world}")
    local = d.batch_size // world
    if d.dataset == "latents":
        source = open_latents(d.path, d.on_bad)
        shape = tuple(int(s) for s in source.latent_shape)
        if shape != (m.in_channels, m.input_size, m.input_size):
            raise ValueError(
                f"data.path {d.path!r} holds latents {'x'.join(map(str, shape))} but model.in_channels x "
                f"model.input_size^2 is {m.in_channels}x{m.input_size}x{m.input_size}; set the model fields to match"
            )
        stored = float(source.scale) if isinstance(source, ShardedLatents) else d.scale
        factor, image_size = d.scale / stored, None
    else:
        source = ImageFolder(d.path, d.on_bad)
        if len(source.classes) > m.num_classes:
            raise ValueError(
                f"data.path {d.path!r} has {len(source.classes)} classes but model.num_classes is {m.num_classes}"
            )
        factor, image_size = d.scale, d.image_size or m.input_size
    n_shard = len(source) // world
    if n_shard < local:
        raise ValueError(
            f"data.path {d.path!r} has {len(source)} usable samples, {n_shard} per rank: fewer than one per-rank "
            f"batch of {local} (data.batch_size {d.batch_size} over {world} rank(s))"
        )
    return source, factor, image_size, local


def check_data(cfg: TrainConfig, world: int = 1) -> None:
    """The checks the loaders make when a run starts, without building them (``train --dry-run``): the data can be
    read, fit the model's input shape and classes, and hold one global batch."""
    if cfg.data.dataset in SHARDED_DATASETS:
        open_sharded(cfg, world)
        return
    build_dataset(cfg)


def build_train_batches(
    cfg: TrainConfig, rank: int = 0, world: int = 1, device: torch.device | None = None
) -> TrainBatches:
    """The ``TrainBatches`` of ``cfg.data`` (``latents`` or ``images``) for ``rank`` of ``world``.

    The model trains on ``data.scale * z``: latents in the sharded layout record the scale they were written
    with (``index.json``) and are rescaled to ``data.scale``; fast-DiT latents are taken as already scaled by
    ``data.scale`` (fast-DiT stores 0.18215 z); images in [-1, 1] are multiplied by ``data.scale``.
    """
    d = cfg.data
    source, factor, image_size, local = open_sharded(cfg, world)
    device_id, decoder = dali_placement(d.backend, device, d.dataset)
    loader = ShardedLoader(
        source,
        local,
        image_size=image_size,
        seed=cfg.engine.seed,
        shard_id=rank,
        num_shards=world,
        shuffle=True,
        drop_last=True,
        hflip=d.hflip,
        backend=d.backend,
        num_workers=usable_workers(d.num_workers),
        on_bad=d.on_bad,
        device_id=device_id,
        decoder_device=decoder,
        dali_py_workers=d.dali_py_workers,
    )
    return TrainBatches(loader, factor, cfg.model.num_classes)


# ---- fine-tuning: initial weights ------------------------------------------------------------------------
def read_init_state(path: str | Path, own: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The state dict stored at ``path``: a ``.safetensors`` file, a plain ``.pt`` state dict (official DiT
    release), a training checkpoint with ``ema`` / ``model`` entries (ours or DiT's ``train.py``; the EMA
    weights are taken), or a diffusers ``DiTTransformer2DModel`` directory (or a ``DiTPipeline`` directory holding
    one), mapped back to the release's keys for the model whose state dict is ``own`` (its fixed sin-cos
    ``pos_embed``, which diffusers does not store, is filled in). Loaded with ``weights_only=True`` or safetensors."""
    p = Path(path)
    if is_diffusers_dir(p):
        if own is None or "pos_embed" not in own:
            raise ValueError(
                f"model.init_from {str(p)!r} is a diffusers directory; reading it needs the DiT's own state dict"
            )
        try:
            return from_diffusers_state(read_diffusers_dir(p)[0], own)
        except ValueError as exc:
            raise ValueError(f"model.init_from {str(p)!r}: {exc}") from None
    if not p.is_file():
        raise FileNotFoundError(f"model.init_from {str(p)!r} does not exist")
    if p.suffix == ".safetensors":
        state: Any = read_safetensors(p)
    else:
        try:
            state = torch.load(p, map_location="cpu", weights_only=True)
        except Exception as exc:  # unpickling refused or not a torch file; torch's text may advise an unsafe load
            raise ValueError(
                f"model.init_from {str(p)!r} is corrupt or not a weights-only torch file ({type(exc).__name__})"
            ) from None
    if isinstance(state, dict) and isinstance(state.get("ema"), dict):
        ema = state["ema"]
        state = ema["module"] if isinstance(ema.get("module"), dict) else ema
    elif isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]
    if not isinstance(state, dict) or not state or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"model.init_from {str(p)!r} holds no state dict of tensors")
    for prefix in ("module.", "_orig_mod."):  # DDP / torch.compile wrappers
        if all(k.startswith(prefix) for k in state):
            state = {k[len(prefix) :]: v for k, v in state.items()}
    return drop_term_heads(state)  # a training term's projector starts fresh


def fitting_init_state(own: dict[str, torch.Tensor], path: str | Path) -> dict[str, torch.Tensor]:
    """``read_init_state(path, own)``, checked against the model whose state dict is ``own`` (meta tensors will do:
    only keys and shapes are compared); ValueError naming the first mismatches. ``--dry-run`` runs it too."""
    state = read_init_state(path, own)
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    shapes = [
        f"{k} {tuple(state[k].shape)} vs model {tuple(v.shape)}"
        for k, v in own.items()
        if k in state and state[k].shape != v.shape
    ]
    if missing or unexpected or shapes:
        parts = []
        for what, items in (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", shapes)):
            if items:
                more = f" (+{len(items) - 3} more)" if len(items) > 3 else ""
                parts.append(f"{len(items)} {what}: {', '.join(items[:3])}{more}")
        raise ValueError(f"model.init_from {str(path)!r} does not fit the model: " + "; ".join(parts))
    return state


def load_init_weights(model: torch.nn.Module, path: str | Path) -> None:
    """Load ``fitting_init_state`` of ``path`` into ``model`` strictly."""
    model.load_state_dict(fitting_init_state(model.state_dict(), path), strict=True)


__all__ = [
    "SHARDED_DATASETS",
    "TrainBatches",
    "build_dataset",
    "build_train_batches",
    "check_data",
    "fitting_init_state",
    "load_init_weights",
    "open_sharded",
    "read_init_state",
]
