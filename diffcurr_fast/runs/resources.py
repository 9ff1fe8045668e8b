"""What a command asks of the machine's memory, checked before it builds or starts anything (its threads:
``runs.threads``).

- ``training_memory(cfg, world, device)``, ``sampling_memory(cfg, num_params, batch, num, guided)``: a lower bound
  of the memory a run or a draw needs (``MemoryEstimate``), from the model's parameter count and its activations;
  ``check_fits`` refuses one above the memory of the device it will run on (the GPU's, or the machine's RAM and
  cgroup limit), in one line with the estimate, before the allocator would fail with a traceback.

The bound is kept low on purpose, so that nothing that runs is refused: parameters at 16 bytes each in training
(fp32 weights and gradients, one optimizer moment, the EMA copy; AdamW keeps two), the weights, gradients and
optimizer state divided over the ranks under DeepSpeed (ZeRO-3 shards all three), and per sample and block only the
token tensors a block cannot do without (``ACTIVATIONS_PER_BLOCK`` of (T, D); the MLP's 4D-wide hidden layer,
attention's scores and the norms are left out), at 2 bytes each under bf16 / fp16 autocast, block inputs only with
``engine.grad_checkpointing``, and the routed blocks at their kept tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffcurr_fast.runs.config import TrainConfig

ACTIVATIONS_PER_BLOCK = 8  # (T, D) tensors a block keeps per sample for its backward: its input, q, k, v, ...
TRAIN_BYTES_PER_PARAM = 16  # fp32 weight, gradient, one optimizer moment, EMA copy
GiB = 1024**3


@dataclass(frozen=True)
class MemoryEstimate:
    """A lower bound of what a command needs in memory: ``params`` parameters taking ``param_bytes`` (with their
    gradients, optimizer state and copies) and ``activation_bytes`` for ``what`` (e.g. "64 samples per
    micro-batch")."""

    params: int
    param_bytes: int
    activation_bytes: int
    what: str
    output_bytes: int = 0  # samples a draw holds until it writes them

    @property
    def total(self) -> int:
        return self.param_bytes + self.activation_bytes + self.output_bytes


def _tokens(cfg: TrainConfig) -> tuple[int, int, int]:
    """(tokens T, width D, blocks) of the model ``cfg`` describes."""
    m = cfg.model
    return (m.input_size // m.patch_size) ** 2, m.hidden_size, m.depth


def count_params(cfg: TrainConfig) -> int:
    """The parameter count of the model ``cfg`` describes, built on the meta device (shapes only, no memory)."""
    # imported here, not at the top: importing this module stays free of torch
    import torch

    from diffcurr_fast.runs.sampling import build_model

    with torch.device("meta"):
        return sum(p.numel() for p in build_model(cfg).parameters())


def _activation_bytes(cfg: TrainConfig, samples: int, per_block: int, width: int) -> int:
    """``per_block`` (T, D) tensors per sample and block of ``width`` bytes, the routed blocks at their kept tokens."""
    # imported here, not at the top: importing this module stays free of torch
    from diffcurr_fast.models.routing import Route, RoutingOptions

    t, d, depth = _tokens(cfg)
    route, routed, kept = Route.from_config(cfg), 0, t
    if route is not None:  # token routing: the span's blocks see the kept tokens
        lo, hi = RoutingOptions.of(cfg.model).span(depth)
        routed, kept = hi - lo, route.kept
    tokens = (depth - routed) * t + routed * kept  # tokens summed over the blocks
    return samples * tokens * d * per_block * width


def training_memory(cfg: TrainConfig, world: int, device: Any) -> MemoryEstimate:
    """The lower bound of one rank's memory in training ``cfg`` over ``world`` ranks on ``device`` (module doc)."""
    # imported here, not at the top: importing this module stays free of torch
    from diffcurr_fast.objective import resolve_precision

    n = count_params(cfg)
    copies = 1 + len(cfg.optim.phema_sigma_rels) * bool(cfg.optim.phema_every)  # the EMA and post-hoc EMAs, whole
    shared = 3 / (world if cfg.engine.kind == "deepspeed" else 1)  # weights, gradients, a moment: ZeRO shards them
    param_bytes = int(n * 4 * (copies + shared))
    micro = max(1, cfg.data.batch_size // (world * cfg.optim.grad_accum_steps))
    width = 4 if resolve_precision(cfg.engine.precision, device) == "fp32" else 2
    per_block = 1 if cfg.engine.grad_checkpointing else ACTIVATIONS_PER_BLOCK
    act = _activation_bytes(cfg, micro, per_block, width)
    return MemoryEstimate(n, param_bytes, act, f"{micro} samples per micro-batch")


def sampling_memory(cfg: TrainConfig, num_params: int, batch: int, num: int, guided: bool) -> MemoryEstimate:
    """The lower bound of a draw of ``num`` samples in batches of ``batch`` from a model of ``num_params`` fp32
    parameters (``guided``: classifier-free guidance runs each batch twice as wide): the weights, two (T, D)
    tensors per sample of the widest batch, and the samples held until they are written."""
    m = cfg.model
    b = min(batch, num) * (2 if guided else 1)
    act = _activation_bytes(cfg, b, 2, 4)
    out = num * m.in_channels * m.input_size**2 * 4
    return MemoryEstimate(num_params, num_params * 4, act, f"batches of {min(batch, num)}", out)


def device_memory(device: Any) -> tuple[int, str]:
    """(bytes, a name) of the memory ``device`` offers: a GPU's total memory, else the machine's RAM (or its
    cgroup's limit when lower)."""
    # imported here, not at the top: importing this module stays free of torch
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return int(props.total_memory), f"GPU {props.name}"
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = Path("/sys/fs/cgroup/memory.max")
    try:
        text = limit.read_text().strip()
        if text.isdigit():
            return min(total, int(text)), "this machine's memory (its cgroup limit)"
    except OSError:
        pass
    return total, "this machine's memory"


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n:.3g} {unit}"
        n /= 1024
    raise AssertionError  # unreachable


def _count(n: int) -> str:
    return f"{n:,}" if n < 1e12 else f"{n:.3g}"


def check_fits(est: MemoryEstimate, device: Any, fix: str) -> None:
    """ValueError in one line when ``est`` exceeds the memory of ``device``; ``fix`` says what to make smaller."""
    have, name = device_memory(device)
    if est.total <= have:
        return
    out = f", {_size(est.output_bytes)} for the samples held until written" if est.output_bytes else ""
    raise ValueError(
        f"this needs at least {_size(est.total)} of memory ({_count(est.params)} parameters: "
        f"{_size(est.param_bytes)}; activations for {est.what}: {_size(est.activation_bytes)}{out}), more than the "
        f"{_size(have)} of {name}; {fix}"
    )


__all__ = [
    "MemoryEstimate",
    "check_fits",
    "count_params",
    "device_memory",
    "sampling_memory",
    "training_memory",
]
