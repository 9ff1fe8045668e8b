"""Triton kernel for the per-sample weighted diffusion MSE and its gradient, in one pass over memory.

loss[b] = w[b] * mean_j (pred - (p[b] x0 + q[b] eps))^2 ; grad = w[b] * (2/M) * (pred - tgt) (docs/ops.md).
Each program reduces one BLOCK of a row into a partial sum (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .philox import INTERPRET, _philox_normal


def _configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK": 4096}, num_warps=4)]
    return [triton.Config({"BLOCK": 1024}, num_warps=4), triton.Config({"BLOCK": 2048}, num_warps=8)]


MIN_BLOCK = min(cfg.kwargs["BLOCK"] for cfg in _configs())


@triton.autotune(configs=_configs(), key=["M"], reset_to_zero=["partial_ptr"])
@triton.jit
def _diffusion_loss_fwd_kernel(
    pred_ptr,
    x0_ptr,
    noise_ptr,
    p_ptr,
    q_ptr,
    w_ptr,
    partial_ptr,
    grad_ptr,
    seed,
    M,
    n_part,
    HAS_NOISE: tl.constexpr,
    WITH_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid_m = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_m * BLOCK + tl.arange(0, BLOCK)
    mask = cols < M
    offs = b * M + cols
    pred = tl.load(pred_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        eps = tl.load(noise_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        eps = _philox_normal(seed, offs)
    p = tl.load(p_ptr + b)
    q = tl.load(q_ptr + b)
    d = pred - (p * x0 + q * eps)  # pred - target
    d = tl.where(mask, d, 0.0)
    tl.store(partial_ptr + b * n_part + pid_m, tl.sum(d * d, axis=0))
    if WITH_GRAD:
        w = tl.load(w_ptr + b)
        g = w * (2.0 / M) * d
        tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=mask)


def diffusion_loss_fwd(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor | None,
    seed: int,
    p: torch.Tensor,
    q: torch.Tensor,
    w: torch.Tensor,
    with_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: contiguous (B, ...) inputs, float32 (B,) p/q/w; returns loss float32 (B,) and grad (or empty)."""
    B = pred.shape[0]
    M = pred.numel() // B if B else 0
    grad = torch.empty_like(pred) if with_grad else pred.new_empty(0)
    if B == 0 or M == 0:
        return torch.zeros(B, dtype=torch.float32, device=pred.device), grad
    n_part = triton.cdiv(M, MIN_BLOCK)
    partial = torch.zeros(B, n_part, dtype=torch.float32, device=pred.device)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK"]), B)
    _diffusion_loss_fwd_kernel[grid](
        pred,
        x0,
        noise if noise is not None else x0,
        p,
        q,
        w,
        partial,
        grad,
        seed,
        M,
        n_part,
        HAS_NOISE=noise is not None,
        WITH_GRAD=with_grad,
    )
    return partial.sum(1) * (w / M), grad
