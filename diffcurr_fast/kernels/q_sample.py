"""Triton kernel for the forward diffusion process x_t = a[b] x0 + c[b] noise (noise given or Philox).

A program handles one block of one sample (a 1-D grid over (sample, block)): the per-sample coefficients are
two scalar loads per program, and the data moves as (BLOCK/4, 4) tiles (16-byte vectors for aligned fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import Launch
from .philox import _philox_normal4, _row_tile, device_guard, elementwise_configs, row_blocks


@triton.autotune(configs=elementwise_configs(), key=["M", "HAS_NOISE"])  # every constexpr but the tuned BLOCK
@triton.jit(do_not_specialize=["seed"])
def _q_sample_fwd_kernel(
    x0_ptr, noise_ptr, a_ptr, c_ptr, out_ptr, seed, M, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr
):
    offs, mask, ctr, b, _ = _row_tile(M, tl.program_id(0), BLOCK)
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK/4, 4)
    if HAS_NOISE:
        eps = tl.load(noise_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        eps = _philox_normal4(seed, ctr)
    a = tl.load(a_ptr + b)
    c = tl.load(c_ptr + b)
    xt = a * x0 + c * eps  # Ho et al. Eq. 4 with per-sample coefficients
    tl.store(out_ptr + offs, xt.to(out_ptr.dtype.element_ty), mask=mask)


def q_sample_fwd(
    x0: torch.Tensor, a: torch.Tensor, c: torch.Tensor, noise: torch.Tensor | None, seed: int
) -> torch.Tensor:
    """Launch: x0 contiguous (B, ...), a/c float32 (B,), noise like x0 or None (Philox from ``seed``)."""
    out = torch.empty_like(x0)
    n = x0.numel()
    if n == 0:
        return out
    B = x0.shape[0]
    M = n // B
    grid = lambda meta: (B * row_blocks(M, meta["BLOCK"]),)
    with device_guard(x0):
        _q_sample_fwd_kernel[grid](
            x0, noise if noise is not None else x0, a, c, out, seed, M, HAS_NOISE=noise is not None
        )
    return out


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches ``q_sample_fwd`` can make (for aot.py): dtype x noise given or not x autotune config."""
    cfgs = elementwise_configs(interpret=False)
    out = []
    for dt in dtypes:
        for has_noise in (False, True):
            for cfg in cfgs[:1] if fast else cfgs:
                args = {
                    "x0_ptr": f"*{dt}",
                    "noise_ptr": f"*{dt}",
                    "a_ptr": "*fp32",
                    "c_ptr": "*fp32",
                    "out_ptr": f"*{dt}",
                    "seed": "i64",
                    "M": "i32",
                }
                out.append(
                    Launch(
                        _q_sample_fwd_kernel,
                        args,
                        {"HAS_NOISE": has_noise, **cfg.kwargs},
                        cfg.num_warps,
                        multiple_of_16=("M",),
                        streaming=True,
                    )
                )
    return out
