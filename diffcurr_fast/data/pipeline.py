"""Sharded, resumable, per-epoch reshuffled loading with a DALI or a torch DataLoader backend.

``ShardedLoader`` is the one entry point: ``for x, y in loader`` runs the rest of the current epoch (from the
resume position) and then advances to the next epoch; ``state_dict()``/``load_state_dict()`` save and restore
the position. Both backends read the indices of ``ShardedOrder`` in the same order, so they yield the same
samples for the same seed and shard (see ``data.order``).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from diffcurr_fast.data import dali
from diffcurr_fast.data.images import ImageDataset, ImageFolder
from diffcurr_fast.data.latents import LatentDataset, open_latents
from diffcurr_fast.data.order import ShardedOrder
from diffcurr_fast.data.section import BACKENDS


class ListSampler(Sampler):
    """Yields a fixed list of keys (dataset indices, or ``(index, flip)`` pairs) in order."""

    def __init__(self, keys: Sequence) -> None:
        self.keys = list(keys)

    def __iter__(self) -> Iterator:
        return iter(self.keys)

    def __len__(self) -> int:
        return len(self.keys)


@dataclass(frozen=True)
class EpochKeys:
    """(dataset indices, flip decisions) a rank reads in an epoch from a start position: ``ShardedOrder``'s, cut
    to ``samples_per_epoch`` (the ``drop_last`` of whole batches), with no flips unless ``hflip``. Picklable, so
    DALI's parallel workers compute each epoch's order themselves."""

    order: ShardedOrder
    samples_per_epoch: int
    hflip: bool

    def __call__(self, epoch: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        idx = self.order.indices(epoch, start)[: max(self.samples_per_epoch - start, 0)]
        flips = self.order.flips(epoch, start)[: len(idx)] if self.hflip else np.zeros(len(idx), dtype=bool)
        return idx, flips


class _DaliReader:
    """A built DALI pipeline, reused across epochs while the loader asks for the position it yields next."""

    def __init__(self, pipe, epoch: int, start: int) -> None:
        self.pipe, self.next, self.busy = pipe, (epoch, start), False


class _SkipCollate:
    """Default collation that drops ``None`` samples (unreadable files under ``on_bad='skip'``) and counts them."""

    def __call__(self, batch: list) -> tuple[torch.Tensor, torch.Tensor, int]:
        kept = [b for b in batch if b is not None]
        skipped = len(batch) - len(kept)
        if not kept:
            return torch.empty(0), torch.empty(0, dtype=torch.int64), skipped
        x = torch.stack([b[0] for b in kept])  # (B, C, H, W)
        y = torch.stack([b[1] for b in kept])  # (B,)
        return x, y, skipped


def resolve_backend(backend: str, on_gpu: bool = False) -> str:
    """``"auto"`` -> ``"dali"`` for a loader that feeds a GPU (``on_gpu``) when DALI imports, else ``"torch"`` (on
    the CPU, DALI's CPU pipelines are no faster than the DataLoader); an explicit ``"dali"`` must be available."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "dali" if on_gpu and dali.dali_available() else "torch"
    if backend == "dali":
        dali.require_dali()
    return backend


class ShardedLoader:
    """Batches ``(x (B, C, H, W) float32, y (B,) int64)`` of one rank, reshuffled per epoch, resumable.

    Args:
        source: a ``LatentDataset`` or an ``ImageFolder`` (or a path: a latent directory, or an image folder when
            ``image_size`` is given).
        batch_size: samples per batch (the last batch of an epoch may be shorter unless ``drop_last``).
        image_size: output size for image folders (ADM centre crop); must be None for latents.
        seed, shard_id, num_shards, shuffle, drop_last, pad: see ``ShardedOrder``; ``drop_last`` also drops a
            trailing partial batch.
        hflip: random horizontal flips for images (decided per sample by ``flip_decisions``).
        backend: ``"auto"``, ``"dali"`` or ``"torch"``.
        num_workers: DataLoader workers (torch) or DALI CPU threads (at least 1).
        device_id: DALI GPU id (None: CPU-only pipelines); ``decoder_device`` ``"cpu"`` or ``"mixed"`` (GPU).
        dali_py_workers: forked Python workers reading image files for DALI (0: read in the pipeline thread).
            The DALI pipeline (and its workers) is built once and reused while the epochs are read in turn
            (``dali_builds`` counts the builds); a jump to another position builds a new one.
        on_bad, check: bad-data policy and image check level when ``source`` is a path.
        epoch, start: initial position (epoch and samples already consumed in it on this rank).
    """

    def __init__(
        self,
        source: LatentDataset | ImageFolder | str | os.PathLike,
        batch_size: int,
        *,
        image_size: int | None = None,
        seed: int = 0,
        shard_id: int = 0,
        num_shards: int = 1,
        shuffle: bool = True,
        drop_last: bool = False,
        pad: bool = False,
        hflip: bool = True,
        backend: str = "auto",
        num_workers: int = 0,
        device_id: int | None = None,
        decoder_device: str = "cpu",
        dali_py_workers: int = 0,
        on_bad: str = "stop",
        check: str = "header",
        epoch: int = 0,
        start: int = 0,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if isinstance(source, (str, os.PathLike)):
            source = ImageFolder(source, on_bad, check) if image_size is not None else open_latents(source, on_bad)
        if isinstance(source, ImageFolder):
            if image_size is None:
                raise ValueError("image folders need image_size (the ADM centre-crop size)")
            self.kind = "images"
        elif isinstance(source, LatentDataset):
            if image_size is not None:
                raise ValueError(f"image_size={image_size} applies to image folders only, not to latents")
            self.kind = "latents"
        else:
            raise ValueError(f"source must be a LatentDataset, an ImageFolder or a path, got {type(source).__name__}")
        self.source, self.image_size, self.batch_size = source, image_size, batch_size
        self.hflip = hflip and self.kind == "images"
        self.order = ShardedOrder(len(source), seed, shard_id, num_shards, shuffle, drop_last, pad)
        self.drop_last = drop_last
        self.backend = resolve_backend(backend, on_gpu=device_id is not None)
        self.num_workers, self.device_id, self.decoder_device = num_workers, device_id, decoder_device
        self.dali_py_workers = dali_py_workers
        self.dali_builds = 0
        self._dali: _DaliReader | None = None
        self.skipped = 0
        self.epoch, self.start = 0, 0
        self.load_state_dict({"epoch": epoch, "start": start})

    def __len__(self) -> int:
        """Batches in a full epoch."""
        n = len(self.order)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def samples_per_epoch(self) -> int:
        """Samples this rank reads per epoch."""
        n = len(self.order)
        return (n // self.batch_size) * self.batch_size if self.drop_last else n

    def state_dict(self) -> dict[str, int]:
        """The resume position: epoch and samples already consumed in it on this rank, plus the order's identity."""
        return {
            "epoch": self.epoch,
            "start": self.start,
            "seed": self.order.seed,
            "shard_id": self.order.shard_id,
            "num_shards": self.order.num_shards,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restore a position from ``state_dict()`` (seed/shard must match when present)."""
        for key in ("seed", "shard_id", "num_shards"):
            if key in state and state[key] != getattr(self.order, key):
                raise ValueError(f"cannot resume: saved {key}={state[key]}, this loader has {getattr(self.order, key)}")
        epoch, start = int(state["epoch"]), int(state["start"])
        if epoch < 0 or not 0 <= start <= self.samples_per_epoch:
            raise ValueError(f"resume position must have epoch >= 0 and 0 <= start <= {self.samples_per_epoch}")
        self.epoch, self.start = epoch, start

    def keys(self, epoch: int, start: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """(dataset indices, flip decisions) this rank reads in ``epoch`` from ``start``."""
        return self._keys(epoch, start)

    @property
    def _keys(self) -> EpochKeys:
        return EpochKeys(self.order, self.samples_per_epoch, self.hflip)

    def epoch_batches(self, epoch: int, start: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Batches of ``epoch`` from position ``start``, without touching the loader's own position."""
        return ((x, y) for x, y in self._read_batches(epoch, start) if len(x))

    def _read_batches(self, epoch: int, start: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        # One item per batch_size samples read, empty when every sample of that batch was skipped as bad.
        idx, flips = self.keys(epoch, start)
        if len(idx) == 0:
            return iter(())
        if self.backend == "dali":
            return self._dali_batches(epoch, start, idx)
        return self._torch_batches(idx, flips)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for x, y in self._read_batches(self.epoch, self.start):
            self.start = min(self.start + self.batch_size, self.samples_per_epoch)  # a skipped batch counts too
            if len(x):
                yield x, y
        self.epoch, self.start = self.epoch + 1, 0

    def _torch_batches(self, idx: np.ndarray, flips: np.ndarray) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        if self.kind == "images":
            dataset = ImageDataset(self.source, self.image_size)
            keys = [(int(i), bool(f)) for i, f in zip(idx, flips)]
        else:
            dataset, keys = self.source, [int(i) for i in idx]
        loader = DataLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=ListSampler(keys),
            num_workers=self.num_workers,
            collate_fn=_SkipCollate(),
            persistent_workers=False,
        )
        for x, y, skipped in loader:
            self.skipped += skipped
            yield x, y

    def _dali_pipeline(self, epoch: int, start: int):
        stream = dali.EpochStream(self._keys, epoch, start, self.samples_per_epoch, self.batch_size)
        threads = max(1, self.num_workers)
        self.dali_builds += 1
        if self.kind == "images":
            return dali.image_pipeline(
                self.source,
                stream,
                self.image_size,
                self.batch_size,
                num_threads=threads,
                device_id=self.device_id,
                decoder_device=self.decoder_device,
                py_workers=self.dali_py_workers,
            )
        return dali.latent_pipeline(self.source, stream, self.batch_size, num_threads=threads, device_id=self.device_id)

    def _dali_batches(self, epoch: int, start: int, idx: np.ndarray) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        reader = self._dali
        if reader is None or reader.busy or reader.next != (epoch, start):
            self._dali = reader = None  # the old pipeline (and its workers) goes before the new one starts
            reader = self._dali = _DaliReader(self._dali_pipeline(epoch, start), epoch, start)
        files = self.source.files if self.kind == "images" else getattr(self.source, "feature_files", None)

        def describe(first: int, last: int) -> str:
            if files is None:
                return f"samples {idx[first:last].tolist()} of {getattr(self.source, 'root', 'the dataset')}"
            return ", ".join(str(files[i]) for i in idx[first:last])

        reader.busy, done = True, 0
        try:
            for x, y in dali.iterate_pipeline(reader.pipe, len(idx), self.batch_size, describe):
                done += len(x)
                reader.next = (epoch, start + done) if done < len(idx) else (epoch + 1, 0)
                yield x, y
        except Exception:
            if self._dali is reader:  # a failed run leaves the pipeline in an unknown state
                self._dali = None
            raise
        finally:
            reader.busy = False
