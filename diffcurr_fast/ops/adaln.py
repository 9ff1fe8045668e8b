"""The DiT block's elementwise path, fused: adaLN-Zero modulate and the gated residual (Peebles & Xie 2023).

``adaln_modulate(x, shift, scale)`` = LayerNorm(x, no affine) * (1 + scale) + shift and
``gated_residual(x, gate, y)`` = x + gate * y, for x, y (B, N, D) and shift, scale, gate (B, D); each is one
forward and one backward kernel (definitions and backward formulas in docs/ops.md).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from diffcurr_fast.ops import _backend, _common


def adaln_modulate_ref(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: (y, mean, rstd); statistics in float32 (float64 for float64 x), y in x's dtype."""
    dt = _common.compute_dtype(x.dtype)
    xf = x.to(dt)  # (B, N, D)
    mean = xf.mean(-1)  # (B, N)
    rstd = torch.rsqrt((xf - mean[..., None]).square().mean(-1) + eps)  # (B, N)
    xhat = (xf - mean[..., None]) * rstd[..., None]
    y = xhat * (1.0 + scale.to(dt)[:, None, :]) + shift.to(dt)[:, None, :]  # adaLN-Zero modulate, DiT Sec. 3.2
    return y.to(x.dtype), mean, rstd


def adaln_modulate_bwd_ref(
    grad_y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference backward: (grad_x, grad_shift, grad_scale) by the LayerNorm backward formula."""
    dt = _common.compute_dtype(x.dtype)
    g = grad_y.to(dt)  # (B, N, D)
    xhat = (x.to(dt) - mean[..., None].to(dt)) * rstd[..., None].to(dt)
    gxh = g * (1.0 + scale.to(dt)[:, None, :])
    gx = rstd[..., None].to(dt) * (gxh - gxh.mean(-1, keepdim=True) - xhat * (gxh * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), g.sum(1).to(scale.dtype), (g * xhat).sum(1).to(scale.dtype)


def gated_residual_ref(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Reference: x + gate[:, None, :] * y (adaLN-Zero gate), computed in float32 (float64 for float64)."""
    dt = _common.compute_dtype(x.dtype)
    return (x.to(dt) + gate.to(dt)[:, None, :] * y.to(dt)).to(x.dtype)


def gated_residual_bwd_ref(
    grad_out: torch.Tensor, gate: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference backward: (grad_gate, grad_y) = (sum_N grad_out * y, grad_out * gate); grad_x is grad_out."""
    dt = _common.compute_dtype(y.dtype)
    g = grad_out.to(dt)  # (B, N, D)
    return (g * y.to(dt)).sum(1).to(gate.dtype), (g * gate.to(dt)[:, None, :]).to(y.dtype)


# ---- dispatch tables: backend -> function (_backend.table) ------------------------------------------------
def _adaln_bwd_reference(grad_y, x, scale, mean, rstd, affine_grads):
    gx, gshift, gscale = adaln_modulate_bwd_ref(grad_y, x, scale, mean, rstd)
    return (gx, gshift, gscale) if affine_grads else (gx, scale.new_empty(0), scale.new_empty(0))


def _gated_fwd_ext(x, gate, y):
    # the C++ kernels take one dtype: gate and y are cast to x's (a copy only under mixed precision)
    return _backend.ext_ops().gated_residual_fwd(
        x.contiguous(), gate.to(x.dtype).contiguous(), y.to(x.dtype).contiguous()
    )


def _gated_bwd_ext(grad_out, gate, y):
    dt = grad_out.dtype  # grad_out has x's dtype; the C++ kernels take one dtype
    args = (grad_out.contiguous(), gate.to(dt).contiguous(), y.to(dt).contiguous())
    ggate, gy = _backend.ext_ops().gated_residual_bwd(*args)  # grad_x is grad_out: no copy is made
    return ggate.to(gate.dtype), gy.to(y.dtype)


# the kernels write fresh, separate outputs; without affine_grads the backward skips the column sums over N
_ADALN_FWD = _backend.table(
    reference=adaln_modulate_ref,
    triton=_backend.contiguous_args(lambda *a: _backend.kernels("adaln").adaln_modulate_fwd(*a)),
    ext=_backend.contiguous_args(lambda *a: _backend.ext_ops().adaln_modulate_fwd(*a)),
)
_ADALN_BWD = _backend.table(
    reference=_adaln_bwd_reference,
    triton=_backend.contiguous_args(lambda *a: _backend.kernels("adaln").adaln_modulate_bwd(*a)),
    ext=_backend.contiguous_args(lambda *a: _backend.ext_ops().adaln_modulate_bwd(*a)),
)
_GATED_FWD = _backend.table(  # Triton reads each input in its own dtype
    reference=gated_residual_ref,
    triton=_backend.contiguous_args(lambda *a: _backend.kernels("adaln").gated_residual_fwd(*a)),
    ext=_gated_fwd_ext,
)
_GATED_BWD = _backend.table(
    reference=gated_residual_bwd_ref,
    triton=_backend.contiguous_args(lambda *a: _backend.kernels("adaln").gated_residual_bwd(*a)),
    ext=_gated_bwd_ext,
)


# ---- adaln_modulate ---------------------------------------------------------------------------------------
# Each op's body is a plain function: the custom op wraps it (for torch.compile), eager calls run it directly.
def _adaln_fwd(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float, backend: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _ADALN_FWD[backend](x, shift, scale, eps)


_adaln_fwd_op = torch.library.custom_op("diffcurr_fast::adaln_modulate", mutates_args=())(_adaln_fwd)


@_adaln_fwd_op.register_fake
def _(x, shift, scale, eps, backend):
    dt = _common.compute_dtype(x.dtype)
    stats = x.new_empty(x.shape[:2], dtype=dt)
    return torch.empty_like(x, memory_format=torch.contiguous_format), stats, torch.empty_like(stats)


def _adaln_bwd(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    backend: str,
    affine_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_x, grad_shift, grad_scale); without ``affine_grads`` the last two are empty (0,) tensors."""
    return _ADALN_BWD[backend](grad_y, x, scale, mean, rstd, affine_grads)


_adaln_bwd_op = torch.library.custom_op("diffcurr_fast::adaln_modulate_backward", mutates_args=())(_adaln_bwd)


@_adaln_bwd_op.register_fake
def _(grad_y, x, scale, mean, rstd, backend, affine_grads=True):
    if not affine_grads:
        return torch.empty_like(x, memory_format=torch.contiguous_format), scale.new_empty(0), scale.new_empty(0)
    return (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(scale, memory_format=torch.contiguous_format),
        torch.empty_like(scale, memory_format=torch.contiguous_format),
    )


def _adaln_setup(ctx, inputs, output):
    x, shift, scale, eps, backend = inputs
    _, mean, rstd = output
    ctx.backend = backend
    ctx.save_for_backward(x, scale, mean, rstd)


def _adaln_grads(ctx, grad_y, bwd):
    """The input gradients from ``bwd`` (the backward custom op, or its plain body in eager mode)."""
    x, scale, mean, rstd = ctx.saved_tensors
    need_shift, need_scale = ctx.needs_input_grad[1], ctx.needs_input_grad[2]
    # without shift / scale gradients the kernel skips their column sums over N
    gx, gshift, gscale = bwd(grad_y, x, scale, mean, rstd, ctx.backend, need_shift or need_scale)
    return gx, gshift if need_shift else None, gscale if need_scale else None, None, None


def _adaln_backward(ctx, grad_y, grad_mean, grad_rstd):
    return _adaln_grads(ctx, grad_y, _adaln_bwd_op)


_adaln_fwd_op.register_autograd(_adaln_backward, setup_context=_adaln_setup)


# ---- gated_residual ---------------------------------------------------------------------------------------
def _gated_fwd(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, backend: str) -> torch.Tensor:
    return _GATED_FWD[backend](x, gate, y)


_gated_fwd_op = torch.library.custom_op("diffcurr_fast::gated_residual", mutates_args=())(_gated_fwd)


@_gated_fwd_op.register_fake
def _(x, gate, y, backend):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _gated_bwd(
    grad_out: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _GATED_BWD[backend](grad_out, gate, y)


_gated_bwd_op = torch.library.custom_op("diffcurr_fast::gated_residual_backward", mutates_args=())(_gated_bwd)


@_gated_bwd_op.register_fake
def _(grad_out, gate, y, backend):
    return torch.empty_like(gate, memory_format=torch.contiguous_format), torch.empty_like(
        y, memory_format=torch.contiguous_format
    )


def _gated_setup(ctx, inputs, output):
    x, gate, y, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(gate, y)


def _gated_grads(ctx, grad_out, bwd):
    """The input gradients from ``bwd`` (the backward custom op, or its plain body in eager mode)."""
    gate, y = ctx.saved_tensors
    ggate = gy = None
    if ctx.needs_input_grad[1]:
        ggate, gy = bwd(grad_out, gate, y, ctx.backend)
        if not ctx.needs_input_grad[2]:
            gy = None
    elif ctx.needs_input_grad[2]:
        # grad_y alone is one broadcast multiply (nothing to fuse); it reads grad_out with its own strides, so a
        # broadcast grad_out is never materialised. The product is rounded once, as in the fused kernel.
        gy = (grad_out * gate[:, None, :]).to(y.dtype)  # (B, N, D)
    return grad_out, ggate, gy, None  # d out / d x is the identity


def _gated_backward(ctx, grad_out):
    return _gated_grads(ctx, grad_out, _gated_bwd_op)


_gated_fwd_op.register_autograd(_gated_backward, setup_context=_gated_setup)


# ---- eager mode: the same kernels and backward formulas through plain autograd Functions -------------------
# A custom op's Python dispatch costs about 50 us per call and backward on a CPU, most of a small DiT block's
# overhead; eager calls skip it. Under torch.compile the custom ops above are traced instead (their fake kernels).
class _AdalnModulateFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, shift, scale, eps, backend):
        y, mean, rstd = _adaln_fwd(x, shift, scale, eps, backend)
        _adaln_setup(ctx, (x, shift, scale, eps, backend), (y, mean, rstd))
        ctx.mark_non_differentiable(mean, rstd)
        return y, mean, rstd

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_y, grad_mean, grad_rstd):
        return _adaln_grads(ctx, grad_y, _adaln_bwd)


class _GatedResidualFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, gate, y, backend):
        _gated_setup(ctx, (x, gate, y, backend), None)
        return _gated_fwd(x, gate, y, backend)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        return _gated_grads(ctx, grad_out, _gated_bwd)


