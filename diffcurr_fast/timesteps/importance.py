"""Loss-aware importance sampling of timesteps (Nichol & Dhariwal 2021, "Improved Denoising Diffusion Probabilistic
Models", Sec. 3.3, Eq. 18; the official improved-diffusion ``resample.py``, LossSecondMomentResampler).

p_k ∝ sqrt(E[L_k^2]), the root second moment of the last ``history`` (10) losses seen at cell k, mixed with a
uniform floor: p = (1 - floor) p / sum(p) + floor / G (floor 1e-3). Until every cell has its ``history`` losses
(the warm-up) the distribution is uniform. The draws are corrected by 1 / (G p_k) (``unbiased``: the product's
``loss_weights``), so the objective keeps its uniform-t mean while its variance drops.

Kept on the device: a (G, history) ring of losses and a (G,) count, so a step needs no host read-back. Each step's
(k, loss) pairs of every rank are gathered (in rank order) and folded on every rank in the same order, as the
official ``update_with_all_losses`` does, so every rank holds the same history. Choices made here: a ring buffer in
place of the official shift-left list (the second moment does not depend on the order of the kept losses; the same
losses are kept); non-finite losses are not folded (the trainer skips such a step anyway).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import Options, positive, unit
from diffcurr_fast.timesteps.base import TimestepSampler, all_gather_cat


@dataclass
class ImportanceOptions(Options):
    """importance's options in the ``timesteps`` section (keys ``timesteps.importance_*``)."""

    PREFIX = "importance_"
    history: int = positive(10, "importance: losses kept per cell (IDDPM: 10); uniform until all are full")
    floor: float = unit(1e-3, "importance: uniform share mixed into the distribution (IDDPM: 1e-3)")


class LossSecondMoment(TimestepSampler):
    """IDDPM's loss-second-moment resampler on ``num_cells`` cells (module doc)."""

    name = "importance"
    Options = ImportanceOptions
    unbiased = True

    def __init__(self, num_cells: int, history: int = 10, uniform_floor: float = 1e-3):
        super().__init__(num_cells)
        if history < 1:
            raise ValueError(f"timesteps.importance_history must be >= 1, got {history}")
        if not 0.0 <= uniform_floor <= 1.0:
            raise ValueError(f"timesteps.importance_floor must be in [0, 1], got {uniform_floor}")
        self.history, self.floor = int(history), float(uniform_floor)
        self._hist = torch.zeros(num_cells, self.history, dtype=torch.float64)  # (G, H) ring of recent losses
        self._count = torch.zeros(num_cells, dtype=torch.int64)  # (G,) losses seen per cell
        self._w: torch.Tensor | None = None

    @classmethod
    def from_config(cls, t: Any, formulation: Any, num_cells: int) -> LossSecondMoment:
        return cls(num_cells, t.importance_history, t.importance_floor)

    @property
    def warmed_up(self) -> torch.Tensor:
        """0-d bool tensor (on the statistics' device): every cell has its ``history`` losses."""
        return (self._count >= self.history).all()

    def weights(self) -> torch.Tensor:
        if self._w is None:
            g = self.num_cells
            w = torch.sqrt((self._hist**2).mean(dim=1))  # (G,) root second moment
            w = (1.0 - self.floor) * w / w.sum().clamp(min=1e-300) + self.floor / g
            self._w = torch.where(self.warmed_up, w, torch.full_like(w, 1.0 / g))  # uniform during the warm-up
        return self._w

    def observe(
        self, k: torch.Tensor, per_sample_loss: torch.Tensor, step: int | None = None, ok: torch.Tensor | None = None
    ) -> None:
        dev = per_sample_loss.device
        if self._hist.device != dev:
            self._hist, self._count = self._hist.to(dev), self._count.to(dev)
        k = all_gather_cat(k.to(dev).long(), self.process_group)  # (W B,) every rank's draws, rank order
        loss = all_gather_cat(per_sample_loss.detach().to(torch.float64), self.process_group)  # (W B,)
        valid = torch.isfinite(loss) if ok is None else torch.isfinite(loss) & ok.to(dev)  # a skipped step: none
        k, loss = k[valid], loss[valid]
        g, h = self.num_cells, self.history
        order = torch.argsort(k, stable=True)  # each cell's losses in arrival order
        ks, ls = k[order], loss[order]
        n = torch.bincount(ks, minlength=g)  # (G,) new losses per cell
        first = torch.cumsum(n, 0) - n  # index of each cell's first loss in the sorted list
        r = torch.arange(ks.numel(), device=dev) - first[ks]  # arrival rank within its cell
        keep = r >= n[ks] - h  # only the last ``history`` of them survive
        pos = (self._count[ks] + r) % h  # ring slot
        self._hist[ks[keep], pos[keep]] = ls[keep]
        self._count += n
        self._w = None

    def state_dict(self) -> dict[str, Any]:
        return {"history": self._hist.detach().cpu().clone(), "count": self._count.detach().cpu().clone()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        hist, count = state["history"], state["count"]
        if tuple(hist.shape) != (self.num_cells, self.history):
            raise ValueError(
                f"importance state has a {tuple(hist.shape)} history, this run ({self.num_cells}, "
                f"{self.history}); timesteps.importance_history or diffusion.num_timesteps differ"
            )
        self._hist, self._count = hist.clone().to(self._hist.device), count.clone().to(self._count.device)
        self._w = None
