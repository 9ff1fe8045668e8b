"""Immiscible diffusion (Li, Jiang, Kodaira, Tomizuka, Keutzer, Xu, "Immiscible Diffusion: Accelerating Diffusion
Training with Noise Assignment", NeurIPS 2024, arXiv 2406.12303; official code yhli123/Immiscible-Diffusion).

Before the forward process, the batch's B noise samples are assigned to its B images by a linear assignment that
minimises the total image-noise distance (the paper's Algorithm 1, the code's
``linear_sum_assignment(vector_norm(x0_i - eps_j))``):

    sigma = argmin_{sigma in S_B} sum_i || x0_i - eps_sigma(i) ||_2        (x0, eps flattened to (B, C H W))

and image i is diffused with eps_sigma(i); the timesteps are drawn independently of the pairing. The cost is the
L2 distance itself, as the official code has it, not its square: with squared costs the sum of ||x0_i||^2 +
||eps_j||^2 is the same for every sigma, and the assignment is the one that maximises sum_i <x0_i, eps_sigma(i)>, a
different pairing in general.

**How it is done here: the data moves, the noise stays.** The noise is never stored: ``ops.q_sample_coef`` and
``ops.diffusion_loss_coef`` regenerate it in-kernel from the step's Philox seed, stream b (elements b C H W to
(b + 1) C H W - 1) for batch position b. Permuting a noise tensor is therefore not possible without passing an index
into every backend of both ops. Instead, with pi = sigma^-1 (pi(b): the image assigned to noise stream b), the
objective trains on (x0[pi], y[pi]) at positions b = 0..B-1, each with noise stream b. This is exactly the paper's
draw:

- The set of training pairs is the same: position b holds (x0_pi(b), eps_b) = (x0_i, eps_sigma(i)) for i = pi(b).
- Everything else the step draws per position is independent of the content: the cells k_b (drawn i.i.d. by
  ``ops.sample_timesteps`` from the sampler's weights), the formulation's point inside each cell and the token
  routing's kept set (from the step's generator), the label dropout (inside the model, per position). sigma is a
  function of (x0, eps) only, so (k_sigma(i))_i has the distribution of (k_i)_i given (x0, eps): image i with
  noise eps_sigma(i) and cell k_sigma(i) is distributed as the paper's image i with noise eps_sigma(i) and cell k_i.
- What reads the per-sample losses reads them per position with that position's cell: the timestep samplers'
  ``observe(k, loss)`` (the curriculum's per-timestep filing, importance sampling's history) file loss b under k_b,
  the cell it was trained at, and the importance weights are per position too. No part of the step keys anything
  to the data's index in the batch. The probe of a loss-probing sampler calls the objective on a fixed (x0, seed)
  before and after the update, so it sees one assignment both times.
- The terms that pair samples within the batch (contrastive's negative i - 1) pair positions, i.e. another
  (image, noise) pair of the batch, as they did on the loader's (random) order.

The one cost: the noise is regenerated once per (micro-)batch by ``ops.philox_randn`` to build the (B, B) cost
matrix (as the objective already does for a term that ``needs_noise``; it is shared with such a term), plus the
distances (B^2 C H W multiply-adds, float64) and the assignment itself, O(B^3) on the host with scipy's
Jonker-Volgenant solver (the cost matrix is copied to the host: a synchronisation per micro-batch, hence not with
``engine.cuda_graphs``). The regenerated noise agrees with the kernels' to a few ulp across backends (docs/ops.md),
bit for bit on the same backend; an assignment could differ only at an exact tie of the total distance.

**Where it lives.** It adds no loss, so it is not a ``TrainingTerm`` in ``terms.use`` (which would need a weight
and a hook into the objective for a term whose forward is zero): it is a switch of the ``terms`` section,
``terms.immiscible``, that the objective (layer 3, which may call ``ops``) reads; this module (layer 2, beside
``ops``) holds the assignment alone and takes the regenerated noise as an argument. The objective applies it on
every call (training, the probes of the timestep samplers, TDC's fine-tunes and scores built from the run's
config): the run's loss is the loss under the assigned noise.

**Per rank and per micro-batch.** The assignment pairs the noise and images of one (micro-)batch on one rank, the
B / (ranks x ``optim.grad_accum_steps``) samples that the objective sees at once; ranks exchange nothing. The
paper's Stable Diffusion code gathers the global batch's distances on rank 0 and assigns over all of it: with many
ranks or accumulation steps our pool is smaller, and so is the effect (the distance saved grows with the pool).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import Options, option

SCIPY_MISSING = "terms.immiscible needs scipy (its linear assignment): pip install scipy, or set terms.immiscible=false"


@dataclass
class ImmiscibleOptions(Options):
    """The switch ``terms.immiscible`` (module doc: where it lives)."""

    SWITCH = "immiscible"
    immiscible: bool = option(
        False,
        "immiscible diffusion (Li et al., arXiv 2406.12303): each (micro-)batch's noise assigned to its images by "
        "a linear assignment of least total distance (terms/immiscible.py; no loss of its own, needs scipy)",
    )

    def active(self) -> bool:
        return self.immiscible

    def refusal(self, cfg: Any, use: str) -> str | None:
        if use == "cuda_graphs":
            return (
                "engine.cuda_graphs does not work with terms.immiscible (its assignment runs on the host); set "
                "engine.cuda_graphs=false"
            )
        return None

    def pairing(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """What the objective does to the step's draw: noise stream b trains on image ``assign_noise(x0, noise)[b]``."""
        return assign_noise


def pair_costs(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """(B, B) float64 costs: entry (b, i) is || eps_b - x0_i ||_2 over the flattened sample (row b: noise stream b)."""
    return torch.cdist(noise.flatten(1).double(), x0.flatten(1).double())  # (B, B)


def assign_noise(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """pi (B,) int64 on x0's device: noise stream b is assigned image pi[b], the assignment that minimises
    sum_b || eps_b - x0_pi(b) ||_2 (module doc). Train on ``x0[pi], y[pi]`` with the noise in place."""
    if x0.shape != noise.shape:
        raise ValueError(f"immiscible: x0 {tuple(x0.shape)} and noise {tuple(noise.shape)} must have one shape")
    b = x0.shape[0]
    if b <= 1:
        return torch.arange(b, dtype=torch.int64, device=x0.device)
    try:  # scipy (a dependency, heavy to import): imported when the assignment runs, loud if it is missing
        from scipy.optimize import linear_sum_assignment
    except ImportError as e:
        raise ImportError(SCIPY_MISSING) from e
    with torch.no_grad():
        cost = pair_costs(x0, noise).cpu().numpy()  # (B, B): the one host copy of the step
    rows, cols = linear_sum_assignment(cost)  # rows = 0..B-1 (the noise streams), cols[b]: the image of stream b
    return torch.as_tensor(cols, dtype=torch.int64).to(x0.device)
