"""Token routing's return: the kept tokens, after the routed blocks, written back among the tokens that skipped
them.

``token_scatter(base, idx, src)``: base (B, T, D), idx (B, K) int64, src (B, K, D) -> (B, T, D) equal to ``base``
except out[b, idx[b, k]] = src[b, k] (TREAD's ``end_route``, Krause et al., arXiv 2501.04765: the tokens that were
not kept take their value from before the route, ``x_D_last``). Out of place: ``base`` is not changed. Its backward:
grad_base is grad_out with the kept rows zeroed, grad_src = grad_out gathered at idx.
"""

from __future__ import annotations

import torch

from diffcurr_fast.ops import _backend
from diffcurr_fast.ops.token_gather import check_route


def token_scatter_ref(base: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Reference: ``base.scatter(1, idx, src)`` over rows: (B, T, D), (B, K), (B, K, D) -> (B, T, D)."""
    return base.scatter(1, idx.unsqueeze(-1).expand(-1, -1, base.shape[-1]), src)  # (B, T, D)


def token_scatter(base: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """(B, T, D) ``base`` with the rows idx (B, K) replaced by src (B, K, D) (module doc). ``backend``: None /
    ``auto`` or ``reference``; an unknown name is a ValueError."""
    if _backend.requested(backend) not in ("auto", "reference") and backend is not None:
        raise ValueError(f"token_scatter runs on its reference only (backend auto or reference), got {backend!r}")
    check_route(base, idx)
    if src.shape != (*idx.shape, base.shape[-1]):
        raise ValueError(f"token_scatter: src must be {(*idx.shape, base.shape[-1])}, got {tuple(src.shape)}")
    return token_scatter_ref(base, idx, src)


__all__ = ["token_scatter", "token_scatter_ref"]
