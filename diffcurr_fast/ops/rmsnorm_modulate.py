"""RMSNorm-modulate, fused: the modern DiT block's pre-norm and its adaLN modulation in one pass.

``rmsnorm_modulate(x, shift, scale, weight)`` = x * rsqrt(mean_d(x^2) + eps) * weight * (1 + scale) + shift per
token (RMSNorm, Zhang & Sennrich 2019, Eq. 4, then the adaLN-Zero modulation of DiT Sec. 3.2), for x (B, N, D),
shift, scale (B, D) and the optional learned weight (D,). It is the RMSNorm twin of ``adaln_modulate``: one forward
and one backward kernel (definitions and backward formulas in docs/ops.md).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from diffcurr_fast.ops import _backend, _common


def rmsnorm_modulate_ref(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (y, rstd); rstd in float32 (float64 for float64 x), y in x's dtype."""
    dt = _common.compute_dtype(x.dtype)
    xf = x.to(dt)  # (B, N, D)
    rstd = torch.rsqrt(xf.square().mean(-1) + eps)  # (B, N): RMSNorm, Zhang & Sennrich Eq. 4
    xhat = xf * rstd[..., None]
    if weight is not None:
        xhat = xhat * weight.to(dt)
    y = xhat * (1.0 + scale.to(dt)[:, None, :]) + shift.to(dt)[:, None, :]  # adaLN-Zero modulate, DiT Sec. 3.2
    return y.to(x.dtype), rstd


