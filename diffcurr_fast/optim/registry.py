"""The optimizers by name (``optim.name``): name -> ``module:Class``, imported on first use.

Adding an optimizer is one new file in this package (a class with ``Options`` (``options.Options``: its fields in the
``optim`` section, its rules and refusals) and ``build(model, cfg, device)``) and one line here. Every optimizer
takes the section's own ``optim.lr``, betas, eps and weight decay, and the learning rate the trainer sets on its
``param_groups`` at every step (warmup and schedule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from diffcurr_fast.options import load, nonneg, option, positive, unit

OPTIM_IMPLS = ("auto", "torch", "apex")  # AdamW kernels (``adamw.py``)
LR_SCHEDULES = ("constant", "cosine")  # ``train.loop.lr_at``
# The largest EMA length of a post-hoc EMA profile (``runs.posthoc_ema``): exponent gamma = 0, the running mean, whose
# relative standard deviation is (1 / (2^2 * 3))^(1/2) (EDM2 eq. 3). Over gamma > -1 the maximum is phi^(-5/2) ~ 0.3003
# (gamma ~ -0.382), but between the two every sigma_rel has two exponents < 0, which weigh early weights more.
PHEMA_SIGMA_REL_MAX = 12**-0.5
OPTIMIZERS: dict[str, str] = {
    "adamw": "diffcurr_fast.optim.adamw:AdamW",
    "muon": "diffcurr_fast.optim.muon:Muon",
    "schedule_free": "diffcurr_fast.optim.schedule_free:ScheduleFree",
}


def optimizer_class(name: str) -> type:
    """The optimizer registered as ``name``; ValueError naming the valid ones."""
    if name not in OPTIMIZERS:
        raise ValueError(f"unknown optim.name {name!r}; valid choices: {', '.join(OPTIMIZERS)}")
    return load(OPTIMIZERS[name])


def check_optimizer(cfg: Any, device: Any) -> None:
    """What only the device tells (a kernel, a package) about the optimizer of ``cfg.optim.name``: ValueError or
    ImportError in one line; the config's validation has checked its options and refusals."""
    optimizer_class(cfg.optim.name).check_device(cfg, device)


def build_optimizer(model: Any, cfg: Any, device: Any) -> Any:
    """The optimizer of ``cfg.optim.name`` over the trainable parameters of ``model``."""
    check_optimizer(cfg, device)
    return optimizer_class(cfg.optim.name).build(model, cfg, device)


@contextlib.contextmanager
def at_train_point(optimizer: Any) -> Iterator[None]:
    """Inside: the parameters at the point where the optimizer takes its gradient and updates; outside, at the
    point that every reader of the weights gets. One point for most optimizers; schedule-free AdamW: its gradient
    point y inside and the averaged point x outside (``schedule_free.py``), through its ``train()`` and ``eval()``."""
    points = callable(getattr(optimizer, "train", None))  # schedulefree's optimizers; torch's have no train()
    if points:
        optimizer.train()
    try:
        yield
    finally:
        if points:
            optimizer.eval()


@dataclass
class OptimOptions:
    """The optimizer, learning-rate schedule, clipping and EMA."""

    lr: float = option(1e-4, "peak learning rate", lo=0.0, lo_open=True)
    weight_decay: float = nonneg(0.0, "AdamW weight decay")
    beta1: float = unit(0.9, "AdamW beta1", hi_open=True)
    beta2: float = unit(0.999, "AdamW beta2", hi_open=True)
    eps: float = option(1e-8, "AdamW epsilon", lo=0.0, lo_open=True)
    impl: str = option(
        "auto",
        "AdamW kernels: auto / torch (torch's fused kernel, CUDA and CPU) or apex (NVIDIA apex FusedAdam)",
        OPTIM_IMPLS,
    )
    name: str = option(
        "adamw", "the optimizer (optim/registry.py; each takes lr, betas, eps, weight_decay)", OPTIMIZERS
    )
    warmup_steps: int = nonneg(0, "linear warmup steps from 0 to lr")
    schedule: str = option("constant", "learning-rate schedule after warmup", LR_SCHEDULES)
    min_lr: float = nonneg(0.0, "final learning rate of the cosine schedule (<= lr)")
    grad_clip: float = nonneg(0.0, "clip the global gradient norm to this (0 = off)")
    grad_accum_steps: int = positive(1, "micro-batches per optimizer step (data.batch_size is split into them)")
    ema_decay: float = unit(0.9999, "EMA decay of the weights (DiT: 0.9999)")
    ema_warmup: bool = option(True, "use decay min(ema_decay, (1 + n) / (10 + n)) at update n")
    phema_every: int = nonneg(
        0,
        "post-hoc EMA (EDM2): steps between snapshots of the power-function averages under phema/, and one at "
        "the end; `sample` / `eval --ema-length` reconstruct any EMA length from them (0 = off)",
    )
    phema_sigma_rels: list[float] = option(
        [0.05, 0.10],
        "post-hoc EMA: the EMA lengths tracked (EDM2 sigma_rel, the profile's width relative to the training time; "
        "each in (0, 12^-1/2]; 12^-1/2 is the plain running mean)",
        lo=0.0,
        hi=PHEMA_SIGMA_REL_MAX,
        lo_open=True,
    )

    def validate(self) -> None:
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr {self.min_lr!r} must be <= optim.lr {self.lr!r}")
        rels = self.phema_sigma_rels
        if self.phema_every and (not rels or len(set(rels)) != len(rels)):
            raise ValueError(
                f"optim.phema_sigma_rels {rels!r} must list one or more distinct values when optim.phema_every is set"
            )
