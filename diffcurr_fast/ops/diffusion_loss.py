"""Fused diffusion training loss: target, squared error, per-sample weight and gradient in one pass.

``loss[b] = w[b] * mean_j (pred[b, j] - (p[b] x0[b, j] + q[b] eps[b, j]))^2`` (docs/ops.md). The forward pass
also writes ``w (2/M) (pred - tgt)`` when pred needs a gradient, so the backward only scales it by the
upstream gradient. With ``seed`` the noise is regenerated in-kernel (Philox), exactly as ``q_sample`` drew it.
"""

from __future__ import annotations

import torch

from diffcurr_fast.diffusion.ddpm import DDPMSchedule
from diffcurr_fast.ops import _backend, _common
from diffcurr_fast.ops.philox import normalize_seed, philox_randn_ref


def diffusion_loss_ref(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor | None,
    p: torch.Tensor,
    q: torch.Tensor,
    w: torch.Tensor,
    seed: int = 0,
) -> torch.Tensor:
    """Reference per-sample loss (B,): w * mean_j (pred - (p x0 + q eps))^2 in float32 (float64 for float64)."""
    dt = _common.compute_dtype(pred.dtype)
    eps = philox_randn_ref(seed, x0.shape, x0.device) if noise is None else noise
    shape = (-1,) + (1,) * (x0.ndim - 1)
    tgt = p.to(dt).view(shape) * x0.to(dt) + q.to(dt).view(shape) * eps.to(dt)  # p x0 + q eps
    d = (pred.to(dt) - tgt).flatten(1)
    return w.to(dt) * d.square().mean(1)


def _ref_fwd(pred, x0, noise, seed, p, q, w, with_grad):
    dt = _common.compute_dtype(pred.dtype)
    eps = philox_randn_ref(seed, x0.shape, x0.device) if noise is None else noise
    shape = (-1,) + (1,) * (x0.ndim - 1)
    d = pred.to(dt) - (p.to(dt).view(shape) * x0.to(dt) + q.to(dt).view(shape) * eps.to(dt))
    M = d[0].numel() if d.shape[0] else 0
    loss = w.to(dt) * d.flatten(1).square().mean(1) if M else torch.zeros(pred.shape[0], dtype=dt, device=pred.device)
    grad = (w.to(dt).view(shape) * (2.0 / max(M, 1)) * d).to(pred.dtype) if with_grad else pred.new_empty(0)
    return loss, grad


