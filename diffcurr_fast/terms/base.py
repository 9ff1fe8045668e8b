"""A training term: a per-sample loss that the objective adds to the regression loss, read from the same step.

Methods such as contrastive flow matching, dispersive loss, representation alignment (SRA, REPA) or immiscible noise
optimise something besides the denoising regression. Each is a ``TrainingTerm``: it declares which of the model's
features it reads (``features``: block indices j whose output tokens the DiT returns from the same forward pass,
``DiT.forward(..., features=)``), and maps the step's ``TermInputs`` to a (B,) loss. The ``Objective`` sums
``weight * term(inputs)`` into its per-sample loss, so importance correction, logging and the skip rules see one loss;
with no terms it calls the model exactly as before.

A term is an ``nn.Module``: trainable parts (a projector MLP) are its submodules, and state it keeps (a teacher's
reference, a running statistic) goes through ``state_dict``. docs/architecture.md ("Adding a training term") says
where a term lives and how it reaches the optimizer, the EMA, the checkpoint and the config.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffcurr_fast.diffusion import TrainingDraw
from diffcurr_fast.options import Options


@dataclass
class TermInputs:
    """What a term may read of one (micro-)batch: the data, the draw and the network's answer.

    ``x0`` (B, C, H, W) and ``y`` (B,) the batch; ``draw`` the formulation's per-sample draw (t, t_in, a, c, p,
    q, w: ``x_in = a x0 + c eps``, target ``p x0 + q eps``); ``x_in`` the network input; ``seed`` the Philox seed of
    eps; ``pred`` (B, C, H, W) the network's prediction; ``features`` {j: (B, T, D) tokens after block j} for the
    blocks the terms asked for; ``noise`` (B, C, H, W) eps itself, regenerated from ``seed`` by the objective when a
    term sets ``needs_noise`` (the fused ops never store it), else None. For a term that runs another network at
    other noise levels (SRA's teacher): ``cells`` (B,) the cells k of the draw on the formulation's difficulty axis
    of ``num_cells`` cells (higher k: more noise), ``redraw(k, generator)`` the formulation's draw at other cells
    (a point inside each continuous cell drawn from ``generator``), and ``autocast()`` the objective's precision
    context of the network call.
    """

    x0: torch.Tensor
    y: torch.Tensor
    draw: TrainingDraw
    x_in: torch.Tensor
    seed: int
    pred: torch.Tensor
    features: dict[int, torch.Tensor]
    noise: torch.Tensor | None = None
    cells: torch.Tensor | None = None
    num_cells: int = 0
    redraw: Callable[[torch.Tensor, torch.Generator | None], TrainingDraw] | None = None
    autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext


class TrainingTerm(nn.Module):
    """Base class of a training term (module doc). Subclasses set ``features`` and implement ``forward``."""

    features: tuple[int, ...] = ()  # the blocks whose output tokens this term reads
    needs_noise: bool = False  # the objective regenerates the step's noise for it (``TermInputs.noise``)
    Options: type[Options] = Options  # its fields in the ``terms`` section (``options.Options``), ``weight`` first

    def attach_teacher(self, teacher: nn.Module) -> None:
        """The trainer hands every term the run's EMA model once it exists; a term that reads a teacher keeps a
        reference to it (never a copy, never a submodule: its weights stay the EMA's), the others ignore it."""

    def forward(self, inputs: TermInputs) -> torch.Tensor:
        """(B,) per-sample loss of this term, unweighted."""
        raise NotImplementedError


def check_block(key: str, block: int | None, cfg: Any) -> None:
    """ValueError unless ``block`` (the key's value, None for its default) is a block of the model."""
    depth = cfg.model.depth
    if block is not None and block >= depth:
        raise ValueError(f"terms.{key} {block} must be a block of the model: 0 to {depth - 1}")
