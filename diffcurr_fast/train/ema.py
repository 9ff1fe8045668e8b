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
        self._cache: tuple | None = None  # (model, its lists) of the last update

    def current_decay(self) -> float:
        """Decay used by the next update."""
        if not self.warmup:
            return self.decay
        n = self.num_updates
        return min(self.decay, (1.0 + n) / (10.0 + n))

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        """ema <- d ema + (1 - d) theta for every parameter (one ``_foreach_lerp_``); buffers copied (one
        ``_foreach_copy_``)."""
        d = self.current_decay()
        ema_p, src_p, ema_b, src_b = self._lists(model)
        if any(p.dtype != torch.float32 for p in src_p):  # a low-precision model: its weights upcast first
            src_p = [p.to(torch.float32) for p in src_p]
        torch._foreach_lerp_(ema_p, src_p, 1.0 - d)  # ema + (1 - d)(theta - ema)
        if ema_b:
            torch._foreach_copy_(ema_b, src_b)
        self.num_updates += 1

    def _lists(self, model: nn.Module) -> tuple[list[torch.Tensor], ...]:
        """(EMA parameters, model parameters, EMA buffers, model buffers), built once per model: walking the
        module tree and detaching every tensor on each step costs more host time than the update itself. The
        lists hold the Parameter objects, which ``load_state_dict``, ``.to`` and ZeRO-3's gathering keep."""
        if self._cache is None or self._cache[0] is not model:
            ema_p, src_p = list(self.module.parameters()), list(model.parameters())
            if len(ema_p) != len(src_p):
                raise ValueError(f"EMA has {len(ema_p)} parameters, the model {len(src_p)}")
            ema_b, src_b = list(self.module.buffers()), list(model.buffers())
            if len(ema_b) != len(src_b):
                raise ValueError(f"EMA has {len(ema_b)} buffers, the model {len(src_b)}")
            self._cache = (model, ema_p, src_p, ema_b, src_b)
        return self._cache[1:]

    def state_dict(self) -> dict[str, Any]:
        return {"module": self.module.state_dict(), "num_updates": self.num_updates, "decay": self.decay}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.module.load_state_dict(state["module"])
        self.num_updates = int(state["num_updates"])
