"""QK-norm and 2-D RoPE, fused: q and k of every head RMS-normalised with their learned weights, then rotated.

``qk_norm_rope(q, k, q_weight, k_weight, cos, sin)`` returns (q', k') ready for attention, for q, k (B, H, N, Dh):
each row of Dh channels is x * rsqrt(mean(x^2) + eps) * weight (RMSNorm, Zhang & Sennrich 2019, Eq. 4, as timm's
and LightningDiT's ``qk_norm``), then each channel pair (x_{2m}, x_{2m+1}) turns by the token's angle m
(RoFormer, Su et al. 2021, Eq. 34): (x_{2m} cos - x_{2m+1} sin, x_{2m} sin + x_{2m+1} cos), with the tables of
``models/modern.rope2d_tables`` (the 2-D layout the modern DiT block uses). Without weights there is no norm; without
tables no rotation. q and k are read in place with their strides (the unbound views of a qkv projection); the
outputs are contiguous (B, H, N, Dh). One forward and one backward kernel (docs/ops.md).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from diffcurr_fast.ops import _backend, _common


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Pairs (x_{2m}, x_{2m+1}) of x (B, H, N, Dh) turned by the tables' angles (back by them with ``inverse``);
    cos, sin (N, Dh/2) or (B, N, Dh/2)."""
    if cos.ndim == 3:
        cos, sin = cos[:, None], sin[:, None]  # (B, 1, N, Dh/2)
    if inverse:
        sin = -sin
    x0, x1 = x[..., 0::2], x[..., 1::2]  # (B, H, N, Dh/2) each
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)  # RoFormer Eq. 34


def _norm_rope_ref(x, weight, cos, sin, eps):
    dt = _common.compute_dtype(x.dtype)
    y = x.to(dt)
    if weight is not None:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps) * weight.to(dt)  # RMSNorm over Dh
    if cos is not None:
        y = _rotate(y, cos.to(dt), sin.to(dt))
    return y.to(x.dtype).contiguous()


def qk_norm_rope_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: (q', k') in q's dtype, computed in float32 (float64 for float64); tables (N, Dh/2) or
    (B, N, Dh/2)."""
    return _norm_rope_ref(q, q_weight, cos, sin, eps), _norm_rope_ref(k, k_weight, cos, sin, eps)


def _norm_rope_bwd_ref(g, x, weight, cos, sin, eps):
    dt = _common.compute_dtype(x.dtype)
    gr = g.to(dt)
    if cos is not None:
        gr = _rotate(gr, cos.to(dt), sin.to(dt), inverse=True)  # the rotation's transpose
    if weight is None:
        return gr.to(x.dtype), None
    xf = x.to(dt)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    xhat = xf * rstd
    gh = gr * weight.to(dt)
    gx = rstd * (gh - xhat * (gh * xhat).mean(-1, keepdim=True))
    return gx.to(x.dtype), (gr * xhat).sum((0, 1, 2)).to(weight.dtype)


def qk_norm_rope_bwd_ref(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reference backward: (grad_q, grad_k, grad_q_weight, grad_k_weight); the weight gradients are None without
    weights."""
    gq, gwq = _norm_rope_bwd_ref(grad_q, q, q_weight, cos, sin, eps)
    gk, gwk = _norm_rope_bwd_ref(grad_k, k, k_weight, cos, sin, eps)
    return gq, gk, gwq, gwk


# ---- dispatch tables: backend -> function (_backend.table) ------------------------------------------------
def _bwd_reference(gq, gk, q, k, wq, wk, cos, sin, eps, weight_grads):
    out = list(qk_norm_rope_bwd_ref(gq, gk, q, k, wq, wk, cos, sin, eps))
    for i in (2, 3):
        if out[i] is None or not weight_grads:
            out[i] = q.new_empty(0)
    return tuple(out)


_FWD = _backend.table(
    reference=qk_norm_rope_ref,
    triton=lambda *a: _backend.kernels("qk_norm_rope").qk_norm_rope_fwd(*a),
    ext=lambda *a: _backend.ext_ops().qk_norm_rope_fwd(*a),
)
_BWD = _backend.table(
    reference=_bwd_reference,
    triton=lambda *a: _backend.kernels("qk_norm_rope").qk_norm_rope_bwd(*a),
    ext=lambda *a: _backend.ext_ops().qk_norm_rope_bwd(*a),
)


# ---- the custom op (what torch.compile traces) and its autograd --------------------------------------------
def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    return _FWD[backend](q, k, q_weight, k_weight, cos, sin, eps)


_fwd_op = torch.library.custom_op("diffcurr_fast::qk_norm_rope", mutates_args=())(_fwd)


@_fwd_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, eps, backend):
    return (
        torch.empty_like(q, memory_format=torch.contiguous_format),
        torch.empty_like(k, memory_format=torch.contiguous_format),
    )


