"""Fused forward diffusion process: x_t = a x0 + c eps with eps given or generated in-kernel from a seed.

``q_sample(x0, t, schedule, ...)`` uses DDPM coefficients a = sqrt(abar_t), c = sqrt(1 - abar_t) (Ho et al.
Eq. 4); ``q_sample_coef(x0, a, c, ...)`` takes per-sample coefficients (flow/SiT: a = 1 - t, c = t; EDM: a = 1,
c = sigma). With ``seed`` the noise is Philox4x32-10 (``philox_randn``) computed inside the kernel and never
stored; ``diffusion_loss(..., seed=seed)`` regenerates the same values.
"""

from __future__ import annotations

import torch

from diffcurr_fast.diffusion.ddpm import DDPMSchedule
from diffcurr_fast.ops import _backend, _common
from diffcurr_fast.ops.philox import draw_seed, normalize_seed, philox_randn, philox_randn_ref


def q_sample_ref(
    x0: torch.Tensor, a: torch.Tensor, c: torch.Tensor, noise: torch.Tensor | None = None, seed: int = 0
) -> torch.Tensor:
    """Reference: x_t[b] = a[b] x0[b] + c[b] eps[b] in float32 (float64 for float64 x0), cast to x0's dtype."""
    dt = _common.compute_dtype(x0.dtype)
    eps = philox_randn_ref(seed, x0.shape, x0.device) if noise is None else noise
    shape = (-1,) + (1,) * (x0.ndim - 1)
    xt = a.to(dt).view(shape) * x0.to(dt) + c.to(dt).view(shape) * eps.to(dt)  # Ho et al. Eq. 4
    return xt.to(x0.dtype)


def _triton(x0, a, c, noise, seed):
    noise = noise.contiguous() if noise is not None else None
    return _backend.kernels("q_sample").q_sample_fwd(x0.contiguous(), a, c, noise, seed)


_KERNELS = _backend.table(reference=q_sample_ref, triton=_triton, ext=lambda *a: _backend.ext_ops().q_sample(*a))


@torch.library.custom_op("diffcurr_fast::q_sample", mutates_args=())
def _q_sample_op(
    x0: torch.Tensor, a: torch.Tensor, c: torch.Tensor, noise: torch.Tensor | None, seed: int, backend: str
) -> torch.Tensor:
    """The forward of the reference and Triton backends as one opaque op (inductor never traces the Philox)."""
    return _KERNELS[backend](x0, a, c, noise, seed)


@_q_sample_op.register_fake
def _(x0, a, c, noise, seed, backend):
    return torch.empty_like(x0, memory_format=torch.contiguous_format)


def _fake_raw(x0, a, c, noise, seed):
    return torch.empty_like(x0, memory_format=torch.contiguous_format)


_backend.register_raw_fake("q_sample", _fake_raw)


def q_sample_fwd(
    x0: torch.Tensor, a: torch.Tensor, c: torch.Tensor, noise: torch.Tensor | None, seed: int, backend: str
) -> torch.Tensor:
    """x_t of a resolved backend; a, c contiguous compute-dtype (B,). The C++/CUDA kernels are called directly
    (their fakes trace), the others through the opaque op."""
    if backend in _backend.EXTENSION:
        return _KERNELS[backend](x0, a, c, noise, seed)
    return _q_sample_op(x0, a, c, noise, seed, backend)


class QSampleFunction(torch.autograd.Function):
    """x_t = a x0 + c eps with gradients to x0, a, c and a given noise (the Philox noise is regenerated)."""

    @staticmethod
    def forward(ctx, x0, a, c, noise, seed: int, backend: str):
        ctx.seed = seed
        ctx.save_for_backward(x0, a, c, noise)
        return q_sample_fwd(x0, a, c, noise, seed, backend)

    @staticmethod
    def backward(ctx, grad):
        x0, a, c, noise = ctx.saved_tensors
        dt = _common.compute_dtype(x0.dtype)
        shape = (-1,) + (1,) * (x0.ndim - 1)
        g = grad.to(dt)
        gx0 = (a.to(dt).view(shape) * g).to(x0.dtype) if ctx.needs_input_grad[0] else None
        ga = (g * x0.to(dt)).flatten(1).sum(1).to(a.dtype) if ctx.needs_input_grad[1] else None
        gc = gnoise = None
        if ctx.needs_input_grad[2]:
            eps = noise if noise is not None else philox_randn(ctx.seed, tuple(x0.shape), x0.device)
            gc = (g * eps.to(dt)).flatten(1).sum(1).to(c.dtype)
        if noise is not None and ctx.needs_input_grad[3]:
            gnoise = (c.to(dt).view(shape) * g).to(noise.dtype)
        return gx0, ga, gc, gnoise, None, None


