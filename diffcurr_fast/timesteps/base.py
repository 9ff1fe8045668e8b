"""The timestep-sampler interface and its composition by product.

A sampler is a distribution over the G cells of the formulation's difficulty axis (DDPM: its T timesteps; flow and
EDM: G equal cells of t / ln sigma, ``Formulation.cell_grid``):

- ``weights()``: (G,) non-negative weights (any scale), or None for uniform; a strategy returns the same tensor
  object until its distribution changes, so the composition can cache the device copy;
- ``observe(k, per_sample_loss, step, ok)``: the statistics of a step's draws k (B,) and their losses (B,), kept on
  the device; collectives go over ``process_group`` (None: every rank), so all ranks hold the same distribution;
  ``ok`` (the trainer's device-side step, ``engine.cuda_graphs``): a 0-d bool device tensor, the step counts only
  where it holds, and a strategy masks its statistics with it instead of reading it back;
- ``loss_weights``: strategies with ``unbiased = True`` (importance sampling) have their draws corrected so that the
  loss keeps the mean it has without them (``Product.loss_weights``);
- ``probe(step)`` / ``observe_probe(before, after)``: a strategy that measures the objective's decrease asks the
  trainer for the loss at some cells (on n samples of the batch, with one noise seed) before and after the step
  (``anuts``); the others return None;
- ``state_dict()`` / ``load_state_dict()``: a resumed run continues bit-identically.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from diffcurr_fast.curriculum.pacing import collective_device, dist_active
from diffcurr_fast.options import Options


def all_reduce_mean(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The mean of ``x`` over the ranks of ``group`` (None: every rank; ``x`` itself on one process), on ``x``'s
    device. ``group`` has no default: a sampler passes its ``process_group``, the ranks of its run."""
    if not dist_active():
        return x
    buf = x.to(collective_device(x.device)).clone()
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return (buf / dist.get_world_size(group)).to(x.device)


def all_gather_cat(x: torch.Tensor, group: Any) -> torch.Tensor:
    """``x`` (B, ...) of every rank of ``group`` (None: every rank) concatenated in rank order (``x`` itself on one
    process); ``group`` has no default, as for ``all_reduce_mean``."""
    if not dist_active():
        return x
    buf = x.to(collective_device(x.device)).contiguous()
    parts = [torch.empty_like(buf) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, buf, group=group)
    return torch.cat(parts).to(x.device)


