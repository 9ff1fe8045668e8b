"""Triton kernels of SwiGLU (fwd + bwd): y = silu(a) * b for the halves a, b of each row of x (R, 2H).

Programs hold (ROWS, BLOCK_H) tiles of the H columns of a share of the rows (``adaln.gated_tile``: H in chunks of
at most 256), reading a and b of a tile with one 2-D load each and writing y (R, H), or grad_x (R, 2H) in the
backward: grad_a = grad_y b s (1 + a (1 - s)), grad_b = grad_y a s, s = sigmoid(a).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adaln import AOT_DIMS, AOT_DIMS_FAST, gated_tile
from .aot import Launch
from .philox import device_guard


@triton.jit
def _swiglu_fwd_kernel(x_ptr, y_ptr, R, Hh, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < R)[:, None] & (j < Hh)[None, :]
    xo = r[:, None] * (2 * Hh) + j[None, :]
    a = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + xo + Hh, mask=mask, other=0.0).to(tl.float32)
    y = a * tl.sigmoid(a) * b  # silu(a) b, Shazeer 2020 Eq. 6
    tl.store(y_ptr + r[:, None] * Hh + j[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(gy_ptr, x_ptr, gx_ptr, R, Hh, ROWS: tl.constexpr, BLOCK_H: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = (r < R)[:, None] & (j < Hh)[None, :]
    xo = r[:, None] * (2 * Hh) + j[None, :]
    a = tl.load(x_ptr + xo, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(x_ptr + xo + Hh, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gy_ptr + r[:, None] * Hh + j[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(a)
    tl.store(gx_ptr + xo, (g * b * s * (1.0 + a * (1.0 - s))).to(gx_ptr.dtype.element_ty), mask=mask)
    tl.store(gx_ptr + xo + Hh, (g * a * s).to(gx_ptr.dtype.element_ty), mask=mask)


def _grid(R: int, Hh: int) -> tuple[tuple[int, int], int, int, int]:
    block_h, rows, warps = gated_tile(Hh)
    return (triton.cdiv(R, rows), triton.cdiv(Hh, block_h)), rows, block_h, warps


def swiglu_fwd(x: torch.Tensor) -> torch.Tensor:
    """Launch: x (..., 2H) contiguous; returns y (..., H) in x's dtype."""
    Hh = x.shape[-1] // 2
    y = x.new_empty((*x.shape[:-1], Hh))
    if y.numel():
        R = y.numel() // Hh
        grid, rows, block_h, warps = _grid(R, Hh)
        with device_guard(x):
            _swiglu_fwd_kernel[grid](x, y, R, Hh, ROWS=rows, BLOCK_H=block_h, num_warps=warps)
    return y


def swiglu_bwd(grad_y: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Launch: grad_y (..., H), x (..., 2H) contiguous; returns grad_x (..., 2H) in x's dtype."""
    Hh = x.shape[-1] // 2
    gx = torch.empty_like(x)
    if grad_y.numel():
        R = grad_y.numel() // Hh
        grid, rows, block_h, warps = _grid(R, Hh)
        with device_guard(x):
            _swiglu_bwd_kernel[grid](grad_y, x, gx, R, Hh, ROWS=rows, BLOCK_H=block_h, num_warps=warps)
    return gx


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches these launchers can make: dtype x tile for each width class (``adaln.AOT_DIMS``: the SwiGLU
    widths of the DiT presets, 2/3 of 4 D, fall in them)."""
    dims = AOT_DIMS_FAST if fast else AOT_DIMS
    out = []
    for dt in dtypes:
        for block_h, rows, warps in sorted({gated_tile(D) for D in dims}):
            cx = {"ROWS": rows, "BLOCK_H": block_h}
            args = {"x_ptr": f"*{dt}", "y_ptr": f"*{dt}", "R": "i32", "Hh": "i32"}
            out.append(Launch(_swiglu_fwd_kernel, args, cx, warps, multiple_of_16=("Hh",), streaming=True))
            args = {"gy_ptr": f"*{dt}", "x_ptr": f"*{dt}", "gx_ptr": f"*{dt}", "R": "i32", "Hh": "i32"}
            out.append(Launch(_swiglu_bwd_kernel, args, cx, warps, multiple_of_16=("Hh",), streaming=True))
    return out
