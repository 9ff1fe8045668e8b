"""Triton kernel for weighted timestep sampling by inverse CDF with Philox uniforms (no host sync)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import Launch
from .philox import _philox4x32_10, _uniform, device_guard

BLOCK = 256


@triton.jit(do_not_specialize=["seed"])
def _sample_timesteps_fwd_kernel(cdf_ptr, w_ptr, t_ptr, imp_ptr, seed, B, T, N_ITER: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < B
    s = seed.to(tl.int64)
    zero = tl.zeros([BLOCK], tl.uint32)
    k0 = (s & 0xFFFFFFFF).to(tl.uint32) + zero
    k1 = ((s >> 32) & 0xFFFFFFFF).to(tl.uint32) + zero
    r0, _, _, _ = _philox4x32_10(offs.to(tl.uint32), zero, zero, zero, k0, k1)  # counter (b, 0, 0, 0)
    u = _uniform(r0)
    total = tl.load(cdf_ptr + T - 1)
    thr = u.to(tl.float64) * total
    # smallest k with cdf[k] > thr: binary search over [0, T)
    lo = tl.zeros([BLOCK], dtype=tl.int64)
    hi = tl.zeros([BLOCK], dtype=tl.int64) + T
    for _ in tl.static_range(N_ITER):
        mid = (lo + hi) // 2
        active = lo < hi
        v = tl.load(cdf_ptr + tl.minimum(mid, T - 1), mask=mask & active, other=0.0)
        go_right = v <= thr
        lo = tl.where(active & go_right, mid + 1, lo)
        hi = tl.where(active & (~go_right), mid, hi)
    # lo < T has a positive weight: u <= 1 - 2**-24 (the top words give float32(2**31) * UNIFORM_SCALE, below 1),
    # so thr < cdf[T-1], and a zero weight repeats the cdf value below it
    wk = tl.load(w_ptr + lo, mask=mask, other=1.0)
    imp = (total / T) / wk  # uniform density over sampled density
    tl.store(t_ptr + offs, lo, mask=mask)
    tl.store(imp_ptr + offs, imp.to(tl.float32), mask=mask)


def sample_timesteps_fwd(weights: torch.Tensor, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: ``weights`` 1-D floating (T,), returns t int64 (B,) and importance float32 (B,)."""
    device = weights.device
    w64 = weights.to(torch.float64).contiguous()
    cdf = torch.cumsum(w64, 0)
    T = w64.shape[0]
    t = torch.empty(batch_size, dtype=torch.int64, device=device)
    imp = torch.empty(batch_size, dtype=torch.float32, device=device)
    if batch_size == 0:
        return t, imp
    n_iter = max(1, int(T).bit_length())
    with device_guard(w64):
        _sample_timesteps_fwd_kernel[(triton.cdiv(batch_size, BLOCK),)](
            cdf, w64, t, imp, seed, batch_size, T, N_ITER=n_iter, BLOCK=BLOCK
        )
    return t, imp


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches ``sample_timesteps_fwd`` makes: weights are float64 whatever their dtype; N_ITER for
    T = 1000 (DDPM) and T up to 2**16 (every N_ITER compiles the same loop, unrolled)."""
    args = {
        "cdf_ptr": "*fp64",
        "w_ptr": "*fp64",
        "t_ptr": "*i64",
        "imp_ptr": "*fp32",
        "seed": "i64",
        "B": "i32",
        "T": "i32",
    }
    return [
        Launch(_sample_timesteps_fwd_kernel, args, {"N_ITER": n, "BLOCK": BLOCK}, 4)
        for n in ((10,) if fast else (10, 17))
    ]
