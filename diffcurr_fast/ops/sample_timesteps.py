"""Weighted timestep sampling on device: inverse CDF of a non-negative weight vector with Philox uniforms.

``t_b`` = smallest k with cdf[k] > u_b * cdf[T-1] (never a zero-weight k) and the importance weight
``imp_b = (cdf[T-1] / T) / w[t_b]`` so that E[imp f(t)] is the uniform-t mean of f (docs/ops.md). The kernel
path has no host synchronisation; the input check (which syncs) is separate and skippable (``validate``).
"""

from __future__ import annotations

import torch

from diffcurr_fast.ops import _backend
from diffcurr_fast.ops.philox import draw_seed, normalize_seed, philox_words, uniform_from_uint32


def sample_timesteps_ref(weights: torch.Tensor, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference draw: (t int64 (B,), importance float32 (B,)) for weights (T,) and ``seed``."""
    w64 = weights.to(torch.float64)
    T = w64.shape[0]
    cdf = torch.cumsum(w64, 0)  # float64 accumulation
    r0 = philox_words(seed, torch.arange(batch_size, dtype=torch.int64, device=weights.device))[0]
    u = uniform_from_uint32(r0).to(torch.float64)
    thr = u * cdf[-1]
    # smallest k with cdf[k] > thr: a positive-weight k < T, since u <= 1 - 2**-24 keeps thr below cdf[T-1]
    k = torch.searchsorted(cdf, thr, right=True)
    imp = (cdf[-1] / T) / w64[k]  # uniform density over sampled density
    return k.to(torch.int64), imp.to(torch.float32)


def _ext(weights: torch.Tensor, batch_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    if weights.dtype not in (torch.float32, torch.float64):  # the C++ kernels take float32 or float64 weights
        weights = weights.float()
    return _backend.ext_ops().sample_timesteps(weights.contiguous(), batch_size, seed)


_KERNELS = _backend.table(
    reference=sample_timesteps_ref,
    triton=lambda *a: _backend.kernels("sample_timesteps").sample_timesteps_fwd(*a),
    ext=_ext,
)


@torch.library.custom_op("diffcurr_fast::sample_timesteps", mutates_args=())
def _sample_timesteps_op(
    weights: torch.Tensor, batch_size: int, seed: int, backend: str
) -> tuple[torch.Tensor, torch.Tensor]:
    return _KERNELS[backend](weights, batch_size, seed)


@_sample_timesteps_op.register_fake
def _(weights, batch_size, seed, backend):
    return (
        weights.new_empty(batch_size, dtype=torch.int64),
        weights.new_empty(batch_size, dtype=torch.float32),
    )


def check_weights(weights: torch.Tensor) -> None:
    """ValueError unless ``weights`` is a 1-D non-empty floating tensor, finite, non-negative, not all zero.

    This check synchronises with the device; ``sample_timesteps(..., validate=False)`` skips it.
    """
    if not isinstance(weights, torch.Tensor):
        raise ValueError(f"weights must be a 1-D floating tensor, got {type(weights).__name__}")
    if weights.ndim != 1 or weights.numel() == 0 or not weights.dtype.is_floating_point:
        raise ValueError(
            f"weights must be a non-empty 1-D floating tensor, got shape {tuple(weights.shape)} dtype {weights.dtype}"
        )
    if not bool(torch.isfinite(weights).all()):
        raise ValueError("weights must be finite; got NaN or inf")
    if bool((weights < 0).any()):
        raise ValueError(f"weights must be non-negative; got min {float(weights.min())}")
    if not bool((weights > 0).any()):
        raise ValueError("weights are all zero; at least one timestep needs a positive weight")


def sample_timesteps(
    batch_size: int,
    weights: torch.Tensor,
    *,
    seed: int | None = None,
    generator: torch.Generator | None = None,
    device: torch.device | str | None = None,
    return_importance: bool = False,
    validate: bool = True,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Draw ``batch_size`` timesteps t ~ weights / sum(weights) on ``device`` (default: the weights' device).

    The seed is ``seed``, else one int64 drawn from ``generator`` (else from torch's default generator), so
    results follow the generator's state. Returns t (int64, (B,)), or ``(t, importance)`` with
    importance = (mean weight) / w[t] (float32) when ``return_importance``. ``validate=False`` skips the weight
    check (which synchronises with the device).
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
        raise ValueError(f"batch_size must be a non-negative int, got {batch_size!r}")
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if validate:
        check_weights(weights)
    elif not isinstance(weights, torch.Tensor) or weights.ndim != 1 or not weights.dtype.is_floating_point:
        raise ValueError("weights must be a 1-D floating tensor")
    if device is not None:
        weights = weights.to(device)
    seed_v = normalize_seed(seed) if seed is not None else draw_seed(generator)
    name = _backend.resolve("sample_timesteps", weights.device, backend)
    t, imp = _sample_timesteps_op(weights, batch_size, seed_v, name)
    return (t, imp) if return_importance else t
