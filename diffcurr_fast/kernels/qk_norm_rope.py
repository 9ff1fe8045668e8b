"""Triton kernels of QK-norm + 2-D RoPE (fwd + bwd), one launch each for q, k and v of the packed projection.

A row is one head's Dh channels of one token; the R = B H N rows of q, k or v are read in place from the packed
qkv (B, N, 3 H Dh) and written to their (B, H, N, Dh) tensors (the backward: the other way round, into the
gradient of qkv), every row addressed by the strides of b, h and n of its source and destination. One kernel
serves every part: ``norm`` (1.0 or 0.0, a run-time value) switches the RMSNorm on or off, and a part without a
rotation (v, or a model without rope2d) reads identity tables (cos 1, sin 0, the same row for every token:
``tab_n`` 0), so each dtype and tile compiles once. Programs hold (ROWS, BLOCK_D) tiles of whole rows
(``adaln.row_tile``); the rotation splits a tile into its even and odd channels (a reshape to pairs, in
registers), so every load is a contiguous run along the row. Tables cos, sin (float32) hold row
b * tab_b + n * tab_n of Dh / 2 entries (tab_b 0: one table for the batch). The backward recomputes the row's
rstd, loops over a fixed share of the rows per program and writes one partial sum of the weight gradient per
program (no atomics), summed after the kernel (dropped without a weight gradient).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .adaln import TARGET_PROGRAMS, row_tile
from .aot import Launch
from .philox import device_guard


@triton.jit
def _pairs(x, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The even and odd channels of each row of x (ROWS, BLOCK_D): two (ROWS, BLOCK_D // 2) tiles."""
    return tl.split(tl.reshape(x, (ROWS, BLOCK_D // 2, 2)))


@triton.jit
def _interleave(x0, x1, ROWS: tl.constexpr, BLOCK_D: tl.constexpr):
    """The inverse of ``_pairs``."""
    return tl.reshape(tl.join(x0, x1), (ROWS, BLOCK_D))


@triton.jit
def _tables(
    cos_ptr,
    sin_ptr,
    b,
    n,
    rmask,
    tab_b,
    tab_n,
    half,
    TAB_ALIGN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """cos and sin of the rows' tokens, (ROWS, BLOCK_D // 2) each."""
    m = tl.arange(0, BLOCK_D // 2)
    t = tl.multiple_of(b * tab_b + n * tab_n, TAB_ALIGN)[:, None] + m[None, :]
    tmask = rmask[:, None] & (m < half)[None, :]
    return tl.load(cos_ptr + t, mask=tmask, other=0.0), tl.load(sin_ptr + t, mask=tmask, other=0.0)


@triton.jit
def _qk_norm_rope_fwd_kernel(
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    R,
    H,
    N,
    Dh,
    half,
    sb,
    sh,
    sn,
    osb,
    osh,
    osn,
    tab_b,
    tab_n,
    eps,
    norm,
    TAB_ALIGN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    rmask = r < R
    dmask = d < Dh
    mask = rmask[:, None] & dmask[None, :]
    b = r // (H * N)
    h = (r // N) % H
    n = r % N
    x = tl.load(x_ptr + (b * sb + h * sh + n * sn)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
    rstd = tl.where(norm != 0.0, 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / Dh + eps), 1.0)  # RMSNorm over Dh
    x = x * rstd[:, None] * tl.load(w_ptr + d, mask=dmask, other=0.0)[None, :]
    c, s = _tables(cos_ptr, sin_ptr, b, n, rmask, tab_b, tab_n, half, TAB_ALIGN, ROWS, BLOCK_D)
    x0, x1 = _pairs(x, ROWS, BLOCK_D)
    y = _interleave(x0 * c - x1 * s, x0 * s + x1 * c, ROWS, BLOCK_D)  # RoFormer Eq. 34
    tl.store(out_ptr + (b * osb + h * osh + n * osn)[:, None] + d[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_bwd_kernel(
    g_ptr,
    x_ptr,
    w_ptr,
    cos_ptr,
    sin_ptr,
    gx_ptr,
    gw_ptr,
    R,
    H,
    N,
    Dh,
    half,
    gsb,
    gsh,
    gsn,
    sb,
    sh,
    sn,
    osb,
    osh,
    osn,
    tab_b,
    tab_n,
    eps,
    norm,
    rows_per_prog,
    TAB_ALIGN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    prog = tl.program_id(0)
    d = tl.arange(0, BLOCK_D)
    dmask = d < Dh
    w = tl.load(w_ptr + d, mask=dmask, other=0.0)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    r_begin = prog.to(tl.int64) * rows_per_prog
    r_end = tl.minimum(r_begin + rows_per_prog, R)
    for r0 in range(r_begin, r_end, ROWS):
        r = r0 + tl.arange(0, ROWS)
        rmask = r < r_end
        mask = rmask[:, None] & dmask[None, :]
        b = r // (H * N)
        h = (r // N) % H
        n = r % N
        g = tl.load(g_ptr + (b * gsb + h * gsh + n * gsn)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        c, s = _tables(cos_ptr, sin_ptr, b, n, rmask, tab_b, tab_n, half, TAB_ALIGN, ROWS, BLOCK_D)
        g0, g1 = _pairs(g, ROWS, BLOCK_D)
        gr = _interleave(g0 * c + g1 * s, g1 * c - g0 * s, ROWS, BLOCK_D)  # the rotation's transpose
        x = tl.load(x_ptr + (b * sb + h * sh + n * sn)[:, None] + d[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.where(norm != 0.0, 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / Dh + eps), 1.0)
        xhat = x * rstd[:, None]
        gh = gr * w[None, :]
        m2 = norm * tl.sum(gh * xhat, axis=1) / Dh  # without the norm: grad_x = gr (w is ones then)
        gx = rstd[:, None] * (gh - xhat * m2[:, None])
        acc += gr * xhat
        obase = b * osb + h * osh + n * osn
        tl.store(gx_ptr + obase[:, None] + d[None, :], gx.to(gx_ptr.dtype.element_ty), mask=mask)
    tl.store(gw_ptr + prog * Dh + d, tl.sum(acc, axis=0), mask=dmask)


def _tab_align(Dh: int) -> int:
    """The largest power of two (at most 16) that divides Dh / 2: every table row starts at a multiple of it."""
    half = Dh // 2
    return min(16, half & -half) if half else 1


def _heads(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """t (B, H, N, Dh) with unit stride along Dh, and its strides of b, h, n."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t, (t.stride(0), t.stride(1), t.stride(2))


def _parts(qkv: torch.Tensor, heads: int) -> tuple[list[torch.Tensor], tuple[int, int, int]]:
    """The q, k and v parts of a packed (B, N, 3 H Dh) tensor (unit stride along the last dimension) as views
    starting at their first element, and the strides of b, h, n shared by the three."""
    Dh = qkv.shape[2] // (3 * heads)
    parts = [qkv[:, :, p * heads * Dh :] for p in range(3)]
    return parts, (qkv.stride(0), Dh, qkv.stride(1))


def _packed(qkv: torch.Tensor) -> torch.Tensor:
    return qkv if qkv.shape[-1] <= 1 or qkv.stride(-1) == 1 else qkv.contiguous()


def _plan(qkv, heads, q_weight, k_weight, cos, sin):
    """Per part (q, k, v): (weight or ones, norm flag, cos, sin, tab_b, tab_n), float32; the identity tables (one
    row of cos 1, sin 0 for every token) stand in for a part without a rotation."""
    Dh = qkv.shape[2] // (3 * heads)
    ones = torch.ones(Dh, dtype=torch.float32, device=qkv.device)
    identity = (ones[: Dh // 2], torch.zeros(max(Dh // 2, 1), dtype=torch.float32, device=qkv.device), 0, 0)
    tables = identity
    if cos is not None:
        tab_b = qkv.shape[1] * (Dh // 2) if cos.ndim == 3 else 0
        tables = (cos.float().contiguous(), sin.float().contiguous(), tab_b, Dh // 2)
    out = []
    for w in (q_weight, k_weight, None):
        rotated = tables if len(out) < 2 else identity  # q and k turn (when there are tables), v does not
        out.append((ones if w is None else w.float().contiguous(), 0.0 if w is None else 1.0, *rotated))
    return out


def qk_norm_rope_fwd(qkv, heads: int, q_weight, k_weight, cos, sin, eps: float):
    """Launch: qkv (B, N, 3 H Dh), weights (Dh,) or None, tables (N, Dh/2) or (B, N, Dh/2) or None; returns q, k, v
    contiguous (B, H, N, Dh) in qkv's dtype (q and k normed and rotated, v copied)."""
    qkv = _packed(qkv)
    B, N, C = qkv.shape
    Dh = C // (3 * heads)
    R = B * heads * N
    outs = [qkv.new_empty(B, heads, N, Dh) for _ in range(3)]
    if R * Dh == 0:
        return tuple(outs)
    block_d, rows, warps = row_tile(Dh)
    parts, (sb, sh, sn) = _parts(qkv, heads)
    for x, out, (w, norm, c, s, tab_b, tab_n) in zip(parts, outs, _plan(qkv, heads, q_weight, k_weight, cos, sin)):
        with device_guard(x):
            _qk_norm_rope_fwd_kernel[(triton.cdiv(R, rows),)](
                x,
                w,
                c,
                s,
                out,
                R,
                heads,
                N,
                Dh,
                Dh // 2,
                sb,
                sh,
                sn,
                *out.stride()[:3],
                tab_b,
                tab_n,
                eps,
                norm,
                TAB_ALIGN=_tab_align(Dh),
                ROWS=rows,
                BLOCK_D=block_d,
                num_warps=warps,
            )
    return tuple(outs)


def qk_norm_rope_bwd(
    grad_q, grad_k, grad_v, qkv, heads: int, q_weight, k_weight, cos, sin, eps: float, weight_grads: bool = True
):
    """Launch: returns grad_qkv (B, N, 3 H Dh) contiguous in qkv's dtype and the weight gradients (the weights'
    dtype; empty (0,) without weights or without ``weight_grads``)."""
    qkv = _packed(qkv)
    B, N, C = qkv.shape
    Dh = C // (3 * heads)
    R = B * heads * N
    wgrad = weight_grads and q_weight is not None
    gqkv = torch.empty(B, N, C, dtype=qkv.dtype, device=qkv.device)
    if R * Dh == 0:
        if not wgrad:
            return gqkv, qkv.new_empty(0), qkv.new_empty(0)
        return gqkv, torch.zeros_like(q_weight), torch.zeros_like(k_weight)
    block_d, rows, warps = row_tile(Dh)
    tiles = triton.cdiv(R, rows)
    per = triton.cdiv(tiles, min(tiles, TARGET_PROGRAMS)) * rows
    progs = triton.cdiv(R, per)
    parts, (sb, sh, sn) = _parts(qkv, heads)
    gparts, ostrides = _parts(gqkv, heads)
    plan = _plan(qkv, heads, q_weight, k_weight, cos, sin)
    gws = []
    for g, x, gx, (w, norm, c, s, tab_b, tab_n) in zip((grad_q, grad_k, grad_v), parts, gparts, plan):
        g, (gsb, gsh, gsn) = _heads(g.to(qkv.dtype))
        gw = torch.empty(progs, Dh, dtype=torch.float32, device=qkv.device)
        gws.append(gw)
        with device_guard(x):
            _qk_norm_rope_bwd_kernel[(progs,)](
                g,
                x,
                w,
                c,
                s,
                gx,
                gw,
                R,
                heads,
                N,
                Dh,
                Dh // 2,
                gsb,
                gsh,
                gsn,
                sb,
                sh,
                sn,
                *ostrides,
                tab_b,
                tab_n,
                eps,
                norm,
                per,
                TAB_ALIGN=_tab_align(Dh),
                ROWS=rows,
                BLOCK_D=block_d,
                num_warps=warps,
            )
    if not wgrad:
        return gqkv, qkv.new_empty(0), qkv.new_empty(0)
    return gqkv, gws[0].sum(0).to(q_weight.dtype), gws[1].sum(0).to(k_weight.dtype)


# head dims the launch tables cover: every row tile from 16 to 256 channels (64 for every DiT preset)
AOT_HEAD_DIMS = (16, 32, 64, 128, 256)


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches these launchers can make: dtype x tile for each head dim class (with the runtime's divisibility
    of Dh / 2 and the tables' strides, which make the table loads vectors)."""
    out = []
    for dt in dtypes:
        for D in (64,) if fast else AOT_HEAD_DIMS:
            block_d, rows, warps = row_tile(D)
            cx = {"TAB_ALIGN": _tab_align(D), "ROWS": rows, "BLOCK_D": block_d}
            ints = {"R": "i32", "H": "i32", "N": "i32", "Dh": "i32", "half": "i32"}
            rows_of = {name: "i32" for name in ("sb", "sh", "sn", "osb", "osh", "osn", "tab_b", "tab_n")}
            flags = {"eps": "fp32", "norm": "fp32"}
            tables = {"w_ptr": "*fp32", "cos_ptr": "*fp32", "sin_ptr": "*fp32"}
            mult = ("Dh", "sb", "sh", "sn", "osb", "osh", "osn") + (
                ("half", "tab_b", "tab_n") if (D // 2) % 16 == 0 else ()
            )
            # rows of fewer than 32 channels: a table row is under 16 floats, and Triton spreads the (ROWS, Dh / 2)
            # table tile so that its loads stay scalar (the data's loads are vectors); not checked as streaming
            streaming = D >= 32
            args = {"x_ptr": f"*{dt}", **tables, "out_ptr": f"*{dt}", **ints, **rows_of, **flags}
            out.append(Launch(_qk_norm_rope_fwd_kernel, args, cx, warps, multiple_of_16=mult, streaming=streaming))
            args = {"g_ptr": f"*{dt}", "x_ptr": f"*{dt}", **tables, "gx_ptr": f"*{dt}", "gw_ptr": "*fp32", **ints}
            args.update({"gsb": "i32", "gsh": "i32", "gsn": "i32", **rows_of, **flags, "rows_per_prog": "i32"})
            mult += ("gsb", "gsh", "gsn", "rows_per_prog")
            out.append(Launch(_qk_norm_rope_bwd_kernel, args, cx, warps, multiple_of_16=mult, streaming=streaming))
    return out
