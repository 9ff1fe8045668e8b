"""Execution engines behind one interface: a single process (CPU or one GPU), DDP under ``torchrun`` and
DeepSpeed ZeRO (stages 1, 2, 3, optimizer offload) under ``deepspeed`` or ``torchrun``.

The loop never branches on the engine: it asks it for the device, builds the wrapped model and optimizer with
``setup``, runs each micro-batch inside ``accumulate`` and back-propagates with ``backward``, clips with
``clip_grad_norm`` (None when the engine clips inside its step), steps with ``step`` (which drops the gradients of
a non-finite step instead), reads or writes full parameters inside ``full_params``, keeps optimizer state with
``optimizer_state`` / ``load_optimizer_state``, reduces flags with ``all_true`` (or ``vote``, on the device) and
sums with ``all_reduce_sum``,
gathers per-rank state with ``gather_objects`` and shares one rank's with ``broadcast_object``; ``split`` gives the
engine of a part of the ranks (DDP over its own process group; TDC's expert parallelism). DDP and DeepSpeed
read the launcher environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``) and use
NCCL on CUDA, gloo on CPU.

The device-side step (``engine.cuda_graphs``; ``setup`` reads it): ``step`` reads nothing back. It returns the
finiteness vote of every rank as a 0-d bool tensor on the device instead of a bool, and torch's fused AdamW leaves
parameters and moments untouched where it is false (its ``found_inf`` argument, CPU and CUDA kernels); the caller
masks what follows with it (``EMA.update``, the timestep sampler's ``observe``) and counts skips on the device
(``train.skips``), whose stop rules are read at the next log step. DeepSpeed decides its overflow skips on the
host: the config refuses the combination.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from diffcurr_fast._files import read_json
from diffcurr_fast.objective import resolve_precision
from diffcurr_fast.runs.checkpoint import list_checkpoints
from diffcurr_fast.runs.config import TrainConfig
from diffcurr_fast.runs.sections import DEVICES, ENGINE_KINDS


def check_launcher(kind: str) -> None:
    """ValueError when ``engine.kind`` ``ddp`` runs outside torchrun (its environment variables are missing)."""
    missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
    if kind == "ddp" and missing:
        raise ValueError(
            f"engine.kind 'ddp' needs the torchrun environment (missing {', '.join(missing)}); launch with "
            "torchrun --nproc_per_node N -m diffcurr_fast.cli train ..., or set engine.kind=single"
        )


def compile_mode(cfg: TrainConfig, device: torch.device, world_size: int) -> str | None:
    """The model's ``torch.compile`` mode: None (eager), ``"default"`` (``engine.compile``) or ``"reduce-overhead"``
    (``engine.cuda_graphs`` on a CUDA device, with or without ``engine.compile``): inductor captures the model's
    forward and backward passes as CUDA graphs and replays them, and the step around them (the fused forward
    process and loss, the clip, fused AdamW, the EMA, the sampler statistics) reads nothing back to the host. On
    CPU there are no CUDA graphs: ``engine.cuda_graphs`` is the device-side step alone. ValueError for what the
    capture does not cover: gradient accumulation (a micro-batch's replay would overwrite the gradients of the one
    before it, which ``.grad`` still holds) and more than one rank (DDP's gradient hooks run between the graphs)."""
    e = cfg.engine
    if not (e.cuda_graphs and device.type == "cuda"):
        return "default" if e.compile else None
    if cfg.optim.grad_accum_steps > 1:
        raise ValueError(
            f"engine.cuda_graphs on CUDA captures the model's backward, which gradient accumulation cannot replay "
            f"(optim.grad_accum_steps={cfg.optim.grad_accum_steps}); set optim.grad_accum_steps=1 or "
            "engine.cuda_graphs=false"
        )
    if world_size > 1:
        raise ValueError(
            f"engine.cuda_graphs on CUDA captures the model on one process only ({world_size} ranks here: DDP's "
            "gradient hooks run between the captured graphs); set engine.cuda_graphs=false"
        )
    return "reduce-overhead"


def _resolve_device(device: str, local_rank: int) -> torch.device:
    if device not in DEVICES:
        raise ValueError(f"unknown device {device!r}; choose one of {DEVICES}")
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
    part = 0  # index of this rank's part after ``split`` (0: not split)
    device_side = False  # engine.cuda_graphs: ``step`` returns a device flag and reads nothing back (module doc)
    _clip_params: tuple[nn.Module, list[nn.Parameter]] | None = None  # (model, its parameters) of the last clip

    def __init__(self, device: str = "auto"):
        self.rank, self.world_size, self.local_rank = 0, 1, 0
        self.device = _resolve_device(device, 0)

    def split(self, parts: int) -> Engine:
        """The engine of this rank's part when the ranks are split into ``parts`` contiguous parts of (nearly) equal
        size (``part_leaders(parts)`` are their first ranks); every rank calls it. One part: this engine."""
        if isinstance(parts, bool) or not isinstance(parts, int) or not 1 <= parts <= self.world_size:
            raise ValueError(f"parts must be an int in [1, {self.world_size}] (the world size), got {parts!r}")
        return self

    def part_leaders(self, parts: int) -> list[int]:
        """The global rank of the first rank of each of ``parts`` parts (``split``)."""
        return [self.world_size * i // parts for i in range(parts)]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """The module the loop calls (identity here)."""
        return model

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Any = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """(module the loop calls, optimizer the loop steps) for ``model`` and its ``optimizer``; ``cfg`` is the
        ``TrainConfig`` (used by engines that configure themselves from it; ``engine.cuda_graphs`` here)."""
        self.device_side = bool(cfg is not None and cfg.engine.cuda_graphs)
        return self.wrap(model), optimizer

    @contextlib.contextmanager
    def accumulate(self, net: nn.Module, boundary: bool) -> Iterator[None]:
        """Context of one micro-batch's forward and backward; ``boundary`` marks the last one of the step."""
        yield

    def backward(self, loss: torch.Tensor, accum_steps: int = 1) -> None:
        """Back-propagate the mean loss of one of ``accum_steps`` micro-batches (scaled by 1 / accum_steps)."""
        (loss / accum_steps if accum_steps > 1 else loss).backward()

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        optimizer.zero_grad(set_to_none=True)

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor | None:
        """Clip the global gradient norm to ``max_norm`` (> 0) and return the norm before clipping; None when off."""
        if max_norm <= 0:
            return None
        if self._clip_params is None or self._clip_params[0] is not model:
            self._clip_params = (model, list(model.parameters()))  # walked once: the tree walk is host time
        grads = [p.grad for p in self._clip_params[1] if p.grad is not None]
        if not grads or len({(g.device, g.dtype) for g in grads}) > 1:
            return torch.nn.utils.clip_grad_norm_(self._clip_params[1], max_norm)
        # torch.nn.utils.clip_grad_norm_'s own arithmetic (bitwise the same), as single foreach calls
        total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads, 2.0)), 2.0)
        torch._foreach_mul_(grads, torch.clamp(float(max_norm) / (total + 1e-6), max=1.0))
        return total

    def step(self, optimizer: torch.optim.Optimizer, lr: float, ok: bool | torch.Tensor = True) -> bool | torch.Tensor:
        """One optimizer update at learning rate ``lr`` when ``ok`` holds on every rank (a host sync); otherwise
        drop the accumulated gradients without an update. Returns whether the update was applied. Device-side
        (``device_side``): no host read; the update is masked on the device and the flag is returned as a 0-d bool
        tensor."""
        if self.device_side:
            return self._masked_step(optimizer, lr, ok)
        if not self.all_true(ok):
            optimizer.zero_grad(set_to_none=True)
            return False
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.step()
        return True

    def _masked_step(self, optimizer: torch.optim.Optimizer, lr: float, ok: bool | torch.Tensor) -> torch.Tensor:
        """The update of ``step`` applied where the vote holds, decided on the device: torch's fused AdamW returns
        at once on ``found_inf`` = 1 (parameters, moments and its step count stay as they were), as it does for
        ``torch.amp.GradScaler``. The gradients of a skipped step are left for the next ``zero_grad``."""
        applied = self.vote(ok)
        if not all(group.get("fused") for group in optimizer.param_groups):
            raise ValueError(
                "engine.cuda_graphs needs torch's fused AdamW (optim.impl auto or torch on CPU or CUDA), got "
                f"{type(optimizer).__name__} without fused=True"
            )
        for group in optimizer.param_groups:
            group["lr"] = lr
        optimizer.found_inf = (~applied).to(torch.float32)  # read by torch.optim.Adam(W).step
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
        return applied

    def full_params(self, model: nn.Module, modify: bool = False) -> contextlib.AbstractContextManager:
        """Context in which every parameter of ``model`` holds its full value (``modify``: writes are kept)."""
        return contextlib.nullcontext()

    def optimizer_state(self, optimizer: torch.optim.Optimizer, run_dir: Path, step: int) -> Any:
        """What the checkpoint of ``step`` stores for the optimizer (every rank calls it)."""
        return optimizer.state_dict()

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Any, run_dir: Path) -> None:
        """Restore what ``optimizer_state`` returned."""
        optimizer.load_state_dict(state)

    def all_true(self, flag: bool | torch.Tensor) -> bool:
        """True iff ``flag`` holds on every rank (a host sync)."""
        return bool(flag)

    def vote(self, flag: bool | torch.Tensor) -> torch.Tensor:
        """``all_true`` without the host read: a 0-d bool tensor on the engine's device."""
        return torch.as_tensor(flag, device=self.device).to(torch.bool).reshape(())

    def gather_objects(self, obj: Any) -> list[Any]:
        """``[obj of rank 0, obj of rank 1, ...]``."""
        return [obj]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (picklable; tensors come back on the CPU)."""
        return obj

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        """Sum each tensor over the ranks, in place."""

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


class DDPEngine(Engine):
    """``torch.nn.parallel.DistributedDataParallel`` over the ``torchrun`` process group."""

    kind = "ddp"

    def __init__(self, device: str = "auto"):
        check_launcher(self.kind)
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = _resolve_device(device, self.local_rank)
        self.group: Any = None  # the process group of the collectives (None: every rank)
        self._owns_group = not dist.is_initialized()
        if self._owns_group:
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            kw = {"device_id": self.device} if self.device.type == "cuda" else {}
            dist.init_process_group(backend=backend, rank=self.rank, world_size=self.world_size, **kw)

    def split(self, parts: int) -> Engine:
        super().split(parts)
        if parts == 1:
            return self
        bounds = [*self.part_leaders(parts), self.world_size]
        sub = copy.copy(self)
        for i in range(parts):  # every rank creates every group, in the same order
            ranks = list(range(bounds[i], bounds[i + 1]))
            group = dist.new_group(ranks)
            if self.rank in ranks:
                sub.group, sub.rank, sub.world_size, sub.part = group, ranks.index(self.rank), len(ranks), i
        sub._owns_group = False
        return sub

    def wrap(self, model: nn.Module) -> nn.Module:
        ids = [self.device.index] if self.device.type == "cuda" else None
        return nn.parallel.DistributedDataParallel(model, device_ids=ids, process_group=self.group)

    @contextlib.contextmanager
    def accumulate(self, net: nn.Module, boundary: bool) -> Iterator[None]:
        """No gradient all-reduce before the last micro-batch of a step."""
        sync = boundary or not hasattr(net, "no_sync")
        with contextlib.nullcontext() if sync else net.no_sync():
            yield

    def _collective_device(self) -> torch.device:
        return self.device if dist.get_backend(self.group) == "nccl" else torch.device("cpu")

    def all_true(self, flag: bool | torch.Tensor) -> bool:
        return bool(self._min_over_ranks(flag).item())

    def vote(self, flag: bool | torch.Tensor) -> torch.Tensor:
        return self._min_over_ranks(flag).to(self.device).to(torch.bool).reshape(())

    def _min_over_ranks(self, flag: bool | torch.Tensor) -> torch.Tensor:
        t = torch.as_tensor(flag).to(self._collective_device(), torch.int32).reshape(1).clone()
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return t

    def gather_objects(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, group=self.group, device=self._collective_device(), group_src=src)
        return box[0]

    def all_reduce_sum(self, tensors: list[torch.Tensor]) -> None:
        dev = self._collective_device()
        for t in tensors:
            buf = t.to(dev)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group)
            if buf is not t:
                t.copy_(buf)

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


# DeepSpeed JSON keys the trainer owns: JSON value "auto" (or absent) is filled from the trainer config; any other
# value must equal the trainer's (a mismatch is an error naming both).
_DS_OWNED = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping")
_DS_CKPT_DIR = "deepspeed"  # under <run_dir>/checkpoints: one DeepSpeed checkpoint tag per ckpt_<step>.pt
_DS_TAG = re.compile(r"^step_(\d{8,})$")


def resolve_deepspeed_config(ds: dict[str, Any], cfg: Any, world_size: int, device_type: str) -> dict[str, Any]:
    """The DeepSpeed config ``ds`` with the trainer's settings filled in (``cfg`` a ``TrainConfig``).

    train_batch_size = data.batch_size, gradient_accumulation_steps = optim.grad_accum_steps,
    train_micro_batch_size_per_gpu = batch_size / (world_size * accum), gradient_clipping = optim.grad_clip,
    bf16.enabled = (engine.precision bf16, or auto on a GPU with bf16, on CUDA; CPU runs fp32 master weights with
    bf16 autocast only).
    A JSON value of "auto" (or a missing key) is filled; a concrete value must agree. The trainer owns the
    optimizer (AdamW, ``optim.*``) and the LR schedule: an "optimizer" or "scheduler" section, or fp16, is refused.
    """
    if not isinstance(ds, dict):
        raise ValueError(f"a DeepSpeed config must be a JSON object, got {type(ds).__name__}")
    out = copy.deepcopy(ds)
    accum = int(cfg.optim.grad_accum_steps)
    batch = int(cfg.data.batch_size)
    if batch % (world_size * accum):
        raise ValueError(
            f"data.batch_size {batch} is not divisible by world size {world_size} x optim.grad_accum_steps {accum}"
        )
    want = {
        "train_batch_size": batch,
        "train_micro_batch_size_per_gpu": batch // (world_size * accum),
        "gradient_accumulation_steps": accum,
        "gradient_clipping": float(cfg.optim.grad_clip),
    }
    for key in _DS_OWNED:
        have = out.get(key, "auto")
        if have != "auto" and have != want[key]:
            raise ValueError(
                f'DeepSpeed config {key}={have!r} disagrees with the trainer\'s {want[key]!r}; set it to "auto" '
                f"(filled from data.batch_size, optim.grad_accum_steps, optim.grad_clip and the world size)"
            )
        out[key] = want[key]
    for section in ("optimizer", "scheduler"):
        if section in out:
            raise ValueError(
                f"DeepSpeed config has an {section!r} section; remove it: the trainer builds AdamW from optim.* and "
                f"sets the learning rate every step (optim.lr, warmup_steps, schedule)"
            )
    if out.get("fp16", {}).get("enabled") not in (None, False, "auto"):
        raise ValueError("DeepSpeed fp16 is not supported; use engine.precision=bf16 (valid choices: fp32, bf16, auto)")
    out.pop("fp16", None)
    bf16 = resolve_precision(cfg.engine.precision, device_type) == "bf16" and device_type == "cuda"
    have = out.get("bf16", {}).get("enabled", "auto")
    if have != "auto" and bool(have) != bf16:
        raise ValueError(
            f"DeepSpeed config bf16.enabled={have!r} disagrees with engine.precision {cfg.engine.precision!r} on "
            f'{device_type} (bf16 weights need CUDA); set it to "auto"'
        )
    out["bf16"] = {**out.get("bf16", {}), "enabled": bf16}
    zero = out.setdefault("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"DeepSpeed zero_optimization.stage {stage!r} is invalid; valid choices: 0, 1, 2, 3")
    off = zero.get("offload_optimizer", {}).get("device", "none")
    if off not in ("none", "cpu"):
        raise ValueError(f"DeepSpeed offload_optimizer.device {off!r} is not supported; valid choices: none, cpu")
    out.setdefault("steps_per_print", 2**31 - 1)
    return out


def load_deepspeed_config(path: str | Path) -> dict[str, Any]:
    """The JSON object in ``path``; FileNotFoundError / ValueError naming the path."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"DeepSpeed config {str(p)!r} does not exist")
    return read_json(p, "DeepSpeed config")


