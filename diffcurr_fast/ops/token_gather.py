"""Token routing's route: the kept tokens of each sample, gathered.

``token_gather(x, idx)``: x (B, T, D), idx (B, K) int64 token indices per sample -> (B, K, D) with
out[b, k] = x[b, idx[b, k]] (TREAD's ``start_route``, Krause et al., arXiv 2501.04765). Its backward scatters the
gradient back: grad_x[b, idx[b, k]] += grad_out[b, k], zero at the tokens not kept (the indices of one sample are
distinct, so no two writes meet).
"""

from __future__ import annotations

import math

import torch

from diffcurr_fast.ops import _backend


def kept_tokens(tokens: int, keep: float) -> int:
    """K of T tokens kept for ``keep`` in (0, 1]: T - floor(T (1 - keep)), at least 1 (TREAD's ``num_keep``;
    ``models.routing``)."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"model.routing_keep must be in (0, 1], got {keep!r}")
    return max(1, tokens - math.floor(tokens * (1.0 - keep) + 1e-9))


def draw_route(
    batch: int, tokens: int, kept: int, generator: torch.Generator | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(B, K) int64 sorted indices of the kept tokens of each sample: K of T uniform without replacement, from
    ``generator`` (on its device; the indices are moved to ``device``)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.rand(batch, tokens, generator=generator, device=gen_device)  # (B, T)
    idx = noise.argsort(dim=1)[:, :kept].sort(dim=1).values  # (B, K)
    return idx.to(device, non_blocking=True)


def token_gather_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Reference: ``x.gather(1, idx)`` over the last dimension's rows: (B, T, D), (B, K) -> (B, K, D)."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, K, D)


def check_route(x: torch.Tensor, idx: torch.Tensor) -> None:
    """ValueError unless ``x`` is (B, T, D) and ``idx`` (B, K) int64 on its device with K <= T."""
    if x.dim() != 3 or idx.dim() != 2 or idx.shape[0] != x.shape[0] or idx.shape[1] > x.shape[1]:
        raise ValueError(
            f"token routing takes x (B, T, D) and idx (B, K <= T), got {tuple(x.shape)}, {tuple(idx.shape)}"
        )
    if idx.dtype != torch.int64 or idx.device != x.device:
        raise ValueError(f"token routing indices must be int64 on {x.device}, got {idx.dtype} on {idx.device}")


def token_gather(x: torch.Tensor, idx: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """(B, K, D) kept tokens of x (B, T, D) at idx (B, K) (module doc). ``backend``: None / ``auto`` or
    ``reference``; an unknown name is a ValueError. ``DIFFCURR_OPS_BACKEND`` is read when ``backend`` is None."""
    if _backend.requested(backend) not in ("auto", "reference") and backend is not None:
        raise ValueError(f"token_gather runs on its reference only (backend auto or reference), got {backend!r}")
    check_route(x, idx)
    return token_gather_ref(x, idx)


__all__ = ["check_route", "draw_route", "kept_tokens", "token_gather", "token_gather_ref"]
