"""Fused diffusion training loss: target, squared error, per-sample weight and gradient in one pass.

``loss[b] = w[b] * mean_j (pred[b, j] - (p[b] x0[b, j] + q[b] eps[b, j]))^2`` (docs/ops.md). When pred needs a
gradient, the forward pass also writes it, ``s w (2/M) (pred - tgt)`` with s = 1/B under ``reduction="mean"``
(the mean is taken inside the op), so ``loss.backward()`` has nothing left to do: the whole forward + backward
reads pred and the target's inputs once and writes the gradient once. A zero coefficient drops its input (eps
prediction never reads x0). With ``seed`` the noise is
regenerated in-kernel (Philox), exactly as ``q_sample`` drew it.
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
    grad_scale: float | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Reference per-sample loss (B,): w * mean_j (pred - (p x0 + q eps))^2 in float32 (float64 for float64), 0
    for empty samples. With ``grad_scale``: ``(loss, grad_scale * d loss.sum() / d pred)``, the gradient the
    kernels write (pred's dtype)."""
    dt = _common.compute_dtype(pred.dtype)
    eps = philox_randn_ref(seed, x0.shape, x0.device) if noise is None else noise
    shape = (-1,) + (1,) * (x0.ndim - 1)
    d = pred.to(dt) - (p.to(dt).view(shape) * x0.to(dt) + q.to(dt).view(shape) * eps.to(dt))  # pred - tgt
    M = d[0].numel() if d.shape[0] else 0
    loss = w.to(dt) * d.flatten(1).square().mean(1) if M else torch.zeros(pred.shape[0], dtype=dt, device=pred.device)
    if grad_scale is None:
        return loss
    return loss, (w.to(dt).view(shape) * (2.0 / max(M, 1) * grad_scale) * d).to(pred.dtype)


def _reference(pred, x0, noise, seed, p, q, w, with_grad, grad_scale):
    if not with_grad:
        return diffusion_loss_ref(pred, x0, noise, p, q, w, seed), pred.new_empty(0)
    return diffusion_loss_ref(pred, x0, noise, p, q, w, seed, grad_scale)


def _triton(pred, x0, noise, seed, p, q, w, with_grad, grad_scale):
    noise = noise.contiguous() if noise is not None else None
    pred, stride = _common.sample_rows(pred)  # a channel slice of the network output is read in place
    args = (pred, x0.contiguous(), noise, seed, p, q, w, with_grad, grad_scale, stride)
    return _backend.kernels("diffusion_loss").diffusion_loss_fwd(*args)