def rmsnorm_modulate_bwd_ref(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Reference backward: (grad_x, grad_shift, grad_scale, grad_weight or None) by the RMSNorm backward formula."""
    dt = _common.compute_dtype(x.dtype)
    g = grad_y.to(dt)  # (B, N, D)
    r = rstd[..., None].to(dt)
    xhat = x.to(dt) * r
    w = 1.0 if weight is None else weight.to(dt)
    gh = g * (1.0 + scale.to(dt)[:, None, :]) * w
    gx = r * (gh - xhat * (gh * xhat).mean(-1, keepdim=True))
    s = (g * xhat).sum(1)  # (B, D)
    gweight = None if weight is None else ((1.0 + scale.to(dt)) * s).sum(0).to(weight.dtype)
    return gx.to(x.dtype), g.sum(1).to(scale.dtype), (s * w).to(scale.dtype), gweight


# ---- dispatch tables: backend -> function (_backend.table) ------------------------------------------------
def _bwd_reference(grad_y, x, scale, weight, rstd, affine_grads):
    gx, gshift, gscale, gweight = rmsnorm_modulate_bwd_ref(grad_y, x, scale, weight, rstd)
    if not affine_grads:
        return gx, scale.new_empty(0), scale.new_empty(0), scale.new_empty(0)
    return gx, gshift, gscale, scale.new_empty(0) if gweight is None else gweight


def _contiguous(t):
    return None if t is None else t.contiguous()


_FWD = _backend.table(
    reference=rmsnorm_modulate_ref,
    triton=lambda x, shift, scale, weight, eps: _backend.kernels("rmsnorm_modulate").rmsnorm_modulate_fwd(
        x.contiguous(), shift.contiguous(), scale.contiguous(), _contiguous(weight), eps
    ),
    ext=lambda x, shift, scale, weight, eps: _backend.ext_ops().rmsnorm_modulate_fwd(x, shift, scale, weight, eps),
)
_BWD = _backend.table(
    reference=_bwd_reference,
    triton=lambda gy, x, scale, weight, rstd, affine: _backend.kernels("rmsnorm_modulate").rmsnorm_modulate_bwd(
        gy.contiguous(), x.contiguous(), scale.contiguous(), _contiguous(weight), rstd.contiguous(), affine
    ),
    ext=lambda gy, x, scale, weight, rstd, affine: _backend.ext_ops().rmsnorm_modulate_bwd(
        gy, x, scale, weight, rstd, affine
    ),
)


# ---- the custom op (what torch.compile traces) and its autograd --------------------------------------------
def _fwd(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor | None, eps: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _FWD[backend](x, shift, scale, weight, eps)


_fwd_op = torch.library.custom_op("diffcurr_fast::rmsnorm_modulate", mutates_args=())(_fwd)


@_fwd_op.register_fake
def _(x, shift, scale, weight, eps, backend):
    rstd = x.new_empty(x.shape[:2], dtype=_common.compute_dtype(x.dtype))
    return torch.empty_like(x, memory_format=torch.contiguous_format), rstd


def _bwd(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    backend: str,
    affine_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_shift, grad_scale, grad_weight); without ``affine_grads`` the last three are empty (0,) tensors,
    and grad_weight is empty without a weight."""
    return _BWD[backend](grad_y, x, scale, weight, rstd, affine_grads)


_bwd_op = torch.library.custom_op("diffcurr_fast::rmsnorm_modulate_backward", mutates_args=())(_bwd)


@_bwd_op.register_fake
def _(grad_y, x, scale, weight, rstd, backend, affine_grads=True):
    gx = torch.empty_like(x, memory_format=torch.contiguous_format)
    if not affine_grads:
        return gx, scale.new_empty(0), scale.new_empty(0), scale.new_empty(0)
    gweight = scale.new_empty(0) if weight is None else torch.empty_like(weight, memory_format=torch.contiguous_format)
    vec = torch.empty_like(scale, memory_format=torch.contiguous_format)
    return gx, vec, torch.empty_like(vec), gweight


def _setup(ctx, inputs, output):
    x, shift, scale, weight, eps, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(x, scale, weight, output[1])


def _grads(ctx, grad_y, bwd):
    """The input gradients from ``bwd`` (the backward custom op, or its plain body in eager mode)."""
    x, scale, weight, rstd = ctx.saved_tensors
    need = ctx.needs_input_grad
    # without shift / scale / weight gradients the kernel skips their column sums over N
    gx, gshift, gscale, gweight = bwd(grad_y, x, scale, weight, rstd, ctx.backend, need[1] or need[2] or need[3])
    return (
        gx if need[0] else None,
        gshift if need[1] else None,
        gscale if need[2] else None,
        gweight if need[3] else None,
        None,
        None,
    )


_fwd_op.register_autograd(lambda ctx, grad_y, grad_rstd: _grads(ctx, grad_y, _bwd_op), setup_context=_setup)


# ---- eager mode: the same kernels and backward formulas through a plain autograd Function -------------------
# (a custom op's Python dispatch costs tens of microseconds per call on a CPU, ops/adaln.py)
class _RmsNormModulateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, scale, weight, eps, backend):
        y, rstd = _fwd(x, shift, scale, weight, eps, backend)
        _setup(ctx, (x, shift, scale, weight, eps, backend), (y, rstd))
        ctx.mark_non_differentiable(rstd)
        return y, rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_rstd):
        return _grads(ctx, grad_y, _bwd)


def _apply(x, shift, scale, weight, eps, backend):
    if torch.compiler.is_compiling():
        return _fwd_op(x, shift, scale, weight, eps, backend)
    return _RmsNormModulateFunction.apply(x, shift, scale, weight, eps, backend)


# ---- public API -------------------------------------------------------------------------------------------
def rmsnorm_modulate(
    x: torch.Tensor,
    shift: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """y = RMSNorm(x) * weight * (1 + scale) + shift, fused forward and backward.

    x (B, N, D); shift, scale (B, D) of x's dtype and device; weight (D,) or None (no weight); float32 statistics
    with ``eps``.
    """
    _common.check_block(x, {"shift": shift, "scale": scale})
    _common.check_weight(weight, x, x.shape[2])
    eps = _common.check_eps(eps)
    y, _ = _apply(x, shift, scale, weight, eps, _common.backend_for("rmsnorm_modulate_fwd", x, backend))
    return y


__all__ = ["rmsnorm_modulate", "rmsnorm_modulate_bwd_ref", "rmsnorm_modulate_ref"]
