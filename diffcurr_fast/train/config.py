"""Typed, strict training configuration: dataclass sections, YAML recipes and ``--set a.b=value`` overrides.

A configuration is a ``TrainConfig`` of eight sections (model, diffusion, curriculum, data, optim, engine,
logging, checkpoint). Every field carries a one-line doc (``metadata["doc"]``) and, where it is a choice, its
valid values (``metadata["choices"]``). Unknown keys, wrong types and invalid values raise ``ValueError`` naming
the key and what is valid. ``load_config(path, overrides)`` builds one from a recipe; ``config_to_yaml`` writes
the resolved configuration (the run directory keeps it as ``config.yaml``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


def _f(default: Any, doc: str, choices: tuple | None = None, **kw: Any) -> Any:
    meta = {"doc": doc}
    if choices is not None:
        meta["choices"] = choices
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


MODEL_PRESETS = ("custom", "DiT-XL/2", "DiT-XL/4", "DiT-XL/8", "DiT-L/2", "DiT-L/4", "DiT-L/8", "DiT-B/2",
                 "DiT-B/4", "DiT-B/8", "DiT-S/2", "DiT-S/4", "DiT-S/8")  # fmt: skip
FORMULATIONS = ("ddpm", "flow", "edm")
PREDICTIONS = ("eps", "x0", "v", "velocity")
WEIGHTINGS = ("none", "min_snr", "p2")
BETA_SCHEDULES = ("linear", "cosine")
PACINGS = ("patience", "fixed", "none", "adaptive")
ORDERS = ("easy_to_hard", "hard_to_easy")
CLUSTER_METHODS = ("uniform", "snr", "log_snr")
DATASETS = ("digits", "npz", "latents", "images")
DATA_BACKENDS = ("auto", "dali", "torch")
ON_BAD = ("skip", "stop")
ENGINES = ("auto", "single", "ddp", "deepspeed")
DEVICES = ("auto", "cpu", "cuda")
PRECISIONS = ("fp32", "bf16")
NAN_POLICIES = ("skip", "stop")
LR_SCHEDULES = ("constant", "cosine")
SAMPLERS = ("ddpm", "ddim", "heun", "euler")
OPS_BACKENDS = ("auto", "cuda", "triton", "cpu", "reference")
ATTN_BACKENDS = ("auto", "flash_attn", "sdpa", "math")


@dataclass
class ModelConfig:
    """The network (a DiT)."""

    preset: str = _f("custom", "DiT preset name, or 'custom' to use the dimensions below", MODEL_PRESETS)
    input_size: int = _f(8, "spatial size of the (latent) images the model sees")
    in_channels: int = _f(1, "channels of the (latent) images")
    num_classes: int = _f(10, "number of class labels (the null label for guidance is num_classes)")
    patch_size: int = _f(2, "patch size (custom only)")
    hidden_size: int = _f(128, "transformer width (custom only)")
    depth: int = _f(6, "number of DiT blocks (custom only)")
    num_heads: int = _f(4, "attention heads (custom only)")
    mlp_ratio: float = _f(4.0, "MLP width / hidden_size (custom only)")
    class_dropout_prob: float = _f(0.1, "label dropout probability (enables classifier-free guidance)")
    attn_backend: str = _f("auto", "attention backend", ATTN_BACKENDS)
    fused_adaln: bool = _f(False, "use the fused adaLN modulate / gated residual ops in the blocks")
    dtr: bool = _f(False, "Denoising Task Routing (timestep-dependent channel masks)")
    init_from: str = _f(
        "",
        "fine-tune: initial weights (.pt state dict such as DiT-XL-2-256x256.pt, one of our "
        "checkpoints, or a .safetensors export); ignored when resuming",
    )

    def validate(self) -> None:
        for name in ("input_size", "in_channels", "num_classes", "patch_size", "hidden_size", "depth", "num_heads"):
            _positive(self, name)
        _in_range(self, "class_dropout_prob", 0.0, 1.0, hi_open=True)
        _in_range(self, "mlp_ratio", 0.0, math.inf)


@dataclass
class DiffusionConfig:
    """The diffusion formulation and its training objective."""

    formulation: str = _f(
        "ddpm", "ddpm (discrete t), flow (linear interpolant, SiT) or edm (Karras et al.)", FORMULATIONS
    )
    num_timesteps: int = _f(1000, "T: DDPM timesteps, or the number of flow-t / EDM-sigma cells for the curriculum")
    beta_schedule: str = _f("linear", "beta schedule", BETA_SCHEDULES)
    prediction: str = _f("eps", "network target: eps, x0 or v (ddpm); velocity (flow); x0 (edm denoiser)", PREDICTIONS)
    learn_sigma: bool = _f(True, "learn the variance with the IDDPM hybrid loss (network outputs 2C channels)")
    weighting: str = _f("none", "per-timestep loss weighting of the MSE term", WEIGHTINGS)
    min_snr_gamma: float = _f(5.0, "gamma of the MinSNR weighting")
    fused_ops: bool = _f(True, "use the fused q_sample / diffusion_loss / sample_timesteps ops")
    ops_backend: str = _f("auto", "backend of the fused ops", OPS_BACKENDS)
    sigma_data: float = _f(0.5, "EDM: standard deviation of the data")
    P_mean: float = _f(-1.2, "EDM: mean of ln(sigma) during training")
    P_std: float = _f(1.2, "EDM: standard deviation of ln(sigma) during training")
    sigma_min: float = _f(0.002, "EDM: smallest sigma (training range and sampling grid)")
    sigma_max: float = _f(80.0, "EDM: largest sigma (training range and sampling grid)")

    def validate(self) -> None:
        _positive(self, "num_timesteps")
        _in_range(self, "sigma_data", 0.0, math.inf, lo_open=True)
        _in_range(self, "P_std", 0.0, math.inf, lo_open=True)
        _in_range(self, "sigma_min", 0.0, math.inf, lo_open=True)
        _in_range(self, "sigma_max", self.sigma_min, math.inf, lo_open=True)
        _in_range(self, "P_mean", -math.inf, math.inf)
        _in_range(self, "min_snr_gamma", 0.0, math.inf, lo_open=True)


@dataclass
class CurriculumConfig:
    """Difficulty curriculum over timestep clusters (Kim et al., ICLR 2025)."""

    pacing: str = _f("patience", "patience (the paper), fixed (NaiveCL), none (vanilla) or adaptive", PACINGS)
    num_clusters: int = _f(20, "N, the number of timestep clusters")
    method: str = _f("snr", "clustering rule", CLUSTER_METHODS)
    order: str = _f("easy_to_hard", "unlock order (hard_to_easy = anti-curriculum)", ORDERS)
    patience: int = _f(20, "evaluations without improvement before the next unlock")
    ema: float = _f(0.9, "decay of the monitored-loss EMA per evaluation, in [0, 1)")
    min_delta: float = _f(1e-3, "relative decrease of the monitored loss that counts as an improvement")
    stage_iters: int = _f(0, "steps per stage for fixed pacing (0 = unset)")
    eval_every: int = _f(10, "steps per evaluation window")
    adaptive_floor: float = _f(0.5, "share of uniform sampling kept by adaptive pacing, in [0, 1]")

    def validate(self) -> None:
        _positive(self, "num_clusters")
        _positive(self, "eval_every")
        _in_range(self, "patience", 0, math.inf)
        _in_range(self, "ema", 0.0, 1.0, hi_open=True)
        _in_range(self, "min_delta", 0.0, math.inf)
        _in_range(self, "stage_iters", 0, math.inf)
        _in_range(self, "adaptive_floor", 0.0, 1.0)
        if self.pacing == "fixed" and self.stage_iters < 1:
            raise ValueError("curriculum.stage_iters must be >= 1 when curriculum.pacing is 'fixed'")


@dataclass
class DataConfig:
    """Training data."""

    dataset: str = _f(
        "digits",
        "digits (built in, 8x8), npz (arrays x (N, C, H, W) and y (N,)), latents (a fast-DiT or sharded latent "
        "directory) or images (an ImageNet-layout folder)",
        DATASETS,
    )
    path: str = _f("", "npz: a .npz file or a directory of x.npy and y.npy; latents / images: the directory")
    scale: float = _f(1.0, "the model trains on scale * data (0.18215 for Stable Diffusion VAE latents; see docs)")
    batch_size: int = _f(128, "global batch size (split evenly across ranks)")
    num_workers: int = _f(0, "DataLoader worker processes (0 = load in the training process); DALI CPU threads")
    image_size: int = _f(0, "images: ADM centre-crop size (0 = model.input_size)")
    hflip: bool = _f(True, "images: random horizontal flips (decided per sample and epoch)")
    backend: str = _f("auto", "latents / images loader: auto (DALI when importable), dali or torch", DATA_BACKENDS)
    on_bad: str = _f("stop", "latents / images: a corrupt or unreadable file stops the run or is skipped", ON_BAD)

    def validate(self) -> None:
        _positive(self, "batch_size")
        _in_range(self, "num_workers", 0, math.inf)
        _in_range(self, "image_size", 0, math.inf)
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"data.scale must be a positive finite float, got {self.scale!r}")
        if self.dataset in ("npz", "latents", "images") and not self.path:
            what = {"npz": "a .npz file or a directory", "latents": "a latent directory", "images": "an image folder"}
            raise ValueError(f"data.path is required when data.dataset is {self.dataset!r} ({what[self.dataset]})")


@dataclass
class OptimConfig:
    """AdamW, learning-rate schedule, clipping and EMA."""

    lr: float = _f(1e-4, "peak learning rate")
    weight_decay: float = _f(0.0, "AdamW weight decay")
    beta1: float = _f(0.9, "AdamW beta1")
    beta2: float = _f(0.999, "AdamW beta2")
    eps: float = _f(1e-8, "AdamW epsilon")
    impl: str = _f("auto", "AdamW kernels: auto / torch (torch's, fused on CUDA) or apex (NVIDIA apex FusedAdam)",
                   ("auto", "torch", "apex"))  # fmt: skip
    warmup_steps: int = _f(0, "linear warmup steps from 0 to lr")
    schedule: str = _f("constant", "learning-rate schedule after warmup", LR_SCHEDULES)
    min_lr: float = _f(0.0, "final learning rate of the cosine schedule")
    grad_clip: float = _f(0.0, "clip the global gradient norm to this (0 = off)")
    grad_accum_steps: int = _f(1, "micro-batches per optimizer step (data.batch_size is split into them)")
    ema_decay: float = _f(0.9999, "EMA decay of the weights (DiT: 0.9999)")
    ema_warmup: bool = _f(True, "use decay min(ema_decay, (1 + n) / (10 + n)) at update n")

    def validate(self) -> None:
        _in_range(self, "lr", 0.0, math.inf, lo_open=True)
        _in_range(self, "weight_decay", 0.0, math.inf)
        _in_range(self, "beta1", 0.0, 1.0, hi_open=True)
        _in_range(self, "beta2", 0.0, 1.0, hi_open=True)
        _in_range(self, "eps", 0.0, math.inf, lo_open=True)
        _in_range(self, "warmup_steps", 0, math.inf)
        _in_range(self, "min_lr", 0.0, self.lr)
        _in_range(self, "grad_clip", 0.0, math.inf)
        _positive(self, "grad_accum_steps")
        _in_range(self, "ema_decay", 0.0, 1.0)


@dataclass
class EngineConfig:
    """Where and how the step runs."""

    kind: str = _f("auto", "auto (ddp under torchrun, else single), single, ddp or deepspeed (ZeRO)", ENGINES)
    deepspeed_config: str = _f("", "deepspeed: DeepSpeed JSON (ZeRO stage, offload); batch, clip, bf16 filled in")
    device: str = _f("auto", "auto (cuda when available), cpu or cuda", DEVICES)
    max_steps: int = _f(1000, "total optimizer steps (attempted steps, skipped ones included)")
    seed: int = _f(0, "global seed (each rank adds its rank)")
    precision: str = _f("fp32", "fp32, or bf16 autocast", PRECISIONS)
    tf32: bool = _f(True, "allow TF32 matmuls on GPU")
    compile: bool = _f(False, "torch.compile the model")
    grad_checkpointing: bool = _f(False, "recompute each DiT block in the backward pass")
    nan_policy: str = _f("skip", "on a non-finite loss: skip the step and count it, or stop", NAN_POLICIES)
    max_nan_skips: int = _f(100, "stop after this many skipped steps (skip policy)")
    cpu_threads: int = _f(0, "torch intra-op threads on CPU (0 = torch's default)")

    def validate(self) -> None:
        _positive(self, "max_steps")
        _in_range(self, "seed", 0, 2**63 - 1)
        _positive(self, "max_nan_skips")
        _in_range(self, "cpu_threads", 0, 4096)
        if self.kind == "deepspeed" and not self.deepspeed_config:
            raise ValueError("engine.deepspeed_config is required when engine.kind is 'deepspeed' (a DeepSpeed JSON)")


@dataclass
class LoggingConfig:
    """Progress, metrics and the end-of-run report."""

    log_every: int = _f(10, "steps between metrics.jsonl records")
    progress: bool = _f(True, "show a tqdm progress bar")
    tensorboard: bool = _f(False, "also write TensorBoard scalars (when tensorboard is importable)")
    num_samples: int = _f(64, "images in the end-of-run sample grid (0 = no grid)")
    sampler: str = _f("ddim", "sampler of the end-of-run grid", SAMPLERS)
    sample_steps: int = _f(50, "sampling steps of the end-of-run grid")
    cfg_scale: float = _f(1.0, "classifier-free guidance scale of the end-of-run grid")
    plots: bool = _f(True, "write the per-cluster loss and curriculum timeline plots at the end")

    def validate(self) -> None:
        _positive(self, "log_every")
        _in_range(self, "num_samples", 0, math.inf)
        _positive(self, "sample_steps")
        _in_range(self, "cfg_scale", 0.0, math.inf)


@dataclass
class CheckpointConfig:
    """Run directory and checkpoints."""

    run_dir: str = _f("runs/demo", "output directory of the run")
    every: int = _f(1000, "steps between checkpoints (a final one is always written)")
    keep_last: int = _f(3, "checkpoints kept (older ones are deleted)")
    export_ema: bool = _f(True, "write the EMA weights as ema.safetensors at the end")

    def validate(self) -> None:
        if not self.run_dir:
            raise ValueError("checkpoint.run_dir must be a non-empty path")
        _positive(self, "every")
        _positive(self, "keep_last")


@dataclass
class TrainConfig:
    """The whole training configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def validate(self) -> TrainConfig:
        """Check every field (types, choices, ranges) and the cross-section rules; returns self."""
        for sec in dataclasses.fields(self):
            section = getattr(self, sec.name)
            for f in dataclasses.fields(section):
                _check_field(f"{sec.name}.{f.name}", f, getattr(section, f.name), _hints(type(section))[f.name])
            section.validate()
        d = self.diffusion
        if d.formulation == "ddpm" and d.prediction not in ("eps", "x0", "v"):
            raise ValueError(f"diffusion.prediction {d.prediction!r} is not a ddpm target; valid choices: eps, x0, v")
        if d.formulation in ("flow", "edm"):
            bad = {
                "diffusion.prediction": (d.prediction, "velocity" if d.formulation == "flow" else "x0"),
                "diffusion.learn_sigma": (d.learn_sigma, False),
                "diffusion.weighting": (d.weighting, "none"),
                "model.dtr": (self.model.dtr, False),
            }
            for key, (value, need) in bad.items():
                if value != need:
                    raise ValueError(
                        f"{key}={value!r} is not supported with diffusion.formulation {d.formulation!r}; use {need!r}"
                    )
            if self.logging.sampler not in ("euler", "heun"):
                raise ValueError(
                    f"logging.sampler {self.logging.sampler!r} cannot sample a {d.formulation} model; valid choices: "
                    "euler, heun"
                )
        if self.curriculum.num_clusters > self.diffusion.num_timesteps:
            raise ValueError(
                f"curriculum.num_clusters ({self.curriculum.num_clusters}) must be <= diffusion.num_timesteps "
                f"({self.diffusion.num_timesteps})"
            )
        m = self.model
        if self.data.dataset == "images":
            size = self.data.image_size or m.input_size
            if (m.in_channels, m.input_size) != (3, size):
                raise ValueError(
                    f"data.dataset 'images' gives 3x{size}x{size} images but the model takes "
                    f"{m.in_channels}x{m.input_size}x{m.input_size}; set model.in_channels=3, model.input_size={size}"
                )
        if m.preset == "custom":
            if m.input_size % m.patch_size:
                raise ValueError(f"model.input_size {m.input_size} is not divisible by model.patch_size {m.patch_size}")
            if m.hidden_size % m.num_heads or m.hidden_size % 4:
                raise ValueError(
                    f"model.hidden_size {m.hidden_size} must be a multiple of 4 and of model.num_heads {m.num_heads}"
                )
        return self

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON-serialisable)."""
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # type: ignore


# ---- checks -------------------------------------------------------------------------------------------
def _positive(section: Any, name: str) -> None:
    value = getattr(section, name)
    if value < 1:
        raise ValueError(f"{_section_name(section)}.{name} must be >= 1, got {value!r}")


def _in_range(section, name, lo, hi, lo_open: bool = False, hi_open: bool = False) -> None:
    value = getattr(section, name)
    ok = (value > lo if lo_open else value >= lo) and (value < hi if hi_open else value <= hi)
    if not ok or (isinstance(value, float) and math.isnan(value)):
        lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
        raise ValueError(f"{_section_name(section)}.{name} must lie in {lb}{lo}, {hi}{rb}, got {value!r}")


def _section_name(section: Any) -> str:
    for name, cls in SECTIONS.items():
        if isinstance(section, cls):
            return name
    return type(section).__name__


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Return ``value`` as type ``tp`` (int -> float widening only); ValueError naming ``key`` otherwise."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "nan"):
        return float(value)
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
            if arg is not type(None):
                try:
                    return _coerce(key, value, arg)
                except ValueError:
                    pass
        raise ValueError(f"{key} must be {tp}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp) and not isinstance(value, bool):
        return value
    raise ValueError(f"{key} must be of type {_type_name(tp)}, got {value!r} ({type(value).__name__})")


def _check_field(key: str, f: dataclasses.Field, value: Any, tp: Any) -> None:
    _coerce(key, value, tp)
    choices = f.metadata.get("choices")
    if choices is not None and value not in choices:
        raise ValueError(f"invalid value {value!r} for {key}; valid choices: {', '.join(map(str, choices))}")


# ---- building ------------------------------------------------------------------------------------------
def config_from_dict(data: dict[str, Any] | None, base: TrainConfig | None = None) -> TrainConfig:
    """Build (and validate) a config from a nested dict over ``base`` (defaults); unknown keys are errors."""
    cfg = base if base is not None else TrainConfig()
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"a config must be a mapping of sections, got {type(data).__name__}")
    for sec_name, values in data.items():
        if sec_name not in SECTIONS:
            raise ValueError(f"unknown config section {sec_name!r}; valid sections: {', '.join(SECTIONS)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"config section {sec_name!r} must be a mapping, got {values!r}")
        for key, value in values.items():
            _set_field(cfg, f"{sec_name}.{key}", value)
    return cfg.validate()


def _set_field(cfg: TrainConfig, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"config keys look like section.field, got {dotted!r}; sections: {', '.join(SECTIONS)}")
    sec_name, key = parts
    if sec_name not in SECTIONS:
        raise ValueError(f"unknown config section {sec_name!r} in {dotted!r}; valid sections: {', '.join(SECTIONS)}")
    section = getattr(cfg, sec_name)
    names = [f.name for f in dataclasses.fields(section)]
    if key not in names:
        raise ValueError(f"unknown config key {dotted!r}; valid keys of {sec_name}: {', '.join(names)}")
    f = next(f for f in dataclasses.fields(section) if f.name == key)
    value = _coerce(dotted, value, _hints(type(section))[key])
    _check_field(dotted, f, value, _hints(type(section))[key])
    setattr(section, key, value)


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b=value`` and parse the value as YAML (so ``1e-4``, ``true``, ``null``, ``[1, 2]`` are typed)."""
    if "=" not in text:
        raise ValueError(f"an override looks like section.field=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ValueError(f"cannot parse the value of override {text!r}: {exc}") from None
    if isinstance(value, str) and _looks_float(value):  # YAML 1.1 reads 1e-4 as a string
        value = float(value)
    return key, value


def _looks_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return any(c in s.lower() for c in "e.")


def _fix_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _fix_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fix_floats(v) for v in obj]
    if isinstance(obj, str) and _looks_float(obj):
        return float(obj)
    return obj