# (loss (B,), grad_scale * d loss / d pred (contiguous) or an empty tensor); p, q, w contiguous (B,). pred may
# be a batch-strided view (each sample contiguous): the C++/CUDA and Triton kernels read it in place.
_KERNELS = _backend.table(
    reference=_reference, triton=_triton, ext=lambda *a: _backend.ext_ops().diffusion_loss_fwd(*a)
)


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
    grad_scale: float,
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward of the reference and Triton backends as one opaque op (inductor never traces the Philox)."""
    return _KERNELS[backend](pred, x0, noise, seed, p, q, w, with_grad, grad_scale)


def _fake(pred, x0, noise, seed, p, q, w, with_grad, grad_scale=1.0, backend=None):
    loss = pred.new_empty(pred.shape[0], dtype=_common.compute_dtype(pred.dtype))
    grad = torch.empty_like(pred, memory_format=torch.contiguous_format) if with_grad else pred.new_empty(0)
    return loss, grad


_diffusion_loss_op.register_fake(_fake)
_backend.register_raw_fake("diffusion_loss_fwd", _fake)


def diffusion_loss_fwd(pred, x0, noise, seed, p, q, w, with_grad: bool, grad_scale: float, backend: str):
    """(loss (B,), grad_scale * d loss / d pred or an empty tensor) of a resolved backend; p, q, w contiguous (B,).
    The C++/CUDA kernels are called directly (their fakes trace), the others through the opaque op."""
    if backend in _backend.EXTENSION:
        return _KERNELS[backend](pred, x0, noise, seed, p, q, w, with_grad, grad_scale)
    return _diffusion_loss_op(pred, x0, noise, seed, p, q, w, with_grad, grad_scale, backend)


# Whether the backward may read the upstream gradient on the host to skip the rescaling pass. Only CPU tensors
# are ever read (free there); on other devices the read would synchronise, so the buffer is always rescaled.
# Tests that emulate on the CPU what a GPU step reads back turn it off.
CHECK_UPSTREAM_ON_CPU = True


class DiffusionLossFunction(torch.autograd.Function):
    """The loss, reduced (``mean``: a 0-d batch mean) or per sample (``none``), whose forward also writes the
    gradient d loss / d pred for an upstream gradient of one.

    When that is the upstream gradient that arrives (``loss.backward()`` of the mean), the backward returns the
    buffer the forward wrote and does no pass over memory at all; otherwise it returns the buffer rescaled (one
    pass). The buffer is saved with its version counter, so a caller that modifies the returned gradient in place
    and then runs backward through the same graph again gets autograd's error, never a wrong gradient.
    """

    @staticmethod
    def forward(ctx, pred, x0, noise, seed: int, p, q, w, mean: bool, backend: str):
        grad_scale = 1.0 / pred.shape[0] if mean and pred.shape[0] else 1.0  # d mean / d loss[b] = 1/B
        loss, buf = diffusion_loss_fwd(pred, x0, noise, seed, p, q, w, True, grad_scale, backend)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(buf)
        return loss.mean() if mean else loss

    @staticmethod
    def backward(ctx, grad_loss):
        if torch.is_grad_enabled():
            raise RuntimeError("diffusion_loss has no second derivative (backward with create_graph=True)")
        (buf,) = ctx.saved_tensors
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return (None,) * 9
        # on the CPU the check costs no synchronisation; elsewhere the scaling is always applied
        if CHECK_UPSTREAM_ON_CPU and not torch.compiler.is_compiling() and grad_loss.device.type == "cpu":
            if (float(grad_loss) == 1.0) if grad_loss.ndim == 0 else bool((grad_loss == 1.0).all()):
                return buf, *(None,) * 8
        shape = (-1,) + (1,) * (buf.ndim - 1)
        g = grad_loss if grad_loss.ndim == 0 else grad_loss.view(shape)
        return (buf * g).to(buf.dtype), *(None,) * 8


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
        noise = noise.detach()
        seed_v = 0
    mean = reduction == "mean"
    if _common.traced_under_compile(noise, backend):  # inductor fuses the definition (_common)
        loss = diffusion_loss_ref(pred, x0.detach(), noise, p, q, w)
        return loss.mean() if mean else loss
    name = _common.backend_for("diffusion_loss_fwd", pred, backend)
    if pred.requires_grad and torch.is_grad_enabled():
        return DiffusionLossFunction.apply(pred, x0.detach(), noise, seed_v, p, q, w, mean, name)
    loss, _ = diffusion_loss_fwd(pred, x0, noise, seed_v, p, q, w, False, 1.0, name)
    return loss.mean() if mean else loss


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

    The drop-in form for DDPM code (diffusers' training scripts): a thin adapter that gathers (p, q, w) at ``t``
    from the schedule's cached table and calls ``diffusion_loss_coef``.

    loss[b] = w_t * mean_j (pred - target)^2 with target eps, x0 or v = sqrt(abar) eps - sqrt(1 - abar) x0
    (Salimans & Ho 2022) and w_t = ``loss_weights(SNR_t, prediction, weighting, gamma)`` (MinSNR: Hang et al.
    Eq. 5), times the optional per-sample ``weights`` (B,) (e.g. the importance from ``sample_timesteps``).
    ``noise`` may be None when ``seed`` (the one given to ``q_sample``) is given. ``validate=False`` skips the
    range check of ``t`` (a host sync).
    """
    _check_pred_x0(pred, x0)
    T = _common.num_timesteps(schedule)
    t = _common.check_timesteps(t, pred, T, validate)
    table = _common.schedule_table(
        schedule, "loss", pred.device, _common.compute_dtype(pred.dtype), prediction, weighting, gamma
    )
    p, q, w = table.index_select(1, t).unbind()  # (3, T) -> (3, B): one gather; each row contiguous
    if weights is not None:
        w = w * _common.per_sample(weights, pred, "weights")
    return diffusion_loss_coef(pred, x0, noise, p, q, w, reduction=reduction, seed=seed, backend=backend)
