"""Contrastive flow matching, DeltaFM (Stoica, Ramanujan, Fan, Farhadi, Krishna, Hoffman, "Contrastive Flow
Matching", ICCV 2025, arXiv 2506.05350; official code gstoica27/DeltaFM).

The paper's objective (its Eq. 6) for a flow model v_theta with target v = alpha' x + sigma' eps:

    L = E || v_theta(x_t, t, y) - (alpha'_t x + sigma'_t eps) ||^2 - lambda E || v_theta(x_t, t, y) - (alpha'_t x~
        + sigma'_t eps~) ||^2

where (x~, eps~) is another sample of the batch (a negative pair: its data and noise, another class with high
probability), and lambda = 0.05 (the paper's and the code's ``--contrastive-weight``). The first term is the
regression loss the objective already has; this term is the second, -|| pred - target~ ||^2 per sample, and the
objective adds it with weight ``terms.contrastive_weight`` (lambda).

Defined here for every formulation: the target is the formulation's p x0 + q eps (``TrainingDraw``), so the
negative of sample i is p_i x0_j + q_i eps_j at sample i's own noise level: DeltaFM's (alpha'_t x~ + sigma'_t eps~)
for flow with v prediction, and the same construction for DDPM (eps, x0 or v targets) and EDM. Choices made here:

- The negative of sample i is sample i - 1 of the (micro-)batch (a roll by one), not a random pairing: no random
  stream is used, so resumes and ranks need nothing more, and every sample is one negative exactly once. A batch of
  one has no other sample: refused.
- The squared distance is the per-sample mean over C, H, W (as the regression loss) and carries the same weight w_i
  (1 unless ``diffusion.weighting`` weights the regression, e.g. MinSNR).
- The noise is not stored (the fused ops regenerate it): the objective regenerates eps from the step's Philox seed
  for this term (``needs_noise``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import Options, option
from diffcurr_fast.terms.base import TermInputs, TrainingTerm


@dataclass
class ContrastiveOptions(Options):
    """contrastive's options in the ``terms`` section (keys ``terms.contrastive_*``)."""

    PREFIX = "contrastive_"
    weight: float = option(
        0.05, "contrastive (DeltaFM, arXiv 2506.05350): lambda of its negative pair", lo=0.0, lo_open=True
    )

    def min_micro_batch(self, cfg: Any) -> int:
        return 2  # a negative pair


class Contrastive(TrainingTerm):
    """-w_i || pred_i - (p_i x0_{i-1} + q_i eps_{i-1}) ||^2 (module doc); reads no features."""

    features = ()
    needs_noise = True
    Options = ContrastiveOptions

    @classmethod
    def from_config(cls, cfg: Any) -> Contrastive:
        return cls()

    def forward(self, inputs: TermInputs) -> torch.Tensor:
        x0, d = inputs.x0, inputs.draw
        if x0.shape[0] < 2:
            raise ValueError("terms.use contrastive needs at least 2 samples per (micro-)batch: a negative pair")
        eps = inputs.noise.to(x0.dtype)  # (B, C, H, W): the step's noise
        shape = (-1,) + (1,) * (x0.dim() - 1)
        p, q = d.p.to(x0.dtype).view(shape), d.q.to(x0.dtype).view(shape)
        negative = p * x0.roll(1, dims=0) + q * eps.roll(1, dims=0)  # (B, C, H, W): sample i - 1's data and noise
        dist = (inputs.pred - negative).square().flatten(1).mean(dim=1)  # (B,)
        return -d.w.to(dist.dtype) * dist
