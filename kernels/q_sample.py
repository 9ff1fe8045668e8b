"""Triton kernel for the forward diffusion process x_t = a[b] x0 + c[b] noise (noise given or Philox)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .philox import _philox_normal, elementwise_configs


@triton.autotune(configs=elementwise_configs(), key=["M"])
@triton.jit
def _q_sample_fwd_kernel(
    x0_ptr, noise_ptr, a_ptr, c_ptr, out_ptr, seed, n, M, HAS_NOISE: tl.constexpr, BLOCK: tl.constexpr
):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    b = offs // M
    x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_NOISE:
        eps = tl.load(noise_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        eps = _philox_normal(seed, offs)
    a = tl.load(a_ptr + b, mask=mask, other=0.0)
    c = tl.load(c_ptr + b, mask=mask, other=0.0)
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
    M = n // x0.shape[0]
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK"]),)
    _q_sample_fwd_kernel[grid](
        x0, noise if noise is not None else x0, a, c, out, seed, n, M, HAS_NOISE=noise is not None
    )
    return out
