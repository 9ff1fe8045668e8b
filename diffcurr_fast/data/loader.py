"""A plain torch data path with an exactly resumable position.

``ArrayDataset`` holds images (N, C, H, W) and labels (N,) in memory or memory-mapped (``load_npz``);
``ResumableLoader`` yields per-rank batches ``(x, y)`` forever. Epoch ``e`` visits the permutation
``randperm(N)`` drawn from a generator seeded with ``(seed, e)``; global batch ``k`` of an epoch is the slice
``[k B, (k + 1) B)`` of it (the tail that does not fill a batch is dropped) and rank ``r`` of ``W`` takes the
``r``-th of its ``W`` equal parts. The position (epoch, batches consumed) is the whole state, so a resumed run
sees exactly the batches the uninterrupted run would have seen, whatever the worker count.
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from diffcurr_fast.data.errors import BadDataError, check_finite


class ArrayDataset(Dataset):
    """Images (N, C, H, W) and int labels (N,) as tensors or (memory-mapped) numpy arrays, scaled by ``scale``.

    Labels must be of an integer dtype and >= 0 (checked here). Images must be finite: in-memory arrays are checked
    here, memory-mapped ones batch by batch as they are read; a NaN or inf raises ``BadDataError`` naming
    ``source`` and the sample index."""

    def __init__(
        self, x: torch.Tensor | np.ndarray, y: torch.Tensor | np.ndarray, scale: float = 1.0, source: str = "data"
    ):
        if x.ndim != 4:
            raise ValueError(f"{source}: images must have shape (N, C, H, W), got {tuple(x.shape)}")
        if y.ndim != 1 or y.shape[0] != x.shape[0]:
            raise ValueError(f"{source}: labels must have shape ({x.shape[0]},), got {tuple(y.shape)}")
        ydt = y.dtype if isinstance(y, np.ndarray) else torch.empty(0, dtype=y.dtype).numpy().dtype
        if ydt.kind not in "iu":
            raise BadDataError(
                f"{source}: labels y must be integers, got dtype {ydt} (a float label would be "
                "truncated); store them as int64"
            )
        if len(y) and int(np.asarray(y).min()) < 0:
            raise BadDataError(f"{source}: labels must be >= 0, got {int(np.asarray(y).min())}")
        self.x, self.y, self.scale, self.source = x, y, float(scale), source
        self._lazy_check = isinstance(x, np.memmap)  # big files: checked as read, not scanned up front
        if not self._lazy_check:
            check_finite(x, source)

    def __len__(self) -> int:
        return int(self.x.shape[0])

    def _get(self, idx: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.as_tensor(np.asarray(self.x[idx]) if isinstance(self.x, np.ndarray) else self.x[idx])
        if self._lazy_check:
            check_finite(x if x.ndim == 4 else x[None], self.source, indices=np.atleast_1d(np.asarray(idx)))
        y = torch.as_tensor(np.asarray(self.y[idx]) if isinstance(self.y, np.ndarray) else self.y[idx])
        x = x.float() if x.dtype not in (torch.float32, torch.float64) else x
        return (x * self.scale if self.scale != 1.0 else x), y.long()

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._get(i)

    def batch(self, indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(x (b, C, H, W), y (b,)) for ``indices`` in one gather."""
        idx = np.asarray(indices, dtype=np.int64)
        if isinstance(self.x, np.ndarray):  # memory-mapped arrays read fastest in ascending order
            order = np.argsort(idx, kind="stable")
            inv = np.empty_like(order)
            inv[order] = np.arange(len(order))
            x, y = self._get(idx[order])
            return x[torch.as_tensor(inv)], y[torch.as_tensor(inv)]
        return self._get(torch.as_tensor(idx))


