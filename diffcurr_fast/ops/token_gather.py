"""Token routing's route: the kept tokens of each sample, gathered.

``token_gather(x, idx)``: x (B, T, D), idx (B, K) int64 token indices per sample -> (B, K, D) with
out[b, k] = x[b, idx[b, k]] (TREAD's ``start_route``, Krause et al., arXiv 2501.04765). Its backward scatters the
gradient back: grad_x[b, idx[b, k]] = grad_out[b, k], zero at the tokens not kept (the indices of one sample are
distinct, so no two writes meet: no atomics, and each row of grad_x is written once). Both are row copies, one
forward and one backward kernel per backend (docs/ops.md).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from diffcurr_fast.ops import _backend, _common


def token_gather_ref(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Reference: ``x.gather(1, idx)`` over the last dimension's rows: (B, T, D), (B, K) -> (B, K, D)."""
    return x.gather(1, idx.unsqueeze(-1).expand(-1, -1, x.shape[-1]))  # (B, K, D)


def token_gather_bwd_ref(grad_out: torch.Tensor, idx: torch.Tensor, tokens: int) -> torch.Tensor:
    """Reference backward: (B, tokens, D) zeros with the rows idx set to grad_out (B, K, D)."""
    B, _, D = grad_out.shape
    zeros = grad_out.new_zeros(B, tokens, D)
    return zeros.scatter(1, idx.unsqueeze(-1).expand(-1, -1, D), grad_out)  # (B, T, D)


def check_route(x: torch.Tensor, idx: torch.Tensor) -> None:
    """ValueError unless ``x`` is (B, T, D) and ``idx`` (B, K) int64 on its device with K <= T."""
    if x.dim() != 3 or idx.dim() != 2 or idx.shape[0] != x.shape[0] or idx.shape[1] > x.shape[1]:
        raise ValueError(
            f"token routing takes x (B, T, D) and idx (B, K <= T), got {tuple(x.shape)}, {tuple(idx.shape)}"
        )
    if idx.dtype != torch.int64 or idx.device != x.device:
        raise ValueError(f"token routing indices must be int64 on {x.device}, got {idx.dtype} on {idx.device}")


def route_backend(op: str, x: torch.Tensor, backend: str | None) -> str:
    """The backend of routing op ``op`` for x: ``_backend.resolve``'s choice, except that dtypes other than
    ``_common.KERNEL_DTYPES`` (float64, integers) run on the reference (a ValueError when a kernel backend was
    asked for by the argument)."""
    name = _backend.resolve(op, x.device, backend)
    if name != "reference" and x.dtype not in _common.KERNEL_DTYPES:
        if backend not in (None, "auto"):
            raise ValueError(f"{op}: backend {backend!r} takes dtypes {_common.KERNEL_DTYPES}, got {x.dtype}")
        return "reference"
    return name


# ---- dispatch tables: backend -> function (_backend.table) ------------------------------------------------
# The kernels take contiguous inputs and write fresh contiguous outputs (the C++/CUDA ops make their inputs
# contiguous themselves); gather's backward is the scatter kernel without a base (zeros where no row lands).
_GATHER_FWD = _backend.table(
    reference=_backend.contiguous_args(token_gather_ref),
    triton=_backend.contiguous_args(lambda *a: _backend.kernels("token_route").token_gather_fwd(*a)),
    ext=lambda x, idx: _backend.ext_ops().token_gather(x, idx),
)
_GATHER_BWD = _backend.table(
    reference=_backend.contiguous_args(token_gather_bwd_ref),
    triton=_backend.contiguous_args(
        lambda g, idx, t: _backend.kernels("token_route").token_scatter_fwd(None, idx, g, t)
    ),
    ext=lambda g, idx, tokens: _backend.ext_ops().token_scatter(None, idx, g, tokens),
)


# ---- custom ops (what torch.compile traces) and their autograd --------------------------------------------
def _gather_fwd(x: torch.Tensor, idx: torch.Tensor, backend: str) -> torch.Tensor:
    return _GATHER_FWD[backend](x, idx)


_gather_fwd_op = torch.library.custom_op("diffcurr_fast::token_gather", mutates_args=())(_gather_fwd)


@_gather_fwd_op.register_fake
def _(x, idx, backend):
    return x.new_empty(x.shape[0], idx.shape[1], x.shape[2])


def _gather_bwd(grad_out: torch.Tensor, idx: torch.Tensor, tokens: int, backend: str) -> torch.Tensor:
    return _GATHER_BWD[backend](grad_out, idx, tokens)


_gather_bwd_op = torch.library.custom_op("diffcurr_fast::token_gather_backward", mutates_args=())(_gather_bwd)


@_gather_bwd_op.register_fake
def _(grad_out, idx, tokens, backend):
    return grad_out.new_empty(grad_out.shape[0], tokens, grad_out.shape[2])


def _gather_setup(ctx, inputs, output):
    x, idx, backend = inputs
    ctx.backend, ctx.tokens = backend, x.shape[1]
    ctx.save_for_backward(idx)


def _gather_grads(ctx, grad_out, bwd):
    """grad_x from ``bwd`` (the backward custom op, or its plain body in eager mode)."""
    (idx,) = ctx.saved_tensors
    return bwd(grad_out, idx, ctx.tokens, ctx.backend), None, None


def _gather_backward(ctx, grad_out):
    return _gather_grads(ctx, grad_out, _gather_bwd_op)


_gather_fwd_op.register_autograd(_gather_backward, setup_context=_gather_setup)


# Eager calls skip the custom op's Python dispatch (as the adaLN ops do): the same kernels and backward.
class TokenGatherFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, idx, backend):
        _gather_setup(ctx, (x, idx, backend), None)
        return _gather_fwd(x, idx, backend)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return _gather_grads(ctx, grad_out, _gather_bwd)


def _gather_apply(x, idx, backend):
    if torch.compiler.is_compiling():
        return _gather_fwd_op(x, idx, backend)
    return TokenGatherFunction.apply(x, idx, backend)


_backend.register_raw_fake("token_gather", lambda x, idx: x.new_empty(x.shape[0], idx.shape[1], x.shape[2]))


# ---- public API -------------------------------------------------------------------------------------------
def token_gather(x: torch.Tensor, idx: torch.Tensor, backend: str | None = None) -> torch.Tensor:
    """(B, K, D) kept tokens of x (B, T, D) at idx (B, K) (module doc), forward and backward fused.

    ``backend``: None / ``auto`` (``DIFFCURR_OPS_BACKEND`` is read when None), ``cuda``, ``triton``, ``cpu`` or
    ``reference`` (``_backend``); an unknown name is a ValueError, an unavailable one a RuntimeError. x may be
    float32, bfloat16 or float16 on the kernels (other dtypes run on the reference). The indices of a sample must
    be distinct and lie in [0, T): the CPU kernels check them, the GPU kernels cannot without a host
    synchronisation (an index outside moves no row).
    """
    check_route(x, idx)
    name = route_backend("token_gather", x, backend)
    if name == "reference":
        return token_gather_ref(x, idx)
    return _gather_apply(x, idx, name)


__all__ = [
    "TokenGatherFunction",
    "check_route",
    "route_backend",
    "token_gather",
    "token_gather_bwd_ref",
    "token_gather_ref",
]
