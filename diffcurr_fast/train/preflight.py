"""Everything about a training run that can be checked before its directory is touched (``train --dry-run`` runs
exactly this): the config, the guidance it will sample with, the device, launcher, optimizer and backends asked
for, the input files, the evaluation's reference, the DeepSpeed JSON, optional packages that were asked for, the
batch split, the threads and memory it needs (``runs.resources``), the run directory (``rundir.check_run_dir``),
and the data, initial weights and the components' own input files, opened and read as the start reads them
(``train.data``, ``Options.check_inputs``).

``check_run(cfg, resume=..., overwrite=...)`` raises ValueError / FileNotFoundError / FileExistsError /
ImportError with one line naming the key and what to do, and returns the ``RunStart``.
"""

from __future__ import annotations

import importlib.util
import os
import warnings
from pathlib import Path

import torch

from diffcurr_fast.models.attention import flash_attn_reason
from diffcurr_fast.models.diffusers_dit import is_diffusers_dir
from diffcurr_fast.ops._backend import CHOICES, unavailable_reason
from diffcurr_fast.optim.registry import check_optimizer
from diffcurr_fast.runs.config import TrainConfig
from diffcurr_fast.runs.resources import check_fits, training_memory
from diffcurr_fast.runs.sampling import build_model
from diffcurr_fast.runs.threads import check_threads
from diffcurr_fast.train.data import check_data, fitting_init_state
from diffcurr_fast.train.engine import check_launcher, load_deepspeed_config
from diffcurr_fast.train.evaluation import check_reference
from diffcurr_fast.train.rundir import TRAIN_LAYOUT, RunLayout, RunStart, check_run_dir

__all__ = [
    "check_backends",
    "check_component_inputs",
    "check_guidance",
    "check_init_from",
    "check_inputs",
    "check_resources",
    "check_run",
]


def _device_type(cfg: TrainConfig):
    if cfg.engine.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("engine.device is 'cuda' but no CUDA device is available; use 'cpu' or 'auto'")
    return "cuda" if cfg.engine.device != "cpu" and torch.cuda.is_available() else "cpu"


def env_ops(cfg: TrainConfig) -> list[str]:
    """The fused ops a run calls without a backend argument (the model's fused blocks, ``model.fused_adaln``: the
    gated residual and what each model option calls, ``Options.fused_ops``): DIFFCURR_OPS_BACKEND picks theirs. The
    diffusion ops take ``diffusion.ops_backend``."""
    if not cfg.model.fused_adaln:
        return []
    return [*(op for _, opts in cfg.used() for op in opts.fused_ops(cfg)), "gated_residual_fwd"]


# Measured on the demo model (train, 2-core CPU without bf16 instructions): 1.83 it/s with bf16 autocast against
# 22.3 it/s in fp32.
BF16_ON_CPU = (
    "engine.precision 'bf16' on a CPU: bf16 autocast is emulated there, about 12x slower than fp32 (the demo model: "
    "1.83 against 22.3 it/s on 2 cores); set engine.precision=auto (fp32 on CPU, bf16 on a GPU that has it) or fp32"
)


