"""Typed, strict training configuration: the dataclass sections and their rules.

A configuration is a ``TrainConfig`` of eleven sections (model, diffusion, curriculum, timesteps, data, optim,
engine, logging, checkpoint, eval, tdc). Every field carries a one-line doc (``metadata["doc"]``) and, where it is a
choice, its valid values (``metadata["choices"]``). Unknown keys, wrong types and invalid values raise ``ValueError``
naming the key and what is valid. ``config_from_dict`` builds one from a nested dict; recipes, ``--set`` overrides
and the YAML written to a run directory are ``runs.recipes``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _owned(module: str, name: str, *, before: tuple = ()) -> Callable[[], tuple]:
    """The valid values of a choice field as its owner defines them (``module.name``, after ``before``), imported
    on first use so that importing the config (a command's ``--help``) stays light."""

    @functools.cache
    def values() -> tuple:
        return (*before, *getattr(importlib.import_module(module), name))

    return values


# Every choice of a lower layer is defined by the module that implements it; the config only refers to it.
MODEL_PRESETS = _owned("diffcurr_fast.models.dit", "DIT_PRESETS", before=("custom",))
ROUTINGS = _owned("diffcurr_fast.models.routing", "ROUTINGS")
SRA_LOSSES = _owned("diffcurr_fast.terms.sra", "LOSSES")
NORMS = _owned("diffcurr_fast.models.modern", "NORMS")
MLPS = _owned("diffcurr_fast.models.modern", "MLPS")
POSITIONS = _owned("diffcurr_fast.models.modern", "POSITIONS")
FORMULATIONS = _owned("diffcurr_fast.diffusion", "FORMULATIONS")
PREDICTIONS = _owned("diffcurr_fast.diffusion", "ALL_PREDICTIONS", before=("auto",))
BETA_SCHEDULES = _owned("diffcurr_fast.diffusion.ddpm", "BETA_SCHEDULES")
WEIGHTINGS = _owned("diffcurr_fast.diffusion.weights", "WEIGHTINGS", before=("auto",))
OPS_BACKENDS = _owned("diffcurr_fast.ops._backend", "BACKENDS", before=("auto",))
PACINGS = _owned("diffcurr_fast.curriculum.pacing", "PACINGS")
ORDERS = _owned("diffcurr_fast.curriculum.pacing", "ORDERS")
TIMESTEP_SAMPLERS = _owned("diffcurr_fast.timesteps.registry", "SAMPLERS")
CLUSTER_METHODS = _owned("diffcurr_fast.curriculum.clustering", "CLUSTER_METHODS")
DATA_BACKENDS = _owned("diffcurr_fast.data.pipeline", "BACKENDS")
ON_BAD = _owned("diffcurr_fast.data.errors", "ON_BAD")
ATTN_BACKENDS = _owned("diffcurr_fast.models.attention", "ATTENTION_BACKENDS")
PRECISIONS = _owned("diffcurr_fast.objective", "PRECISIONS")
SAMPLERS = _owned("diffcurr_fast.runs.sampling", "SAMPLERS", before=("auto",))
LEARN_SIGMA = ("auto", True, False)
# The trainer's choices are defined here, below it (``train`` imports them from this module).
SHARDED_DATASETS = ("latents", "images")
DATASETS = ("digits", "mnist5k", "npz", *SHARDED_DATASETS)  # data.dataset: built-in, arrays, or ShardedLoader
PIXEL_DATASETS = ("digits", "mnist5k", "images")  # images in [-1, 1]; npz and latents may hold latents
ENGINE_KINDS = ("auto", "single", "ddp", "deepspeed")
DEVICES = ("auto", "cpu", "cuda")
OPTIM_IMPLS = ("auto", "torch", "apex")  # AdamW kernels (``train.engine.build_optimizer``)
NAN_POLICIES = ("skip", "stop")
LR_SCHEDULES = ("constant", "cosine")  # ``train.loop.lr_at``
# The largest EMA length of a post-hoc EMA profile (``runs.posthoc_ema``): exponent gamma = 0, the running mean, whose
# relative standard deviation is (1 / (2^2 * 3))^(1/2) (EDM2 eq. 3). Over gamma > -1 the maximum is phi^(-5/2) ~ 0.3003
# (gamma ~ -0.382), but between the two every sigma_rel has two exponents < 0, which weigh early weights more.
PHEMA_SIGMA_REL_MAX = 12**-0.5

INF = math.inf


def with_article(word: str) -> str:
    """``word`` with its indefinite article (``an edm``, ``a flow``)."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def resolve_sampler(sampler: str, formulation: str) -> str:
    """``sampler``, or for ``auto`` the formulation's own (``diffusion.FORMULATION_DEFAULTS``: ddim for ddpm, heun for
    flow and edm), as ``logging.sampler`` and ``eval.sampler`` resolve; the commands that sample a checkpoint
    (``sample``, ``eval --ckpt``) resolve their ``--sampler`` with it."""
    if sampler != "auto":
        return sampler
    from diffcurr_fast.diffusion import FORMULATION_DEFAULTS  # here: importing the config stays free of torch

    return FORMULATION_DEFAULTS[formulation]["sampler"]


def _field(
    default: Any,
    doc: str,
    choices: tuple | Callable[[], tuple] | None = None,
    *,
    lo: float | None = None,
    hi: float = INF,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Any:
    """A config field: its default, one-line doc, and its valid values (``choices``, or the range [lo, hi] with
    open ends as flagged). ``_check_field`` is the one place these are checked."""
    meta: dict[str, Any] = {"doc": doc}
    if choices is not None:
        meta["choices"] = choices
    if lo is not None:
        meta["range"] = (lo, hi, lo_open, hi_open)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _pos(default: int, doc: str) -> Any:
    """An int field >= 1."""
    return _field(default, doc, lo=1)


def _nonneg(default: float, doc: str, **kw: Any) -> Any:
    """A field >= 0 (``hi`` etc. as in ``_field``)."""
    return _field(default, doc, lo=0, **kw)


def _unit(default: float, doc: str, **kw: Any) -> Any:
    """A float field in [0, 1] (ends open as flagged)."""
    return _field(default, doc, lo=0.0, hi=1.0, **kw)


@dataclass
class ModelConfig:
    """The network (a DiT)."""

    preset: str = _field("custom", "DiT preset name, or 'custom' to use the dimensions below", MODEL_PRESETS)
    input_size: int = _pos(8, "spatial size of the (latent) images the model sees")
    in_channels: int = _pos(1, "channels of the (latent) images")
    num_classes: int = _pos(10, "number of class labels (the null label for guidance is num_classes)")
    patch_size: int | None = _field(None, "patch size (a preset fills it; custom default 2)", lo=1)
    hidden_size: int | None = _field(None, "transformer width (a preset fills it; custom default 128)", lo=1)
    depth: int | None = _field(None, "number of DiT blocks (a preset fills it; custom default 6)", lo=1)
    num_heads: int | None = _field(None, "attention heads (a preset fills it; custom default 4)", lo=1)
    mlp_ratio: float = _field(4.0, "MLP width / hidden_size", lo=0.0, lo_open=True)
    class_dropout_prob: float = _unit(0.1, "label dropout probability (enables classifier-free guidance)", hi_open=True)
    attn_backend: str = _field("auto", "attention backend", ATTN_BACKENDS)
    fused_adaln: bool = _field(
        False, "run the blocks' elementwise ops fused (adaLN modulate, gated residual, tanh-GELU)"
    )
    dtr: bool = _field(False, "Denoising Task Routing (timestep-dependent channel masks)")
    routing: str = _field(
        "none",
        "token routing in training: tread (a share of the tokens skips a span) or sprint (the span runs on the kept "
        "tokens alone, its output fused with the tokens before it; adds a [MASK] token and a fusion layer)",
        ROUTINGS,
    )
    routing_keep: float = _unit(
        0.5,
        "routing: share of each sample's tokens that the span's blocks process (SPRINT's paper: 0.25)",
        lo_open=True,
    )
    routing_start: int = _nonneg(2, "routing: the span's first block (0-based; sprint: the dense encoder's depth)")
    routing_end: int | None = _field(None, "routing: the block after the span (exclusive; None: depth - 2)", lo=1)
    routing_until: int = _nonneg(0, "routing: the step from which every token runs every block again (0: never)")
    norm: str = _field(
        "layernorm", "the blocks' pre-norms and final norm: layernorm (DiT) or rmsnorm (LightningDiT; no affine)", NORMS
    )
    qk_norm: bool = _field(False, "RMSNorm of q and k per head over head_dim, with a learnable weight (LightningDiT)")
    mlp: str = _field(
        "gelu", "the blocks' MLP: gelu (DiT) or swiglu (w3(silu(w1 x) * w2 x), 2/3 the width; LightningDiT)", MLPS
    )
    pos: str = _field(
        "sincos",
        "positions: sincos (the fixed embedding added to the tokens, DiT) or rope2d (2-D rotary q and k; LightningDiT)",
        POSITIONS,
    )
    init_from: str = _field(
        "",
        "fine-tune: initial weights (.pt state dict such as DiT-XL-2-256x256.pt, one of our "
        "checkpoints, a .safetensors export, or a diffusers DiTTransformer2DModel / DiTPipeline directory); "
        "ignored when resuming",
    )

    def validate(self) -> None:
        """A preset fills the dimensions left unset, and replaces those set by an earlier source (the recipe when
        the preset is an override); a dimension set in the preset's own source or a later one that contradicts it
        is an error, and so are dimensions the DiT cannot take (``models.dit.check_dims``)."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.models.dit import DIT_PRESETS, check_dims
        from diffcurr_fast.models.modern import check_modern

        dims = DIT_PRESETS.get(self.preset, CUSTOM_DIMS)
        filled = _filled(self)
        rank, where = _source_of(self, "preset")
        by = f"model.preset {self.preset!r} ({where})" if self.preset != "custom" else "custom default"
        for name, value in dims.items():
            have = getattr(self, name)
            earlier = self.preset != "custom" and _source_of(self, name)[0] < rank
            if have is None or name in filled or earlier:  # a later preset takes every dimension, equal ones too
                setattr(self, name, value)
                filled.add(name)
                _sources(self)[name] = (rank, by)
            elif self.preset != "custom" and have != value:
                raise ValueError(
                    f"model.{name}={have!r} contradicts model.preset {self.preset!r} ({name} {value}) in the same "
                    f"or a later source ({_source_of(self, name)[1]}); unset it (model.{name}=null) to take the "
                    "preset's value, or use model.preset=custom"
                )
        try:
            check_dims(self.input_size, self.patch_size, self.hidden_size, self.num_heads)
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None
        try:  # the choices are checked with the fields; what is left is rope2d's head dim
            check_modern(self.norm, self.qk_norm, self.mlp, self.pos, self.hidden_size // self.num_heads)
        except ValueError as exc:
            raise ValueError(f"model.{exc}") from None
        if self.routing != "none":
            start, end = self.routing_span()
            if not start < end <= self.depth:
                raise ValueError(
                    f"model.routing spans blocks [{start}, {end}) (model.routing_start, model.routing_end), which must "
                    f"hold at least one of the {self.depth} blocks (0 <= start < end <= depth)"
                )

    def routing_span(self) -> tuple[int, int]:
        """The blocks [start, end) that token routing spans (``routing_end`` None: depth - 2)."""
        return self.routing_start, self.routing_end if self.routing_end is not None else self.depth - 2


CUSTOM_DIMS = {"patch_size": 2, "hidden_size": 128, "depth": 6, "num_heads": 4}


@dataclass
class DiffusionConfig:
    """The diffusion formulation and its training objective."""

    formulation: str = _field(
        "ddpm", "ddpm (discrete t), flow (linear interpolant, SiT) or edm (Karras et al.)", FORMULATIONS
    )
    num_timesteps: int = _pos(1000, "T: DDPM timesteps, or the number of flow-t / EDM-sigma cells for the curriculum")
    beta_schedule: str = _field("linear", "beta schedule", BETA_SCHEDULES)
    prediction: str = _field(
        "auto",
        "network target: eps, x0 or v (ddpm); velocity (flow); x0 (edm denoiser); auto: eps "
        "(ddpm), velocity (flow), x0 (edm)",
        PREDICTIONS,
    )
    learn_sigma: bool | str = _field(
        "auto",
        "learn the variance with the IDDPM hybrid loss (network outputs 2C channels); "
        "auto: true for ddpm, false for flow and edm",
        LEARN_SIGMA,
    )
    weighting: str = _field("auto", "per-timestep loss weighting of the MSE term (ddpm; auto: none)", WEIGHTINGS)
    min_snr_gamma: float = _field(5.0, "gamma of the MinSNR weighting", lo=0.0, lo_open=True)
    ops_backend: str = _field("auto", "backend of the fused ops (reference: the pure-torch definition)", OPS_BACKENDS)
    sigma_data: float = _field(0.5, "EDM: standard deviation of the data", lo=0.0, lo_open=True)
    P_mean: float = _field(-1.2, "EDM: mean of ln(sigma) during training", lo=-INF)
    P_std: float = _field(1.2, "EDM: standard deviation of ln(sigma) during training", lo=0.0, lo_open=True)
    sigma_min: float = _field(0.002, "EDM: smallest sigma (training range and sampling grid)", lo=0.0, lo_open=True)
    sigma_max: float = _field(80.0, "EDM: largest sigma (training range and sampling grid)", lo=0.0, lo_open=True)

    def validate(self) -> None:
        if not self.sigma_min < self.sigma_max:
            raise ValueError(f"diffusion.sigma_min {self.sigma_min} must be < diffusion.sigma_max {self.sigma_max}")
        if self.formulation == "ddpm" and self.beta_schedule == "linear" and self.num_timesteps < 20:
            raise ValueError(  # its last beta, 0.02 x 1000 / T, would pass 1
                "diffusion.beta_schedule 'linear' needs diffusion.num_timesteps >= 20 (its betas scale with 1000 / T), "
                f"got {self.num_timesteps}; give more timesteps or diffusion.beta_schedule=cosine"
            )
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion import TRAIN_PREDICTIONS

        preds = TRAIN_PREDICTIONS[self.formulation]
        if self.prediction not in preds:
            raise ValueError(
                f"diffusion.prediction {self.prediction!r} is not {with_article(self.formulation)} target; valid "
                f"choices: {', '.join(preds)}"
            )


@dataclass
class CurriculumConfig:
    """Difficulty curriculum over timestep clusters (Kim et al., ICLR 2025)."""

    pacing: str = _field("patience", "patience (the paper), fixed (NaiveCL), none (vanilla) or adaptive", PACINGS)
    num_clusters: int = _pos(20, "N, the number of timestep clusters")
    method: str = _field("snr", "clustering rule", CLUSTER_METHODS)
    order: str = _field("easy_to_hard", "unlock order (hard_to_easy = anti-curriculum)", ORDERS)
    patience: int = _nonneg(20, "evaluations without improvement before the next unlock")
    ema: float = _unit(0.9, "decay of the monitored-loss EMA per evaluation, in [0, 1)", hi_open=True)
    min_delta: float = _nonneg(1e-3, "relative decrease of the monitored loss that counts as an improvement")
    stage_iters: int = _nonneg(0, "steps per stage for fixed pacing (0 = unset)")
    eval_every: int = _pos(10, "steps per evaluation window")
    adaptive_floor: float = _unit(0.5, "share of uniform sampling kept by adaptive pacing, in [0, 1]")

    def validate(self) -> None:
        if self.pacing == "fixed" and self.stage_iters < 1:
            raise ValueError("curriculum.stage_iters must be >= 1 when curriculum.pacing is 'fixed'")


@dataclass
class TimestepsConfig:
    """Timestep sampling: the strategy multiplied with the curriculum's unlock mask (docs/training.md)."""

    sampler: str = _field(
        "uniform", "timestep strategy (times the curriculum's mask and the formulation's prior)", TIMESTEP_SAMPLERS
    )
    lognormal_mean: float = _field(0.0, "lognormal: mean of log SNR (flow: -2 x the logit-normal mean)", lo=-INF)
    lognormal_std: float = _field(
        2.0, "lognormal: std of log SNR (2 = SD3's logit-normal(0, 1) t for flow)", lo=0.0, lo_open=True
    )
    importance_history: int = _pos(10, "importance: losses kept per cell (IDDPM: 10); uniform until all are full")
    importance_floor: float = _unit(1e-3, "importance: uniform share mixed into the distribution (IDDPM: 1e-3)")
    speed_k: float = _field(5.0, "speed: how many times as likely a cell before the convergence area is", lo=1.0)
    speed_threshold: float = _field(
        1e-4,
        "speed: increment of sqrt(1 - abar) per 1/1000 of the axis where the convergence area begins",
        lo=0.0,
        lo_open=True,
    )
    anuts_every: int = _pos(20, "anuts: steps between policy updates (each probes the loss before and after)")
    anuts_candidates: int = _pos(16, "anuts: cells, evenly spaced, whose loss decrease is measured")
    anuts_probes: int = _pos(3, "anuts: size of the subset S whose decrease is the reward")
    anuts_probe_batch: int = _pos(4, "anuts: samples of the batch the probes are measured on")
    anuts_buffer: int = _field(10, "anuts: updates kept to choose S by correlation with the total decrease", lo=2)
    anuts_lr: float = _field(0.02, "anuts: Adam learning rate of the policy's log a, log b", lo=0.0, lo_open=True)
    anuts_entropy: float = _nonneg(0.0, "anuts: weight of the policy's entropy bonus")

    def validate(self) -> None:
        if self.sampler == "anuts" and self.anuts_probes > self.anuts_candidates:
            raise ValueError(
                f"timesteps.anuts_probes {self.anuts_probes} must be <= timesteps.anuts_candidates "
                f"{self.anuts_candidates}"
            )


@dataclass
class TermsConfig:
    """Training terms beyond the regression loss (``diffcurr_fast.terms``), each added with its weight."""

    use: list[str] = _field([], "the terms the step adds (terms/registry.py): contrastive, dispersive, sra, repa")
    contrastive_weight: float = _field(
        0.05, "contrastive (DeltaFM, arXiv 2506.05350): lambda of its negative pair", lo=0.0, lo_open=True
    )

    dispersive_weight: float = _field(
        0.5, "dispersive (Wang and He, arXiv 2506.09027): its weight", lo=0.0, lo_open=True
    )
    dispersive_block: int | None = _field(
        None, "dispersive: the block whose output tokens it disperses (None: depth // 4)", lo=0
    )
    dispersive_tau: float = _field(1.0, "dispersive: the temperature tau", lo=0.0, lo_open=True)
    sra_weight: float = _field(
        0.5, "sra (self-representation alignment, arXiv 2505.02831): its weight", lo=0.0, lo_open=True
    )
    sra_student_block: int | None = _field(
        None, "sra: the block whose output tokens are aligned, through the projector (None: depth // 4 - 1)", lo=0
    )
    sra_teacher_block: int | None = _field(
        None, "sra: the EMA model's block whose output tokens are the target (None: 3 depth // 4 - 1)", lo=0
    )
    sra_gap: float = _field(
        0.2, "sra: the teacher's largest noise-level gap below the student, a fraction of the cells", lo=0.0, hi=1.0
    )
    sra_projector_dim: int | None = _field(None, "sra: the projector MLP's hidden width (None: 2 x hidden_size)", lo=1)
    sra_loss: str = _field("cosine", "sra: cosine (1 - cos per token) or smooth_l1 (beta 0.05)", SRA_LOSSES)
    repa_weight: float = _field(
        0.5, "repa (representation alignment, arXiv 2410.06940): its weight (the official 0.5)", lo=0.0, lo_open=True
    )
    repa_block: int | None = _field(
        None, "repa: the block whose output tokens are aligned, through the projector (None: depth // 3 - 1)", lo=0
    )
    repa_encoder: str = _field(
        "",
        "repa: the frozen encoder, a local file (required with repa): a TorchScript module (torch.jit.save) "
        "returning patch tokens (B, N, D), or a safetensors state dict of a DINOv2-style ViT; no torch.save pickles",
    )
    repa_encoder_size: int = _field(
        224, "repa: the encoder's input size (images resized to it bicubically; DINOv2: 224 for 16x16 tokens)", lo=1
    )
    repa_projector_dim: int = _field(2048, "repa: the projector MLP's hidden width (the official 2048)", lo=1)

    immiscible: bool = _field(
        False,
        "immiscible diffusion (Li et al., arXiv 2406.12303): each (micro-)batch's noise assigned to its images by "
        "a linear assignment of least total distance (terms/immiscible.py; no loss of its own, needs scipy)",
    )

    def validate(self) -> None:
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.terms.registry import NAMES

        bad = [u for u in self.use if u not in NAMES]
        if bad or len(set(self.use)) != len(self.use):
            raise ValueError(f"terms.use {self.use!r}: each term once, from {', '.join(NAMES)}")
        if "repa" in self.use and not self.repa_encoder:
            raise ValueError(
                "terms.repa_encoder is required with terms.use repa: a local TorchScript file (torch.jit.save) or "
                "a safetensors file of a DINOv2-style ViT (docs/training.md, REPA from a local encoder)"
            )


@dataclass
class DataConfig:
    """Training data."""

    dataset: str = _field(
        "digits",
        "digits (built in, 8x8), mnist5k (built in, 28x28, the mnist extra), npz (arrays x (N, C, H, W) and y "
        "(N,)), latents (a fast-DiT or sharded latent directory) or images (an ImageNet-layout folder)",
        DATASETS,
    )
    path: str = _field("", "npz: a .npz file or a directory of x.npy and y.npy; latents / images: the directory")
    scale: float = _field(
        1.0,
        "the model trains on scale * data (0.18215 for Stable Diffusion VAE latents; see docs)",
        lo=0.0,
        lo_open=True,
    )
    batch_size: int = _pos(128, "global batch size (split evenly across ranks)")
    num_workers: int = _nonneg(0, "DataLoader worker processes (0 = load in the training process); DALI CPU threads")
    image_size: int = _nonneg(0, "images: ADM centre-crop size (0 = model.input_size)")
    hflip: bool = _field(True, "images: random horizontal flips (decided per sample and epoch)")
    backend: str = _field(
        "auto", "latents / images loader: auto (DALI on a GPU when importable), dali or torch", DATA_BACKENDS
    )
    dali_py_workers: int = _nonneg(
        0, "images with DALI: forked Python workers reading the files (0: read in the pipeline's thread)"
    )
    on_bad: str = _field("stop", "latents / images: a corrupt or unreadable file stops the run or is skipped", ON_BAD)

    def validate(self) -> None:
        if self.dataset in ("npz", "latents", "images") and not self.path:
            what = {"npz": "a .npz file or a directory", "latents": "a latent directory", "images": "an image folder"}
            raise ValueError(f"data.path is required when data.dataset is {self.dataset!r} ({what[self.dataset]})")
        if self.dataset in ("digits", "mnist5k") and self.path:
            raise ValueError(
                f"data.path {self.path!r} is set but data.dataset is {self.dataset!r} (built in, reads no "
                "file); set data.dataset to npz, latents or images to train on it"
            )


@dataclass
class OptimConfig:
    """AdamW, learning-rate schedule, clipping and EMA."""

    lr: float = _field(1e-4, "peak learning rate", lo=0.0, lo_open=True)
    weight_decay: float = _nonneg(0.0, "AdamW weight decay")
    beta1: float = _unit(0.9, "AdamW beta1", hi_open=True)
    beta2: float = _unit(0.999, "AdamW beta2", hi_open=True)
    eps: float = _field(1e-8, "AdamW epsilon", lo=0.0, lo_open=True)
    impl: str = _field(
        "auto",
        "AdamW kernels: auto / torch (torch's fused kernel, CUDA and CPU) or apex (NVIDIA apex FusedAdam)",
        OPTIM_IMPLS,
    )
    warmup_steps: int = _nonneg(0, "linear warmup steps from 0 to lr")
    schedule: str = _field("constant", "learning-rate schedule after warmup", LR_SCHEDULES)
    min_lr: float = _nonneg(0.0, "final learning rate of the cosine schedule (<= lr)")
    grad_clip: float = _nonneg(0.0, "clip the global gradient norm to this (0 = off)")
    grad_accum_steps: int = _pos(1, "micro-batches per optimizer step (data.batch_size is split into them)")
    ema_decay: float = _unit(0.9999, "EMA decay of the weights (DiT: 0.9999)")
    ema_warmup: bool = _field(True, "use decay min(ema_decay, (1 + n) / (10 + n)) at update n")
    phema_every: int = _nonneg(
        0,
        "post-hoc EMA (EDM2): steps between snapshots of the power-function averages under phema/, and one at "
        "the end; `sample` / `eval --ema-length` reconstruct any EMA length from them (0 = off)",
    )
    phema_sigma_rels: list[float] = _field(
        [0.05, 0.10],
        "post-hoc EMA: the EMA lengths tracked (EDM2 sigma_rel, the profile's width relative to the training time; "
        "each in (0, 12^-1/2]; 12^-1/2 is the plain running mean)",
        lo=0.0,
        hi=PHEMA_SIGMA_REL_MAX,
        lo_open=True,
    )

    def validate(self) -> None:
        if self.min_lr > self.lr:
            raise ValueError(f"optim.min_lr {self.min_lr!r} must be <= optim.lr {self.lr!r}")
        rels = self.phema_sigma_rels
        if self.phema_every and (not rels or len(set(rels)) != len(rels)):
            raise ValueError(
                f"optim.phema_sigma_rels {rels!r} must list one or more distinct values when optim.phema_every is set"
            )


@dataclass
class EngineConfig:
    """Where and how the step runs."""

    kind: str = _field("auto", "auto (ddp under torchrun, else single), single, ddp or deepspeed (ZeRO)", ENGINE_KINDS)
    deepspeed_config: str = _field("", "deepspeed: DeepSpeed JSON (ZeRO stage, offload); batch, clip, bf16 filled in")
    device: str = _field("auto", "auto (cuda when available), cpu or cuda", DEVICES)
    max_steps: int = _pos(1000, "total optimizer steps (attempted steps, skipped ones included)")
    seed: int = _field(0, "global seed (each rank adds its rank)", lo=0, hi=2**63 - 1)
    precision: str = _field("fp32", "fp32, bf16 autocast, or auto (bf16 on a GPU that has it, fp32 on CPU)", PRECISIONS)
    tf32: bool = _field(True, "allow TF32 matmuls on GPU")
    compile: bool = _field(False, "torch.compile the model")
    grad_checkpointing: bool = _field(False, "recompute each DiT block in the backward pass")
    nan_policy: str = _field("skip", "on a non-finite loss: skip the step and count it, or stop", NAN_POLICIES)
    max_nan_skips: int = _pos(100, "stop after more than this many skipped steps in a row (skip policy)")
    max_skip_share: float = _unit(
        0.05,
        "stop once more than this share of engine.max_steps was skipped (skip "
        "policy; the error names the first skipped step)",
    )
    cpu_threads: int = _field(0, "torch intra-op threads on CPU (0 = torch's default)", lo=0, hi=4096)
    retain_host_memory: bool = _field(
        True,
        "CPU: keep freed host memory in the process (glibc mallopt) so each step's "
        "large tensors reuse mapped pages instead of page-faulting new ones",
    )
    cuda_graphs: bool = _field(
        False,
        "a training step that reads nothing back to the host, as CUDA graph capture needs: a non-finite step is "
        "skipped on the device (optimizer, EMA and sampler statistics masked), the skip counts and stop rules are "
        "read at the next log step; on CUDA the model is also compiled with mode reduce-overhead (its forward and "
        "backward replayed as CUDA graphs; one process, no gradient accumulation)",
    )

    def validate(self) -> None:
        if self.kind == "deepspeed" and not self.deepspeed_config:
            raise ValueError("engine.deepspeed_config is required when engine.kind is 'deepspeed' (a DeepSpeed JSON)")
        if self.kind == "deepspeed" and self.cuda_graphs:
            raise ValueError(
                "engine.cuda_graphs does not apply to engine.kind 'deepspeed' (DeepSpeed decides its overflow skips "
                "on the host); use engine.kind single or ddp, or engine.cuda_graphs=false"
            )


@dataclass
class LoggingConfig:
    """Progress, metrics and the end-of-run report."""

    log_every: int = _pos(10, "steps between metrics.jsonl records")
    progress: bool = _field(True, "show a tqdm progress bar")
    tensorboard: bool = _field(False, "also write TensorBoard scalars to tb/ (needs the tensorboard package)")
    wandb: bool = _field(
        False,
        "also log the scalars to Weights & Biases (extra 'wandb'; the run id is kept in "
        "wandb_id.txt, so a resume continues the same run)",
    )
    wandb_project: str = _field("diffcurr-fast", "wandb project")
    wandb_mode: str = _field(
        "offline", "wandb offline (files under wandb/, upload later with `wandb sync`) or online", ("offline", "online")
    )
    num_samples: int = _nonneg(64, "images in the end-of-run sample grid (0 = no grid)")
    sampler: str = _field(
        "auto", "sampler of the end-of-run grid (auto: ddim for ddpm, heun for flow and edm)", SAMPLERS
    )
    sample_steps: int = _pos(50, "sampling steps of the end-of-run grid")
    cfg_scale: float = _nonneg(1.0, "classifier-free guidance scale of the end-of-run grid")
    plots: bool = _field(True, "write the per-cluster loss and curriculum timeline plots at the end")
    eval_every: int = _nonneg(0, "steps between evaluations of the EMA weights (FD etc., the eval section; 0 = off)")


@dataclass
class CheckpointConfig:
    """Run directory and checkpoints."""

    run_dir: str = _field("runs/demo", "output directory of the run")
    every: int = _pos(1000, "steps between checkpoints (a final one is always written)")
    keep_last: int = _pos(3, "checkpoints kept (older ones are deleted)")
    export_ema: bool = _field(True, "write the EMA weights as ema.safetensors at the end")

    def validate(self) -> None:
        if not self.run_dir:
            raise ValueError("checkpoint.run_dir must be a non-empty path")


EVAL_FEATURES = ("digits", "mnist5k", "inception")  # ``diffcurr_fast.eval.features.EXTRACTORS``
# The images the classifier extractors take (``eval.features``; eval/features.py checks their input against it):
# evaluation during training does not resize (the eval command's --convert).
EVAL_SHAPES = {"digits": (1, 8, 8), "mnist5k": (1, 28, 28)}


@dataclass
class EvalConfig:
    """Evaluation during training (every ``logging.eval_every`` steps, rank 0, EMA weights, its own RNG)."""

    num_samples: int = _field(500, "images sampled per evaluation (labels cycle through the classes)", lo=2)
    steps: int = _pos(50, "sampling steps")
    sampler: str = _field("auto", "sampler (auto: ddim for ddpm, heun for flow and edm)", SAMPLERS)
    cfg_scale: float = _nonneg(1.0, "classifier-free guidance scale")
    features: str = _field(
        "digits",
        "feature extractor: digits / mnist5k (classifiers of those built-in data) or inception (FID)",
        EVAL_FEATURES,
    )
    inception_weights: str = _field("", "inception: local pytorch-fid weights file (never downloaded)")
    reference: str = _field(
        "",
        "reference statistics or images .npz ('' = the training data; digits / mnist5k "
        "data: all digits / mnist5k's held-out split)",
    )
    num_reference: int = _field(10000, "'' reference: training images used (at most)", lo=2)
    seed: int = _field(0, "seed of the evaluation samples (the same noise at every evaluation)", lo=0, hi=2**63 - 1)

    def validate(self) -> None:
        if self.features == "inception" and not self.inception_weights:
            raise ValueError(
                "eval.features 'inception' needs eval.inception_weights (a local pytorch-fid weights "
                "file; it is never downloaded)"
            )


# Choices of the tdc section. The config is the lowest layer that needs them, so it owns them; ``diffcurr_fast.tdc``
# imports them from here.
GROUP_METHODS = _owned("diffcurr_fast.curriculum.clustering", "CLUSTER_METHODS", before=("db",))
FULL_BUDGET_ENDS = ("hardest", "easiest")
BASE_WEIGHTS = ("ema", "model")
IMPORTANCE_METHODS = ("taylor", "magnitude")
PROPOSERS = ("local", "uniform", "llm")
LLM_FALLBACKS = ("none", "local")


@dataclass
class TDCConfig:
    """TDC training (diffcurr-fast tdc): stage 2 after stage 1, which is the rest of this config."""

    num_groups: int = _pos(3, "N, the number of timestep groups (one expert each)")
    budget_floor: float = _field(
        0.5,
        "k of TDC Eq. 2, in (0, 1]: group i of N gets FLOPs(i) = (i/N + (N-i)/N k) F, so no expert falls below k F",
        lo=0.0,
        hi=1.0,
        lo_open=True,
    )
    group_method: str = _field("db", "grouping rule on the SNR axis", GROUP_METHODS)
    full_budget: str = _field("hardest", "which end of t gets the full budget F", FULL_BUDGET_ENDS)
    base_weights: str = _field("ema", "stage-1 weights that stage 2 prunes", BASE_WEIGHTS)
    importance: str = _field("taylor", "unit importance for pruning", IMPORTANCE_METHODS)
    importance_batches: int = _pos(2, "batches of the Taylor importance (diffusion-loss gradients)")
    proposer: str = _field("local", "candidate proposer of the proxy search", PROPOSERS)
    rounds: int = _pos(2, "proxy-search rounds")
    candidates: int = _pos(3, "candidates per round")
    recover_steps: int = _nonneg(10, "AdamW steps that recover each candidate before it is scored")
    recover_lr: float = _field(1e-4, "learning rate of the recovery steps", lo=0.0, lo_open=True)
    search_batches: int = _pos(4, "training batches cycled by the recovery steps")
    heldout_batches: int = _pos(2, "held-out batches of the proxy score (disjoint from the search batches)")
    search_batch_size: int = _nonneg(0, "batch size of importance, recovery and proxy (0 = data.batch_size)")
    drop_empty_blocks: bool = _field(False, "remove blocks left with no head and no channel")
    finetune_steps: int = _pos(200, "stage-2 fine-tuning steps of every expert")
    finetune_lr: float = _nonneg(0.0, "stage-2 peak learning rate (0 = optim.lr)")
    expert_parallel: bool = _field(
        False,
        "stage 2 with the ranks split into min(N, world) parts, each searching and "
        "fine-tuning its own groups (DDP; false: every expert over all ranks)",
    )
    llm_url: str = _field("", "llm proposer: OpenAI-compatible endpoint (https://host/v1)")
    llm_model: str = _field("", "llm proposer: model name")
    llm_api_key_env: str = _field("", "llm proposer: NAME of the environment variable holding the API key")
    llm_fallback: str = _field(
        "none",
        "llm proposer whose endpoint gives no reply: none (stop with an error) or "
        "local (the local proposer fills the round, said on the console)",
        LLM_FALLBACKS,
    )
    seed: int = _nonneg(0, "seed of the data split, importance and search")

    def validate(self) -> None:
        if self.proposer == "llm" and not (self.llm_url and self.llm_model):
            raise ValueError("tdc.proposer 'llm' needs tdc.llm_url and tdc.llm_model")


@dataclass
class TrainConfig:
    """The whole training configuration."""

    model: ModelConfig = field(default_factory=ModelConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    timesteps: TimestepsConfig = field(default_factory=TimestepsConfig)
    terms: TermsConfig = field(default_factory=TermsConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tdc: TDCConfig = field(default_factory=TDCConfig)

    def validate(self) -> TrainConfig:
        """Resolve ``auto`` (``resolve_auto``), check every field (types, choices, ranges) and the cross-section
        rules; returns self."""
        self.resolve_auto()
        for sec in dataclasses.fields(self):
            section = getattr(self, sec.name)
            for f in dataclasses.fields(section):
                _check_field(f"{sec.name}.{f.name}", f, getattr(section, f.name), _hints(type(section))[f.name])
            if hasattr(section, "validate"):  # the section's own cross-field rules, where it has any
                section.validate()
        self._check_formulation_fields()
        if self.curriculum.num_clusters > self.diffusion.num_timesteps:
            raise ValueError(
                f"curriculum.num_clusters ({self.curriculum.num_clusters}) must be <= diffusion.num_timesteps "
                f"({self.diffusion.num_timesteps})"
            )
        host_only = {
            "timesteps.sampler 'anuts'": (self.timesteps.sampler == "anuts", "its policy update reads losses back"),
            "optim.impl 'apex'": (self.optim.impl == "apex", "its FusedAdam cannot skip an update on the device"),
            "terms.immiscible": (self.terms.immiscible, "its assignment runs on the host"),
        }
        for what, (used, why) in host_only.items():
            if self.engine.cuda_graphs and used:
                raise ValueError(f"engine.cuda_graphs does not work with {what} ({why}); set engine.cuda_graphs=false")
        if self.tdc.num_groups > self.diffusion.num_timesteps:
            raise ValueError(
                f"tdc.num_groups ({self.tdc.num_groups}) must be <= diffusion.num_timesteps "
                f"({self.diffusion.num_timesteps})"
            )
        m = self.model
        if self.logging.eval_every and m.in_channels not in (1, 3):
            raise ValueError(
                f"logging.eval_every needs images (model.in_channels 1 or 3), got {m.in_channels} "
                "channels (latents would need the VAE decoder); set logging.eval_every=0"
            )
        blocks = (("dispersive", "dispersive_block"), ("sra", "sra_student_block"), ("sra", "sra_teacher_block"))
        for name, key in (*blocks, ("repa", "repa_block")):
            block = getattr(self.terms, key)
            if name in self.terms.use and block is not None and block >= m.depth:
                raise ValueError(f"terms.{key} {block} must be a block of the model: 0 to {m.depth - 1}")
        if "repa" in self.terms.use and m.in_channels not in (1, 3):
            raise ValueError(
                f"terms.use repa needs images (model.in_channels 1 or 3), got {m.in_channels} channels: its encoder "
                "sees the clean image (latents would need the VAE decoder); drop repa from terms.use"
            )
        shape = (m.in_channels, m.input_size, m.input_size)
        takes = EVAL_SHAPES.get(self.eval.features, shape)
        if self.logging.eval_every and takes != shape:
            fits = next((f for f, s in EVAL_SHAPES.items() if s == shape), None)
            fix = f"eval.features={fits} (its own classifier)" if fits else "eval.features=inception (FID)"
            raise ValueError(
                f"eval.features {self.eval.features!r} scores {'x'.join(map(str, takes))} images, but this model "
                f"makes {'x'.join(map(str, shape))} (data.dataset {self.data.dataset!r}); set {fix}"
            )
        if self.data.dataset == "images":
            size = self.data.image_size or m.input_size
            if (m.in_channels, m.input_size) != (3, size):
                raise ValueError(
                    f"data.dataset 'images' gives 3x{size}x{size} images but the model takes "
                    f"{m.in_channels}x{m.input_size}x{m.input_size}; set model.in_channels=3, model.input_size={size}"
                )
        return self

    def _check_formulation_fields(self) -> None:
        """The fields of ``FORMULATION_FIELDS`` hold values the formulation allows (``diffusion.FORMULATION_LIMITS``;
        the prediction is ``DiffusionConfig.validate``'s, the evaluation sampler counts only when evaluations run)."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion import FORMULATION_LIMITS

        form = self.diffusion.formulation
        for (sec, key), name in FORMULATION_FIELDS.items():
            valid, value = FORMULATION_LIMITS[form].get(name), getattr(getattr(self, sec), key)
            if valid is None or value in valid or name == "prediction":
                continue
            if name != "sampler":
                raise ValueError(
                    f"{sec}.{key}={value!r} is not supported with diffusion.formulation {form!r}; use {valid[0]!r}"
                )
            if sec == "logging" or self.logging.eval_every:
                raise ValueError(
                    f"{sec}.{key} {value!r} cannot sample {with_article(form)} model; valid choices: {', '.join(valid)}"
                )

    def resolve_auto(self) -> None:
        """The fields of ``FORMULATION_FIELDS`` that are ``auto`` take the formulation's own choice
        (``diffusion.FORMULATION_DEFAULTS``). One set by an earlier source than ``diffusion.formulation`` (the recipe
        when the formulation is an override) that does not apply to that formulation yields to it as well; set in
        the same source or a later one, it stays, and ``validate`` says why it cannot be used."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion import FORMULATION_DEFAULTS, FORMULATION_LIMITS

        form = self.diffusion.formulation
        rank, where = _source_of(self.diffusion, "formulation")
        own, limits = FORMULATION_DEFAULTS[form], FORMULATION_LIMITS[form]
        for (sec, key), default_key in FORMULATION_FIELDS.items():
            section = getattr(self, sec)
            value, filled = getattr(section, key), _filled(section)
            fits = default_key not in limits or value in limits[default_key]
            yields = not fits and _source_of(section, key)[0] < rank and value != "auto" and key not in filled
            if value == "auto" or key in filled or yields:
                note = f"; {value!r} ({_source_of(section, key)[1]}) does not apply to {form}" if yields else ""
                setattr(section, key, own[default_key])
                filled.add(key)
                _sources(section)[key] = (rank, f"auto: diffusion.formulation {form!r} ({where}){note}")

    def sources(self) -> dict[str, str]:
        """``section.field`` -> the source that set it (a recipe, the demo, --set, a preset, auto), for the fields
        not left at their defaults."""
        return {
            f"{sec.name}.{k}": label
            for sec in dataclasses.fields(self)
            for k, (_, label) in _sources(getattr(self, sec.name)).items()
        }

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON-serialisable)."""
        return dataclasses.asdict(self)


SECTIONS: dict[str, type] = {f.name: f.default_factory for f in dataclasses.fields(TrainConfig)}  # type: ignore
# The fields whose ``auto`` follows diffusion.formulation -> their key in ``diffusion.FORMULATION_DEFAULTS`` (and in
# ``FORMULATION_LIMITS``, where the formulation limits their values).
FORMULATION_FIELDS = {
    ("diffusion", "prediction"): "prediction",
    ("diffusion", "learn_sigma"): "learn_sigma",
    ("diffusion", "weighting"): "weighting",
    ("model", "dtr"): "dtr",
    ("logging", "sampler"): "sampler",
    ("eval", "sampler"): "sampler",
}


# ---- sources: which part of the command line set a field --------------------------------------------------------
# Each section records, per field, (rank, label) of the source that set it: rank 0 the defaults, then one rank per
# source in the order they were applied (the demo or a recipe, then the --set list), so that a later source can
# win over an earlier one (a preset override replaces the recipe's dimensions, a formulation override the recipe's
# formulation-specific choices). Values filled in by ``validate`` (a preset's dimensions, auto) are kept in
# ``_filled`` so that they are filled again when what they follow changes.
DEFAULT_SOURCE = (0, "default")


def _sources(section: Any) -> dict[str, tuple[int, str]]:
    return section.__dict__.setdefault("_sources", {})


def _filled(section: Any) -> set[str]:
    return section.__dict__.setdefault("_filled", set())


def _source_of(section: Any, key: str) -> tuple[int, str]:
    return _sources(section).get(key, DEFAULT_SOURCE)


def _new_source(cfg: TrainConfig, label: str) -> tuple[int, str]:
    """The next source applied to ``cfg``: (its rank, ``label``)."""
    rank = cfg.__dict__.get("_rank", 0) + 1
    cfg.__dict__["_rank"] = rank
    return rank, label


# ---- checks -------------------------------------------------------------------------------------------
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
    if typing.get_origin(tp) is list:  # a list field: each item as the item type
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list of {_type_name(item)} ([a, b, ...]), got {value!r}")
        return [_coerce(key, v, item) for v in value]
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


def _choices(f: dataclasses.Field) -> tuple | None:
    """The valid values of a choice field (resolved from their owner), or None."""
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def _check_field(key: str, f: dataclasses.Field, value: Any, tp: Any) -> None:
    """The one check of a field's value: its type, then its choices or its range; every float must be finite."""
    value = _coerce(key, value, tp)
    choices = _choices(f)
    if choices is not None and value not in choices:
        raise ValueError(f"invalid value {value!r} for {key}; valid choices: {', '.join(map(str, choices))}")
    for item in value if isinstance(value, list) else [value]:  # a list field: the range holds for each item
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{key} must be a finite number, got {item!r}")
        rng = f.metadata.get("range")
        if rng is not None and item is not None:
            lo, hi, lo_open, hi_open = rng
            if not ((item > lo if lo_open else item >= lo) and (item < hi if hi_open else item <= hi)):
                if hi == INF:
                    raise ValueError(f"{key} must be {'>' if lo_open else '>='} {lo}, got {item!r}")
                lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
                raise ValueError(f"{key} must lie in {lb}{lo}, {hi}{rb}, got {item!r}")


# ---- building ------------------------------------------------------------------------------------------
def config_from_dict(
    data: dict[str, Any] | None, base: TrainConfig | None = None, source: str = "config"
) -> TrainConfig:
    """Build (and validate) a config from a nested dict over ``base`` (defaults); unknown keys are errors. The dict
    is one source, named ``source`` in the recorded provenance (``TrainConfig.sources``)."""
    cfg = base if base is not None else TrainConfig()
    src = _new_source(cfg, source)
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
            _set_field(cfg, f"{sec_name}.{key}", value, src)
    return cfg.validate()


# Keys that configs saved by earlier versions hold (a checkpoint's, a TDC run's tdc.json, a bundle's
# train_config.json): removed (None) or renamed. ``upgrade_saved`` reads them; a recipe or --set that names one is an
# error (saying what a renamed key became).
LEGACY_KEYS = {("diffusion", "fused_ops"): None, ("tdc", "k"): "budget_floor"}


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``TrainConfig.to_dict`` of this or an earlier version) in today's keys: its ``LEGACY_KEYS``
    dropped or renamed. A new dict; ``data`` is not changed."""
    out = {sec: dict(values) if isinstance(values, dict) else values for sec, values in data.items()}
    for (sec, old), new in LEGACY_KEYS.items():
        if isinstance(out.get(sec), dict) and old in out[sec]:
            value = out[sec].pop(old)
            if new is not None:
                out[sec].setdefault(new, value)
    return out


def _set_field(cfg: TrainConfig, dotted: str, value: Any, source: tuple[int, str] = DEFAULT_SOURCE) -> None:
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"config keys look like section.field, got {dotted!r}; sections: {', '.join(SECTIONS)}")
    sec_name, key = parts
    if sec_name not in SECTIONS:
        raise ValueError(f"unknown config section {sec_name!r} in {dotted!r}; valid sections: {', '.join(SECTIONS)}")
    section = getattr(cfg, sec_name)
    names = [f.name for f in dataclasses.fields(section)]
    if key not in names:
        renamed = f" (renamed {sec_name}.{LEGACY_KEYS[sec_name, key]})" if LEGACY_KEYS.get((sec_name, key)) else ""
        raise ValueError(f"unknown config key {dotted!r}{renamed}; valid keys of {sec_name}: {', '.join(names)}")
    f = next(f for f in dataclasses.fields(section) if f.name == key)
    value = _coerce(dotted, value, _hints(type(section))[key])
    _check_field(dotted, f, value, _hints(type(section))[key])
    setattr(section, key, value)
    _filled(section).discard(key)  # set by the user now, not filled from a preset or auto
    if value is None or value == "auto":  # back to what validate fills in
        _sources(section).pop(key, None)
    else:
        _sources(section)[key] = source


# Sections whose values must match between a checkpoint and the run resuming from it (they define the model,
# the objective and the curriculum's state); the others (steps, LR, logging, ...) may change on resume.
RESUME_LOCKED = ("model", "diffusion", "curriculum", "timesteps", "terms")
# A checkpoint written before a section or a key existed has its defaults.
_DEFAULTS = {sec: dataclasses.asdict(SECTIONS[sec]()) for sec in RESUME_LOCKED}
# Keys of other sections that must match too: the batches (their size and order) and every RNG stream derive from
# them, so a resume with another value could not continue the run it names.
RESUME_LOCKED_KEYS = (("data", "batch_size"), ("engine", "seed"))
# Keys of the locked sections that may differ: the initial weights only matter for a fresh start; the fused ops
# compute the eager block's function with the same parameters, so a run may switch them on or off.
RESUME_FREE = {("model", "init_from"), ("model", "fused_adaln")}


def resume_mismatches(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Keys of the locked sections whose values differ between ``saved`` (a ``to_dict``) and ``cfg``; a key the
    saved config predates counts as its default."""
    now = cfg.to_dict()
    diffs = []
    for sec in RESUME_LOCKED:
        a, b = saved.get(sec, _DEFAULTS.get(sec, {})), now[sec]
        for key in sorted(set(a) | set(b)):
            if (sec, key) in RESUME_FREE:
                continue
            was = a[key] if key in a else _DEFAULTS.get(sec, {}).get(key)  # a key newer than the checkpoint
            if was != b.get(key):
                diffs.append(f"{sec}.{key}: checkpoint {was!r} vs now {b.get(key)!r}")
    for sec, key in RESUME_LOCKED_KEYS:
        a, b = saved.get(sec, {}).get(key), now[sec][key]
        if a != b:
            diffs.append(f"{sec}.{key}: checkpoint {a!r} vs now {b!r}")
    return diffs
