"""Samplers with classifier-free guidance: DDPM ancestral, DDIM, EDM Heun, flow Euler / Heun.

A model is any callable ``model(x, t, y) -> out`` where ``x`` is (B, C, ...), ``y`` the (B,) class labels (or
None) and ``t`` is, per formulation:

- DDPM / DDIM: the int64 timestep index tensor (B,) of the ORIGINAL schedule (a respaced sampler maps its indices
  through ``timestep_map`` first, as DiT's ``_WrappedModel``); ``out`` is the eps / x0 / v prediction, with the
  variance values appended along dim 1 when the ``Readout`` says ``learn_sigma``;
- EDM: sigma (B,) in ``x``'s dtype; ``out`` is the denoised D(x; sigma) (wrap a raw network with
  ``EDMDenoiser``);
- flow: continuous t (B,) in [0, 1] in ``x``'s dtype; ``out`` is the velocity d x_t / dt = eps - x0.

Classifier-free guidance (``cfg_scale != 1``) follows DiT's ``forward_with_cfg``: the model is called on the
doubled batch [x, x] with labels [y, null] where null = ``num_classes``, and only the first ``guide_channels``
channels (default: x's channels, i.e. eps, D or the velocity) are guided, out = uncond + s (cond - uncond); the
remaining channels (the learned variance) are the conditional half's. ``cfg_scale = 1`` is plain conditional
sampling with a single model call.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from tqdm.auto import tqdm

from diffcurr_fast.diffusion.ddpm import DDPMSchedule
from diffcurr_fast.diffusion.edm import karras_sigmas
from diffcurr_fast.diffusion.readout import Readout
from diffcurr_fast.diffusion.respace import RespacedModel

FLOW_METHODS = ("euler", "heun")
Model = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]


# ---- shared helpers ------------------------------------------------------------------------------------
def make_generator(
    seed: int | None = None, generator: torch.Generator | None = None, device: torch.device | str = "cpu"
) -> torch.Generator | None:
    """Return ``generator``, or a new one seeded with ``seed`` on ``device``, or None when neither is given."""
    if seed is not None and generator is not None:
        raise ValueError("pass either seed or generator, not both")
    if seed is not None:
        g = torch.Generator(device=device)
        g.manual_seed(int(seed))
        return g
    return generator


def _randn(shape, generator, device, dtype) -> torch.Tensor:
    return torch.randn(shape, generator=generator, device=device, dtype=dtype)


def guided_model_output(
    model: Model,
    x: torch.Tensor,
    t: torch.Tensor,
    y: torch.Tensor | None = None,
    cfg_scale: float = 1.0,
    num_classes: int | None = None,
    guide_channels: int | None = None,
) -> torch.Tensor:
    """Model output with classifier-free guidance on the first ``guide_channels`` channels (DiT forward_with_cfg)."""
    if cfg_scale == 1.0:
        return model(x, t, y)
    if y is None:
        raise ValueError(f"cfg_scale={cfg_scale} needs class labels y; pass y or use cfg_scale=1")
    if num_classes is None or num_classes < 1:
        raise ValueError(f"cfg_scale={cfg_scale} needs num_classes (the null label), got {num_classes!r}")
    ch = x.shape[1] if guide_channels is None else guide_channels
    y_null = torch.full_like(y, num_classes)
    # DiT's batch [cond; uncond]; the first half of the result is the guided output (its other channels: cond's)
    out = guided_forward(model, torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, y_null]), cfg_scale, ch)
    return out[: x.shape[0]]  # (B, C', ...)


def guided_forward(forward, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor, cfg_scale: float, n_guided: int):
    """DiT's batched classifier-free guidance (``forward_with_cfg``) around any ``forward(x, t, y)``: the batch is
    [conditional half; unconditional half] (y's second half holds the null label) and x's first half is used for
    both; the first ``n_guided`` output channels of both halves are the guided ones, the others are returned
    unguided."""
    if x.shape[0] % 2:
        raise ValueError(f"forward_with_cfg needs an even batch [cond; uncond], got batch size {x.shape[0]}")
    half = x[: len(x) // 2]  # (N/2, C, H, W)
    combined = torch.cat([half, half], dim=0)  # (N, C, H, W)
    model_out = forward(combined, t, y)  # (N, out_channels, H, W)
    if not 1 <= n_guided <= model_out.shape[1]:
        raise ValueError(f"guide_channels must lie in [1, {model_out.shape[1]}], got {n_guided}")
    eps, rest = model_out[:, :n_guided], model_out[:, n_guided:]
    cond_eps, uncond_eps = torch.split(eps, len(eps) // 2, dim=0)
    half_eps = uncond_eps + cfg_scale * (cond_eps - uncond_eps)  # Ho & Salimans 2022, Eq. 6
    eps = torch.cat([half_eps, half_eps], dim=0)
    return torch.cat([eps, rest], dim=1)  # (N, out_channels, H, W)


def _check_common(shape, y, device) -> tuple[tuple[int, ...], torch.device]:
    shape = tuple(int(s) for s in shape)
    if len(shape) < 2 or any(s < 1 for s in shape):
        raise ValueError(f"shape must be (B, C, ...) with positive sizes, got {shape}")
    if y is not None and tuple(y.shape) != (shape[0],):
        raise ValueError(f"y must have shape ({shape[0]},), got {tuple(y.shape)}")
    return shape, torch.device(device) if device is not None else torch.device("cpu")


def _initial(shape, noise, generator, device, dtype) -> torch.Tensor:
    if noise is None:
        return _randn(shape, generator, device, dtype)
    if tuple(noise.shape) != shape:
        raise ValueError(f"noise shape {tuple(noise.shape)} does not match shape {shape}")
    return noise.to(device=device, dtype=dtype)


# ---- DDPM ancestral and DDIM -----------------------------------------------------------------------------
def ddpm_step(
    schedule: DDPMSchedule,
    model_out: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor,
    readout: Readout = Readout(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One ancestral step x_{t-1} = mu_theta(x_t, t) + sigma_t z, no noise at t = 0 (Ho et al. Alg. 2), with
    ``model_out`` read as ``readout`` says. Returns ``(x_prev, pred_x0)``.
    """
    out = schedule.p_mean_variance(model_out, x_t, t, readout)
    nonzero = (t != 0).to(x_t.dtype).reshape((-1,) + (1,) * (x_t.ndim - 1))  # (B, 1, ...)
    return out["mean"] + nonzero * torch.exp(0.5 * out["log_variance"]) * noise, out["pred_x0"]


def ddim_step(
    schedule: DDPMSchedule,
    model_out: torch.Tensor,
    x_t: torch.Tensor,
    t: torch.Tensor,
    noise: torch.Tensor | None = None,
    eta: float = 0.0,
    readout: Readout = Readout(),
) -> tuple[torch.Tensor, torch.Tensor]:
    """One DDIM step (Song et al. 2021, Eq. 12 with sigma_t(eta) of Eq. 16). Returns ``(x_prev, pred_x0)``.

    x_{t-1} = sqrt(abar_{t-1}) x0_hat + sqrt(1 - abar_{t-1} - sigma_t^2) eps_hat + sigma_t z,
    sigma_t = eta sqrt((1 - abar_{t-1}) / (1 - abar_t)) sqrt(1 - abar_t / abar_{t-1}); no noise at t = 0.
    Learned variance values, if any, are ignored (as in IDDPM), and so is ``readout.fixed_variance``.
    """
    if not eta >= 0:
        raise ValueError(f"eta must be non-negative, got {eta}")
    if eta > 0 and noise is None:
        raise ValueError("ddim_step with eta > 0 needs noise")
    out = schedule.p_mean_variance(model_out, x_t, t, readout)
    x0, eps = out["pred_x0"], out["pred_eps"]
    abar = schedule.coef("alphas_cumprod", t, x_t)
    abar_prev = schedule.coef("alphas_cumprod_prev", t, x_t)
    sigma = eta * torch.sqrt((1 - abar_prev) / (1 - abar)) * torch.sqrt(1 - abar / abar_prev)  # (B, 1, ...)
    x_prev = abar_prev.sqrt() * x0 + torch.sqrt((1 - abar_prev - sigma**2).clamp(min=0)) * eps
    if eta > 0:
        nonzero = (t != 0).to(x_t.dtype).reshape((-1,) + (1,) * (x_t.ndim - 1))
        x_prev = x_prev + nonzero * sigma * noise
    return x_prev, x0


def _discrete_sample(
    kind: str,
    model: Model,
    schedule: DDPMSchedule,
    shape,
    y,
    *,
    eta: float,
    num_classes,
    cfg_scale,
    readout,
    timestep_map,
    noise,
    generator,
    seed,
    device,
    dtype,
    progress,
    guide_channels,
) -> torch.Tensor:
    schedule.check_prediction(readout.prediction)
    shape, device = _check_common(shape, y, device)
    gen = make_generator(seed, generator, device)
    if timestep_map is not None:
        timestep_map = torch.as_tensor(timestep_map, dtype=torch.long)
        if timestep_map.shape != (schedule.num_timesteps,):
            raise ValueError(
                f"timestep_map must have shape ({schedule.num_timesteps},), got {tuple(timestep_map.shape)}"
            )
        model = RespacedModel(model, timestep_map)
    x = _initial(shape, noise, gen, device, dtype)
    y = None if y is None else y.to(device)
    steps = range(schedule.num_timesteps - 1, -1, -1)
    for i in tqdm(steps, disable=not progress, desc=kind):
        t = torch.full((shape[0],), i, dtype=torch.long, device=device)
        out = guided_model_output(model, x, t, y, cfg_scale, num_classes, guide_channels).to(dtype)
        if kind == "ddpm":
            z = _randn(shape, gen, device, dtype)
            x, _ = ddpm_step(schedule, out, x, t, z, readout)
        else:
            z = _randn(shape, gen, device, dtype) if eta > 0 else None
            x, _ = ddim_step(schedule, out, x, t, z, eta, readout)
    return x


def ddpm_sample(
    model: Model,
    schedule: DDPMSchedule,
    shape: tuple[int, ...],
    y: torch.Tensor | None = None,
    *,
    num_classes: int | None = None,
    cfg_scale: float = 1.0,
    readout: Readout = Readout(),
    timestep_map: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    guide_channels: int | None = None,
) -> torch.Tensor:
    """Ancestral sampling (Ho et al. Alg. 2) from x_T ~ N(0, I) down to x_0, fixed or learned variance.

    ``readout`` says how to read the model's output (its prediction, a learned variance, x0 clipping, the fixed
    variance); the default reads an eps prediction with the fixed large variance. For a respaced schedule pass
    ``(schedule, timestep_map) = respace(base, "250")``: the model then receives the original indices
    ``timestep_map[t]``. ``noise`` fixes x_T; ``seed`` / ``generator`` drive all draws.
    """
    return _discrete_sample(
        "ddpm",
        model,
        schedule,
        shape,
        y,
        eta=0.0,
        num_classes=num_classes,
        cfg_scale=cfg_scale,
        readout=readout,
        timestep_map=timestep_map,
        noise=noise,
        generator=generator,
        seed=seed,
        device=device,
        dtype=dtype,
        progress=progress,
        guide_channels=guide_channels,
    )


def ddim_sample(
    model: Model,
    schedule: DDPMSchedule,
    shape: tuple[int, ...],
    y: torch.Tensor | None = None,
    *,
    eta: float = 0.0,
    num_classes: int | None = None,
    cfg_scale: float = 1.0,
    readout: Readout = Readout(),
    timestep_map: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    guide_channels: int | None = None,
) -> torch.Tensor:
    """DDIM sampling (Song et al. 2021) with stochasticity ``eta`` (0: deterministic ODE, 1: DDPM-like).

    Usually run on a respaced schedule, e.g. ``respace(base, "ddim50")``; arguments as in ``ddpm_sample``.
    """
    if not eta >= 0:
        raise ValueError(f"eta must be non-negative, got {eta}")
    return _discrete_sample(
        "ddim",
        model,
        schedule,
        shape,
        y,
        eta=float(eta),
        num_classes=num_classes,
        cfg_scale=cfg_scale,
        readout=readout,
        timestep_map=timestep_map,
        noise=noise,
        generator=generator,
        seed=seed,
        device=device,
        dtype=dtype,
        progress=progress,
        guide_channels=guide_channels,
    )


# ---- EDM Heun (Karras et al. 2022, Algorithm 2) -------------------------------------------------------
def edm_heun_step(
    denoise: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    sigma_cur: float,
    sigma_next: float,
    gamma: float = 0.0,
    S_noise: float = 1.0,
    noise: torch.Tensor | None = None,
) -> torch.Tensor:
    """One step of EDM Algorithm 2; ``denoise(x, sigma_vec) -> D(x; sigma)`` with sigma_vec of shape (B,).

    sigma_hat = (1 + gamma) sigma_cur; x_hat = x + sqrt(sigma_hat^2 - sigma_cur^2) S_noise z (churn);
    Euler step with d = (x_hat - D(x_hat; sigma_hat)) / sigma_hat; 2nd-order correction unless sigma_next = 0.
    """
    if not sigma_cur > 0 or sigma_next < 0:
        raise ValueError(f"need sigma_cur > 0 and sigma_next >= 0, got {sigma_cur}, {sigma_next}")
    if gamma < 0:
        raise ValueError(f"gamma must be non-negative, got {gamma}")
    b = x.shape[0]
    sigma_hat = sigma_cur * (1.0 + gamma)
    if gamma > 0:
        if noise is None:
            raise ValueError("edm_heun_step with gamma > 0 needs noise")
        x = x + math.sqrt(sigma_hat**2 - sigma_cur**2) * S_noise * noise  # Alg. 2 line 6
    vec = lambda s: torch.full((b,), s, dtype=x.dtype, device=x.device)
    d = (x - denoise(x, vec(sigma_hat)).to(x.dtype)) / sigma_hat  # Alg. 2 line 7
    x_next = x + (sigma_next - sigma_hat) * d  # Alg. 2 line 8
    if sigma_next > 0:
        d_prime = (x_next - denoise(x_next, vec(sigma_next)).to(x.dtype)) / sigma_next  # Alg. 2 line 10
        x_next = x + (sigma_next - sigma_hat) * (0.5 * d + 0.5 * d_prime)  # Alg. 2 line 11
    return x_next


def edm_heun_sample(
    model: Model,
    shape: tuple[int, ...],
    y: torch.Tensor | None = None,
    *,
    num_steps: int = 18,
    sigma_min: float = 0.002,
    sigma_max: float = 80.0,
    rho: float = 7.0,
    S_churn: float = 0.0,
    S_min: float = 0.0,
    S_max: float = float("inf"),
    S_noise: float = 1.0,
    num_classes: int | None = None,
    cfg_scale: float = 1.0,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    guide_channels: int | None = None,
) -> torch.Tensor:
    """EDM stochastic / deterministic Heun sampler (Karras et al. Alg. 2; S_churn = 0 gives Alg. 1).

    ``model(x, sigma, y) -> D(x; sigma)``; time steps from ``karras_sigmas`` (EDM Eq. 5);
    gamma_i = min(S_churn / N, sqrt(2) - 1) for sigma_i in [S_min, S_max], else 0. ``noise`` is the standard
    normal that is scaled by sigma_max to give x_0.
    """
    shape, device = _check_common(shape, y, device)
    sigmas = karras_sigmas(num_steps, sigma_min, sigma_max, rho).tolist()
    if S_churn < 0 or S_noise < 0:
        raise ValueError(f"S_churn and S_noise must be non-negative, got {S_churn}, {S_noise}")
    gen = make_generator(seed, generator, device)
    x = _initial(shape, noise, gen, device, dtype) * sigmas[0]  # Alg. 2 line 1
    y = None if y is None else y.to(device)
    denoise = lambda xx, s: guided_model_output(model, xx, s, y, cfg_scale, num_classes, guide_channels)
    for i in tqdm(range(num_steps), disable=not progress, desc="edm-heun"):
        s_cur, s_next = sigmas[i], sigmas[i + 1]
        gamma = min(S_churn / num_steps, math.sqrt(2.0) - 1.0) if S_min <= s_cur <= S_max else 0.0
        z = _randn(shape, gen, device, dtype) if gamma > 0 else None
        x = edm_heun_step(denoise, x, s_cur, s_next, gamma, S_noise, z)
    return x


# ---- flow ODE (linear interpolant, t = 1 noise -> t = 0 data) --------------------------------------------
def flow_euler_step(
    velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, t_cur: float, t_next: float
) -> torch.Tensor:
    """Euler step of dx/dt = v(x, t): x_next = x + (t_next - t_cur) v(x, t_cur)."""
    vec = torch.full((x.shape[0],), t_cur, dtype=x.dtype, device=x.device)
    return x + (t_next - t_cur) * velocity(x, vec).to(x.dtype)


def flow_heun_step(
    velocity: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, t_cur: float, t_next: float
) -> torch.Tensor:
    """Heun (explicit trapezoid) step: x' = x + h v(x, t); x_next = x + h (v(x, t) + v(x', t_next)) / 2."""
    b = x.shape[0]
    h = t_next - t_cur
    v1 = velocity(x, torch.full((b,), t_cur, dtype=x.dtype, device=x.device)).to(x.dtype)
    x_euler = x + h * v1
    v2 = velocity(x_euler, torch.full((b,), t_next, dtype=x.dtype, device=x.device)).to(x.dtype)
    return x + h * 0.5 * (v1 + v2)


def flow_sample(
    model: Model,
    shape: tuple[int, ...],
    y: torch.Tensor | None = None,
    *,
    num_steps: int = 50,
    method: str = "heun",
    t_start: float = 1.0,
    t_end: float = 0.0,
    num_classes: int | None = None,
    cfg_scale: float = 1.0,
    noise: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
    guide_channels: int | None = None,
) -> torch.Tensor:
    """Integrate the probability-flow ODE dx/dt = v(x, t) from t_start (noise) to t_end (data), uniform grid.

    ``model(x, t, y) -> velocity`` (eps - x0); ``method`` is ``"euler"`` or ``"heun"`` (2 calls per step).
    """
    if method not in FLOW_METHODS:
        raise ValueError(f"unknown flow sampling method {method!r}; choose one of {FLOW_METHODS}")
    if not isinstance(num_steps, int) or num_steps < 1:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    if not 0.0 <= t_end < t_start <= 1.0:
        raise ValueError(f"need 0 <= t_end < t_start <= 1, got t_start={t_start}, t_end={t_end}")
    shape, device = _check_common(shape, y, device)
    gen = make_generator(seed, generator, device)
    x = _initial(shape, noise, gen, device, dtype)
    y = None if y is None else y.to(device)
    ts = torch.linspace(t_start, t_end, num_steps + 1, dtype=torch.float64).tolist()
    velocity = lambda xx, tt: guided_model_output(model, xx, tt, y, cfg_scale, num_classes, guide_channels)
    step = flow_euler_step if method == "euler" else flow_heun_step
    for i in tqdm(range(num_steps), disable=not progress, desc=f"flow-{method}"):
        x = step(velocity, x, ts[i], ts[i + 1])
    return x
