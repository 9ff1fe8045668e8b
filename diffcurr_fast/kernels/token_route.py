"""Triton kernels for token routing (TREAD): the gather of the kept tokens and their scatter back (fwd + bwd).

Row copies, no arithmetic: x (B, T, D), idx (B, K) int64, src (B, K, D). Programs hold (ROWS, BLOCK_D) tiles of
whole rows (BLOCK_D <= 256, at most 4,096 elements: 16 per thread), a 2-D grid over (row tiles, column blocks).
The scatter and its backward read the inverse map of idx, pos (B, T) int32 (pos[b, idx[b, k]] = k, -1 at the
tokens not kept), so each output row is written once: from src, from base, or zero. Nothing is checked on the
device: an index outside [0, T) moves no row (its gathered row is zero); duplicate indices leave unspecified which
source a row takes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import Launch
from .philox import device_guard

TILE_ELEMS = 4096  # elements of one (ROWS, BLOCK_D) tile
MAX_BLOCK_D = 256
POS_BLOCK = 1024  # indices per program of the position map


def route_tile(D: int) -> tuple[int, int, int]:
    """(BLOCK_D, ROWS, num_warps) of the routing kernels for rows of D elements."""
    block_d = min(MAX_BLOCK_D, max(16, triton.next_power_of_2(D)))
    rows = TILE_ELEMS // block_d
    return block_d, rows, min(16, max(4, rows * block_d // 512))


@triton.jit
def _token_positions_kernel(idx_ptr, pos_ptr, n, T, K, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # flat (b, k)
    m = i < n
    t = tl.load(idx_ptr + i, mask=m, other=-1)
    ok = m & (t >= 0) & (t < T)
    tl.store(pos_ptr + (i // K).to(tl.int64) * T + t, (i % K).to(tl.int32), mask=ok)  # pos[b, idx[b, k]] = k


@triton.jit
def _token_gather_fwd_kernel(x_ptr, idx_ptr, out_ptr, rows, T, K, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # output rows (b, k), flat
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = r < rows
    dmask = d < D
    t = tl.load(idx_ptr + r, mask=rmask, other=-1)
    valid = rmask & (t >= 0) & (t < T)
    src = (r // K).to(tl.int64) * T + t  # the row of x: out[b, k] = x[b, idx[b, k]]
    v = tl.load(x_ptr + src[:, None] * D + d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
    tl.store(out_ptr + r.to(tl.int64)[:, None] * D + d[None, :], v, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _token_scatter_fwd_kernel(
    base_ptr,
    pos_ptr,
    src_ptr,
    out_ptr,
    rows,
    T,
    K,
    D,
    HAS_BASE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # output rows (b, t), flat
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = r < rows
    dmask = d < D
    k = tl.load(pos_ptr + r, mask=rmask, other=-1)
    kept = k >= 0
    srow = (r // T).to(tl.int64) * K + k  # a kept token's row of src
    v = tl.load(src_ptr + srow[:, None] * D + d[None, :], mask=kept[:, None] & dmask[None, :], other=0.0)
    offs = r.to(tl.int64)[:, None] * D + d[None, :]
    if HAS_BASE:  # a token not kept keeps its value from before the route; without base (gather's backward) zero
        old = tl.load(base_ptr + offs, mask=(rmask & ~kept)[:, None] & dmask[None, :], other=0.0)
        v = tl.where(kept[:, None], v, old)
    tl.store(out_ptr + offs, v, mask=rmask[:, None] & dmask[None, :])


@triton.jit
def _token_scatter_bwd_kernel(
    go_ptr, pos_ptr, gbase_ptr, gsrc_ptr, rows, T, K, D, ROWS: tl.constexpr, BLOCK_D: tl.constexpr
):
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # rows (b, t) of grad_out, flat
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    rmask = r < rows
    dmask = d < D
    mask = rmask[:, None] & dmask[None, :]
    k = tl.load(pos_ptr + r, mask=rmask, other=-1)
    kept = k >= 0
    offs = r.to(tl.int64)[:, None] * D + d[None, :]
    g = tl.load(go_ptr + offs, mask=mask, other=0.0)
    # grad_base: grad_out with the kept rows zeroed; grad_src[b, k] = grad_out[b, idx[b, k]]
    tl.store(gbase_ptr + offs, tl.where(kept[:, None], 0.0, g).to(gbase_ptr.dtype.element_ty), mask=mask)
    srow = (r // T).to(tl.int64) * K + k
    tl.store(gsrc_ptr + srow[:, None] * D + d[None, :], g, mask=kept[:, None] & dmask[None, :])


def _positions(idx: torch.Tensor, tokens: int) -> torch.Tensor:
    """pos (B, tokens) int32: the inverse map of idx (B, K), -1 at the tokens not kept."""
    B, K = idx.shape
    pos = torch.full((B, tokens), -1, dtype=torch.int32, device=idx.device)
    if B * K:
        with device_guard(idx):
            _token_positions_kernel[(triton.cdiv(B * K, POS_BLOCK),)](idx, pos, B * K, tokens, K, BLOCK=POS_BLOCK)
    return pos


def token_gather_fwd(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Launch: out (B, K, D) = x[b, idx[b, k]] for contiguous x (B, T, D) and idx (B, K) int64."""
    B, T, D = x.shape
    K = idx.shape[1]
    out = torch.empty(B, K, D, dtype=x.dtype, device=x.device)
    if out.numel():
        block_d, rows, warps = route_tile(D)
        with device_guard(x):
            _token_gather_fwd_kernel[(triton.cdiv(B * K, rows), triton.cdiv(D, block_d))](
                x, idx, out, B * K, T, K, D, ROWS=rows, BLOCK_D=block_d, num_warps=warps
            )
    return out


