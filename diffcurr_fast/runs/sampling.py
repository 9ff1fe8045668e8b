"""Building a model from a training config, and sampling it with DDPM, DDIM, Heun or Euler.

``ddpm`` / ``ddim`` run on the DDPM schedule respaced to ``steps`` (IDDPM ``space_timesteps``). ``heun`` /
``euler`` integrate the probability-flow ODE of the same model in EDM's variance-exploding form (Karras et al.
2022, Sec. 2 and Alg. 1): x_ve = x_vp / sqrt(abar), sigma = sqrt((1 - abar) / abar), on the Karras sigma grid
(EDM Eq. 5) between the schedule's smallest and largest sigma; the network is queried at the fractional DDPM
timestep whose log sigma matches (linear interpolation of the log-sigma table), which DiT's sinusoidal timestep
embedding accepts.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from tqdm.auto import tqdm

from diffcurr_fast._lazy import pyplot
from diffcurr_fast.diffusion import (
    DDPMSchedule,
    EDMDenoiser,
    EDMFormulation,
    FlowFormulation,
    Readout,
    build_formulation,
    ddim_sample,
    ddpm_sample,
    edm_heun_sample,
    flow_sample,
    formulation_class,
    guided_model_output,
    karras_sigmas,
    make_generator,
    respace,
)
from diffcurr_fast.models import DiT
from diffcurr_fast.models.dit import LabelEmbedder
from diffcurr_fast.runs.checkpoint import load_weights
from diffcurr_fast.runs.config import components
from diffcurr_fast.runs.sections import resolve_sampler, with_article
from diffcurr_fast.runs.threads import check_threads

if TYPE_CHECKING:
    from diffcurr_fast.runs.config import TrainConfig

SAMPLERS = ("ddpm", "ddim", "heun", "euler")


def set_cpu_threads(threads: int | None, cfg: TrainConfig | None = None) -> int:
    """torch's intra-op CPU threads for a command: ``threads`` (its ``--threads``) when given, else the run's own
    ``engine.cpu_threads``; 0 keeps torch's default; more than this machine runs is refused (``check_threads``).
    Returns the count in use. (A small model on a busy machine is
    many times slower at torch's default than at one thread.)"""
    n = cfg.engine.cpu_threads if threads is None and cfg is not None else threads or 0
    check_threads(n, "--threads" if threads is not None else "engine.cpu_threads")
    if n:
        torch.set_num_threads(n)
    return torch.get_num_threads()


def build_model(cfg: TrainConfig) -> DiT:
    """The DiT described by ``cfg.model`` (+ learn_sigma and T from ``cfg.diffusion``): its dimensions, then the
    keywords each model option sets (``dit_kwargs`` of its options, ``models.registry``)."""
    m = cfg.model
    kw: dict[str, Any] = dict(
        input_size=m.input_size,
        in_channels=m.in_channels,
        num_classes=m.num_classes,
        class_dropout_prob=m.class_dropout_prob,
        learn_sigma=cfg.diffusion.learn_sigma,
        attn_backend=m.attn_backend,
        grad_checkpointing=cfg.engine.grad_checkpointing,
        fused_adaln=m.fused_adaln,
        num_timesteps=cfg.diffusion.num_timesteps,
    )
    for comp in components("model"):
        kw.update(comp.options.of(m).dit_kwargs(cfg))
    # the config has resolved a preset into its dimensions (``ModelConfig.validate``)
    return DiT(
        patch_size=m.patch_size,
        hidden_size=m.hidden_size,
        depth=m.depth,
        num_heads=m.num_heads,
        mlp_ratio=m.mlp_ratio,
        **kw,
    )


def checkpoint_dit(state: dict[str, Any], cfg: TrainConfig, weights: dict[str, Any], what: str) -> DiT:
    """The DiT of the training checkpoint ``state`` (read with ``checkpoint.load_checkpoint``; ``cfg`` its config)
    holding ``weights`` (its EMA or raw weights, or a post-hoc EMA): built from the ``model_config`` the checkpoint
    records (a pruned expert's own architecture), else from ``cfg``, and loaded by ``checkpoint.load_weights``, which
    names ``what`` in one line when the weights are not finite or do not fit. ``sample`` and ``export`` load with it."""
    model = DiT.from_config(state["model_config"]) if "model_config" in state else build_model(cfg)
    return load_weights(model, weights, what)


def check_sampler(sampler: str, steps: int, cfg: TrainConfig) -> str:
    """The sampler a command runs on the model of ``cfg`` (``auto``: the formulation's own, ``resolve_sampler``);
    ValueError naming ``--sampler`` when it cannot sample the formulation, or ``--steps`` when it is not in [1, T]
    for a DDPM model. The commands check this right after reading a checkpoint's config, before building its model."""
    form = cfg.diffusion.formulation
    sampler = resolve_sampler(sampler, form)
    valid = formulation_class(form).limits.get("sampler", SAMPLERS)
    if sampler not in valid:
        raise ValueError(
            f"--sampler {sampler!r} cannot sample {with_article(form)} model; valid choices: {', '.join(valid)}"
        )
    if steps < 1:
        raise ValueError(f"--steps must be >= 1, got {steps}")
    if formulation_class(form).discrete and steps > cfg.diffusion.num_timesteps:  # t is the timestep index
        top = cfg.diffusion.num_timesteps
        raise ValueError(f"--steps must be an int in [1, {top}] (the model's diffusion.num_timesteps), got {steps}")
    return sampler


def build_schedule(cfg: TrainConfig) -> DDPMSchedule | FlowFormulation | EDMFormulation:
    """The formulation of ``cfg.diffusion``: ``DDPMSchedule``, ``FlowFormulation`` or ``EDMFormulation``."""
    return build_formulation(cfg.diffusion)


class VEDenoiser:
    """D(x_ve; sigma) of a DDPM network, for the EDM ODE samplers (see the module doc)."""

    def __init__(self, model: nn.Module, schedule: DDPMSchedule, prediction: str, channels: int):
        self.model, self.prediction, self.channels = model, prediction, channels
        abar = schedule.alphas_cumprod
        self.log_sigmas = 0.5 * (torch.log1p(-abar) - torch.log(abar))  # (T,) increasing in t
        self.sigma_min = float(self.log_sigmas[0].exp())
        self.sigma_max = float(self.log_sigmas[-1].exp())

    def t_of_sigma(self, sigma: torch.Tensor) -> torch.Tensor:
        """Fractional timestep with log sigma(t) = log sigma, by linear interpolation of the table."""
        ls = sigma.detach().to("cpu", torch.float64).log().clamp(self.log_sigmas[0], self.log_sigmas[-1])
        hi = torch.searchsorted(self.log_sigmas, ls).clamp(1, len(self.log_sigmas) - 1)
        lo = hi - 1
        frac = (ls - self.log_sigmas[lo]) / (self.log_sigmas[hi] - self.log_sigmas[lo])
        return (lo.to(torch.float64) + frac).to(sigma.device)

    def __call__(self, x: torch.Tensor, sigma: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        s = sigma.to(torch.float64).reshape(-1, *([1] * (x.ndim - 1)))  # (B, 1, 1, 1)
        abar = 1.0 / (1.0 + s**2)
        x_vp = (x.to(torch.float64) * abar.sqrt()).to(x.dtype)  # x_vp = sqrt(abar) x_ve
        t = self.t_of_sigma(sigma).to(x.dtype)
        out = self.model(x_vp, t, y)[:, : self.channels].to(torch.float64)  # (B, C, H, W)
        if self.prediction == "eps":
            x0 = x.to(torch.float64) - s * out  # x_ve = x0 + sigma eps
        elif self.prediction == "x0":
            x0 = out
        else:  # v = sqrt(abar) eps - sqrt(1 - abar) x0 (Salimans & Ho 2022)
            x0 = abar.sqrt() * x_vp.to(torch.float64) - (1.0 - abar).sqrt() * out
        return x0.to(x.dtype)


@torch.no_grad()
def sample(
    model: nn.Module,
    schedule: DDPMSchedule | FlowFormulation | EDMFormulation,
    *,
    sampler: str,
    steps: int,
    labels: torch.Tensor,
    channels: int,
    size: int,
    num_classes: int,
    readout: Readout,
    cfg_scale: float = 1.0,
    seed: int = 0,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    """Draw ``len(labels)`` samples (N, C, H, W) in data space with ``sampler`` in ddpm | ddim | heun | euler, the
    network's output read as ``readout`` says (``sampling_readout`` builds it from a run config).

    A flow model (``schedule`` a ``FlowFormulation``) integrates its velocity ODE from t = 1 to 0 with euler or heun;
    an EDM model (raw network F with EDM preconditioning) its probability-flow ODE on the Karras sigma grid.
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"unknown sampler {sampler!r}; choose one of {SAMPLERS}")
    if cfg_scale != 1.0 and not cfg_scale >= 0:
        raise ValueError(f"cfg scale must be >= 0, got {cfg_scale}")
    if cfg_scale != 1.0 and not has_null_label(model):
        raise ValueError(
            f"guidance scale {cfg_scale:g} needs the null label, but this model was trained without label "
            "dropout (model.class_dropout_prob=0); sample with --cfg 1 (logging.cfg_scale / "
            "eval.cfg_scale 1), or train with model.class_dropout_prob > 0"
        )
    if isinstance(schedule, (FlowFormulation, EDMFormulation)) and sampler not in ("euler", "heun"):
        kind = "flow" if isinstance(schedule, FlowFormulation) else "edm"
        raise ValueError(f"sampler {sampler!r} cannot sample {with_article(kind)} model; valid choices: euler, heun")
    if isinstance(schedule, EDMFormulation):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        den = EDMDenoiser(lambda x, t, yy: model(x, t, yy), schedule.sigma_data)
        shape = (len(labels), channels, size, size)
        common = dict(num_classes=num_classes, cfg_scale=cfg_scale, seed=seed, device=torch.device(device))
        lo, hi = schedule.sigma_min, schedule.sigma_max
        if sampler == "heun":
            x = edm_heun_sample(
                den, shape, labels.to(device), num_steps=steps, sigma_min=lo, sigma_max=hi, progress=progress, **common
            )
        else:
            x = _euler(den, shape, labels.to(device), steps, lo, hi, progress=progress, **common)
        return x.clamp(-1, 1) if readout.clip_denoised else x
    if isinstance(schedule, FlowFormulation):
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"steps must be a positive int, got {steps!r}")
        x = flow_sample(
            lambda x, t, yy: model(x, t, yy),
            (len(labels), channels, size, size),
            labels.to(device),
            num_steps=steps,
            method=sampler,
            num_classes=num_classes,
            cfg_scale=cfg_scale,
            seed=seed,
            device=device,
            progress=progress,
        )
        return x.clamp(-1, 1) if readout.clip_denoised else x
    if isinstance(steps, bool) or not isinstance(steps, int) or not 1 <= steps <= schedule.num_timesteps:
        raise ValueError(f"steps must be an int in [1, {schedule.num_timesteps}], got {steps!r}")
    device = torch.device(device)
    y = labels.to(device)
    shape = (len(labels), channels, size, size)
    fn = lambda x, t, yy: model(x, t, yy)
    common = dict(num_classes=num_classes, cfg_scale=cfg_scale, seed=seed, device=device, progress=progress)
    if sampler in ("ddpm", "ddim"):
        sched, tmap = respaced(schedule, sampler, steps)
        run = ddpm_sample if sampler == "ddpm" else ddim_sample
        return run(fn, sched, shape, y, readout=readout, timestep_map=tmap.to(device), **common)
    den = VEDenoiser(model, schedule, readout.prediction, channels)
    if sampler == "heun":
        x = edm_heun_sample(den, shape, y, num_steps=steps, sigma_min=den.sigma_min, sigma_max=den.sigma_max, **common)
    else:
        x = _euler(den, shape, y, steps, den.sigma_min, den.sigma_max, **common)
    return x.clamp(-1, 1) if readout.clip_denoised else x


def sampling_readout(cfg: TrainConfig) -> Readout:
    """How ``sample`` reads the network of ``cfg``: its prediction and learned variance (``cfg.diffusion``), x0
    clipped to [-1, 1] when the data lies there (``pixel_range``), the fixed variance the large one."""
    d = cfg.diffusion
    return Readout(d.prediction, learn_sigma=d.learn_sigma, clip_denoised=pixel_range(cfg))


def has_null_label(model: nn.Module) -> bool:
    """Whether every label embedding of ``model`` has the null label that classifier-free guidance needs (a DiT
    trained with label dropout; Ho & Salimans 2022)."""
    if not isinstance(model, nn.Module):  # a plain callable (e.g. a routing wrapper): nothing to inspect
        return True
    tables = [m for m in model.modules() if isinstance(m, LabelEmbedder)]
    return all(t.embedding_table.num_embeddings > t.num_classes for t in tables)


def respaced(schedule: DDPMSchedule, sampler: str, steps: int) -> tuple[DDPMSchedule, torch.Tensor]:
    """The DDPM schedule ``sample`` runs ``sampler`` (ddpm | ddim) on with ``steps`` steps, and its ``timestep_map``
    (the original timesteps the sampler visits)."""
    spec = str(steps) if sampler == "ddpm" else f"ddim{steps}"
    if sampler == "ddim" and schedule.num_timesteps % steps:
        spec = str(steps)  # "ddimN" needs N to divide T; fall back to IDDPM's even spacing
    return respace(schedule, spec)


def pixel_range(cfg: TrainConfig) -> bool:
    """Whether the data lies in [-1, 1] (digits; images at scale 1), so samples may be clipped to it."""
    return cfg.data.dataset in ("digits", "mnist5k") or (cfg.data.dataset == "images" and cfg.data.scale == 1.0)


def grid_sampler(cfg: TrainConfig) -> tuple[str, int]:
    """Sampler and number of steps of the end-of-run grid (``cfg.logging``; at most T steps)."""
    return cfg.logging.sampler, min(cfg.logging.sample_steps, cfg.diffusion.num_timesteps)


def grid_unavailable(cfg: TrainConfig) -> str | None:
    """Why ``cfg`` gets no end-of-run grid, or None when it gets one."""
    lg, m = cfg.logging, cfg.model
    if lg.num_samples == 0:
        return "logging.num_samples is 0"
    if m.in_channels not in (1, 3):
        return (
            f"the model makes {m.in_channels}-channel latents, not images; decode samples with "
            "`diffcurr-fast sample --vae DIR`, or set logging.num_samples=0"
        )
    return None


class SamplingInterrupted(Exception):
    """A signal asked a draw to stop (``sample_grid``'s ``should_stop``); ``signum`` is the signal."""

    def __init__(self, signum: int):
        self.signum = int(signum)
        super().__init__(f"signal {self.signum} received while sampling")


class _Interruptible(nn.Module):
    """``model``, raising ``SamplingInterrupted`` before a call when ``should_stop()`` returns a signal number."""

    def __init__(self, model: nn.Module, should_stop: Callable[[], int | None]):
        super().__init__()
        self.model, self.should_stop = model, should_stop

    def forward(self, *args: Any) -> torch.Tensor:
        signum = self.should_stop()
        if signum is not None:
            raise SamplingInterrupted(signum)
        return self.model(*args)


def sample_grid(
    model: nn.Module,
    schedule: Any,
    cfg: TrainConfig,
    path: str | Path,
    device: Any,
    should_stop: Callable[[], int | None] | None = None,
) -> Path | None:
    """The end-of-run grid of ``cfg.logging`` (sampler, steps, guidance; ``num_samples`` images, labels cycling
    through the classes) drawn from ``model`` and saved at ``path``, with a progress bar (``logging.progress``);
    None when there is no grid (``grid_unavailable`` says why). ``should_stop``: asked before every network call; a
    signal number it returns stops the draw with ``SamplingInterrupted`` (nothing written)."""
    lg, m = cfg.logging, cfg.model
    if grid_unavailable(cfg) is not None:
        return None
    sampler, steps = grid_sampler(cfg)
    net = model if should_stop is None else _Interruptible(model, should_stop)
    x = sample(
        net,
        schedule,
        sampler=sampler,
        steps=steps,
        labels=torch.arange(lg.num_samples) % m.num_classes,
        channels=m.in_channels,
        size=m.input_size,
        num_classes=m.num_classes,
        readout=sampling_readout(cfg),
        cfg_scale=lg.cfg_scale,
        seed=cfg.engine.seed,
        device=device,
        progress=lg.progress,
    )
    nrow = m.num_classes if m.num_classes <= 16 else None
    return save_grid(x / cfg.data.scale, path, nrow=nrow, upscale=max(1, 32 // m.input_size))


def _euler(den, shape, y, steps, sigma_min, sigma_max, *, num_classes, cfg_scale, seed, device, progress):
    # Euler on dx/dsigma = (x - D(x; sigma)) / sigma (EDM Eq. 3 with sigma(t) = t), Karras grid (EDM Eq. 5).
    gen = make_generator(seed, None, device)
    sigmas = karras_sigmas(steps, sigma_min, sigma_max).tolist()
    x = torch.randn(shape, generator=gen, device=device) * sigmas[0]
    for s, s_next in tqdm(list(zip(sigmas[:-1], sigmas[1:])), disable=not progress, desc="euler"):
        vec = torch.full((shape[0],), s, device=device)
        d = (x - guided_model_output(den, x, vec, y, cfg_scale, num_classes, shape[1])) / s
        x = x + (s_next - s) * d
    return x


def grid_image(x: torch.Tensor, nrow: int | None = None, pad: int = 1) -> torch.Tensor:
    """Tile (N, C, H, W) images in [-1, 1] (C in 1 or 3) into one (H', W', C) float image in [0, 1]."""
    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"a grid needs images (N, 1 or 3, H, W), got shape {tuple(x.shape)}")
    n, c, h, w = x.shape
    nrow = nrow or max(1, int(math.ceil(math.sqrt(n))))
    rows = int(math.ceil(n / nrow))
    img = torch.ones(c, rows * (h + pad) + pad, nrow * (w + pad) + pad)
    x = ((x.float().cpu().clamp(-1, 1) + 1) / 2).contiguous()
    for i in range(n):
        r, k = divmod(i, nrow)
        img[:, pad + r * (h + pad) : pad + r * (h + pad) + h, pad + k * (w + pad) : pad + k * (w + pad) + w] = x[i]
    return img.permute(1, 2, 0)  # (H', W', C)


def save_grid(x: torch.Tensor, path: str | Path, nrow: int | None = None, upscale: int = 1) -> Path:
    """Write ``grid_image(x)`` as a PNG, each pixel repeated ``upscale`` times (small images stay visible)."""
    plt = pyplot()
    img = grid_image(x, nrow)
    if upscale > 1:
        img = img.repeat_interleave(upscale, 0).repeat_interleave(upscale, 1)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    arr = img.numpy()
    if arr.shape[2] == 1:
        plt.imsave(path, arr[:, :, 0], cmap="gray", vmin=0.0, vmax=1.0)
    else:
        plt.imsave(path, arr)
    return path


# Seed of batch b of a batched draw: batch 0 uses the seed itself, so one batch equals ``sample(seed=seed)``; the
# stride keeps the batches of nearby seeds apart. The result depends on (seed, batch size), not on the world size.
BATCH_SEED_STRIDE = 1_000_003


def batch_slices(num: int, batch_size: int, rank: int = 0, world: int = 1) -> list[tuple[int, slice]]:
    """(batch index, sample slice) of the batches of ``num`` samples that rank ``rank`` of ``world`` draws
    (batches dealt round-robin, as ADM's ``sample_ddp`` shards its draws)."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"--batch-size must be a positive int, got {batch_size!r}")
    n_batches = -(-num // batch_size)
    return [(b, slice(b * batch_size, min((b + 1) * batch_size, num))) for b in range(rank, n_batches, world)]


def sample_batch(
    model: nn.Module, schedule: Any, *, labels: torch.Tensor, batch: int, seed: int, **kw: Any
) -> torch.Tensor:
    """``sample`` of one batch of a batched draw (seed ``seed + batch * BATCH_SEED_STRIDE``); ValueError when the
    model produced NaN or inf."""
    x = sample(model, schedule, labels=labels, seed=seed + batch * BATCH_SEED_STRIDE, **kw)
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"sampling produced NaN or inf values (batch {batch}); the model is not usable")
    return x


def to_uint8_nhwc(x: torch.Tensor) -> torch.Tensor:
    """Images (N, C, H, W) in [-1, 1] as ADM writes them: ((x + 1) * 127.5).clamp(0, 255) to uint8, (N, H, W, C)."""
    return ((x.float() + 1) * 127.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).contiguous()
