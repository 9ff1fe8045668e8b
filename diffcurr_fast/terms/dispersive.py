"""Dispersive loss (Wang and He, "Diffuse and Disperse: Image Generation with Representation Regularization", arXiv
2506.09027; official code raywang4/DispLoss, its InfoNCE-L2 variant).

A regulariser with no positive pairs: the representations z_i of one block's output tokens (flattened, (B, F)) are
pushed apart within the batch,

    L_disp = log (1 / B^2) sum_{i, j} exp(-||z_i - z_j||^2 / (F tau))

(the paper's Eq. for InfoNCE with the squared L2 distance; the official PyTorch code divides the distance by the
feature size F and uses tau = 1, over the full B x B matrix, its diagonal of zeros included). It reaches -log B
quickly: that is expected (its authors, DispLoss issues 1 and 3); it needs B > 1.

Choices made here: the block is ``terms.dispersive_block`` (the DiT's output tokens after that block, the same pass;
default depth // 4); the loss is one number per (micro-)batch, returned to every sample (the objective's mean over
the batch is L_disp); computed in float32; the representations are per rank (no gather across ranks, as the
official code).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import Options, option
from diffcurr_fast.terms.base import TermInputs, TrainingTerm, check_block


def dispersive_loss(z: torch.Tensor, tau: float = 1.0) -> torch.Tensor:
    """L_disp of z (B, ...) (module doc), a 0-d float32 tensor."""
    z = z.float().flatten(1)  # (B, F)
    d = torch.cdist(z, z).square() / (z.shape[1] * tau)  # (B, B), zero diagonal
    return torch.logsumexp(-d.flatten(), dim=0) - 2.0 * torch.log(torch.tensor(float(z.shape[0])))


@dataclass
class DispersiveOptions(Options):
    """dispersive's options in the ``terms`` section (keys ``terms.dispersive_*``)."""

    PREFIX = "dispersive_"
    weight: float = option(0.5, "dispersive (Wang and He, arXiv 2506.09027): its weight", lo=0.0, lo_open=True)
    block: int | None = option(None, "dispersive: the block whose output tokens it disperses (None: depth // 4)", lo=0)
    tau: float = option(1.0, "dispersive: the temperature tau", lo=0.0, lo_open=True)

    def validate(self, cfg: Any) -> None:
        check_block("dispersive_block", self.block, cfg)

    def min_micro_batch(self, cfg: Any) -> int:
        return 2  # it compares the samples of the batch


class Dispersive(TrainingTerm):
    """The dispersive loss of block ``block``'s output tokens, the batch's value for every sample (module doc)."""

    Options = DispersiveOptions

    def __init__(self, block: int, tau: float = 1.0):
        super().__init__()
        self.features, self.tau = (int(block),), float(tau)

    @classmethod
    def from_config(cls, cfg: Any) -> Dispersive:
        t = cfg.terms
        return cls(t.dispersive_block if t.dispersive_block is not None else cfg.model.depth // 4, t.dispersive_tau)

    def forward(self, inputs: TermInputs) -> torch.Tensor:
        z = inputs.features[self.features[0]]  # (B, T, D)
        if z.shape[0] < 2:
            raise ValueError("terms.use dispersive needs at least 2 samples per (micro-)batch")
        return dispersive_loss(z, self.tau).expand(z.shape[0])  # (B,)