# The embedded default run (``diffcurr-fast train`` without a recipe, ``make demo``): a small DiT on the built-in
# 8x8 digits with the SNR curriculum, sized to finish in minutes on two CPU cores. Its matrices are too small to
# gain from intra-op threads, and one thread avoids oversubscribing a shared machine (cpu_threads=1). Cosine betas
# and MinSNR-5 make the most of 3,000 steps at 8x8; the grid is drawn with guidance scale 2. The dataclass
# defaults above are the paper settings (DiT: AdamW 1e-4, EMA 0.9999; curriculum: N = 20, tau = 200) that
# recipes start from.
DEMO: dict[str, dict[str, Any]] = {
    "model": {"preset": "custom", "input_size": 8, "in_channels": 1, "num_classes": 10, "patch_size": 2,
              "hidden_size": 64, "depth": 4, "num_heads": 4},
    "diffusion": {"num_timesteps": 1000, "beta_schedule": "cosine", "prediction": "eps", "learn_sigma": True,
                  "weighting": "min_snr", "min_snr_gamma": 5.0},
    "curriculum": {"pacing": "patience", "method": "snr", "num_clusters": 10, "patience": 4, "eval_every": 10,
                   "ema": 0.5, "min_delta": 0.02},
    "data": {"dataset": "digits", "batch_size": 64},
    "optim": {"lr": 1e-3, "warmup_steps": 100, "schedule": "cosine", "min_lr": 1e-5, "grad_clip": 1.0,
              "ema_decay": 0.999},
    "engine": {"max_steps": 3000, "cpu_threads": 1},
    "logging": {"log_every": 25, "num_samples": 100, "sampler": "ddim", "sample_steps": 100, "cfg_scale": 2.0},
    "checkpoint": {"run_dir": "runs/demo", "every": 1000, "keep_last": 2},
}  # fmt: skip


