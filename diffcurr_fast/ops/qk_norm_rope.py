"""QK-norm and 2-D RoPE, fused: q and k of every head RMS-normalised with their learned weights, then rotated.

``qk_norm_rope(qkv, heads, q_weight, k_weight, cos, sin)`` takes the attention's packed projection qkv
(B, N, 3 H Dh), [q; k; v] of H heads along the last dimension (the layout of DiT's and timm's ``qkv`` linear), and
returns (q, k, v) ready for attention, each contiguous (B, H, N, Dh): every row of Dh channels of q and k is
x * rsqrt(mean(x^2) + eps) * weight (RMSNorm, Zhang & Sennrich 2019, Eq. 4, as timm's and LightningDiT's
``qk_norm``), then each channel pair (x_{2m}, x_{2m+1}) turns by the token's angle m (RoFormer, Su et al. 2021,
Eq. 34): (x_{2m} cos - x_{2m+1} sin, x_{2m} sin + x_{2m+1} cos), with the tables of ``models/modern.rope2d_tables``
(the 2-D layout the modern DiT block uses); v is only laid out by heads. Without weights there is no norm, without
tables no rotation. One forward kernel reads qkv once; the backward writes the gradient of qkv in one pass (no
stack of the three head gradients and no copy of its permuted layout, which unbinding q, k, v from a view costs).
Definitions and the backward formulas: docs/ops.md.
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


def split_heads(qkv: torch.Tensor, heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v (B, H, N, Dh) views of the packed projection qkv (B, N, 3 H Dh)."""
    B, N, C = qkv.shape
    return qkv.reshape(B, N, 3, heads, C // (3 * heads)).permute(2, 0, 3, 1, 4).unbind(0)


def _norm_rope_ref(x, weight, cos, sin, eps):
    dt = _common.compute_dtype(x.dtype)
    y = x.to(dt)
    if weight is not None:
        y = y * torch.rsqrt(y.square().mean(-1, keepdim=True) + eps) * weight.to(dt)  # RMSNorm over Dh
    if cos is not None:
        y = _rotate(y, cos.to(dt), sin.to(dt))
    return y.to(x.dtype).contiguous()


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reference: (q, k, v) contiguous (B, H, N, Dh) in qkv's dtype, computed in float32 (float64 for float64);
    tables (N, Dh/2) or (B, N, Dh/2)."""
    q, k, v = split_heads(qkv, heads)
    return _norm_rope_ref(q, q_weight, cos, sin, eps), _norm_rope_ref(k, k_weight, cos, sin, eps), v.contiguous()


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
    grad_v: torch.Tensor,
    qkv: torch.Tensor,
    heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Reference backward: (grad_qkv (B, N, 3 H Dh), grad_q_weight, grad_k_weight); the weight gradients are None
    without weights."""
    q, k, _ = split_heads(qkv, heads)
    gq, gwq = _norm_rope_bwd_ref(grad_q, q, q_weight, cos, sin, eps)
    gk, gwk = _norm_rope_bwd_ref(grad_k, k, k_weight, cos, sin, eps)
    grads = torch.stack((gq, gk, grad_v.to(qkv.dtype)))  # (3, B, H, N, Dh)
    return grads.permute(1, 3, 0, 2, 4).reshape(qkv.shape), gwq, gwk


# ---- dispatch tables: backend -> function (_backend.table) ------------------------------------------------
def _bwd_reference(gq, gk, gv, qkv, heads, wq, wk, cos, sin, eps, weight_grads):
    gqkv, gwq, gwk = qk_norm_rope_bwd_ref(gq, gk, gv, qkv, heads, wq, wk, cos, sin, eps)
    if gwq is None or not weight_grads:
        return gqkv, qkv.new_empty(0), qkv.new_empty(0)
    return gqkv, gwq, gwk


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
    qkv: torch.Tensor,
    heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _FWD[backend](qkv, heads, q_weight, k_weight, cos, sin, eps)


_fwd_op = torch.library.custom_op("diffcurr_fast::qk_norm_rope", mutates_args=())(_fwd)


@_fwd_op.register_fake
def _(qkv, heads, q_weight, k_weight, cos, sin, eps, backend):
    B, N, C = qkv.shape
    return tuple(qkv.new_empty(B, heads, N, C // (3 * heads)) for _ in range(3))


def _bwd(
    grad_q: torch.Tensor,
    grad_k: torch.Tensor,
    grad_v: torch.Tensor,
    qkv: torch.Tensor,
    heads: int,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    eps: float,
    backend: str,
    weight_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(grad_qkv, grad_q_weight, grad_k_weight); the weight gradients are empty (0,) tensors without weights or
    without ``weight_grads``."""
    return _BWD[backend](grad_q, grad_k, grad_v, qkv, heads, q_weight, k_weight, cos, sin, eps, weight_grads)


_bwd_op = torch.library.custom_op("diffcurr_fast::qk_norm_rope_backward", mutates_args=())(_bwd)


@_bwd_op.register_fake
def _(grad_q, grad_k, grad_v, qkv, heads, q_weight, k_weight, cos, sin, eps, backend, weight_grads=True):
    gqkv = torch.empty_like(qkv, memory_format=torch.contiguous_format)
    if q_weight is None or not weight_grads:
        return gqkv, qkv.new_empty(0), qkv.new_empty(0)
    return gqkv, torch.empty_like(q_weight), torch.empty_like(k_weight)


def _setup(ctx, inputs, output):
    qkv, heads, q_weight, k_weight, cos, sin, eps, backend = inputs
    ctx.heads, ctx.eps, ctx.backend = heads, eps, backend
    ctx.save_for_backward(qkv, q_weight, k_weight, cos, sin)


def _grads(ctx, grad_q, grad_k, grad_v, bwd):
    """The input gradients from ``bwd`` (the backward custom op, or its plain body in eager mode)."""
    qkv, q_weight, k_weight, cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    B, N, C = qkv.shape
    grads = [grad_q, grad_k, grad_v]
    for i, g in enumerate(grads):  # an output that no loss reads has no gradient: zeros of its shape
        if g is None:
            grads[i] = qkv.new_zeros(B, ctx.heads, N, C // (3 * ctx.heads))
    weight_grads = need[2] or need[3]
    gqkv, gwq, gwk = bwd(*grads, qkv, ctx.heads, q_weight, k_weight, cos, sin, ctx.eps, ctx.backend, weight_grads)
    return gqkv if need[0] else None, None, gwq if need[2] else None, gwk if need[3] else None, None, None, None, None


_fwd_op.register_autograd(lambda ctx, gq, gk, gv: _grads(ctx, gq, gk, gv, _bwd_op), setup_context=_setup)


# ---- eager mode: the same kernels and backward formulas through a plain autograd Function -------------------
# (a custom op's Python dispatch costs tens of microseconds per call on a CPU, ops/adaln.py)
class _QkNormRopeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, heads, q_weight, k_weight, cos, sin, eps, backend):
        out = _fwd(qkv, heads, q_weight, k_weight, cos, sin, eps, backend)
        _setup(ctx, (qkv, heads, q_weight, k_weight, cos, sin, eps, backend), out)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_q, grad_k, grad_v):
        return _grads(ctx, grad_q, grad_k, grad_v, _bwd)


def _apply(qkv, heads, q_weight, k_weight, cos, sin, eps, backend):
    if torch.compiler.is_compiling():
        return _fwd_op(qkv, heads, q_weight, k_weight, cos, sin, eps, backend)
    return _QkNormRopeFunction.apply(qkv, heads, q_weight, k_weight, cos, sin, eps, backend)


# ---- public API -------------------------------------------------------------------------------------------
def _tables(cos, sin, qkv: torch.Tensor, tokens: int, head_dim: int):
    """cos and sin as (N, Dh/2) or (B, N, Dh/2); they may also come as (B or 1, 1, N, Dh/2) (broadcast over the
    heads, as the model gathers them under token routing)."""
    if (cos is None) != (sin is None):
        raise ValueError("give both cos and sin (the rotation) or neither")
    if cos is None:
        return None, None
    if head_dim % 2:
        raise ValueError(f"the rotation needs an even head dim (channel pairs), got {head_dim}")
    B, half = qkv.shape[0], head_dim // 2
    out = []
    for name, given in (("cos", cos), ("sin", sin)):
        _common.check_float(given, name)
        t = given[:, 0] if given.ndim == 4 and given.shape[1] == 1 else given  # (B or 1, N, Dh/2)
        t = t[0] if t.ndim == 3 and t.shape[0] == 1 else t  # (N, Dh/2)
        if t.shape not in ((tokens, half), (B, tokens, half)):
            raise ValueError(
                f"{name} must have shape ({tokens}, {half}) or ({B}, {tokens}, {half}) (or with a head dim of 1), "
                f"got {tuple(given.shape)}"
            )
        if t.device != qkv.device or (torch.float64 in (t.dtype, qkv.dtype) and t.dtype != qkv.dtype):
            raise ValueError(f"{name} ({t.dtype}, {t.device}) must match qkv ({qkv.dtype}, {qkv.device})")
        if t.requires_grad and torch.is_grad_enabled():
            raise ValueError(f"{name} requires grad: the rotary tables are constants here; pass them detached")
        out.append(t)
    if out[0].shape != out[1].shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    return out[0], out[1]


def qk_norm_rope(
    qkv: torch.Tensor,
    heads: int,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q, k, v) for attention from the packed projection: per-head RMSNorm of q and k with their weights, then the
    2-D rotation by the tables, fused forward and backward.

    qkv (B, N, 3 * heads * Dh) ([q; k; v] along the last dimension); q_weight, k_weight (Dh,) or both None (no
    norm); cos, sin (N, Dh/2), (B, N, Dh/2) or (B, 1, N, Dh/2), or both None (no rotation). Returns three
    contiguous (B, heads, N, Dh) tensors in qkv's dtype; float32 arithmetic (float64 on the reference).
    """
    _common.check_float(qkv, "qkv")
    if qkv.ndim != 3:
        raise ValueError(f"qkv must have shape (B, N, 3 * heads * head_dim), got {tuple(qkv.shape)}")
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or qkv.shape[2] % (3 * heads):
        raise ValueError(
            f"heads must be a positive int that divides qkv's last dimension {qkv.shape[2]} into 3 * heads * head_dim, "
            f"got {heads!r}"
        )
    head_dim = qkv.shape[2] // (3 * heads)
    if (q_weight is None) != (k_weight is None):
        raise ValueError("give both q_weight and k_weight (the QK-norm) or neither")
    _common.check_weight(q_weight, qkv, head_dim, "q_weight")
    _common.check_weight(k_weight, qkv, head_dim, "k_weight")
    cos, sin = _tables(cos, sin, qkv, qkv.shape[1], head_dim)
    eps = _common.check_eps(eps)
    return _apply(qkv, heads, q_weight, k_weight, cos, sin, eps, _common.backend_for("qk_norm_rope_fwd", qkv, backend))


__all__ = ["qk_norm_rope", "qk_norm_rope_bwd_ref", "qk_norm_rope_ref", "split_heads"]