def _bwd(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    backend: str,
    weight_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_q, grad_k, grad_q_weight, grad_k_weight); the weight gradients are empty (0,) tensors without weights
    or without ``weight_grads``."""
    return _BWD[backend](grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, weight_grads)


_bwd_op = torch.library.custom_op("diffcurr_fast::qk_norm_rope_backward", mutates_args=())(_bwd)


@_bwd_op.register_fake
def _(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, eps, backend, weight_grads=True):
    gq = torch.empty_like(q, memory_format=torch.contiguous_format)
    gk = torch.empty_like(k, memory_format=torch.contiguous_format)
    if q_weight is None or not weight_grads:
        return gq, gk, q.new_empty(0), q.new_empty(0)
    return gq, gk, torch.empty_like(q_weight), torch.empty_like(k_weight)


def _setup(ctx, inputs, output):
    q, k, q_weight, k_weight, cos, sin, eps, backend = inputs
    ctx.eps, ctx.backend = eps, backend
    ctx.save_for_backward(q, k, q_weight, k_weight, cos, sin)


def _grads(ctx, grad_q, grad_k, bwd):
    """The input gradients from ``bwd`` (the backward custom op, or its plain body in eager mode)."""
    q, k, q_weight, k_weight, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    # an output that no loss reads has no gradient: zeros of its shape
    grad_q = torch.zeros_like(q, memory_format=torch.contiguous_format) if grad_q is None else grad_q
    grad_k = torch.zeros_like(k, memory_format=torch.contiguous_format) if grad_k is None else grad_k
    gq, gk, gwq, gwk = bwd(grad_q, grad_k, q, k, q_weight, k_weight, cos, sin, ctx.eps, ctx.backend, need[2] or need[3])
    return (
        gq if need[0] else None,
        gk if need[1] else None,
        gwq if need[2] else None,
        gwk if need[3] else None,
        None,
        None,
        None,
        None,
    )


_fwd_op.register_autograd(lambda ctx, gq, gk: _grads(ctx, gq, gk, _bwd_op), setup_context=_setup)


# ---- eager mode: the same kernels and backward formulas through a plain autograd Function -------------------
# (a custom op's Python dispatch costs tens of microseconds per call on a CPU, ops/adaln.py)
class _QkNormRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, q_weight, k_weight, cos, sin, eps, backend):
        out = _fwd(q, k, q_weight, k_weight, cos, sin, eps, backend)
        _setup(ctx, (q, k, q_weight, k_weight, cos, sin, eps, backend), out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k):
        return _grads(ctx, grad_q, grad_k, _bwd)


def _apply(q, k, q_weight, k_weight, cos, sin, eps, backend):
    if torch.compiler.is_compiling():
        return _fwd_op(q, k, q_weight, k_weight, cos, sin, eps, backend)
    return _QkNormRopeFunction.apply(q, k, q_weight, k_weight, cos, sin, eps, backend)


# ---- public API -------------------------------------------------------------------------------------------
def _tables(cos, sin, q: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """cos and sin as (N, Dh/2) or (B, N, Dh/2); they may also come as (B or 1, 1, N, Dh/2) (broadcast over the
    heads, as the model gathers them under token routing)."""
    if (cos is None) != (sin is None):
        raise ValueError("give both cos and sin (the rotation) or neither")
    if cos is None:
        return None, None
    B, _, N, Dh = q.shape
    if Dh % 2:
        raise ValueError(f"the rotation needs an even head dim (channel pairs), got {Dh}")
    out = []
    for name, t in (("cos", cos), ("sin", sin)):
        _common.check_float(t, name)
        if t.ndim == 4 and t.shape[1] == 1:
            t = t[:, 0]  # (B or 1, N, Dh/2)
        if t.ndim == 3 and t.shape[0] == 1:
            t = t[0]  # (N, Dh/2)
        if t.shape not in ((N, Dh // 2), (B, N, Dh // 2)):
            raise ValueError(
                f"{name} must have shape ({N}, {Dh // 2}) or ({B}, {N}, {Dh // 2}) (or with a head dim of 1), got "
                f"{tuple(cos.shape if name == 'cos' else sin.shape)}"
            )
        if t.device != q.device or (torch.float64 in (t.dtype, q.dtype) and t.dtype != q.dtype):
            raise ValueError(f"{name} ({t.dtype}, {t.device}) must match q ({q.dtype}, {q.device})")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad: the rotary tables are constants here; pass them detached")
        out.append(t)
    if out[0].shape != out[1].shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    return out[0], out[1]


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k'): per-head RMSNorm of q and k with their weights, then the 2-D rotation by the tables, fused
    forward and backward.

    q, k (B, H, N, Dh) of one dtype and device, any strides; q_weight, k_weight (Dh,) or both None (no norm);
    cos, sin (N, Dh/2), (B, N, Dh/2) or (B, 1, N, Dh/2), or both None (no rotation); not both None. Returns
    contiguous (B, H, N, Dh) tensors in q's dtype; float32 arithmetic.
    """
    _common.check_float(q, "q")
    if q.ndim != 4:
        raise ValueError(f"q must have shape (B, H, N, Dh), got {tuple(q.shape)}")
    _common.check_like(k, q, "k", "q")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight (the QK-norm) or neither")
    _common.check_weight(q_weight, q, q.shape[3], "q_weight")
    _common.check_weight(k_weight, q, q.shape[3], "k_weight")
    cos, sin = _tables(cos, sin, q)
    if q_weight is None and cos is None:
        raise ValueError("qk_norm_rope has nothing to do: give the QK-norm weights, the rotary tables, or both")
    eps = _common.check_eps(eps)
    return _apply(q, k, q_weight, k_weight, cos, sin, eps, _common.backend_for("qk_norm_rope_fwd", q, backend))


__all__ = ["qk_norm_rope", "qk_norm_rope_bwd_ref", "qk_norm_rope_ref"]
