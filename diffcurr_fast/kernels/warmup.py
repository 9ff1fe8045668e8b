"""Autotuning ahead of the first step: every autotuned launch once per constexpr combination at the run's sizes.

Triton's autotuner times its candidates on the first call per key, with host synchronisations, so that call
cannot happen inside a CUDA-graph capture (``torch.compile(mode="reduce-overhead")``, a captured step). Call
``warm_up`` with the batch's shape and dtype before capturing: afterwards every launch the step makes finds its
config in the autotuner's cache (the keys cover every constexpr, so no combination is left to tune).
"""

from __future__ import annotations

import torch

from .diffusion_loss import diffusion_loss_fwd
from .philox import philox_randn_fwd
from .q_sample import q_sample_fwd


def warm_up(x_shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str, seed: int = 1) -> int:
    """Tune q_sample (noise given or Philox), the loss (x noise x gradient) and the noise kernel for a batch of
    ``x_shape`` (B, ...) in ``dtype`` on ``device``; returns the number of launches made. Random inputs (zeros can
    time faster than real data)."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError("kernels.warm_up must run before CUDA-graph capture: the autotuner synchronises the host")
    B = x_shape[0]
    g = torch.Generator(device).manual_seed(seed)
    x0, noise, pred = (torch.randn(x_shape, generator=g, device=device).to(dtype) for _ in range(3))
    coef = [torch.rand(B, generator=g, device=device) for _ in range(3)]  # a/p, c/q, w: float32 (B,)
    launches = 0
    for given in (None, noise):
        q_sample_fwd(x0, coef[0], coef[1], given, seed)
        launches += 1
        for with_grad in (False, True):
            diffusion_loss_fwd(pred, x0, given, seed, *coef, with_grad)
            launches += 1
    philox_randn_fwd(seed, tuple(x_shape), device)
    return launches + 1
