"""Triton kernel for the per-sample weighted diffusion MSE and its gradient, in one pass over memory.

loss[b] = w[b] * mean_j (pred - (p[b] x0 + q[b] eps))^2 ; grad = s * w[b] * (2/M) * (pred - tgt) (docs/ops.md),
where s (``grad_scale``, folded into the weights the kernel reads for the gradient) is the upstream gradient the
caller expects (1/B for a batch mean), so the backward usually has nothing left to do. With the noise given, a
zero p[b] skips the loads of x0 (the eps target never reads it).
A program handles one block of one sample (a 1-D grid over (sample, block), so any batch size fits) and writes
one partial sum (deterministic, no atomics); the per-sample p, q, w are scalar loads per program. Sample b of
pred starts at b * pred_stride (>= M: the first channels of a wider output are read in place); x0, the noise and
the gradient are contiguous (B, M).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .aot import Launch
from .philox import INTERPRET, _philox_normal4, _row_tile, device_guard, row_blocks


def _configs(interpret: bool = INTERPRET) -> list[triton.Config]:
    # 2048 with 8 warps spills 4 bytes for 16-bit data with in-kernel noise on sm_80 (ptxas targets 48 registers)
    if interpret:
        return [triton.Config({"BLOCK": 4096}, num_warps=4)]
    return [triton.Config({"BLOCK": 1024}, num_warps=4), triton.Config({"BLOCK": 2048}, num_warps=4)]


MIN_BLOCK = min(cfg.kwargs["BLOCK"] for cfg in _configs())


# keyed on every constexpr but the tuned BLOCK; reset_to_zero: a larger BLOCK writes fewer partial sums than the
# n_part slots (sized for MIN_BLOCK), so what a smaller candidate wrote while timing must not stay behind
@triton.autotune(configs=_configs(), key=["M", "HAS_NOISE", "WITH_GRAD"], reset_to_zero=["partial_ptr"])
@triton.jit(do_not_specialize=["seed"])
def _diffusion_loss_fwd_kernel(
    pred_ptr,
    x0_ptr,
    noise_ptr,
    p_ptr,
    q_ptr,
    w_ptr,
    partial_ptr,
    grad_ptr,
    seed,
    M,
    pred_stride,
    n_part,
    HAS_NOISE: tl.constexpr,
    WITH_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    offs, mask, ctr, b, j = _row_tile(M, tl.program_id(0), BLOCK)
    pred_row = pred_ptr + b.to(tl.int64) * (pred_stride - M)  # pred_row + b * M + j: element j of sample b
    pred = tl.load(pred_row + offs, mask=mask, other=0.0).to(tl.float32)  # (BLOCK/4, 4)
    if HAS_NOISE:  # memory-bound: the eps target (p = 0) never reads x0
        p = tl.load(p_ptr + b)
        tgt = tl.load(q_ptr + b) * tl.load(noise_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if p != 0.0:
            tgt += p * tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:  # Philox-bound, at the register limit with BLOCK=2048 on sm_80: x0 is always read, no branch
        x0 = tl.load(x0_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        eps = _philox_normal4(seed, ctr)
        tgt = tl.load(p_ptr + b) * x0 + tl.load(q_ptr + b) * eps
    d = tl.where(mask, pred - tgt, 0.0)  # pred - target
    tl.store(partial_ptr + b * n_part + j, tl.sum(tl.sum(d * d, axis=1), axis=0))
    if WITH_GRAD:
        g = (tl.load(w_ptr + b) * (2.0 / M)) * d  # w_ptr: the weights times grad_scale
        tl.store(grad_ptr + offs, g.to(grad_ptr.dtype.element_ty), mask=mask)


def diffusion_loss_fwd(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor | None,
    seed: int,
    p: torch.Tensor,
    q: torch.Tensor,
    w: torch.Tensor,
    with_grad: bool,
    grad_scale: float = 1.0,
    pred_stride: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch: contiguous (B, ...) inputs but pred, whose samples are contiguous and ``pred_stride`` elements
    apart (None: M); float32 (B,) p/q/w. Returns loss float32 (B,) and the contiguous grad (or empty)."""
    B = pred.shape[0]
    M = pred.numel() // B if B else 0
    grad = torch.empty(pred.shape, dtype=pred.dtype, device=pred.device) if with_grad else pred.new_empty(0)
    if B == 0 or M == 0:
        return torch.zeros(B, dtype=torch.float32, device=pred.device), grad
    n_part = row_blocks(M, MIN_BLOCK)
    partial = torch.zeros(B, n_part, dtype=torch.float32, device=pred.device)
    grid = lambda meta: (B * row_blocks(M, meta["BLOCK"]),)
    with device_guard(pred):
        _diffusion_loss_fwd_kernel[grid](
            pred,
            x0,
            noise if noise is not None else x0,
            p,
            q,
            w * grad_scale if with_grad and grad_scale != 1.0 else w,
            partial,
            grad,
            seed,
            M,
            M if pred_stride is None else pred_stride,
            n_part,
            HAS_NOISE=noise is not None,
            WITH_GRAD=with_grad,
        )
    return partial.sum(1) * (w / M), grad


def aot_launches(dtypes, fast: bool = False) -> list:
    """The launches ``diffusion_loss_fwd`` can make: dtype x noise given or not x gradient or not x config."""
    cfgs = _configs(interpret=False)
    out = []
    for dt in dtypes:
        for has_noise in (False, True):
            for with_grad in (True,) if fast else (False, True):
                for cfg in cfgs[:1] if fast else cfgs:
                    args = {
                        "pred_ptr": f"*{dt}",
                        "x0_ptr": f"*{dt}",
                        "noise_ptr": f"*{dt}",
                        "p_ptr": "*fp32",
                        "q_ptr": "*fp32",
                        "w_ptr": "*fp32",
                        "partial_ptr": "*fp32",
                        "grad_ptr": f"*{dt}",
                        "seed": "i64",
                        "M": "i32",
                        "pred_stride": "i32",
                        "n_part": "i32",
                    }
                    cx = {"HAS_NOISE": has_noise, "WITH_GRAD": with_grad, **cfg.kwargs}
                    out.append(
                        Launch(
                            _diffusion_loss_fwd_kernel,
                            args,
                            cx,
                            cfg.num_warps,
                            multiple_of_16=("M", "pred_stride"),
                            streaming=True,
                        )
                    )
    return out
