"""SwiGLU, fused: silu(a) * b on the two halves of the first MLP projection (Shazeer 2020, Eq. 6).

``swiglu(x)`` = silu(x[..., :H]) * x[..., H:] for x (..., 2H): a = w1 x and b = w2 x stacked as one projection
(the modern DiT block's ``mlp.w12``), so the backward writes the gradient of that one projection output without a
concatenation. silu(a) = a sigmoid(a); grad_a = grad_y b s (1 + a (1 - s)), grad_b = grad_y a s with s = sigmoid(a)
(Liger-Kernel's form). One forward and one backward kernel (docs/ops.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from diffcurr_fast.ops import _backend, _common


def swiglu_ref(x: torch.Tensor) -> torch.Tensor:
    """Reference: silu(a) * b for the halves a, b of x's last dimension, in float32 (float64 for float64)."""
    dt = _common.compute_dtype(x.dtype)
    a, b = x.to(dt).chunk(2, dim=-1)  # (..., H) each
    return (F.silu(a) * b).to(x.dtype)


def swiglu_bwd_ref(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Reference backward: grad_x (..., 2H) = [grad_y b s (1 + a (1 - s)), grad_y a s], s = sigmoid(a)."""
    dt = _common.compute_dtype(x.dtype)
    a, b = x.to(dt).chunk(2, dim=-1)
    g = grad_y.to(dt)
    s = torch.sigmoid(a)
    return torch.cat((g * b * s * (1.0 + a * (1.0 - s)), g * a * s), dim=-1).to(x.dtype)


# ---- dispatch tables: backend -> function (_backend.table) ------------------------------------------------
_FWD = _backend.table(
    reference=swiglu_ref,
    triton=_backend.contiguous_args(lambda x: _backend.kernels("swiglu").swiglu_fwd(x)),
    ext=lambda x: _backend.ext_ops().swiglu_fwd(x),
)
_BWD = _backend.table(
    reference=swiglu_bwd_ref,
    triton=_backend.contiguous_args(lambda gy, x: _backend.kernels("swiglu").swiglu_bwd(gy, x)),
    ext=lambda gy, x: _backend.ext_ops().swiglu_bwd(gy, x),
)


# ---- the custom op (what torch.compile traces) and its autograd --------------------------------------------
def _fwd(x: torch.Tensor, backend: str) -> torch.Tensor:
    return _FWD[backend](x)


_fwd_op = torch.library.custom_op("diffcurr_fast::swiglu", mutates_args=())(_fwd)


@_fwd_op.register_fake
def _(x, backend):
    return x.new_empty((*x.shape[:-1], x.shape[-1] // 2))


def _bwd(grad_y: torch.Tensor, x: torch.Tensor, backend: str) -> torch.Tensor:
    return _BWD[backend](grad_y, x)


_bwd_op = torch.library.custom_op("diffcurr_fast::swiglu_backward", mutates_args=())(_bwd)


@_bwd_op.register_fake
def _(grad_y, x, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _setup(ctx, inputs, output):
    x, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(x)


def _grads(ctx, grad_y, bwd):
    (x,) = ctx.saved_tensors
    return bwd(grad_y, x, ctx.backend), None


_fwd_op.register_autograd(lambda ctx, grad_y: _grads(ctx, grad_y, _bwd_op), setup_context=_setup)


# ---- eager mode: the same kernels and backward formulas through a plain autograd Function -------------------
# (a custom op's Python dispatch costs tens of microseconds per call on a CPU, ops/adaln.py)
class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, backend):
        _setup(ctx, (x, backend), None)
        return _fwd(x, backend)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y):
        return _grads(ctx, grad_y, _bwd)


def _apply(x, backend):
    if torch.compiler.is_compiling():
        return _fwd_op(x, backend)
    return _SwiGLUFunction.apply(x, backend)


# ---- public API -------------------------------------------------------------------------------------------
def swiglu(x: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """silu(a) * b for a, b the two halves of x's last dimension, fused forward and backward.

    x (..., 2H), any float dtype (float32 arithmetic; float64 on the reference); returns (..., H) in x's dtype.
    """
    _common.check_float(x, "x")
    if x.ndim < 1 or x.shape[-1] % 2:
        raise ValueError(
            f"x must have an even last dimension holding the two halves [a, b] of the projection, got shape "
            f"{tuple(x.shape)}"
        )
    return _apply(x, _common.backend_for("swiglu_fwd", x, backend))


__all__ = ["swiglu", "swiglu_bwd_ref", "swiglu_ref"]
