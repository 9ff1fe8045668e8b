"""Triton kernel for the counter-based Philox4x32-10 normal noise (definition in ``docs/ops.md``).

``_philox_normal4`` is the shared device function: for a vector of 64-bit counters it returns the (R, 4) tile
of noise values of flat elements ``4 c .. 4 c + 3``, one 10-round Philox per counter (each gives four words).
q_sample and diffusion_loss call it so that the loss regenerates exactly the noise q_sample used. The 32-bit
Philox is written out here (not ``tl.randint4x``, which ran the 64-bit variant for int64 offsets before Triton
3.4, giving different noise from the CUDA, CPU and reference backends).

Streaming kernels work on (BLOCK // 4, 4) tiles: a row of the tile is one Philox counter and four consecutive
elements, so its loads and stores are 16-byte vectors (fp32) when the data is aligned.
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

from .aot import Launch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def elementwise_configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    """Autotune candidates for the memory-bound elementwise kernels (a single one under the interpreter)."""
    if interpret:
        return [triton.Config({"BLOCK": 4096}, num_warps=4)]
    return [
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=8),
    ]


def device_guard(t: torch.Tensor):
    """Make ``t``'s GPU the current device for a launch (Triton launches on the current device's stream)."""
    if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


@triton.jit
def _philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al. 2011) on uint32 tensors; the key is bumped after every round but the last."""
    for _ in tl.static_range(10):
        _c0 = c0
        _c2 = c2
        c0 = tl.umulhi(_c2, tl.full(_c2.shape, 0xCD9E8D57, tl.uint32)) ^ c1 ^ k0
        c2 = tl.umulhi(_c0, tl.full(_c0.shape, 0xD2511F53, tl.uint32)) ^ c3 ^ k1
        c1 = _c2 * 0xCD9E8D57
        c3 = _c0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _uniform(r):
    """u(r) of docs/ops.md: the word as int32, folded to [0, 2**31), times 2**-31."""
    s = r.to(tl.int32, bitcast=True)
    s = tl.where(s < 0, -s - 1, s)
    return s.to(tl.float32) * 4.6566127342e-10


@triton.jit
def _philox_normal4(seed, ctr):
    """(R, 4) noise tile for int64 counters ``ctr`` (R,): column k is n_k of docs/ops.md (Box-Muller pairs)."""
    s = seed.to(tl.int64)
    k0 = (s & 0xFFFFFFFF).to(tl.uint32)
    k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32)
    c0 = (ctr & 0xFFFFFFFF).to(tl.uint32)
    c1 = ((ctr >> 32) & 0xFFFFFFFF).to(tl.uint32)
    zero = tl.zeros(ctr.shape, tl.uint32)
    r0, r1, r2, r3 = _philox4x32_10(c0, c1, zero, zero, k0 + zero, k1 + zero)
    rad_a = tl.sqrt(-2.0 * tl.log(tl.maximum(_uniform(r0), 1.0e-7)))
    rad_b = tl.sqrt(-2.0 * tl.log(tl.maximum(_uniform(r2), 1.0e-7)))
    th_a = 6.283185307179586 * _uniform(r1)
    th_b = 6.283185307179586 * _uniform(r3)
    k = tl.arange(0, 4)[None, :]
    n01 = tl.where(k == 0, (rad_a * tl.cos(th_a))[:, None], (rad_a * tl.sin(th_a))[:, None])
    n23 = tl.where(k == 2, (rad_b * tl.cos(th_b))[:, None], (rad_b * tl.sin(th_b))[:, None])
    return tl.where(k < 2, n01, n23)


@triton.jit
def _row_tile(M, pid, BLOCK: tl.constexpr):
    """Tile ``pid`` of the (B, M) matrix for a (sample, block) program: (offsets (BLOCK/4, 4), mask, counters, b).

    The blocks of sample b start at the multiple of 4 at or below b * M, so every tile row is one whole Philox
    counter (when M % 4 != 0 a counter straddles two samples: each keeps its own elements).
    """
    n_blk = tl.cdiv(M + tl.where(M % 4 == 0, 0, 3), BLOCK)
    b = pid // n_blk
    j = pid - b * n_blk
    start = b.to(tl.int64) * M
    ctr = (start // 4) + j * (BLOCK // 4) + tl.arange(0, BLOCK // 4)  # (BLOCK/4,)
    offs = ctr[:, None] * 4 + tl.arange(0, 4)[None, :]
    mask = (offs >= start) & (offs < start + M)
    return offs, mask, ctr, b, j


def row_blocks(M: int, block: int) -> int:
    """Programs per sample of ``_row_tile`` (host side of its block count)."""
    return triton.cdiv(M + (0 if M % 4 == 0 else 3), block)


@triton.autotune(configs=elementwise_configs(), key=["n"])
@triton.jit(do_not_specialize=["seed"])
def _philox_randn_fwd_kernel(out_ptr, seed, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    ctr = pid.to(tl.int64) * (BLOCK // 4) + tl.arange(0, BLOCK // 4)
    offs = ctr[:, None] * 4 + tl.arange(0, 4)[None, :]
    tl.store(out_ptr + offs, _philox_normal4(seed, ctr), mask=offs < n)


def philox_randn_fwd(seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Launch the noise kernel: float32 tensor of ``shape`` on ``device`` (seed already a signed int64)."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    n = out.numel()
    if n == 0:
        return out
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    with device_guard(out):
        _philox_randn_fwd_kernel[grid](out, seed, n)
    return out


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches ``philox_randn_fwd`` can make (for aot.py): every autotune config."""
    cfgs = elementwise_configs(interpret=False)[:1] if fast else elementwise_configs(interpret=False)
    return [
        Launch(
            _philox_randn_fwd_kernel,
            {"out_ptr": "*fp32", "seed": seed_t, "n": "i32"},
            dict(c.kwargs),
            c.num_warps,
            multiple_of_16=("n",),
            streaming=True,
        )
        for c in cfgs
        for seed_t in (("i64",) if fast else ("i64", "i32"))
    ]