def demo_config() -> TrainConfig:
    """The embedded default run (see ``DEMO``)."""
    return config_from_dict(DEMO)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """The YAML recipe at ``path`` over the paper defaults (or the embedded demo when ``path`` is None), then
    ``overrides`` (``a.b=value``); validated."""
    data: dict[str, Any] = DEMO if path is None else {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"recipe {str(p)!r} does not exist")
        with open(p) as fh:
            data = _fix_floats(yaml.safe_load(fh) or {})
    cfg = config_from_dict(data)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_field(cfg, key, value)
    return cfg.validate()


def config_to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML (sections in their declared order)."""
    return yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False)


def describe_config() -> str:
    """Every key with its type, default, choices and doc (for ``--help-config``)."""
    lines = []
    for sec_name, cls in SECTIONS.items():
        lines.append(f"{sec_name}:  # {cls.__doc__}")
        inst = cls()
        for f in dataclasses.fields(inst):
            choices = f.metadata.get("choices")
            extra = f" (one of {', '.join(map(str, choices))})" if choices else ""
            tp = _type_name(_hints(cls)[f.name])
            lines.append(f"  {f.name}: {getattr(inst, f.name)!r}  # {tp}; {f.metadata.get('doc', '')}{extra}")
    return "\n".join(lines)


# Sections whose values must match between a checkpoint and the run resuming from it (they define the model,
# the objective and the curriculum's state); the others (steps, LR, logging, ...) may change on resume.
RESUME_LOCKED = ("model", "diffusion", "curriculum")
# Keys of the locked sections that may differ: the initial weights only matter for a fresh start.
RESUME_FREE = {("model", "init_from")}


def resume_mismatches(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Keys of the locked sections whose values differ between ``saved`` (a ``to_dict``) and ``cfg``."""
    now = cfg.to_dict()
    diffs = []
    for sec in RESUME_LOCKED:
        a, b = saved.get(sec, {}), now[sec]
        for key in sorted(set(a) | set(b)):
            if (sec, key) in RESUME_FREE:
                continue
            if a.get(key) != b.get(key):
                diffs.append(f"{sec}.{key}: checkpoint {a.get(key)!r} vs now {b.get(key)!r}")
    if saved.get("data", {}).get("batch_size") != now["data"]["batch_size"]:
        diffs.append(f"data.batch_size: checkpoint {saved.get('data', {}).get('batch_size')!r} vs now "
                     f"{now['data']['batch_size']!r}")  # fmt: skip
    return diffs
