"""Scaled dot-product attention with selectable backends.

``attention(q, k, v, backend)`` takes q, k, v of shape (B, H, N, Dh) and returns softmax(q k^T * scale) v of the
same layout (Vaswani et al. 2017, Eq. 1). Backends:

- ``math``: the reference. Scores, softmax and the weighted sum are computed in float32 (float64 stays
  float64), with autocast disabled, then cast back to the input dtype.
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (PyTorch picks flash / memory-efficient /
  math kernels itself).
- ``flash_attn``: the ``flash-attn`` package (Dao et al.), CUDA tensors in float16 / bfloat16 only; it wants the
  (B, N, H, Dh) layout, so the tensors are transposed around the call.
- ``auto``: ``flash_attn`` when it is usable for these tensors, else ``sdpa``.

A backend asked for by name that cannot run raises :class:`BackendUnavailableError` with the reason.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F

__all__ = [
    "ATTENTION_BACKENDS",
    "BackendUnavailableError",
    "attention",
    "available_backends",
    "flash_attn_reason",
    "prepare",
]

ATTENTION_BACKENDS: tuple[str, ...] = ("auto", "flash_attn", "sdpa", "math")

# flash-attn 2 supports head dimensions up to 256 on sm80+ (Ampere, Ada, Hopper).
_FLASH_MAX_HEAD_DIM = 256
_FLASH_DTYPES = (torch.float16, torch.bfloat16)


class BackendUnavailableError(RuntimeError):
    """An attention backend was requested explicitly but cannot run here (the message says why)."""


_FLASH_IMPORT: tuple | None = None  # (flash_attn_func or None, reason or None), filled on first use


def _flash_attn_func():
    """Import ``flash_attn.flash_attn_func`` once; return ``(func, None)`` or ``(None, reason)``. ``prepare`` runs
    it when a module is built: an import inside a ``torch.compile``d forward is a graph break that makes dynamo
    skip the whole frame (the model then runs eager)."""
    global _FLASH_IMPORT
    if _FLASH_IMPORT is None:
        try:  # optional dependency (the flash extra), imported once here
            from flash_attn import flash_attn_func

            _FLASH_IMPORT = (flash_attn_func, None)
        except Exception as exc:  # ImportError, or a broken build raising OSError / RuntimeError at import
            _FLASH_IMPORT = (None, f"the flash-attn package cannot be imported ({type(exc).__name__}: {exc})")
    return _FLASH_IMPORT


def flash_attn_reason(
    q: torch.Tensor | None = None, k: torch.Tensor | None = None, v: torch.Tensor | None = None
) -> str | None:
    """Why the ``flash_attn`` backend cannot run (for the given q, k, v), or None when it can."""
    func, reason = _flash_attn_func()
    if func is None:
        return reason
    if not torch.cuda.is_available():
        return "no CUDA device is available"
    if q is None:
        return None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t is None:
            continue
        if t.device.type != "cuda":
            return f"flash-attn needs CUDA tensors, got {name} on device {t.device}"
        if t.device != q.device:
            return f"flash-attn needs q, k, v on one device, got {name} on {t.device} and q on {q.device}"
        if t.dtype not in _FLASH_DTYPES:
            return f"flash-attn needs float16 or bfloat16 tensors, got {name} of dtype {t.dtype}"
        if t.dtype != q.dtype:
            return f"flash-attn needs q, k, v of one dtype, got {name} {t.dtype} and q {q.dtype}"
        if t.shape[-1] > _FLASH_MAX_HEAD_DIM:
            return f"flash-attn supports head_dim <= {_FLASH_MAX_HEAD_DIM}, got {t.shape[-1]} for {name}"
    if v is not None and v.shape[-1] != q.shape[-1]:
        return f"flash-attn needs the head dim of v to equal that of q, got {v.shape[-1]} and {q.shape[-1]}"
    major, _ = torch.cuda.get_device_capability(q.device)
    if major < 8:
        return f"flash-attn 2 needs compute capability >= 8.0, device {q.device} has {major}.x"
    return None


def prepare(backend: str) -> None:
    """Resolve, outside any compiled region, what ``attention(..., backend)`` will look up (the flash-attn import)."""
    if backend in ("auto", "flash_attn"):
        _flash_attn_func()


def available_backends() -> list[str]:
    """Names of the concrete attention backends that can run in this environment (``auto`` picks among them)."""
    names = ["math", "sdpa"]
    if flash_attn_reason() is None:
        names.append("flash_attn")
    return names


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"attention expects q, k, v of shape (B, H, N, Dh); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[:2] != k.shape[:2] or k.shape[:3] != v.shape[:3] or q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"attention shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} "
            "(need equal B and H, equal Dh for q and k, equal N for k and v)"
        )


def attention_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Reference attention: softmax(q k^T * scale) v with float32 (or wider) scores and softmax."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    compute = torch.promote_types(q.dtype, torch.float32)
    with torch.autocast(q.device.type, enabled=False):
        scores = torch.matmul(q.to(compute), k.to(compute).transpose(-2, -1)) * scale  # (B, H, N, M)
        probs = torch.softmax(scores, dim=-1)  # (B, H, N, M)
        out = torch.matmul(probs, v.to(compute))  # (B, H, N, Dv)
    return out.to(q.dtype)


def _attention_flash(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None) -> torch.Tensor:
    func, _ = _flash_attn_func()
    out = func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale)  # (B, N, H, Dh)
    return out.transpose(1, 2)  # (B, H, N, Dh)


_warned_auto = False


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, backend: str = "auto", scale: float | None = None
) -> torch.Tensor:
    """Multi-head attention over (B, H, N, Dh) tensors with the chosen backend.

    Args:
        q: queries (B, H, N, Dh).
        k: keys (B, H, M, Dh).
        v: values (B, H, M, Dv) (Dv = Dh for ``flash_attn``).
        backend: one of ``auto``, ``flash_attn``, ``sdpa``, ``math``.
        scale: score scale; default ``1 / sqrt(Dh)``.

    Returns:
        (B, H, N, Dv) tensor in q's dtype.
    """
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; valid choices: {', '.join(ATTENTION_BACKENDS)}")
    _check_qkv(q, k, v)
    if backend == "auto":
        reason = flash_attn_reason(q, k, v)
        if reason is None:
            backend = "flash_attn"
        else:
            global _warned_auto
            if not _warned_auto and q.device.type == "cuda" and q.dtype in _FLASH_DTYPES:
                warnings.warn(f"attention backend 'auto' uses sdpa: {reason}", stacklevel=2)
                _warned_auto = True
            backend = "sdpa"
    if backend == "math":
        return attention_math(q, k, v, scale)
    if backend == "sdpa":
        return F.scaled_dot_product_attention(q, k, v, scale=scale)
    reason = flash_attn_reason(q, k, v)
    if reason is not None:
        raise BackendUnavailableError(f"attention backend 'flash_attn' is unavailable: {reason}")
    return _attention_flash(q, k, v, scale)
