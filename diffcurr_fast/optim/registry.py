"""The optimizers by name (``optim.name``): name -> ``module:Class``, imported on first use.

Adding an optimizer is one new file in this package (a class with ``Options`` (``options.Options``: its fields in the
``optim`` section, its rules and refusals) and ``build(model, cfg, device)``) and one line here. Every optimizer
takes the section's own ``optim.lr``, betas, eps and weight decay, and the learning rate the trainer sets on its
``param_groups`` at every step (warmup and schedule).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from diffcurr_fast.options import load

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
