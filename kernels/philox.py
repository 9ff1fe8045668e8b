"""Triton kernel for the counter-based Philox4x32-10 normal noise (definition in ``docs/ops.md``).

``_philox_normal`` is the shared device function: the noise value of flat element ``i`` for a 64-bit ``seed``.
q_sample and diffusion_loss call it so that the loss regenerates exactly the noise q_sample used.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def elementwise_configs() -> list[triton.Config]:
    """Autotune candidates for the memory-bound elementwise kernels (a single one under the interpreter)."""
    if INTERPRET:
        return [triton.Config({"BLOCK": 4096}, num_warps=4)]
    return [
        triton.Config({"BLOCK": 1024}, num_warps=4),
        triton.Config({"BLOCK": 2048}, num_warps=8),
        triton.Config({"BLOCK": 4096}, num_warps=8),
    ]


@triton.jit
def _philox_normal(seed, offs):
    """Normal noise for int64 flat indices ``offs``: n_{i % 4} of Philox4x32-10 at counter i // 4 (Box-Muller)."""
    c = offs // 4
    k = offs % 4
    r0, r1, r2, r3 = tl.randint4x(seed, c)
    first = k < 2
    ra = tl.where(first, r0, r2)
    rb = tl.where(first, r1, r3)
    ua = tl.uint_to_uniform_float(ra)
    ub = tl.uint_to_uniform_float(rb)
    rad = tl.sqrt(-2.0 * tl.log(tl.maximum(ua, 1.0e-7)))
    th = 6.283185307179586 * ub
    return tl.where((k % 2) == 0, rad * tl.cos(th), rad * tl.sin(th))


@triton.autotune(configs=elementwise_configs(), key=[])
@triton.jit
def _philox_randn_fwd_kernel(out_ptr, seed, n, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, _philox_normal(seed, offs), mask=mask)


def philox_randn_fwd(seed: int, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
    """Launch the noise kernel: float32 tensor of ``shape`` on ``device`` (seed already a signed int64)."""
    out = torch.empty(shape, dtype=torch.float32, device=device)
    n = out.numel()
    if n == 0:
        return out
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    _philox_randn_fwd_kernel[grid](out, seed, n)
    return out