def _finish(x0, a, c, noise, seed, backend, return_noise):
    if noise is not None:
        _common.check_like(noise, x0, "noise", "x0")
        if seed is not None:
            raise ValueError("pass either noise or seed, not both (seed generates the noise in-kernel)")
        seed_v = 0
    else:
        seed_v = normalize_seed(seed) if seed is not None else draw_seed()
    if _common.traced_under_compile(noise, backend):  # inductor fuses the definition (_common)
        xt = q_sample_ref(x0, a, c, noise)
        return (xt, noise) if return_noise else xt
    name = _common.backend_for("q_sample", x0, backend)
    tracked = (x0, a, c) if noise is None else (x0, a, c, noise)
    if torch.is_grad_enabled() and any(v.requires_grad for v in tracked):
        xt = QSampleFunction.apply(x0, a, c, noise, seed_v, name)
    else:  # nothing to differentiate (the usual training step): the kernel alone
        xt = q_sample_fwd(x0, a, c, noise, seed_v, name)
    if not return_noise:
        return xt
    if noise is None:
        noise = philox_randn(seed_v, x0.shape, x0.device, backend=name).to(x0.dtype)
    return xt, noise


def q_sample_coef(
    x0: torch.Tensor,
    a: torch.Tensor | float,
    c: torch.Tensor | float,
    noise: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    return_noise: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x_t = a[b] x0 + c[b] eps with per-sample coefficients ``a``, ``c`` (scalars or (B,) tensors).

    ``noise`` (like x0) is used when given; otherwise eps is Philox noise from ``seed`` (drawn from torch's
    default generator when None). Returns x_t (x0's dtype), or ``(x_t, noise)`` when ``return_noise`` (the
    generated noise is then materialised). Gradients flow to x0, a, c and a given noise.
    """
    _common.check_batched(x0, "x0")
    a = _common.per_sample(a, x0, "a", detach=False)
    c = _common.per_sample(c, x0, "c", detach=False)
    return _finish(x0, a, c, noise, seed, backend, return_noise)


def q_sample(
    x0: torch.Tensor,
    t: torch.Tensor,
    schedule: DDPMSchedule | torch.Tensor,
    noise: torch.Tensor | None = None,
    *,
    seed: int | None = None,
    return_noise: bool = False,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """DDPM forward process x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps (Ho et al. Eq. 4), fused.

    The drop-in form for DDPM code (diffusers' ``add_noise``): a thin adapter that gathers (a, c) at ``t`` from
    the schedule's cached table and calls ``q_sample_coef``. ``schedule`` is a ``DDPMSchedule`` or a 1-D
    ``alphas_cumprod`` tensor; ``t`` int (B,) on x0's device. ``noise`` is used when given; otherwise eps is
    Philox noise from ``seed`` (pass the same seed to ``diffusion_loss``), drawn from torch's default generator
    when None. Returns x_t, or ``(x_t, noise)`` when ``return_noise``. ``validate=False`` skips the range check
    of ``t`` (a host sync).
    """
    _common.check_batched(x0, "x0")
    T = _common.num_timesteps(schedule)
    t = _common.check_timesteps(t, x0, T, validate)
    table = _common.schedule_table(schedule, "q_sample", x0.device, _common.compute_dtype(x0.dtype))
    a, c = table.index_select(1, t).unbind()  # (2, T) -> (2, B): one gather; a and c are contiguous rows
    return q_sample_coef(x0, a, c, noise, seed=seed, return_noise=return_noise, backend=backend)