def check_backends(cfg: TrainConfig) -> None:
    """The engine, attention and fused-op backends asked for by name can run here; an explicit bf16 on a CPU warns
    (``BF16_ON_CPU``)."""
    dev = torch.device(_device_type(cfg))
    e, m, d = cfg.engine, cfg.model, cfg.diffusion
    if e.kind == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        raise ImportError("engine.kind 'deepspeed' needs the deepspeed package: pip install deepspeed")
    check_launcher(e.kind)
    check_optimizer(cfg, dev)
    if m.attn_backend == "flash_attn":
        reason = flash_attn_reason()
        if reason is not None:
            raise ValueError(f"model.attn_backend 'flash_attn' cannot run here: {reason}; use auto, sdpa or math")
    if d.ops_backend not in ("auto", "reference"):
        for op in ("q_sample", "diffusion_loss_fwd", "sample_timesteps"):  # the names the fused ops resolve
            reason = unavailable_reason(d.ops_backend, op, dev)
            if reason is not None:
                raise ValueError(
                    f"diffusion.ops_backend {d.ops_backend!r} cannot run on {dev.type}: {reason}; use auto or reference"
                )
    env = os.environ.get("DIFFCURR_OPS_BACKEND", "")  # ops.ENV_VAR: the backend of the ops called without one
    if env and env != "auto":
        if env not in CHOICES:
            raise ValueError(
                f"DIFFCURR_OPS_BACKEND={env!r} is not an ops backend; use one of {', '.join(CHOICES)}, or unset it"
            )
        for op in env_ops(cfg):
            reason = unavailable_reason(env, op, dev)
            if reason is not None:
                raise ValueError(
                    f"DIFFCURR_OPS_BACKEND={env!r} cannot run {op} on {dev.type}: {reason}; unset it or set it to auto"
                )
    if e.precision == "bf16" and dev.type == "cpu" and int(os.environ.get("RANK", "0")) == 0:
        warnings.warn(BF16_ON_CPU, UserWarning, stacklevel=1)  # one location: shown once per process
    if cfg.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ImportError(
            "logging.tensorboard is true but tensorboard is not installed: pip install tensorboard, "
            "or set logging.tensorboard=false"
        )
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ImportError(
            "logging.wandb is true but wandb is not installed: pip install 'diffcurr-fast[wandb]', or set "
            "logging.wandb=false"
        )


def check_inputs(cfg: TrainConfig) -> None:
    """The data, initial weights, DeepSpeed JSON and REPA encoder named by ``cfg`` exist and are readable (the
    encoder's format from its first bytes: ``check_component_inputs`` reads it whole)."""
    d = cfg.data
    p = Path(d.path) if d.path else None
    if d.dataset == "npz" and p is not None:
        if p.is_dir():
            missing = [n for n in ("x.npy", "y.npy") if not (p / n).is_file()]
            if missing:
                raise FileNotFoundError(f"data.path {d.path!r} is a directory without {' and '.join(missing)}")
        elif not p.is_file():
            raise FileNotFoundError(f"data.path {d.path!r} does not exist (a .npz file or a directory of x.npy, y.npy)")
    elif d.dataset in ("latents", "images") and p is not None and not p.is_dir():
        raise FileNotFoundError(f"data.path {d.path!r} is not a directory (data.dataset {d.dataset!r})")
    if d.dataset == "images" and p is not None:
        classes = [c for c in p.iterdir() if c.is_dir()]
        if not classes:
            raise ValueError(f"data.path {d.path!r} has no class subdirectories (expected {d.path}/<class>/<image>)")
        if not any(f.is_file() for c in classes for f in c.iterdir()):
            raise ValueError(f"data.path {d.path!r} holds no image files (its class folders are empty)")
    init = cfg.model.init_from
    if init and Path(init).is_dir() and not is_diffusers_dir(init):
        raise ValueError(
            f"model.init_from {init!r} is a folder but not a diffusers DiT directory (no config.json or "
            "transformer/config.json); give a weights file or a diffusers export"
        )
    if init and not Path(init).exists():
        raise FileNotFoundError(
            f"model.init_from {init!r} does not exist (a weights file or a diffusers DiT directory)"
        )
    for _, opts in cfg.used():  # the components' own files (REPA's encoder: exists, not a pickle)
        opts.check_inputs(cfg, read=False)
    if cfg.engine.kind == "deepspeed":
        ds = load_deepspeed_config(cfg.engine.deepspeed_config)
        if not isinstance(ds, dict):
            raise ValueError(f"DeepSpeed config {cfg.engine.deepspeed_config!r} must be a JSON object")


