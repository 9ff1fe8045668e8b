"""The proxy of proxy-based pruning (TDC, arXiv 2312.13307, Sec. 3.3): a short recovery fine-tune of a pruned
candidate on its group's timesteps (``recover``), then its score, the group's diffusion loss on held-out batches
with fixed t and noise (``proxy_loss``). The search around them is ``search.py``.
"""

from __future__ import annotations

import math

import torch

from diffcurr_fast.tdc.prune import Batches, group_loss

__all__ = ["proxy_loss", "recover"]


def recover(
    model,
    group,
    data: Batches,
    steps: int,
    *,
    schedule,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> list[float]:
    """Short recovery fine-tune of ``model`` on the group's timesteps (AdamW, t ~ U[group]); returns the losses.

    ``data`` is a sequence of ``(x0, y)`` batches, cycled. The model is left in eval mode.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    data = list(data)
    if steps and not data:
        raise ValueError("recover needs at least one (x0, y) batch")
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[float] = []
    if steps:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        gen = torch.Generator().manual_seed(seed)
        model.train()
        for step in range(steps):
            x0, y = data[step % len(data)]
            loss = group_loss(model, schedule, group, x0, y, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    model.eval()
    return losses


@torch.no_grad()
def proxy_loss(model, group, heldout: Batches, *, schedule, seed: int = 1234) -> float:
    """The proxy: mean group diffusion loss on held-out batches with t and noise drawn from ``seed``."""
    heldout = list(heldout)
    if not heldout:
        raise ValueError("proxy_loss needs at least one held-out (x0, y) batch")
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for x0, y in heldout:
        total += float(group_loss(model, schedule, group, x0, y, gen))
    model.train(was_training)
    return total / len(heldout)