def token_scatter_fwd(base: torch.Tensor | None, idx: torch.Tensor, src: torch.Tensor, tokens: int) -> torch.Tensor:
    """Launch: out (B, tokens, D) = base with the rows idx replaced by src (B, K, D); base None: zeros there (the
    backward of the gather). Contiguous inputs."""
    B, K, D = src.shape
    out = torch.empty(B, tokens, D, dtype=src.dtype, device=src.device)
    if out.numel():
        pos = _positions(idx, tokens)
        block_d, rows, warps = route_tile(D)
        with device_guard(src):
            _token_scatter_fwd_kernel[(triton.cdiv(B * tokens, rows), triton.cdiv(D, block_d))](
                base if base is not None else src,  # never read without HAS_BASE
                pos,
                src,
                out,
                B * tokens,
                tokens,
                K,
                D,
                HAS_BASE=base is not None,
                ROWS=rows,
                BLOCK_D=block_d,
                num_warps=warps,
            )
    return out


def token_scatter_bwd(grad_out: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: (grad_base (B, T, D), grad_src (B, K, D)) of token_scatter for contiguous grad_out, one pass."""
    B, T, D = grad_out.shape
    K = idx.shape[1]
    gbase = torch.empty_like(grad_out)
    gsrc = torch.empty(B, K, D, dtype=grad_out.dtype, device=grad_out.device)
    if gbase.numel():
        pos = _positions(idx, T)
        block_d, rows, warps = route_tile(D)
        with device_guard(grad_out):
            _token_scatter_bwd_kernel[(triton.cdiv(B * T, rows), triton.cdiv(D, block_d))](
                grad_out, pos, gbase, gsrc, B * T, T, K, D, ROWS=rows, BLOCK_D=block_d, num_warps=warps
            )
    return gbase, gsrc


# D values the launch tables cover: every tile the DiT presets (D = 384, 768, 1024, 1152) and the tests use.
AOT_DIMS = (16, 32, 64, 128, 256, 384, 1152)
AOT_DIMS_FAST = (384,)


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches these launchers can make: the position map, and dtype x tile x variant of the row copies."""
    out = [
        Launch(
            _token_positions_kernel,
            {"idx_ptr": "*i64", "pos_ptr": "*i32", "n": "i32", "T": "i32", "K": "i32"},
            {"BLOCK": POS_BLOCK},
            4,
        )
    ]
    ints = {"rows": "i32", "T": "i32", "K": "i32", "D": "i32"}
    for dt in dtypes:
        for block_d, rows, warps in sorted({route_tile(D) for D in (AOT_DIMS_FAST if fast else AOT_DIMS)}):
            cx = {"ROWS": rows, "BLOCK_D": block_d}
            args = {"x_ptr": f"*{dt}", "idx_ptr": "*i64", "out_ptr": f"*{dt}", **ints}
            out.append(Launch(_token_gather_fwd_kernel, args, cx, warps, multiple_of_16=("D",), streaming=True))
            args = {"base_ptr": f"*{dt}", "pos_ptr": "*i32", "src_ptr": f"*{dt}", "out_ptr": f"*{dt}", **ints}
            for has_base in (True, False):
                out.append(
                    Launch(
                        _token_scatter_fwd_kernel,
                        args,
                        {"HAS_BASE": has_base, **cx},
                        warps,
                        multiple_of_16=("D",),
                        streaming=True,
                    )
                )
            args = {"go_ptr": f"*{dt}", "pos_ptr": "*i32", "gbase_ptr": f"*{dt}", "gsrc_ptr": f"*{dt}", **ints}
            out.append(Launch(_token_scatter_bwd_kernel, args, cx, warps, multiple_of_16=("D",), streaming=True))
    return out
