"""Triton kernels for the DiT block's elementwise path: adaLN modulate and the gated residual (fwd + bwd).

x (B, N, D); shift, scale, gate (B, D). A program handles ROWS tokens of one sample as a (ROWS, BLOCK_D) tile;
the backward kernels write per-tile partial sums of the (B, D) parameter gradients (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .philox import INTERPRET, elementwise_configs


def _row_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"ROWS": 16}, num_warps=4)]
    return [
        triton.Config({"ROWS": 2}, num_warps=4),
        triton.Config({"ROWS": 4}, num_warps=4),
        triton.Config({"ROWS": 8}, num_warps=8),
    ]


MIN_ROWS = min(cfg.kwargs["ROWS"] for cfg in _row_configs())


@triton.autotune(configs=_row_configs(), key=["N", "D"])
@triton.jit
def _adaln_modulate_fwd_kernel(
    x_ptr, shift_ptr, scale_ptr, y_ptr, mean_ptr, rstd_ptr, N, D, eps, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    rmask = n < N
    dmask = d < D
    mask = rmask[:, None] & dmask[None, :]
    row = b * N + n  # (ROWS,)
    offs = row[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
    mean = tl.sum(x, axis=1) / D
    xc = tl.where(mask, x - mean[:, None], 0.0)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / D + eps)
    shift = tl.load(shift_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * (1.0 + scale[None, :]) + shift[None, :]  # adaLN-Zero modulate
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(mean_ptr + row, mean, mask=rmask)
    tl.store(rstd_ptr + row, rstd, mask=rmask)


@triton.autotune(configs=_row_configs(), key=["N", "D"], reset_to_zero=["gshift_ptr", "gscale_ptr"])
@triton.jit
def _adaln_modulate_bwd_kernel(
    gy_ptr,
    x_ptr,
    scale_ptr,
    mean_ptr,
    rstd_ptr,
    gx_ptr,
    gshift_ptr,
    gscale_ptr,
    N,
    D,
    n_part,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    n = pid_n * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    rmask = n < N
    dmask = d < D
    mask = rmask[:, None] & dmask[None, :]
    row = b * N + n
    offs = row[:, None] * D + d[None, :]
    g = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    mean = tl.load(mean_ptr + row, mask=rmask, other=0.0)
    rstd = tl.load(rstd_ptr + row, mask=rmask, other=0.0)
    scale = tl.load(scale_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
    gxh = g * (1.0 + scale[None, :])
    c1 = tl.sum(gxh, axis=1) / D
    c2 = tl.sum(gxh * xhat, axis=1) / D
    gx = rstd[:, None] * (gxh - c1[:, None] - xhat * c2[:, None])
    tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=mask)
    part = (b * n_part + pid_n) * D + d
    tl.store(gshift_ptr + part, tl.sum(g, axis=0), mask=dmask)
    tl.store(gscale_ptr + part, tl.sum(g * xhat, axis=0), mask=dmask)


@triton.autotune(configs=elementwise_configs(), key=["D"])
@triton.jit
def _gated_residual_fwd_kernel(x_ptr, gate_ptr, y_ptr, out_ptr, n, ND, D, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    goff = (offs // ND) * D + offs % D
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + goff, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + gate * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=_row_configs(), key=["N", "D"], reset_to_zero=["ggate_ptr"])
@triton.jit
def _gated_residual_bwd_kernel(
    go_ptr, gate_ptr, y_ptr, gy_ptr, ggate_ptr, N, D, n_part, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    n = pid_n * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    rmask = n < N
    dmask = d < D
    mask = rmask[:, None] & dmask[None, :]
    offs = (b * N + n)[:, None] * D + d[None, :]
    g = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(gy_ptr + offs, (g * gate[None, :]).to(gy_ptr.dtype.element_ty), mask=mask)
    tl.store(ggate_ptr + (b * n_part + pid_n) * D + d, tl.sum(g * y, axis=0), mask=dmask)


def adaln_modulate_fwd(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch: x (B, N, D) contiguous, shift/scale (B, D); returns y (x's dtype), mean, rstd float32 (B, N)."""
    B, N, D = x.shape
    y = torch.empty_like(x)
    mean = torch.empty(B, N, dtype=torch.float32, device=x.device)
    rstd = torch.empty(B, N, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, mean, rstd
    grid = lambda meta: (B, triton.cdiv(N, meta["ROWS"]))
    _adaln_modulate_fwd_kernel[grid](x, shift, scale, y, mean, rstd, N, D, eps, BLOCK_D=triton.next_power_of_2(D))
    return y, mean, rstd


def adaln_modulate_bwd(
    grad_y: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, mean: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch: returns grad_x (x's dtype), grad_shift and grad_scale (scale's dtype, (B, D))."""
    B, N, D = x.shape
    gx = torch.empty_like(x)
    n_part = max(1, triton.cdiv(N, MIN_ROWS))
    gshift = torch.zeros(B, n_part, D, dtype=torch.float32, device=x.device)
    gscale = torch.zeros(B, n_part, D, dtype=torch.float32, device=x.device)
    if x.numel():
        grid = lambda meta: (B, triton.cdiv(N, meta["ROWS"]))
        _adaln_modulate_bwd_kernel[grid](
            grad_y, x, scale, mean, rstd, gx, gshift, gscale, N, D, n_part, BLOCK_D=triton.next_power_of_2(D)
        )
    return gx, gshift.sum(1).to(scale.dtype), gscale.sum(1).to(scale.dtype)


def gated_residual_fwd(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Launch: out = x + gate[:, None, :] * y for contiguous x, y (B, N, D) and gate (B, D)."""
    B, N, D = x.shape
    out = torch.empty_like(x)
    n = x.numel()
    if n:
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
        _gated_residual_fwd_kernel[grid](x, gate, y, out, n, N * D, D)
    return out


def gated_residual_bwd(
    grad_out: torch.Tensor, gate: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: returns grad_gate (gate's dtype, (B, D)) and grad_y (y's dtype); grad_x is grad_out itself."""
    B, N, D = y.shape
    gy = torch.empty_like(y)
    n_part = max(1, triton.cdiv(N, MIN_ROWS))
    ggate = torch.zeros(B, n_part, D, dtype=torch.float32, device=y.device)
    if y.numel():
        grid = lambda meta: (B, triton.cdiv(N, meta["ROWS"]))
        _gated_residual_bwd_kernel[grid](grad_out, gate, y, gy, ggate, N, D, n_part, BLOCK_D=triton.next_power_of_2(D))
    return ggate.sum(1).to(gate.dtype), gy
