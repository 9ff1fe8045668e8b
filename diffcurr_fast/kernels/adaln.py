"""Triton kernels for the DiT block's elementwise path: adaLN modulate and the gated residual (fwd + bwd).

x (B, N, D); shift, scale, gate (B, D). adaLN programs hold (ROWS, BLOCK_D) tiles of whole rows of one sample
(BLOCK_D = next power of two >= D, the row statistics need all of it); the gated residual tiles D in chunks
of at most 256. Tiles are sized by ``row_tile`` / ``gated_tile`` (at most 4,096 elements, 16 per thread; one
row of up to MAX_D = 8,192), so no
kernel spills. The backward kernels loop over a fixed share of the N rows per program and write one partial
column sum per (sample, split): at most ``TARGET_PROGRAMS`` splits in all, not one per tile (deterministic, no
atomics). The gated residual reads x, gate and y in their own dtypes (bf16 attention output on an fp32 stream).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import Launch
from .philox import device_guard

TILE_ELEMS = 4096  # elements of one (ROWS, BLOCK_D) tile
GATED_MAX_BLOCK_D = 256
TARGET_PROGRAMS = 1024  # backward programs aimed for (a few waves on a large GPU); bounds the partial buffers


MAX_D = 8192  # the longest row the adaLN kernels hold in registers (16 per thread at 16 warps)


def _warps(elems: int) -> int:
    return min(16, max(4, elems // 512))


def row_tile(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) of the adaLN kernels for rows of length D."""
    if D > MAX_D:
        raise ValueError(f"the Triton adaLN kernels support rows of at most {MAX_D} elements, got D = {D}")
    block_d = max(16, triton.next_power_of_2(D))
    rows = max(1, min(64, TILE_ELEMS // block_d))
    return block_d, rows, _warps(rows * block_d)


def gated_tile(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) of the gated-residual kernels (D in chunks of at most 256)."""
    block_d = min(GATED_MAX_BLOCK_D, max(16, triton.next_power_of_2(D)))
    rows = TILE_ELEMS // block_d
    return block_d, rows, _warps(rows * block_d)


def _splits(B: int, N: int, rows: int, other_programs: int = 1) -> tuple[int, int]:
    """(splits, rows_per_split): each backward program covers rows_per_split (a multiple of ROWS) rows of N."""
    tiles = triton.cdiv(N, rows)
    want = max(1, triton.cdiv(TARGET_PROGRAMS, max(1, B * other_programs)))
    per = triton.cdiv(tiles, min(tiles, want)) * rows
    return triton.cdiv(N, per), per


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
    acc_shift = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    acc_scale = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
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
        mean = tl.load(mean_ptr + row, mask=rmask, other=0.0)
        rstd = tl.load(rstd_ptr + row, mask=rmask, other=0.0)
        xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        gxh = g * (1.0 + scale[None, :])
        c1 = tl.sum(gxh, axis=1) / D
        c2 = tl.sum(gxh * xhat, axis=1) / D
        gx = rstd[:, None] * (gxh - c1[:, None] - xhat * c2[:, None])
        tl.store(gx_ptr + offs, gx.to(gx_ptr.dtype.element_ty), mask=mask)
        if AFFINE:
            acc_shift += g
            acc_scale += g * xhat
    if AFFINE:
        part = (b * tl.num_programs(1) + s) * D + d
        tl.store(gshift_ptr + part, tl.sum(acc_shift, axis=0), mask=dmask)
        tl.store(gscale_ptr + part, tl.sum(acc_scale, axis=0), mask=dmask)


@triton.jit
def _gated_residual_fwd_kernel(x_ptr, gate_ptr, y_ptr, out_ptr, N, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    mask = (n < N)[:, None] & dmask[None, :]
    offs = (b * N + n)[:, None] * D + d[None, :]
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x + gate[None, :] * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gated_residual_bwd_kernel(
    go_ptr, gate_ptr, y_ptr, gy_ptr, ggate_ptr, N, D, rows_per_split, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    b = tl.program_id(0).to(tl.int64)
    s = tl.program_id(1)
    d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    dmask = d < D
    gate = tl.load(gate_ptr + b * D + d, mask=dmask, other=0.0).to(tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    n_begin = s * rows_per_split
    n_end = tl.minimum(n_begin + rows_per_split, N)
    for n0 in range(n_begin, n_end, ROWS):
        n = n0 + tl.arange(0, ROWS)
        mask = (n < n_end)[:, None] & dmask[None, :]
        offs = (b * N + n)[:, None] * D + d[None, :]
        g = tl.load(go_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(gy_ptr + offs, (g * gate[None, :]).to(gy_ptr.dtype.element_ty), mask=mask)
        acc += g * y
    tl.store(ggate_ptr + (b * tl.num_programs(1) + s) * D + d, tl.sum(acc, axis=0), mask=dmask)


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
    block_d, rows, warps = row_tile(D)
    with device_guard(x):
        _adaln_modulate_fwd_kernel[(B, triton.cdiv(N, rows))](
            x, shift, scale, y, mean, rstd, N, D, eps, ROWS=rows, BLOCK_D=block_d, num_warps=warps
        )
    return y, mean, rstd


def adaln_modulate_bwd(
    grad_y: torch.Tensor,
    x: torch.Tensor,
    scale: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    affine_grads: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch: returns grad_x (x's dtype), grad_shift and grad_scale (scale's dtype, (B, D); empty without
    ``affine_grads``)."""
    B, N, D = x.shape
    gx = torch.empty_like(x)
    if x.numel() == 0:
        zeros = torch.zeros(B, D, dtype=scale.dtype, device=x.device)
        return (gx, zeros, zeros.clone()) if affine_grads else (gx, scale.new_empty(0), scale.new_empty(0))
    block_d, rows, warps = row_tile(D)
    splits, per = _splits(B, N, rows)
    shape = (B, splits, D) if affine_grads else (0,)
    gshift = torch.empty(shape, dtype=torch.float32, device=x.device)
    gscale = torch.empty(shape, dtype=torch.float32, device=x.device)
    with device_guard(x):
        _adaln_modulate_bwd_kernel[(B, splits)](
            grad_y,
            x,
            scale,
            mean,
            rstd,
            gx,
            gshift,
            gscale,
            N,
            D,
            per,
            AFFINE=affine_grads,
            ROWS=rows,
            BLOCK_D=block_d,
            num_warps=warps,
        )
    if not affine_grads:
        return gx, scale.new_empty(0), scale.new_empty(0)
    return gx, gshift.sum(1).to(scale.dtype), gscale.sum(1).to(scale.dtype)


def gated_residual_fwd(x: torch.Tensor, gate: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Launch: out = x + gate[:, None, :] * y (x's dtype) for contiguous x, y (B, N, D) and gate (B, D)."""
    B, N, D = x.shape
    out = torch.empty_like(x)
    if x.numel():
        block_d, rows, warps = gated_tile(D)
        with device_guard(x):
            _gated_residual_fwd_kernel[(B, triton.cdiv(N, rows), triton.cdiv(D, block_d))](
                x, gate, y, out, N, D, ROWS=rows, BLOCK_D=block_d, num_warps=warps
            )
    return out


def gated_residual_bwd(
    grad_out: torch.Tensor, gate: torch.Tensor, y: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: returns grad_gate (gate's dtype, (B, D)) and grad_y (y's dtype); grad_x is grad_out itself."""
    B, N, D = y.shape
    gy = torch.empty_like(y)
    if y.numel() == 0:
        return torch.zeros(B, D, dtype=gate.dtype, device=y.device), gy
    block_d, rows, warps = gated_tile(D)
    d_blocks = triton.cdiv(D, block_d)
    splits, per = _splits(B, N, rows, d_blocks)
    ggate = torch.empty(B, splits, D, dtype=torch.float32, device=y.device)
    with device_guard(y):
        _gated_residual_bwd_kernel[(B, splits, d_blocks)](
            grad_out, gate, y, gy, ggate, N, D, per, ROWS=rows, BLOCK_D=block_d, num_warps=warps
        )
    return ggate.sum(1).to(gate.dtype), gy


# D values the launch tables cover: every row tile the DiT presets (D = 384, 768, 1024, 1152) and the tests use,
# up to MAX_D.
AOT_DIMS = (16, 32, 64, 128, 256, 384, 1024, 1152, 2048, 4096, 8192)
AOT_DIMS_FAST = (384, 1152)


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches these launchers can make: dtype (and the mixed autocast pair) x tile for each D class."""
    dims = AOT_DIMS_FAST if fast else AOT_DIMS
    out = []
    pairs = [(dt, dt) for dt in dtypes] + ([("fp32", "bf16")] if "bf16" in dtypes else [])
    stat = {"mean_ptr": "*fp32", "rstd_ptr": "*fp32"}
    for dt in dtypes:
        for block_d, rows, warps in sorted({row_tile(D) for D in dims}):
            cx = {"ROWS": rows, "BLOCK_D": block_d}
            args = {
                "x_ptr": f"*{dt}",
                "shift_ptr": f"*{dt}",
                "scale_ptr": f"*{dt}",
                "y_ptr": f"*{dt}",
                **stat,
                "N": "i32",
                "D": "i32",
                "eps": "fp32",
            }
            out.append(Launch(_adaln_modulate_fwd_kernel, args, cx, warps, multiple_of_16=("D",), streaming=True))
            for affine in (True,) if fast else (True, False):
                args = {
                    "gy_ptr": f"*{dt}",
                    "x_ptr": f"*{dt}",
                    "scale_ptr": f"*{dt}",
                    **stat,
                    "gx_ptr": f"*{dt}",
                    "gshift_ptr": "*fp32",
                    "gscale_ptr": "*fp32",
                    "N": "i32",
                    "D": "i32",
                    "rows_per_split": "i32",
                }
                out.append(
                    Launch(
                        _adaln_modulate_bwd_kernel,
                        args,
                        {"AFFINE": affine, **cx},
                        warps,
                        multiple_of_16=("D", "rows_per_split"),
                        streaming=True,
                    )
                )
    for xdt, ydt in pairs:
        for block_d, rows, warps in sorted({gated_tile(D) for D in dims}):
            cx = {"ROWS": rows, "BLOCK_D": block_d}
            args = {
                "x_ptr": f"*{xdt}",
                "gate_ptr": f"*{ydt}",
                "y_ptr": f"*{ydt}",
                "out_ptr": f"*{xdt}",
                "N": "i32",
                "D": "i32",
            }
            out.append(Launch(_gated_residual_fwd_kernel, args, cx, warps, multiple_of_16=("D",), streaming=True))
            args = {
                "go_ptr": f"*{xdt}",
                "gate_ptr": f"*{ydt}",
                "y_ptr": f"*{ydt}",
                "gy_ptr": f"*{ydt}",
                "ggate_ptr": "*fp32",
                "N": "i32",
                "D": "i32",
                "rows_per_split": "i32",
            }
            out.append(
                Launch(
                    _gated_residual_bwd_kernel, args, cx, warps, multiple_of_16=("D", "rows_per_split"), streaming=True
                )
            )
    return out