class TimestepSampler:
    """A distribution over ``num_cells`` cells; the base class is uniform and keeps no statistics (module doc)."""

    name = "uniform"
    unbiased = False  # its draws are importance-corrected by ``Product.loss_weights``
    Options: type[Options] = Options  # its fields in the ``timesteps`` section (``options.Options``), if any
    process_group: Any = None

    def __init__(self, num_cells: int):
        self.num_cells = int(num_cells)

    def weights(self) -> torch.Tensor | None:
        """(G,) non-negative weights, or None for uniform."""
        return None

    def observe(
        self, k: torch.Tensor, per_sample_loss: torch.Tensor, step: int | None = None, ok: torch.Tensor | None = None
    ) -> None:
        """Fold the draws ``k`` (B,) and their losses (B,) of one step into the statistics (where ``ok`` holds)."""

    def probe(self, step: int) -> tuple[torch.Tensor, int, int] | None:
        """(cells (P,), n, seed): measure the loss at these cells on the batch's first n samples with noise ``seed``
        before and after step ``step``; or None."""
        return None

    def observe_probe(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """The losses (P, n) of ``probe``'s cells and samples, before and after the step."""

    def state_dict(self) -> dict[str, Any] | None:
        """The state to checkpoint, or None when there is none."""
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def __repr__(self) -> str:
        return f"{type(self).__name__}(num_cells={self.num_cells})"


class Fixed(TimestepSampler):
    """Constant weights: the formulation's cell prior (EDM's log-normal sigma) or a TDC range's indicator."""

    def __init__(self, weights: torch.Tensor, name: str):
        super().__init__(weights.numel())
        self.name = name
        self._w = weights

    def weights(self) -> torch.Tensor:
        return self._w


def range_mask(num_cells: int, timestep_range: tuple[int, int]) -> Fixed:
    """The (G,) float32 indicator of cells [lo, hi) (a TDC group); ValueError for a bad range."""
    try:
        lo, hi = (int(v) for v in timestep_range)
    except (TypeError, ValueError):
        raise ValueError(f"timestep_range must be a (lo, hi) pair of ints, got {timestep_range!r}") from None
    if not 0 <= lo < hi <= num_cells:
        raise ValueError(
            f"timestep_range {timestep_range!r} must satisfy 0 <= lo < hi <= {num_cells} (diffusion.num_timesteps)"
        )
    mask = torch.zeros(num_cells, dtype=torch.float32)
    mask[lo:hi] = 1.0
    return Fixed(mask, "range")


class Product(TimestepSampler):
    """The product of samplers p_k ∝ prod_i w_i[k], itself a sampler (a curriculum inside a TDC range, ...).

    ``weights()`` is on ``device`` and rebuilt only when a factor's weights change. With one non-uniform factor its
    weights are passed through unchanged (no renormalisation: the draws are those of that factor alone); with more,
    the product is formed in float64, normalised and cast to float32. ``loss_weights(k)`` is u_k / p_k, where u is
    the product of the factors that are not ``unbiased``: importance sampling inside the rest keeps the loss's mean
    under u (Nichol & Dhariwal 2021, Sec. 3.3). The statistics go to every factor.
    """

    name = "product"

    def __init__(self, parts: list[TimestepSampler], device: torch.device | str = "cpu"):
        if not parts:
            raise ValueError("Product needs at least one sampler")
        sizes = {p.num_cells for p in parts}
        if len(sizes) != 1:
            raise ValueError(f"the samplers of a product must share their number of cells, got {sorted(sizes)}")
        super().__init__(sizes.pop())
        self.parts = list(parts)
        self.device = torch.device(device)
        self.unbiased = any(p.unbiased for p in self.parts)
        self._src: tuple | None = None
        self._dev: torch.Tensor | None = None
        self._corr: torch.Tensor | None = None  # (G,) float32 u / p, for unbiased factors

    def _refresh(self) -> None:
        src = tuple(p.weights() for p in self.parts)
        if self._src is not None and len(src) == len(self._src) and all(a is b for a, b in zip(src, self._src)):
            return
        live = [w for w in src if w is not None]
        if not live:
            w = torch.full((self.num_cells,), 1.0 / self.num_cells, dtype=torch.float32, device=self.device)
        elif len(live) == 1:
            w = live[0].to(self.device, torch.float32)
        else:
            w = _normalised_product(live, self.device).to(torch.float32)
        self._corr = None
        if self.unbiased:
            rest = [wi for wi, p in zip(src, self.parts) if wi is not None and not p.unbiased]
            u = _normalised_product(rest, self.device) if rest else torch.full_like(w, 1.0, dtype=torch.float64)
            u = u / u.sum()
            p = w.to(torch.float64) / w.to(torch.float64).sum()
            self._corr = torch.where(p > 0, u / p.clamp(min=1e-300), torch.zeros_like(p)).to(torch.float32)
        self._src, self._dev = src, w

    def weights(self) -> torch.Tensor:
        self._refresh()
        return self._dev

    def loss_weights(self, k: torch.Tensor) -> torch.Tensor | None:
        """(B,) float32 correction of the draws ``k``, or None when no factor is ``unbiased``."""
        self._refresh()
        return None if self._corr is None else self._corr[k]

    def observe(
        self, k: torch.Tensor, per_sample_loss: torch.Tensor, step: int | None = None, ok: torch.Tensor | None = None
    ) -> None:
        for p in self.parts:
            p.observe(k, per_sample_loss, step, ok)

    def probe(self, step: int) -> tuple[torch.Tensor, int, int] | None:
        asks = [a for a in (p.probe(step) for p in self.parts) if a is not None]
        if len(asks) > 1:
            raise ValueError("at most one sampler of a product can probe the loss")
        return asks[0] if asks else None

    def observe_probe(self, before: torch.Tensor, after: torch.Tensor) -> None:
        for p in self.parts:
            p.observe_probe(before, after)

    def state_dict(self) -> dict[str, Any]:
        return {p.name: s for p in self.parts if (s := p.state_dict()) is not None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = {p.name for p in self.parts if p.state_dict() is not None}
        if set(state) != mine:
            raise ValueError(f"timestep sampler state holds {sorted(state)}, this run's samplers {sorted(mine)}")
        for p in self.parts:
            if p.name in state:
                p.load_state_dict(state[p.name])
        self._src = None

    def __repr__(self) -> str:
        return " x ".join(repr(p) for p in self.parts)


def _normalised_product(ws: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    out = ws[0].to(device, torch.float64)
    for w in ws[1:]:
        out = out * w.to(device, torch.float64)
    total = out.sum()
    return out / total
