"""Exponential moving average of the model weights (as DiT keeps it; Polyak averaging).

ema <- d ema + (1 - d) theta after every optimizer step, with d = ``decay`` (DiT: 0.9999) or, with ``warmup``,
d_n = min(decay, (1 + n) / (10 + n)) at update n (the usual warm-up, so early averages are not dominated by the
random initialisation). Buffers are copied. The EMA is kept in float32 whatever the model's dtype.

Masked updates (the device-side step, ``engine.cuda_graphs``): ``update(model, ok)`` with a 0-d bool device tensor
changes nothing where ``ok`` is false, without reading it back: the update count lives on the device (float64, so
the decay d_n is the host's double arithmetic), the lerp weight is 1 - d_n or 0, and buffers are copied where ``ok``.
Where ``ok`` holds it gives the bits of the unmasked update.

``PowerEMA`` keeps the power-function averages of post-hoc EMA (EDM2; ``optim.phema_every``, the maths in
``runs.posthoc_ema``): one float32 copy per sigma_rel, updated with beta(t) = (1 - 1/t)^(gamma + 1) at its t-th
update, masked the same way.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from diffcurr_fast.runs.posthoc_ema import power_beta, sigma_rel_to_gamma


class _Counted:
    """The number of updates applied (t); a masked update's count lives on the device, set by the subclass."""

    _updates: int
    _device_updates: torch.Tensor | None

    @property
    def num_updates(self) -> int:
        """Updates applied so far (a masked update's count is on the device: read back here)."""
        return self._updates if self._device_updates is None else int(self._device_updates)

    @num_updates.setter
    def num_updates(self, value: int) -> None:
        self._updates, self._device_updates = int(value), None


class EMA(_Counted):
    """EMA of ``model``'s parameters; ``module`` is an eval-mode, no-grad copy holding the averages."""

    def __init__(self, model: nn.Module, decay: float = 0.9999, warmup: bool = True):
        if not 0.0 <= decay <= 1.0:
            raise ValueError(f"EMA decay must lie in [0, 1], got {decay!r}")
        self.decay, self.warmup = float(decay), bool(warmup)
        self.module = copy.deepcopy(model).float().eval().requires_grad_(False)
        self._updates = 0
        self._device_updates: torch.Tensor | None = None  # the count of masked updates (0-d float64), once used
        self._cache: tuple | None = None  # (model, its lists) of the last update

    def current_decay(self) -> float:
        """Decay used by the next update."""
        if not self.warmup:
            return self.decay
        n = self.num_updates
        return min(self.decay, (1.0 + n) / (10.0 + n))

    @torch.no_grad()
    def update(self, model: nn.Module, ok: torch.Tensor | None = None) -> None:
        """ema <- d ema + (1 - d) theta for every parameter (one ``_foreach_lerp_``); buffers copied (one
        ``_foreach_copy_``). ``ok``: a 0-d bool device tensor; the update applies only where it holds (module doc)."""
        if ok is not None:
            self._masked_update(model, ok)
            return
        d = self.current_decay()
        ema_p, src_p, ema_b, src_b = self._lists(model)
        if any(p.dtype != torch.float32 for p in src_p):  # a low-precision model: its weights upcast first
            src_p = [p.to(torch.float32) for p in src_p]
        torch._foreach_lerp_(ema_p, src_p, 1.0 - d)  # ema + (1 - d)(theta - ema)
        if ema_b:
            torch._foreach_copy_(ema_b, src_b)
        self.num_updates += 1

    def _masked_update(self, model: nn.Module, ok: torch.Tensor) -> None:
        ema_p, src_p, ema_b, src_b = self._lists(model)
        if any(p.dtype != torch.float32 for p in src_p):
            src_p = [p.to(torch.float32) for p in src_p]
        if self._device_updates is None or self._device_updates.device != ok.device:
            self._device_updates = torch.tensor(float(self.num_updates), dtype=torch.float64, device=ok.device)
        n = self._device_updates
        d = torch.clamp((1.0 + n) / (10.0 + n), max=self.decay) if self.warmup else torch.full_like(n, self.decay)
        w = torch.where(ok, 1.0 - d, 0.0).to(torch.float32)  # the host's float(1 - d), or 0: ema unchanged
        # the List overload takes the weight as a tensor (a 0-d tensor passed as the Scalar weight would be read back)
        torch._foreach_lerp_(ema_p, src_p, [w.expand_as(e) for e in ema_p])
        for e, b in zip(ema_b, src_b):
            e.copy_(torch.where(ok, b, e))
        n += ok

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


