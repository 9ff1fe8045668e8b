"""The proxy of proxy-based pruning (TDC, arXiv 2312.13307, Sec. 3.3): a short recovery fine-tune of a pruned
candidate on its group's timesteps (``recover``), then its score, the group's diffusion loss on held-out batches
with fixed t and noise (``proxy_loss``). The search around them is ``search.py``.
"""

from __future__ import annotations

import torch

from diffcurr_fast.objective import default_objective, fit_steps
from diffcurr_fast.tdc.prune import Batches, group_loss, group_weights

__all__ = ["proxy_loss", "recover"]


def recover(
    model,
    group,
    data: Batches,
    steps: int,
    *,
    objective,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> list[float]:
    """Short recovery fine-tune of ``model`` on the group's timesteps with the training ``objective`` (AdamW,
    t ~ U[group]); returns the losses. ``data`` is a sequence of ``(x0, y)`` batches, cycled. The model is left
    in eval mode."""
    data = list(data)
    if steps and not data:
        raise ValueError("recover needs at least one (x0, y) batch")
    objective = default_objective(objective, model)
    losses = fit_steps(
        model,
        objective,
        data,
        group_weights(objective, group),
        steps,
        lr=lr,
        weight_decay=weight_decay,
        generator=torch.Generator().manual_seed(seed),
    )
    model.eval()
    return losses


@torch.no_grad()
def proxy_loss(model, group, heldout: Batches, *, objective, seed: int = 1234) -> float:
    """The proxy: mean training-objective loss of the group on held-out batches with t and noise from ``seed``."""
    heldout = list(heldout)
    if not heldout:
        raise ValueError("proxy_loss needs at least one held-out (x0, y) batch")
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for x0, y in heldout:
        total += float(group_loss(model, objective, group, x0, y, gen))
    model.train(was_training)
    return total / len(heldout)