def check_guidance(cfg: TrainConfig) -> None:
    """The guidance the run will sample with has the null label it needs: ``logging.cfg_scale`` of the end-of-run
    grid (drawn for image models with ``logging.num_samples`` > 0) and ``eval.cfg_scale`` of the evaluations
    (``logging.eval_every`` > 0) must be 1 when ``model.class_dropout_prob`` is 0 (classifier-free guidance, Ho &
    Salimans 2022). Not a check of the config itself: a checkpoint's config that broke it still loads to sample."""
    lg, m = cfg.logging, cfg.model
    if m.class_dropout_prob != 0:
        return
    guided = [
        f"{key} {scale:g}"
        for key, scale, drawn in (
            ("logging.cfg_scale", lg.cfg_scale, lg.num_samples > 0 and m.in_channels in (1, 3)),  # latents: no grid
            ("eval.cfg_scale", cfg.eval.cfg_scale, lg.eval_every > 0),
        )
        if drawn and scale != 1
    ]
    if guided:
        keys = " and ".join(g.split()[0] + "=1" for g in guided)
        raise ValueError(
            f"{' and '.join(guided)}: classifier-free guidance needs the null label, which model.class_dropout_prob=0 "
            f"does not train; set {keys}, or model.class_dropout_prob > 0 (e.g. 0.1)"
        )


def check_init_from(cfg: TrainConfig) -> None:
    """``model.init_from`` is read and fits the model of ``cfg``: built on the meta device (shapes, no memory), so
    a junk, truncated or foreign weights file, or a diffusers folder with a broken config or no weights, is named
    before the run starts."""
    if not cfg.model.init_from:
        return
    with torch.device("meta"):
        model = build_model(cfg)
    fitting_init_state(model.state_dict(), cfg.model.init_from)


def check_component_inputs(cfg: TrainConfig) -> None:
    """The input files of the components the run uses are read as the start reads them (REPA's encoder: it loads,
    and its patch tokens match the model's grid), in one line naming the file or the key to set."""
    for _, opts in cfg.used():
        opts.check_inputs(cfg, read=True)


def check_resources(cfg: TrainConfig, world: int) -> None:
    """``engine.cpu_threads`` within what this machine runs, and the run's memory (a lower bound: the model's
    parameters, optimizer state and activations per rank) within the memory of the device it will run on."""
    check_threads(cfg.engine.cpu_threads, "engine.cpu_threads")
    device = torch.device(_device_type(cfg))
    fix = "use a smaller model (model.hidden_size, model.depth), data.batch_size or more optim.grad_accum_steps"
    check_fits(training_memory(cfg, world, device), device, fix)


def check_run(
    cfg: TrainConfig,
    *,
    resume: bool = False,
    overwrite: bool = False,
    layout: RunLayout = TRAIN_LAYOUT,
    world_size: int | None = None,
    read_inputs: bool = True,
) -> RunStart:
    """Validate the whole run before anything is written (module doc); returns how it starts. ``read_inputs``:
    also open the data and read ``model.init_from`` and REPA's encoder as the start will (the trainer, which reads
    them itself right after, passes False rather than read them twice)."""
    cfg.validate()
    check_guidance(cfg)
    check_backends(cfg)
    check_inputs(cfg)
    check_reference(cfg)
    world = world_size if world_size is not None else int(os.environ.get("WORLD_SIZE", "1"))
    acc = cfg.optim.grad_accum_steps
    if cfg.data.batch_size % (world * acc):
        raise ValueError(
            f"data.batch_size {cfg.data.batch_size} is not divisible by the world size {world} x "
            f"optim.grad_accum_steps {acc}"
        )
    micro = cfg.data.batch_size // (world * acc)
    for comp, opts in cfg.used():  # a component that compares the samples of a batch
        need = opts.min_micro_batch(cfg)
        if micro < need:
            raise ValueError(
                f"{comp.label} needs at least {need} samples per micro-batch, got {micro} (data.batch_size "
                f"{cfg.data.batch_size} over {world} rank(s) x optim.grad_accum_steps {acc})"
            )
    start = check_run_dir(
        cfg.checkpoint.run_dir, layout, resume=resume, overwrite=overwrite, max_steps=cfg.engine.max_steps
    )
    if read_inputs:
        check_data(cfg, world)
        if start.checkpoint is None:  # a resumed run takes its checkpoint's weights
            check_init_from(cfg)
        check_component_inputs(cfg)
    check_resources(cfg, world)  # last: a recipe sized for a GPU cluster, dry-run elsewhere, has passed the rest
    return start
