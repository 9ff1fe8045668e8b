"""Triton kernels of RMSNorm-modulate (fwd + bwd): y = x * rstd * w * (1 + scale) + shift, rstd per row.

x (B, N, D); shift, scale (B, D); w (D,) float32 (absent: ones stand in, one (D,) load per program, so each dtype
and tile compiles once).
Programs hold (ROWS, BLOCK_D) tiles of whole rows of one sample, sized by ``adaln.row_tile`` (the row statistic
needs all of it; D <= ``adaln.MAX_D``). The backward loops over a fixed share of the N rows per program and writes
one partial column sum of grad_y and of grad_y * xhat per (sample, split), as the adaLN backward does (no
atomics); grad_scale = w * sum_n grad_y * xhat and grad_w = sum_b (1 + scale) sum_n grad_y * xhat are formed from
them after the kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adaln import AOT_DIMS, AOT_DIMS_FAST, _splits, row_tile
from .aot import Launch
from .philox import device_guard


@triton.jit
def _rmsnorm_modulate_fwd_kernel(
    x_ptr,
    shift_ptr,
    scale_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    N,
    D,
    eps,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
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
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)  # RMSNorm, Zhang & Sennrich Eq. 4
    xh = x * rstd[:, None] * tl.load(w_ptr + d, mask=dmask, other=0.0)[None, :]
    shift = tl.load(shift_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    scale = tl.load(scale_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    y = xh * (1.0 + scale[None, :]) + shift[None, :]  # adaLN-Zero modulate
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd, mask=rmask)


@triton.jit
def _rmsnorm_modulate_bwd_kernel(
    gy_ptr,
    x_ptr,
    scale_ptr,
    w_ptr,
    rstd_ptr,
    gx_ptr,
    gshift_ptr,
    gxhat_ptr,
    N,
    D,
    rows_per_split,
    AFFINE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    dmask = d < D
    scale = tl.load(scale_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    mul = (1.0 + scale) * tl.load(w_ptr + d, mask=dmask, other=0.0)  # (1 + scale) * w
    acc_shift = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    acc_xhat = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    n_begin = s * rows_per_split
    n_end = tl.minimum(n_begin + rows_per_split, N)
    for n0 in range(n_begin, n_end, ROWS):
        n = n0 + tl.arange(0, ROWS)
        rmask = n < n_end
        mask = rmask[:, None] & dmask[None, :]
        row = b * N + n
        offs = row[:, None] * D + d[None, :]
        g = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (ROWS, BLOCK_D)
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=rmask, other=0.0)
        xhat = x * rstd[:, None]
        gh = g * mul[None, :]
        m2 = tl.sum(gh * xhat, axis=1) / D
        gx = rstd[:, None] * (gh - xhat * m2[:, None])
        tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=mask)
        if AFFINE:
            acc_shift += g
            acc_xhat += g * xhat
    if AFFINE:
        part = (b * tl.num_programs(1) + s) * D + d
        tl.store(gshift_ptr + part, tl.sum(acc_shift, axis=0), mask=dmask)
        tl.store(gxhat_ptr + part, tl.sum(acc_xhat, axis=0), mask=dmask)


def _weight(weight: torch.Tensor | None, D: int, device: torch.device) -> torch.Tensor:
    """The weight as a contiguous float32 (D,) tensor; ones without one."""
    if weight is None:
        return torch.ones(D, dtype=torch.float32, device=device)
    return weight.float().contiguous()


def rmsnorm_modulate_fwd(
    x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, weight: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: x (B, N, D) contiguous, shift/scale (B, D), weight (D,) or None; returns y (x's dtype), rstd float32
    (B, N)."""
    B, N, D = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(B, N, dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, rstd.fill_(1.0 / eps**0.5)
    block_d, rows, warps = row_tile(D)
    with device_guard(x):
        _rmsnorm_modulate_fwd_kernel[(B, triton.cdiv(N, rows))](
            x,
            shift,
            scale,
            _weight(weight, D, x.device),
            y,
            rstd,
            N,
            D,
            eps,
            ROWS=rows,
            BLOCK_D=block_d,
            num_warps=warps,
        )
    return y, rstd


def rmsnorm_modulate_bwd(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    weight: torch.Tensor | None,
    rstd: torch.Tensor,
    affine_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch: returns grad_x (x's dtype), grad_shift and grad_scale (scale's dtype, (B, D)) and grad_weight
    (weight's dtype, (D,)); empty (0,) without ``affine_grads`` (grad_weight also without a weight)."""
    B, N, D = x.shape
    gx = torch.empty_like(x)

    def none():  # a fresh one each: outputs never alias
        return scale.new_empty(0)

    if x.numel() == 0:
        if not affine_grads:
            return gx, none(), none(), none()
        zeros = torch.zeros(B, D, dtype=scale.dtype, device=x.device)
        gw = none() if weight is None else torch.zeros_like(weight)
        return gx, zeros, zeros.clone(), gw
    block_d, rows, warps = row_tile(D)
    splits, per = _splits(B, N, rows)
    shape = (B, splits, D) if affine_grads else (0,)
    gshift = torch.empty(shape, dtype=torch.float32, device=x.device)
    gxhat = torch.empty(shape, dtype=torch.float32, device=x.device)
    with device_guard(x):
        _rmsnorm_modulate_bwd_kernel[(B, splits)](
            grad_y,
            x,
            scale,
            _weight(weight, D, x.device),
            rstd,
            gx,
            gshift,
            gxhat,
            N,
            D,
            per,
            AFFINE=affine_grads,
            ROWS=rows,
            BLOCK_D=block_d,
            num_warps=warps,
        )
    if not affine_grads:
        return gx, none(), none(), none()
    s = gxhat.sum(1)  # (B, D): sum_n grad_y * xhat
    if weight is None:
        return gx, gshift.sum(1).to(scale.dtype), s.to(scale.dtype), none()
    gw = ((1.0 + scale.float()) * s).sum(0)
    return gx, gshift.sum(1).to(scale.dtype), (s * weight.float()).to(scale.dtype), gw.to(weight.dtype)


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches these launchers can make: dtype x tile for each D class (``adaln.AOT_DIMS``)."""
    dims = AOT_DIMS_FAST if fast else AOT_DIMS
    out = []
    for dt in dtypes:
        for block_d, rows, warps in sorted({row_tile(D) for D in dims}):
            cx = {"ROWS": rows, "BLOCK_D": block_d}
            args = {
                "x_ptr": f"*{dt}",
                "shift_ptr": f"*{dt}",
                "scale_ptr": f"*{dt}",
                "w_ptr": "*fp32",
                "y_ptr": f"*{dt}",
                "rstd_ptr": "*fp32",
                "N": "i32",
                "D": "i32",
                "eps": "fp32",
            }
            out.append(Launch(_rmsnorm_modulate_fwd_kernel, args, cx, warps, multiple_of_16=("D",), streaming=True))
            for affine in (True,) if fast else (True, False):
                args = {
                    "gy_ptr": f"*{dt}",
                    "x_ptr": f"*{dt}",
                    "scale_ptr": f"*{dt}",
                    "w_ptr": "*fp32",
                    "rstd_ptr": "*fp32",
                    "gx_ptr": f"*{dt}",
                    "gshift_ptr": "*fp32",
                    "gxhat_ptr": "*fp32",
                    "N": "i32",
                    "D": "i32",
                    "rows_per_split": "i32",
                }
                out.append(
                    Launch(
                        _rmsnorm_modulate_bwd_kernel,
                        args,
                        {"AFFINE": affine, **cx},
                        warps,
                        multiple_of_16=("D", "rows_per_split"),
                        streaming=True,
                    )
                )
    return out