class DeepSpeedEngine(DDPEngine):
    """DeepSpeed ZeRO (stage 0-3, optional CPU optimizer offload) around the trainer's model and AdamW.

    ``setup`` calls ``deepspeed.initialize`` with the config of ``engine.deepspeed_config`` resolved by
    ``resolve_deepspeed_config``. DeepSpeed does the gradient reduction, accumulation boundaries and clipping
    inside ``step``. Under ZeRO-3 parameters are partitioned: ``full_params`` gathers them
    (``deepspeed.zero.GatheredParameters``) for the EMA update and the model state. Optimizer state is written by
    DeepSpeed's own ``save_checkpoint`` (one file per rank) under ``checkpoints/deepspeed/step_<N>``; the
    trainer's ``ckpt_<N>.pt``, written after it, names that tag, so a checkpoint is complete once its .pt exists.
    """

    kind = "deepspeed"

    def __init__(self, device: str = "auto"):
        try:
            import deepspeed  # optional dependency (the deepspeed extra)
        except ImportError as exc:
            raise ImportError(
                f"engine.kind 'deepspeed' needs the deepspeed package ({exc}); pip install deepspeed "
                "(or the 'deepspeed' extra), or use engine.kind single or ddp"
            ) from None
        self._ds_mod = deepspeed
        missing = [k for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(
                f"engine.kind 'deepspeed' needs the deepspeed or torchrun launcher environment; missing "
                f"{', '.join(missing)} (one process: deepspeed --num_gpus 1 ...)"
            )
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        self.local_rank = int(os.environ.get("LOCAL_RANK", self.rank))
        self.device = _resolve_device(device, self.local_rank)
        self.group: Any = None
        self._owns_group = not dist.is_initialized()
        # joins an existing process group (e.g. one a DDP engine of the same process created) or creates one
        deepspeed.init_distributed(dist_backend="nccl" if self.device.type == "cuda" else "gloo")
        self.ds: Any = None
        self.stage = 0

    def split(self, parts: int) -> Engine:
        if parts != 1:
            raise ValueError(
                "splitting the ranks into parts (tdc.expert_parallel) needs engine.kind ddp; DeepSpeed "
                "trains over every rank"
            )
        return self

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: Any = None
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if cfg is None or not cfg.engine.deepspeed_config:
            raise ValueError("engine.kind 'deepspeed' needs engine.deepspeed_config (a DeepSpeed JSON file)")
        conf = resolve_deepspeed_config(
            load_deepspeed_config(cfg.engine.deepspeed_config), cfg, self.world_size, self.device.type
        )
        self.stage = int(conf["zero_optimization"].get("stage", 0))
        if conf["zero_optimization"].get("offload_optimizer", {}).get("device", "none") == "cpu":
            from deepspeed.ops.adam import DeepSpeedCPUAdam  # optional dependency, as above

            d = optimizer.defaults  # ZeRO-Offload steps on the CPU with DeepSpeed's vectorised AdamW
            optimizer = DeepSpeedCPUAdam(
                [p for g in optimizer.param_groups for p in g["params"]],
                lr=d["lr"],
                betas=d["betas"],
                eps=d["eps"],
                weight_decay=d["weight_decay"],
                adamw_mode=True,
            )
        self.ds, opt, _, _ = self._ds_mod.initialize(model=model, optimizer=optimizer, config=conf)
        self.config = conf
        return self.ds, opt

    @contextlib.contextmanager
    def accumulate(self, net: nn.Module, boundary: bool) -> Iterator[None]:
        """DeepSpeed reduces (and, at the boundary, finalises) gradients itself; the boundary is set explicitly."""
        self.ds.set_gradient_accumulation_boundary(boundary)
        yield

    def backward(self, loss: torch.Tensor, accum_steps: int = 1) -> None:
        self.ds.backward(loss)  # DeepSpeed scales by 1 / gradient_accumulation_steps itself

    def zero_grad(self, optimizer: torch.optim.Optimizer) -> None:
        self.ds.zero_grad()

    def clip_grad_norm(self, model: nn.Module, max_norm: float) -> torch.Tensor | None:
        return None  # gradient_clipping runs inside DeepSpeed's step on the partitioned gradients

    def step(self, optimizer: torch.optim.Optimizer, lr: float, ok: bool | torch.Tensor = True) -> bool:
        """DeepSpeed's own overflow handling decides: under ZeRO 1-3 its step discards an update whose gradient
        norm is not finite (``was_step_applied``); without ZeRO the gradients are dropped through ``zero_grad``.
        A step whose loss was not finite counts as skipped even if its gradients were."""
        ok = self.all_true(ok)
        if self.stage == 0 and not ok:
            self.ds.zero_grad()
            return False
        for group in optimizer.param_groups:
            group["lr"] = lr
        self.ds.step()
        return ok and self.ds.was_step_applied()

    def full_params(self, model: nn.Module, modify: bool = False) -> contextlib.AbstractContextManager:
        if self.stage < 3:
            return contextlib.nullcontext()
        params = list(model.parameters())
        return self._ds_mod.zero.GatheredParameters(params, modifier_rank=0 if modify else None)

    def optimizer_state(self, optimizer: torch.optim.Optimizer, run_dir: Path, step: int) -> Any:
        root = Path(run_dir) / "checkpoints" / _DS_CKPT_DIR
        tag = f"step_{step:08d}"
        self.ds.save_checkpoint(str(root), tag=tag, save_latest=False)
        self.barrier()
        if self.is_main:  # drop tags whose ckpt_<N>.pt is gone (retention) or was never written (a crash)
            keep = {s for s, _ in list_checkpoints(run_dir)} | {step}
            for d in root.iterdir():
                m = _DS_TAG.match(d.name)
                if m and int(m.group(1)) not in keep:
                    shutil.rmtree(d, ignore_errors=True)
        return {"deepspeed_tag": tag, "zero_stage": self.stage}

    def load_optimizer_state(self, optimizer: torch.optim.Optimizer, state: Any, run_dir: Path) -> None:
        if not isinstance(state, dict) or "deepspeed_tag" not in state:
            raise ValueError("cannot resume with engine.kind 'deepspeed' from a checkpoint written by another engine")
        if state["zero_stage"] != self.stage:
            raise ValueError(
                f"cannot resume: the checkpoint was written with ZeRO stage {state['zero_stage']}, this run uses "
                f"{self.stage}"
            )
        root = Path(run_dir) / "checkpoints" / _DS_CKPT_DIR
        path, _ = self.ds.load_checkpoint(
            str(root), tag=state["deepspeed_tag"], load_optimizer_states=True, load_lr_scheduler_states=False
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed checkpoint {state['deepspeed_tag']!r} is missing under {str(root)!r}")


def create_engine(kind: str = "auto", device: str = "auto") -> Engine:
    """``auto``: DDP when launched by torchrun with WORLD_SIZE > 1, else single; ``deepspeed`` only by name."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"unknown engine kind {kind!r}; choose one of {ENGINE_KINDS}")
    if kind == "auto":
        kind = "ddp" if int(os.environ.get("WORLD_SIZE", "1")) > 1 else "single"
    if kind == "deepspeed":
        return DeepSpeedEngine(device)
    return DDPEngine(device) if kind == "ddp" else Engine(device)


def unwrap(model: nn.Module) -> nn.Module:
    """The bare module under DDP and ``torch.compile`` wrappers."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel) or type(model).__name__ == "DeepSpeedEngine":
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model