def _adaln_apply(x, shift, scale, eps, backend):
    if torch.compiler.is_compiling():
        return _adaln_fwd_op(x, shift, scale, eps, backend)
    return _AdalnModulateFunction.apply(x, shift, scale, eps, backend)


def _gated_apply(x, gate, y, backend):
    if torch.compiler.is_compiling():
        return _gated_fwd_op(x, gate, y, backend)
    return _GatedResidualFunction.apply(x, gate, y, backend)


# ---- public API -------------------------------------------------------------------------------------------
def adaln_modulate(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float = 1e-6, *, backend: str | None = None
) -> torch.Tensor:
    """y = LayerNorm(x) * (1 + scale) + shift (DiT adaLN-Zero modulate), fused forward and backward.

    x (B, N, D); shift, scale (B, D) of x's dtype and device. LayerNorm has no affine parameters and float32
    statistics with ``eps``.
    """
    _common.check_block(x, {"shift": shift, "scale": scale})
    eps = _common.check_eps(eps)
    y, _, _ = _adaln_apply(x, shift, scale, eps, _common.backend_for("adaln_modulate_fwd", x, backend))
    return y


def gated_residual(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor, *, backend: str | None = None) -> torch.Tensor:
    """out = x + gate[:, None, :] * y (DiT adaLN-Zero gated residual), fused forward and backward.

    x, y (B, N, D) on one device; gate (B, D). gate and y may have another float16/bfloat16/float32 dtype than
    x (under autocast: a bf16 attention output on an fp32 residual stream); the result has x's dtype and is
    computed in float32.
    """
    _common.check_block(x, {"gate": gate}, mixed=True)
    _common.check_float(y, "y")
    if y.shape != x.shape:
        raise ValueError(f"y shape {tuple(y.shape)} does not match x shape {tuple(x.shape)}")
    if y.device != x.device or (torch.float64 in (x.dtype, y.dtype) and y.dtype != x.dtype):
        raise ValueError(f"y ({y.dtype}, {y.device}) must match x ({x.dtype}, {x.device})")
    name = _common.backend_for("gated_residual_fwd", x, backend)
    if (
        name == "cuda"
        and _backend.requested(backend) == "auto"
        and (y.dtype != x.dtype or gate.dtype != x.dtype)
        and _backend.available("triton", "gated_residual_fwd", x.device)
    ):
        name = "triton"  # auto: the CUDA kernel takes one dtype (it would need a cast copy of y); Triton reads both
    return _gated_apply(x, gate, y, name)
