"""Execution engines behind one interface: a single process (CPU or one GPU) and DDP under ``torchrun``.

The loop never branches on the engine: it asks it for the device, wraps the model with ``wrap``, reduces flags
with ``all_true`` and gathers per-rank state with ``gather_objects``. DDP reads the ``torchrun`` environment
(``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and uses NCCL on CUDA, gloo on CPU.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

ENGINE_KINDS = ("auto", "single", "ddp")


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}; choose one of ('auto', 'cpu', 'cuda')")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("engine.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


class Engine:
    """Single-process engine: no communication."""

    kind = "single"

    def __init__(self, device: str = "auto"):
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = _resolve_device(device, 0)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the loop calls (identity here)."""
        return model

    def all_true(self, flag: bool | torch.Tensor) -> bool:
        """True iff ``flag`` holds on every rank (a host sync)."""
        return bool(flag)

    def gather_objects(self, obj: Any) -> list[Any]:
        """``[obj of rank 0, obj of rank 1, ...]``."""
        return [obj]

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class DDPEngine(Engine):
    """``torch.nn.parallel.DistributedDataParallel`` over the ``torchrun`` process group."""

    kind = "ddp"

    def __init__(self, device: str = "auto"):
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(f"engine.kind 'ddp' needs the torchrun environment; missing {', '.join(missing)}")
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = _resolve_device(device, self.local_rank)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kw = {"device_id": self.device} if self.device.type == "cuda" else {}
            dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size, **kw)

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids)

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend() == "nccl" else torch.device("cpu")

    def all_true(self, flag: bool | torch.Tensor) -> bool:
        t = torch.as_tensor(flag).to(self._collective_device(), torch.int32).reshape(1).clone()
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return bool(t.item())

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        dist.barrier()

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def create_engine(kind: str = "auto", device: str = "auto") -> Engine:
    """``auto``: DDP when launched by torchrun with WORLD_SIZE > 1, else single."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {ENGINE_KINDS}")
    if kind == "auto":
        kind = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"
    return DDPEngine(device) if kind == "ddp" else Engine(device)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