@torch.library.custom_op("diffcurr_fast::diffusion_loss", mutates_args=())
def _diffusion_loss_op(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor | None,
    seed: int,
    p: torch.Tensor,
    q: torch.Tensor,
    w: torch.Tensor,
    with_grad: bool,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    if backend == "reference":
        return _ref_fwd(pred, x0, noise, seed, p, q, w, with_grad)
    args = (
        pred.contiguous(),
        x0.contiguous(),
        noise.contiguous() if noise is not None else None,
        seed,
        p.float().contiguous(),
        q.float().contiguous(),
        w.float().contiguous(),
        with_grad,
    )
    if backend == "triton":
        loss, grad = _backend.kernels("diffusion_loss").diffusion_loss_fwd(*args)
    else:
        loss, grad = _common.unalias(_backend.ext_ops().diffusion_loss_fwd(*args), args[:3])
    if with_grad and grad.shape != pred.shape:  # a contiguous copy has pred's shape already; keep it explicit
        grad = grad.view(pred.shape)
    return loss, grad


@_diffusion_loss_op.register_fake
def _(pred, x0, noise, seed, p, q, w, with_grad, backend):
    loss = pred.new_empty(pred.shape[0], dtype=_common.compute_dtype(pred.dtype))
    grad = torch.empty_like(pred, memory_format=torch.contiguous_format) if with_grad else pred.new_empty(0)
    return loss, grad


def _setup_context(ctx, inputs, output):
    ctx.with_grad = inputs[7]
    ctx.save_for_backward(output[1])


def _backward(ctx, grad_loss, grad_grad):
    (buf,) = ctx.saved_tensors
    if not ctx.needs_input_grad[0]:
        return (None,) * 9
    if not ctx.with_grad:
        raise RuntimeError("diffusion_loss was run with with_grad=False; its gradient buffer was not computed")
    shape = (-1,) + (1,) * (buf.ndim - 1)
    g = grad_loss.view(shape)  # (B, 1, ..., 1)
    grad_pred = buf * g if buf.dtype == g.dtype else (buf.to(g.dtype) * g).to(buf.dtype)
    return grad_pred, None, None, None, None, None, None, None, None


_diffusion_loss_op.register_autograd(_backward, setup_context=_setup_context)


def _run(pred, x0, noise, p, q, w, reduction, seed, backend):
    _common.check_reduction(reduction)
    if noise is None:
        if seed is None:
            raise ValueError("diffusion_loss needs the noise or the seed q_sample used to generate it; got neither")
        seed_v = normalize_seed(seed)
    else:
        if seed is not None:
            raise ValueError("pass either noise or seed, not both (seed regenerates the noise in-kernel)")
        _common.check_like(noise, x0, "noise", "x0")
        seed_v = 0
    name = _common.backend_for("diffusion_loss_fwd", pred, backend)
    with_grad = pred.requires_grad and torch.is_grad_enabled()
    loss, _ = _diffusion_loss_op(
        pred, x0.detach(), noise.detach() if noise is not None else None, seed_v, p, q, w, with_grad, name
    )
    return loss.mean() if reduction == "mean" else loss


def _check_pred_x0(pred: torch.Tensor, x0: torch.Tensor) -> None:
    _common.check_batched(pred, "pred")
    _common.check_like(x0, pred, "x0", "pred")


def diffusion_loss_coef(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor | None,
    p: torch.Tensor | float,
    q: torch.Tensor | float,
    w: torch.Tensor | float | None = None,
    *,
    reduction: str = "mean",
    seed: int | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Weighted MSE to the target p[b] x0 + q[b] eps with per-sample coefficients (scalars or (B,) tensors).

    Flow/SiT velocity: p = -1, q = 1; EDM: p = 1, q = 0 with w = lambda(sigma) (Karras et al. Eq. 2/8).
    ``noise`` may be None when ``seed`` is given (Philox noise regenerated in-kernel). Returns the mean over the
    batch or the per-sample (B,) loss (``reduction="none"``), float32 (float64 for float64 inputs). Gradients
    flow to ``pred`` only.
    """
    _check_pred_x0(pred, x0)
    p = _common.per_sample(p, pred, "p")
    q = _common.per_sample(q, pred, "q")
    w = _common.per_sample(1.0 if w is None else w, pred, "w")
    return _run(pred, x0, noise, p, q, w, reduction, seed, backend)


def diffusion_loss(
    pred: torch.Tensor,
    x0: torch.Tensor,
    noise: torch.Tensor | None,
    t: torch.Tensor,
    schedule: DDPMSchedule | torch.Tensor,
    *,
    prediction: str = "eps",
    weighting: str = "none",
    gamma: float = 5.0,
    weights: torch.Tensor | None = None,
    reduction: str = "mean",
    seed: int | None = None,
    backend: str | None = None,
    validate: bool = True,
) -> torch.Tensor:
    """DDPM training loss for ``prediction`` in {eps, x0, v}, optionally MinSNR/P2 weighted, fused.

    loss[b] = w_t * mean_j (pred - target)^2 with target eps, x0 or v = sqrt(abar) eps - sqrt(1 - abar) x0
    (Salimans & Ho 2022) and w_t = ``loss_weights(SNR_t, prediction, weighting, gamma)`` (MinSNR: Hang et al.
    Eq. 5), times the optional per-sample ``weights`` (B,) (e.g. the importance from ``sample_timesteps``).
    ``noise`` may be None when ``seed`` (the one given to ``q_sample``) is given. ``validate=False`` skips the
    range check of ``t`` (a host sync).
    """
    _check_pred_x0(pred, x0)
    T = _common.alphas_cumprod(schedule).shape[0]
    t = _common.check_timesteps(t, pred, T, validate)
    table = _common.schedule_table(
        schedule, "loss", pred.device, _common.compute_dtype(pred.dtype), prediction, weighting, gamma
    )
    p, q, w = table[:, 0][t], table[:, 1][t], table[:, 2][t]  # (B,) each, contiguous: one gather each
    if weights is not None:
        w = w * _common.per_sample(weights, pred, "weights")
    return _run(pred, x0, noise, p, q, w, reduction, seed, backend)
