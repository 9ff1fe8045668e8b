"""Exponential moving average of the model weights (as DiT keeps it; Polyak averaging).

ema <- d ema + (1 - d) theta after every optimizer step, with d = ``decay`` (DiT: 0.9999) or, with ``warmup``,
d_n = min(decay, (1 + n) / (10 + n)) at update n (the usual warm-up, so early averages are not dominated by the
random initialisation). Buffers are copied. The EMA is kept in float32 whatever the model's dtype.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn


class EMA:
    """EMA of ``model``'s parameters; ``module`` is an eval-mode, no-grad copy holding the averages."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = True):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1], got {decay!r}")
        self.decay, self.warmup = float(decay), bool(warmup)
        self.module = copy.deepcopy(model).float().eval().requires_grad_(False)
        self.num_updates = 0

    def current_decay(self) -> float:
        """Decay used by the next update."""
        if not self.warmup:
            return self.decay
        n = self.num_updates
        return min(self.decay, (1.0 + n) / (10.0 + n))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """ema <- d ema + (1 - d) theta for every parameter; buffers copied."""
        d = self.current_decay()
        ema_p = [p for p in self.module.parameters()]
        src_p = [p.detach().to(torch.float32) for p in model.parameters()]
        if len(ema_p) != len(src_p):
            raise ValueError(f"EMA has {len(ema_p)} parameters, the model {len(src_p)}")
        torch._foreach_lerp_(ema_p, src_p, 1.0 - d)  # ema + (1 - d)(theta - ema)
        for b_ema, b in zip(self.module.buffers(), model.buffers()):
            b_ema.copy_(b)
        self.num_updates += 1

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "num_updates": self.num_updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.num_updates = int(state["num_updates"])