def load_npz(path: str | Path, scale: float = 1.0) -> ArrayDataset:
    """A ``.npz`` file with arrays ``x`` (N, C, H, W) and ``y`` (N,), or a directory with ``x.npy`` and ``y.npy``."""
    p = Path(path)
    if p.is_dir():
        fx, fy = p / "x.npy", p / "y.npy"
        if not (fx.is_file() and fy.is_file()):
            raise FileNotFoundError(f"data directory {str(p)!r} must contain x.npy and y.npy")
        x, y = _read_npy(fx, mmap=True), _read_npy(fy, mmap=False)
        return ArrayDataset(x, y, scale, source=str(fx))
    if not p.is_file():
        raise FileNotFoundError(f"data file {str(p)!r} does not exist")
    try:
        with np.load(p) as z:
            missing = {"x", "y"} - set(z.files)
            if missing:
                raise ValueError(f"{str(p)!r} lacks array(s) {sorted(missing)}; it needs x (N, C, H, W) and y (N,)")
            x, y = z["x"], z["y"]
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise BadDataError(f"{str(p)!r} is not a readable .npz file ({type(exc).__name__}: {exc})") from None
    except ValueError as exc:
        if "pickle" in str(exc) or "Object arrays" in str(exc):
            raise BadDataError(
                f"{str(p)!r} holds object (pickled) arrays, which are not loaded; x and y must be numeric arrays"
            ) from None
        if "lacks array" in str(exc):
            raise
        raise BadDataError(f"{str(p)!r} is not a readable .npz file ({exc})") from None
    return ArrayDataset(torch.from_numpy(x.copy()), torch.from_numpy(y.copy()), scale, source=str(p))


def _read_npy(path: Path, mmap: bool) -> np.ndarray:
    """``np.load`` of one ``.npy`` (memory-mapped when ``mmap``); BadDataError naming the file when unreadable."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (OSError, EOFError, ValueError) as exc:
        raise BadDataError(f"{str(path)!r} is not a readable .npy file (truncated or corrupt: {exc})") from None


class EpochBatchSampler(Sampler[list[int]]):
    """Rank ``rank``'s index lists of one epoch, from global batch ``start`` on (see the module doc)."""

    def __init__(self, n: int, global_batch: int, rank: int, world: int, seed: int, epoch: int, start: int = 0):
        if global_batch % world:
            raise ValueError(f"global batch size {global_batch} is not divisible by the world size {world}")
        if n < global_batch:
            raise ValueError(f"the dataset has {n} samples, fewer than one global batch of {global_batch}")
        self.n, self.B, self.rank, self.world = n, global_batch, rank, world
        self.seed, self.epoch, self.start = seed, epoch, start

    def batches_per_epoch(self) -> int:
        return self.n // self.B

    def __len__(self) -> int:
        return max(self.batches_per_epoch() - self.start, 0)

    def __iter__(self) -> Iterator[list[int]]:
        g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) % (2**63))
        perm = torch.randperm(self.n, generator=g)  # (N,)
        b = self.B // self.world
        for k in range(self.start, self.batches_per_epoch()):
            lo = k * self.B + self.rank * b
            yield perm[lo : lo + b].tolist()


class ResumableLoader:
    """Infinite per-rank batch iterator over ``dataset`` with ``state_dict`` / ``load_state_dict``."""

    def __init__(
        self,
        dataset: Dataset,
        global_batch: int,
        *,
        rank: int = 0,
        world: int = 1,
        seed: int = 0,
        num_workers: int = 0,
        pin_memory: bool = False,
    ):
        self.dataset = dataset
        self.global_batch, self.rank, self.world, self.seed = global_batch, rank, world, seed
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch, self.batch = 0, 0
        self._sampler(0, 0)  # validates the sizes now
        self._it: Iterator | None = None

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.world

    def _sampler(self, epoch: int, start: int) -> EpochBatchSampler:
        n = len(self.dataset)  # type: ignore[arg-type]
        return EpochBatchSampler(n, self.global_batch, self.rank, self.world, self.seed, epoch, start)

    def _epoch_iter(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        sampler = self._sampler(self.epoch, self.batch)
        if isinstance(self.dataset, ArrayDataset) and self.num_workers == 0:
            return (self.dataset.batch(idx) for idx in sampler)
        return iter(
            DataLoader(self.dataset, batch_sampler=sampler, num_workers=self.num_workers, pin_memory=self.pin_memory)
        )

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        while True:
            if self._it is None:
                self._it = self._epoch_iter()
            try:
                x, y = next(self._it)
            except StopIteration:
                self._it = None
                self.epoch, self.batch = self.epoch + 1, 0
                continue
            self.batch += 1
            return x, y

    def state_dict(self) -> dict[str, int]:
        """The position: ``epoch`` and the number of its global batches already consumed."""
        return {"epoch": self.epoch, "batch": self.batch, "seed": self.seed, "global_batch": self.global_batch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue from ``state_dict()``'s position (the seed and global batch size must match)."""
        if state["seed"] != self.seed or state["global_batch"] != self.global_batch:
            raise ValueError(
                f"data position was saved with seed {state['seed']} and global batch {state['global_batch']}, "
                f"this loader has seed {self.seed} and global batch {self.global_batch}"
            )
        self.epoch, self.batch = int(state["epoch"]), int(state["batch"])
        self._it = None
