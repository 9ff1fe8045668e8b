"""Token routing's return: the kept tokens, after the routed blocks, written back among the tokens that skipped
them.

``token_scatter(base, idx, src)``: base (B, T, D), idx (B, K) int64, src (B, K, D) -> (B, T, D) equal to ``base``
except out[b, idx[b, k]] = src[b, k] (TREAD's ``end_route``, Krause et al., arXiv 2501.04765: the tokens that were
not kept take their value from before the route, ``x_D_last``). Out of place: ``base`` is not changed. Its backward:
grad_base is grad_out with the kept rows zeroed, grad_src = grad_out gathered at idx. The kernels write each output
row once (from src or from base), and the backward makes one pass over grad_out for both gradients (docs/ops.md).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from diffcurr_fast.ops import _backend
from diffcurr_fast.ops.token_gather import _gather_fwd, _gather_fwd_op, check_route, route_backend


def token_scatter_ref(base: torch.Tensor, idx: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Reference: ``base.scatter(1, idx, src)`` over rows: (B, T, D), (B, K), (B, K, D) -> (B, T, D)."""
    return base.scatter(1, idx.unsqueeze(-1).expand(-1, -1, base.shape[-1]), src)  # (B, T, D)


def token_scatter_bwd_ref(grad_out: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference backward: (grad_base (B, T, D), grad_src (B, K, D)) = (grad_out with the rows idx zeroed,
    grad_out at the rows idx)."""
    rows = idx.unsqueeze(-1).expand(-1, -1, grad_out.shape[-1])
    return grad_out.scatter(1, rows, 0.0), grad_out.gather(1, rows)


# ---- dispatch tables: backend -> function (_backend.table) ------------------------------------------------
_SCATTER_FWD = _backend.table(
    reference=_backend.contiguous_args(token_scatter_ref),
    triton=_backend.contiguous_args(
        lambda base, idx, src: _backend.kernels("token_route").token_scatter_fwd(base, idx, src, base.shape[1])
    ),
    ext=lambda base, idx, src: _backend.ext_ops().token_scatter(base, idx, src, base.shape[1]),
)
_SCATTER_BWD = _backend.table(
    reference=_backend.contiguous_args(token_scatter_bwd_ref),
    triton=_backend.contiguous_args(lambda *a: _backend.kernels("token_route").token_scatter_bwd(*a)),
    ext=lambda grad_out, idx: _backend.ext_ops().token_scatter_bwd(grad_out, idx),
)


# ---- custom ops (what torch.compile traces) and their autograd --------------------------------------------
def _scatter_fwd(base: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, backend: str) -> torch.Tensor:
    return _SCATTER_FWD[backend](base, idx, src)


_scatter_fwd_op = torch.library.custom_op("diffcurr_fast::token_scatter", mutates_args=())(_scatter_fwd)


@_scatter_fwd_op.register_fake
def _(base, idx, src, backend):
    return torch.empty_like(base, memory_format=torch.contiguous_format)


def _scatter_bwd(grad_out: torch.Tensor, idx: torch.Tensor, backend: str) -> tuple[torch.Tensor, torch.Tensor]:
    return _SCATTER_BWD[backend](grad_out, idx)


_scatter_bwd_op = torch.library.custom_op("diffcurr_fast::token_scatter_backward", mutates_args=())(_scatter_bwd)


@_scatter_bwd_op.register_fake
def _(grad_out, idx, backend):
    B, _, D = grad_out.shape
    return torch.empty_like(grad_out, memory_format=torch.contiguous_format), grad_out.new_empty(B, idx.shape[1], D)


def _scatter_setup(ctx, inputs, output):
    base, idx, src, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(idx)


def _scatter_grads(ctx, grad_out, bwd, gather):
    """(grad_base, None, grad_src, None) from ``bwd`` and ``gather`` (the custom ops, or their plain bodies in
    eager mode): both gradients in one pass over grad_out, grad_src alone as a gather."""
    (idx,) = ctx.saved_tensors
    need_base, need_src = ctx.needs_input_grad[0], ctx.needs_input_grad[2]
    if need_base:
        grad_base, grad_src = bwd(grad_out, idx, ctx.backend)
        return grad_base, None, grad_src if need_src else None, None
    return None, None, gather(grad_out, idx, ctx.backend) if need_src else None, None


def _scatter_backward(ctx, grad_out):
    return _scatter_grads(ctx, grad_out, _scatter_bwd_op, _gather_fwd_op)


_scatter_fwd_op.register_autograd(_scatter_backward, setup_context=_scatter_setup)


# Eager calls skip the custom op's Python dispatch (as the adaLN ops do): the same kernels and backward.
class TokenScatterFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, base, idx, src, backend):
        _scatter_setup(ctx, (base, idx, src, backend), None)
        return _scatter_fwd(base, idx, src, backend)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return _scatter_grads(ctx, grad_out, _scatter_bwd, _gather_fwd)


def _scatter_apply(base, idx, src, backend):
    if torch.compiler.is_compiling():
        return _scatter_fwd_op(base, idx, src, backend)
    return TokenScatterFunction.apply(base, idx, src, backend)


def _raw_scatter_fake(base, idx, src, tokens):
    return src.new_empty(src.shape[0], tokens, src.shape[2])


def _raw_scatter_bwd_fake(grad_out, idx):
    B, _, D = grad_out.shape
    return torch.empty_like(grad_out, memory_format=torch.contiguous_format), grad_out.new_empty(B, idx.shape[1], D)


_backend.register_raw_fake("token_scatter", _raw_scatter_fake)
_backend.register_raw_fake("token_scatter_bwd", _raw_scatter_bwd_fake)


# ---- public API -------------------------------------------------------------------------------------------
def token_scatter(base: torch.Tensor, idx: torch.Tensor, src: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """(B, T, D) ``base`` with the rows idx (B, K) replaced by src (B, K, D) (module doc), forward and backward
    fused. ``backend`` and the indices as for ``token_gather``; src must have base's dtype and device."""
    check_route(base, idx)
    if src.shape != (*idx.shape, base.shape[-1]):
        raise ValueError(f"token_scatter: src must be {(*idx.shape, base.shape[-1])}, got {tuple(src.shape)}")
    if src.dtype != base.dtype or src.device != base.device:
        raise ValueError(
            f"token_scatter: src ({src.dtype}, {src.device}) must match base ({base.dtype}, {base.device})"
        )
    name = route_backend("token_scatter", base, backend)
    if name == "reference":
        return token_scatter_ref(base, idx, src)
    return _scatter_apply(base, idx, src, name)


__all__ = ["TokenScatterFunction", "token_scatter", "token_scatter_bwd_ref", "token_scatter_ref"]