class PowerEMA(_Counted):
    """Power-function averages of ``model``'s parameters, one per ``sigma_rels`` entry (EDM2 Section 3.1; default
    its two, 0.05 and 0.10): ``modules[i]`` is an eval-mode, no-grad float32 copy holding the average of exponent
    ``gammas[i]``, the weights theta_1..theta_t averaged with the profile (gamma + 1) tau^gamma / t^(gamma + 1) over
    the steps (``runs.posthoc_ema``; t = the updates applied). Buffers are copied."""

    def __init__(self, model: nn.Module, sigma_rels: tuple[float, ...] | list[float] = (0.05, 0.10)):
        self.sigma_rels = tuple(float(s) for s in sigma_rels)
        if not self.sigma_rels or len(set(self.sigma_rels)) != len(self.sigma_rels):
            raise ValueError(f"PowerEMA needs one or more distinct sigma_rels, got {list(sigma_rels)!r}")
        self.gammas = tuple(sigma_rel_to_gamma(s) for s in self.sigma_rels)
        self.modules = [copy.deepcopy(model).float().eval().requires_grad_(False) for _ in self.sigma_rels]
        self._updates = 0
        self._device_updates: torch.Tensor | None = None  # the count of masked updates (0-d float64), once used
        self._cache: tuple | None = None  # (model, its lists) of the last update

    @torch.no_grad()
    def update(self, model: nn.Module, ok: torch.Tensor | None = None) -> None:
        """avg <- beta(t) avg + (1 - beta(t)) theta for every average (one ``_foreach_lerp_`` each), t the update's
        number (1 first: the average starts as theta); buffers copied. ``ok``: a 0-d bool device tensor; the update
        applies only where it holds, its count kept on the device (as ``EMA.update``)."""
        avgs, src_p, bufs, src_b = self._lists(model)
        if any(p.dtype != torch.float32 for p in src_p):  # a low-precision model: its weights upcast first
            src_p = [p.to(torch.float32) for p in src_p]
        if ok is not None:
            self._masked_update(avgs, src_p, bufs, src_b, ok)
            return
        t = self.num_updates + 1
        for gamma, avg in zip(self.gammas, avgs):
            torch._foreach_lerp_(avg, src_p, 1.0 - power_beta(t, gamma))
        for b in bufs:
            torch._foreach_copy_(b, src_b)
        self.num_updates = t

    def _masked_update(self, avgs, src_p, bufs, src_b, ok: torch.Tensor) -> None:
        if self._device_updates is None or self._device_updates.device != ok.device:
            self._device_updates = torch.tensor(float(self.num_updates), dtype=torch.float64, device=ok.device)
        n = self._device_updates
        for gamma, avg in zip(self.gammas, avgs):
            beta = (1.0 - 1.0 / (n + 1.0)) ** (gamma + 1.0)  # power_beta(n + 1, gamma), in float64 on the device
            w = torch.where(ok, 1.0 - beta, 0.0).to(torch.float32)
            torch._foreach_lerp_(avg, src_p, [w.expand_as(a) for a in avg])
        for b in bufs:
            for e, s in zip(b, src_b):
                e.copy_(torch.where(ok, s, e))
        n += ok

    def _lists(self, model: nn.Module) -> tuple[Any, ...]:
        """(per average its parameters, the model's parameters, per average its buffers, the model's buffers),
        built once per model (as ``EMA._lists``)."""
        if self._cache is None or self._cache[0] is not model:
            src_p, src_b = list(model.parameters()), list(model.buffers())
            avgs = [list(m.parameters()) for m in self.modules]
            bufs = [list(m.buffers()) for m in self.modules]
            if len(avgs[0]) != len(src_p) or len(bufs[0]) != len(src_b):
                raise ValueError(
                    f"PowerEMA has {len(avgs[0])} parameters and {len(bufs[0])} buffers, the model {len(src_p)} and "
                    f"{len(src_b)}"
                )
            self._cache = (model, avgs, src_p, [b for b in bufs if b], src_b)
        return self._cache[1:]

    def buffer_names(self) -> list[str]:
        """The state-dict keys of the buffers (copied, not averaged)."""
        return [name for name, _ in self.modules[0].named_buffers()]

    def state_dict(self) -> dict[str, Any]:
        return {
            "sigma_rels": list(self.sigma_rels),
            "modules": [m.state_dict() for m in self.modules],
            "num_updates": self.num_updates,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; ValueError when it tracked other sigma_rels."""
        if [float(s) for s in state["sigma_rels"]] != list(self.sigma_rels):
            raise ValueError(
                f"the power-function averages were kept for sigma_rels {list(state['sigma_rels'])}, not "
                f"{list(self.sigma_rels)}"
            )
        for m, sd in zip(self.modules, state["modules"]):
            m.load_state_dict(sd)
        self.num_updates = int(state["num_updates"])
