"""Typed, strict training configuration: the sections, composed from the options of their components.

A configuration is a ``TrainConfig`` of twelve sections (model, diffusion, curriculum, timesteps, terms, data, optim,
engine, logging, checkpoint, eval, tdc). A section holds its own fields (declared here with ``options.option``: a
default, a one-line doc, its choices or range) and the fields of the components registered for it (``COMPONENTS``):
each formulation, timestep strategy, training term and model option declares its options beside its code
(``options.Options``), and the section takes them as its keys (``terms.sra_weight`` is SRA's ``weight``). The config
names no component: it asks each one whether the run uses it, for its rules (``validate``) and for what it refuses.

Unknown keys, wrong types and invalid values raise ``ValueError`` naming the key and what is valid; so does an option
of a component the run does not use when the user set it (``check_unused``). ``config_from_dict`` builds one from a
nested dict; recipes, ``--set`` overrides and the YAML written to a run directory are ``runs.recipes``.

Importing this module imports no torch (a command's ``--help`` imports it): the components are imported when the
first section is built.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from diffcurr_fast.options import (
    DEFAULT_SOURCE,
    Options,
    check_value,
    coerce,
    filled,
    hints,
    is_record,
    load,
    new_source,
    nonneg,
    option,
    positive,
    source_of,
    sources,
    unit,
)


def _owned(module: str, name: str, *, before: tuple = ()) -> Callable[[], tuple]:
    """The valid values of a choice field as its owner defines them (``module.name``, after ``before``), read when a
    value is checked, so that importing the config (a command's ``--help``) stays light and a registry may grow."""

    def values() -> tuple:
        return (*before, *getattr(importlib.import_module(module), name))

    return values


# Every choice of a lower layer is defined by the module that implements it; the config only refers to it.
MODEL_PRESETS = _owned("diffcurr_fast.models.dit", "DIT_PRESETS", before=("custom",))
FORMULATIONS = _owned("diffcurr_fast.diffusion.registry", "FORMULATIONS")
PREDICTIONS = _owned("diffcurr_fast.diffusion", "ALL_PREDICTIONS", before=("auto",))
WEIGHTINGS = _owned("diffcurr_fast.diffusion.weights", "WEIGHTINGS", before=("auto",))
OPS_BACKENDS = _owned("diffcurr_fast.ops._backend", "BACKENDS", before=("auto",))
PACINGS = _owned("diffcurr_fast.curriculum.pacing", "PACINGS")
ORDERS = _owned("diffcurr_fast.curriculum.pacing", "ORDERS")
TIMESTEP_SAMPLERS = _owned("diffcurr_fast.timesteps.registry", "STRATEGIES")
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
OPTIMIZERS = _owned("diffcurr_fast.optim.registry", "OPTIMIZERS")
OPTIM_IMPLS = ("auto", "torch", "apex")  # AdamW kernels (``optim.adamw``)
NAN_POLICIES = ("skip", "stop")
LR_SCHEDULES = ("constant", "cosine")  # ``train.loop.lr_at``
# The largest EMA length of a post-hoc EMA profile (``runs.posthoc_ema``): exponent gamma = 0, the running mean, whose
# relative standard deviation is (1 / (2^2 * 3))^(1/2) (EDM2 eq. 3). Over gamma > -1 the maximum is phi^(-5/2) ~ 0.3003
# (gamma ~ -0.382), but between the two every sigma_rel has two exponents < 0, which weigh early weights more.
PHEMA_SIGMA_REL_MAX = 12**-0.5


def with_article(word: str) -> str:
    """``word`` with its indefinite article (``an edm``, ``a flow``)."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def resolve_sampler(sampler: str, formulation: str) -> str:
    """``sampler``, or for ``auto`` the formulation's own (its ``defaults["sampler"]``), as ``logging.sampler`` and
    ``eval.sampler`` resolve; the commands that sample a checkpoint (``sample``, ``eval --ckpt``) resolve their
    ``--sampler`` with it."""
    if sampler != "auto":
        return sampler
    from diffcurr_fast.diffusion.registry import formulation_class  # here: importing the config stays free of torch

    return formulation_class(formulation).defaults["sampler"]


# ---- the sections' own fields ----------------------------------------------------------------------------------
@dataclass
class _ModelCore:
    """The network (a DiT)."""

    preset: str = option("custom", "DiT preset name, or 'custom' to use the dimensions below", MODEL_PRESETS)
    input_size: int = positive(8, "spatial size of the (latent) images the model sees")
    in_channels: int = positive(1, "channels of the (latent) images")
    num_classes: int = positive(10, "number of class labels (the null label for guidance is num_classes)")
    patch_size: int | None = option(None, "patch size (a preset fills it; custom default 2)", lo=1)
    hidden_size: int | None = option(None, "transformer width (a preset fills it; custom default 128)", lo=1)
    depth: int | None = option(None, "number of DiT blocks (a preset fills it; custom default 6)", lo=1)
    num_heads: int | None = option(None, "attention heads (a preset fills it; custom default 4)", lo=1)
    mlp_ratio: float = option(4.0, "MLP width / hidden_size", lo=0.0, lo_open=True)
    class_dropout_prob: float = unit(0.1, "label dropout probability (enables classifier-free guidance)", hi_open=True)
    attn_backend: str = option("auto", "attention backend", ATTN_BACKENDS)
    fused_adaln: bool = option(
        False, "run the blocks' elementwise ops fused (adaLN modulate, gated residual, tanh-GELU)"
    )
    init_from: str = option(
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

        dims = DIT_PRESETS.get(self.preset, CUSTOM_DIMS)
        done = filled(self)
        rank, where = source_of(self, "preset")
        by = f"model.preset {self.preset!r} ({where})" if self.preset != "custom" else "custom default"
        for name, value in dims.items():
            have = getattr(self, name)
            earlier = self.preset != "custom" and source_of(self, name)[0] < rank
            if have is None or name in done or earlier:  # a later preset takes every dimension, equal ones too
                setattr(self, name, value)
                done.add(name)
                sources(self)[name] = (rank, by)
            elif self.preset != "custom" and have != value:
                raise ValueError(
                    f"model.{name}={have!r} contradicts model.preset {self.preset!r} ({name} {value}) in the same "
                    f"or a later source ({source_of(self, name)[1]}); unset it (model.{name}=null) to take the "
                    "preset's value, or use model.preset=custom"
                )
        try:
            check_dims(self.input_size, self.patch_size, self.hidden_size, self.num_heads)
        except ValueError as exc:
            raise ValueError(f"model: {exc}") from None
        if int(self.hidden_size * self.mlp_ratio) < 1:
            raise ValueError(
                f"model.mlp_ratio {self.mlp_ratio!r} gives the MLP int({self.hidden_size} x {self.mlp_ratio!r}) = "
                f"{int(self.hidden_size * self.mlp_ratio)} hidden units; it needs at least 1 (DiT: 4.0)"
            )


CUSTOM_DIMS = {"patch_size": 2, "hidden_size": 128, "depth": 6, "num_heads": 4}


@dataclass
class _DiffusionCore:
    """The diffusion formulation and its training objective."""

    formulation: str = option("ddpm", "the formulation (diffusion/registry.py)", FORMULATIONS)
    num_timesteps: int = positive(
        1000, "T: the timesteps of a discrete formulation, or the number of cells of a continuous one's axis"
    )
    prediction: str = option(
        "auto", "network target (auto: the formulation's own; each formulation trains its own set)", PREDICTIONS
    )
    learn_sigma: bool | str = option(
        "auto",
        "learn the variance with the IDDPM hybrid loss (network outputs 2C channels; auto: the formulation's own)",
        LEARN_SIGMA,
    )
    weighting: str = option(
        "auto", "per-timestep loss weighting of the MSE term (auto: the formulation's own)", WEIGHTINGS
    )
    min_snr_gamma: float = option(5.0, "gamma of the MinSNR weighting", lo=0.0, lo_open=True)
    ops_backend: str = option("auto", "backend of the fused ops (reference: the pure-torch definition)", OPS_BACKENDS)

    def validate(self) -> None:
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion.registry import formulation_class

        preds = formulation_class(self.formulation).limits["prediction"]
        if self.prediction not in preds:
            raise ValueError(
                f"diffusion.prediction {self.prediction!r} is not {with_article(self.formulation)} target; valid "
                f"choices: {', '.join(preds)}"
            )


@dataclass
class _TimestepsCore:
    """Timestep sampling: the strategy multiplied with the curriculum's unlock mask (docs/training.md)."""

    sampler: str = option(
        "uniform", "timestep strategy (times the curriculum's mask and the formulation's prior)", TIMESTEP_SAMPLERS
    )


@dataclass
class _TermsCore:
    """Training terms beyond the regression loss (``diffcurr_fast.terms``), each added with its weight."""

    use: list[str] = option([], "the terms the step adds, in order (terms/registry.py)")

    def validate(self) -> None:
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.terms.registry import SWITCHES, names

        valid = names()
        switch = next((u for u in self.use if u in SWITCHES), None)
        if switch is not None:
            key = load(SWITCHES[switch]).SWITCH
            raise ValueError(
                f"terms.use lists {switch!r}, which adds no loss and is not a term: it is the switch "
                f"terms.{key}=true; drop it from terms.use"
            )
        if any(u not in valid for u in self.use) or len(set(self.use)) != len(self.use):
            raise ValueError(f"terms.use {self.use!r}: each term once, from {', '.join(valid)}")


@dataclass
class CurriculumConfig:
    """Difficulty curriculum over timestep clusters (Kim et al., ICLR 2025)."""

    pacing: str = option("patience", "patience (the paper), fixed (NaiveCL), none (vanilla) or adaptive", PACINGS)
    num_clusters: int = positive(20, "N, the number of timestep clusters")
    method: str = option("snr", "clustering rule", CLUSTER_METHODS)
    order: str = option("easy_to_hard", "unlock order (hard_to_easy = anti-curriculum)", ORDERS)
    patience: int = nonneg(20, "evaluations without improvement before the next unlock")
    ema: float = unit(0.9, "decay of the monitored-loss EMA per evaluation, in [0, 1)", hi_open=True)
    min_delta: float = nonneg(1e-3, "relative decrease of the monitored loss that counts as an improvement")
    stage_iters: int = nonneg(0, "steps per stage for fixed pacing (0 = unset)")
    eval_every: int = positive(10, "steps per evaluation window")
    adaptive_floor: float = unit(0.5, "share of uniform sampling kept by adaptive pacing, in [0, 1]")

    def validate(self) -> None:
        if self.pacing == "fixed" and self.stage_iters < 1:
            raise ValueError("curriculum.stage_iters must be >= 1 when curriculum.pacing is 'fixed'")


@dataclass
class DataConfig:
    """Training data."""

    dataset: str = option(
        "digits",
        "digits (built in, 8x8), mnist5k (built in, 28x28, the mnist extra), npz (arrays x (N, C, H, W) and y "
        "(N,)), latents (a fast-DiT or sharded latent directory) or images (an ImageNet-layout folder)",
        DATASETS,
    )
    path: str = option("", "npz: a .npz file or a directory of x.npy and y.npy; latents / images: the directory")
    scale: float = option(
        1.0,
        "the model trains on scale * data (0.18215 for Stable Diffusion VAE latents; see docs)",
        lo=0.0,
        lo_open=True,
    )
    batch_size: int = positive(128, "global batch size (split evenly across ranks)")
    num_workers: int = nonneg(0, "DataLoader worker processes (0 = load in the training process); DALI CPU threads")
    image_size: int = nonneg(0, "images: ADM centre-crop size (0 = model.input_size)")
    hflip: bool = option(True, "images: random horizontal flips (decided per sample and epoch)")
    backend: str = option(
        "auto", "latents / images loader: auto (DALI on a GPU when importable), dali or torch", DATA_BACKENDS
    )
    dali_py_workers: int = nonneg(
        0, "images with DALI: forked Python workers reading the files (0: read in the pipeline's thread)"
    )
    on_bad: str = option("stop", "latents / images: a corrupt or unreadable file stops the run or is skipped", ON_BAD)

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
class _OptimCore:
    """The optimizer, learning-rate schedule, clipping and EMA."""

    lr: float = option(1e-4, "peak learning rate", lo=0.0, lo_open=True)
    weight_decay: float = nonneg(0.0, "AdamW weight decay")
    beta1: float = unit(0.9, "AdamW beta1", hi_open=True)
    beta2: float = unit(0.999, "AdamW beta2", hi_open=True)
    eps: float = option(1e-8, "AdamW epsilon", lo=0.0, lo_open=True)
    impl: str = option(
        "auto",
        "AdamW kernels: auto / torch (torch's fused kernel, CUDA and CPU) or apex (NVIDIA apex FusedAdam)",
        OPTIM_IMPLS,
    )
    name: str = option(
        "adamw", "the optimizer (optim/registry.py; each takes lr, betas, eps, weight_decay)", OPTIMIZERS
    )
    warmup_steps: int = nonneg(0, "linear warmup steps from 0 to lr")
    schedule: str = option("constant", "learning-rate schedule after warmup", LR_SCHEDULES)
    min_lr: float = nonneg(0.0, "final learning rate of the cosine schedule (<= lr)")
    grad_clip: float = nonneg(0.0, "clip the global gradient norm to this (0 = off)")
    grad_accum_steps: int = positive(1, "micro-batches per optimizer step (data.batch_size is split into them)")
    ema_decay: float = unit(0.9999, "EMA decay of the weights (DiT: 0.9999)")
    ema_warmup: bool = option(True, "use decay min(ema_decay, (1 + n) / (10 + n)) at update n")
    phema_every: int = nonneg(
        0,
        "post-hoc EMA (EDM2): steps between snapshots of the power-function averages under phema/, and one at "
        "the end; `sample` / `eval --ema-length` reconstruct any EMA length from them (0 = off)",
    )
    phema_sigma_rels: list[float] = option(
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

    kind: str = option("auto", "auto (ddp under torchrun, else single), single, ddp or deepspeed (ZeRO)", ENGINE_KINDS)
    deepspeed_config: str = option("", "deepspeed: DeepSpeed JSON (ZeRO stage, offload); batch, clip, bf16 filled in")
    device: str = option("auto", "auto (cuda when available), cpu or cuda", DEVICES)
    max_steps: int = positive(1000, "total optimizer steps (attempted steps, skipped ones included)")
    seed: int = option(0, "global seed (each rank adds its rank)", lo=0, hi=2**63 - 1)
    precision: str = option("fp32", "fp32, bf16 autocast, or auto (bf16 on a GPU that has it, fp32 on CPU)", PRECISIONS)
    tf32: bool = option(True, "allow TF32 matmuls on GPU")
    compile: bool = option(False, "torch.compile the model")
    grad_checkpointing: bool = option(False, "recompute each DiT block in the backward pass")
    nan_policy: str = option("skip", "on a non-finite loss: skip the step and count it, or stop", NAN_POLICIES)
    max_nan_skips: int = positive(100, "stop after more than this many skipped steps in a row (skip policy)")
    max_skip_share: float = unit(
        0.05,
        "stop once more than this share of engine.max_steps was skipped (skip "
        "policy; the error names the first skipped step)",
    )
    cpu_threads: int = option(0, "torch intra-op threads on CPU (0 = torch's default)", lo=0, hi=4096)
    retain_host_memory: bool = option(
        True,
        "CPU: keep freed host memory in the process (glibc mallopt) so each step's "
        "large tensors reuse mapped pages instead of page-faulting new ones",
    )
    cuda_graphs: bool = option(
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

    log_every: int = positive(10, "steps between metrics.jsonl records")
    progress: bool = option(True, "show a tqdm progress bar")
    tensorboard: bool = option(False, "also write TensorBoard scalars to tb/ (needs the tensorboard package)")
    wandb: bool = option(
        False,
        "also log the scalars to Weights & Biases (extra 'wandb'; the run id is kept in "
        "wandb_id.txt, so a resume continues the same run)",
    )
    wandb_project: str = option("diffcurr-fast", "wandb project")
    wandb_mode: str = option(
        "offline", "wandb offline (files under wandb/, upload later with `wandb sync`) or online", ("offline", "online")
    )
    num_samples: int = nonneg(64, "images in the end-of-run sample grid (0 = no grid)")
    sampler: str = option("auto", "sampler of the end-of-run grid (auto: the formulation's own)", SAMPLERS)
    sample_steps: int = positive(50, "sampling steps of the end-of-run grid")
    cfg_scale: float = nonneg(1.0, "classifier-free guidance scale of the end-of-run grid")
    plots: bool = option(True, "write the per-cluster loss and curriculum timeline plots at the end")
    eval_every: int = nonneg(0, "steps between evaluations of the EMA weights (FD etc., the eval section; 0 = off)")


@dataclass
class CheckpointConfig:
    """Run directory and checkpoints."""

    run_dir: str = option("runs/demo", "output directory of the run")
    every: int = positive(1000, "steps between checkpoints (a final one is always written)")
    keep_last: int = positive(3, "checkpoints kept (older ones are deleted)")
    export_ema: bool = option(True, "write the EMA weights as ema.safetensors at the end")

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

    num_samples: int = option(500, "images sampled per evaluation (labels cycle through the classes)", lo=2)
    steps: int = positive(50, "sampling steps")
    sampler: str = option("auto", "sampler (auto: the formulation's own)", SAMPLERS)
    cfg_scale: float = nonneg(1.0, "classifier-free guidance scale")
    features: str = option(
        "digits",
        "feature extractor: digits / mnist5k (classifiers of those built-in data) or inception (FID)",
        EVAL_FEATURES,
    )
    inception_weights: str = option("", "inception: local pytorch-fid weights file (never downloaded)")
    reference: str = option(
        "",
        "reference statistics or images .npz ('' = the training data; digits / mnist5k "
        "data: all digits / mnist5k's held-out split)",
    )
    num_reference: int = option(10000, "'' reference: training images used (at most)", lo=2)
    seed: int = option(0, "seed of the evaluation samples (the same noise at every evaluation)", lo=0, hi=2**63 - 1)

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

    num_groups: int = positive(3, "N, the number of timestep groups (one expert each)")
    budget_floor: float = option(
        0.5,
        "k of TDC Eq. 2, in (0, 1]: group i of N gets FLOPs(i) = (i/N + (N-i)/N k) F, so no expert falls below k F",
        lo=0.0,
        hi=1.0,
        lo_open=True,
    )
    group_method: str = option("db", "grouping rule on the SNR axis", GROUP_METHODS)
    full_budget: str = option("hardest", "which end of t gets the full budget F", FULL_BUDGET_ENDS)
    base_weights: str = option("ema", "stage-1 weights that stage 2 prunes", BASE_WEIGHTS)
    importance: str = option("taylor", "unit importance for pruning", IMPORTANCE_METHODS)
    importance_batches: int = positive(2, "batches of the Taylor importance (diffusion-loss gradients)")
    proposer: str = option("local", "candidate proposer of the proxy search", PROPOSERS)
    rounds: int = positive(2, "proxy-search rounds")
    candidates: int = positive(3, "candidates per round")
    recover_steps: int = nonneg(10, "AdamW steps that recover each candidate before it is scored")
    recover_lr: float = option(1e-4, "learning rate of the recovery steps", lo=0.0, lo_open=True)
    search_batches: int = positive(4, "training batches cycled by the recovery steps")
    heldout_batches: int = positive(2, "held-out batches of the proxy score (disjoint from the search batches)")
    search_batch_size: int = nonneg(0, "batch size of importance, recovery and proxy (0 = data.batch_size)")
    drop_empty_blocks: bool = option(False, "remove blocks left with no head and no channel")
    finetune_steps: int = positive(200, "stage-2 fine-tuning steps of every expert")
    finetune_lr: float = nonneg(0.0, "stage-2 peak learning rate (0 = optim.lr)")
    expert_parallel: bool = option(
        False,
        "stage 2 with the ranks split into min(N, world) parts, each searching and "
        "fine-tuning its own groups (DDP; false: every expert over all ranks)",
    )
    llm_url: str = option("", "llm proposer: OpenAI-compatible endpoint (https://host/v1)")
    llm_model: str = option("", "llm proposer: model name")
    llm_api_key_env: str = option("", "llm proposer: NAME of the environment variable holding the API key")
    llm_fallback: str = option(
        "none",
        "llm proposer whose endpoint gives no reply: none (stop with an error) or "
        "local (the local proposer fills the round, said on the console)",
        LLM_FALLBACKS,
    )
    seed: int = nonneg(0, "seed of the data split, importance and search")

    def validate(self) -> None:
        if self.proposer == "llm" and not (self.llm_url and self.llm_model):
            raise ValueError("tdc.proposer 'llm' needs tdc.llm_url and tdc.llm_model")


# ---- components ---------------------------------------------------------------------------------------------------
# The sections whose keys include their components' options: section -> (the field that selects among them, or None
# where each is turned on by its own field; the registry module; its table of name -> ``module:Class``). A table's
# entry is the component's class (whose ``Options`` are its options) or its ``Options`` class itself.
COMPONENTS: dict[str, tuple[tuple[str | None, str, str], ...]] = {
    "model": ((None, "diffcurr_fast.models.registry", "OPTIONS"),),
    "diffusion": (("formulation", "diffcurr_fast.diffusion.registry", "FORMULATIONS"),),
    "timesteps": (("sampler", "diffcurr_fast.timesteps.registry", "STRATEGIES"),),
    "terms": (("use", "diffcurr_fast.terms.registry", "TERMS"), (None, "diffcurr_fast.terms.registry", "SWITCHES")),
    "optim": (("name", "diffcurr_fast.optim.registry", "OPTIMIZERS"),),
}
_CORES: dict[str, type] = {
    "model": _ModelCore,
    "diffusion": _DiffusionCore,
    "curriculum": CurriculumConfig,
    "timesteps": _TimestepsCore,
    "terms": _TermsCore,
    "data": DataConfig,
    "optim": _OptimCore,
    "engine": EngineConfig,
    "logging": LoggingConfig,
    "checkpoint": CheckpointConfig,
    "eval": EvalConfig,
    "tdc": TDCConfig,
}
SECTION_NAMES = tuple(_CORES)


@dataclass(frozen=True)
class Component:
    """One registered component of a section: its name, the field that selects it (None: its own ``SWITCH``) and
    its options class."""

    section: str
    name: str
    selector: str | None
    options: type[Options]

    def used(self, section: Any) -> bool:
        """Whether the run whose section is ``section`` uses it."""
        if self.selector is None:
            return self.options.of(section).active()
        chosen = getattr(section, self.selector)
        return self.name in chosen if isinstance(chosen, list) else self.name == chosen

    @property
    def label(self) -> str:
        """How errors name it: ``terms.use sra``, ``timesteps.sampler 'anuts'``, ``model.routing``."""
        if self.selector is None:
            return f"{self.section}.{self.options.SWITCH or self.name}"
        if self.selector == "use":
            return f"{self.section}.{self.selector} {self.name}"
        return f"{self.section}.{self.selector} {self.name!r}"

    def how_to_use(self, section: Any) -> str:
        """How a user turns it on, for the error naming one of its options that is set while it is off."""
        if self.selector is None:
            key = f"{self.section}.{self.options.SWITCH}"
            return f"it applies only when {key} turns it on ({key} is {getattr(section, self.options.SWITCH)!r})"
        key, chosen = f"{self.section}.{self.selector}", getattr(section, self.selector)
        if isinstance(chosen, list):
            return f"{key} {chosen!r} does not list {self.name!r}; add it to {key}"
        return f"{key} is {chosen!r}; set {key}={self.name}"


def components(section: str) -> list[Component]:
    """The components registered for ``section`` now (a test may register one), in registry order."""
    out = []
    for selector, module, table in COMPONENTS.get(section, ()):
        for name, target in getattr(importlib.import_module(module), table).items():
            obj = load(target)
            out.append(Component(section, name, selector, getattr(obj, "Options", obj)))
    return out


_TYPES: dict[tuple, type] = {}


def section_type(name: str) -> type:
    """The dataclass of section ``name``: its own fields, then each component's options under their keys (a
    component's field's metadata names it: ``component``). Built on first use and again when a registry grew."""
    comps = components(name)
    key = (name, tuple((c.name, c.options) for c in comps))
    if key not in _TYPES:
        core, extra, seen = _CORES[name], [], {f.name for f in dataclasses.fields(_CORES[name])}
        for c in comps:
            for f in dataclasses.fields(c.options):
                k = c.options.PREFIX + f.name
                if k in seen:
                    raise ValueError(f"{name}.{k}: the options of {c.name!r} repeat a key of the section")
                seen.add(k)
                new = field(
                    default=f.default,
                    default_factory=f.default_factory,
                    metadata={**f.metadata, "component": c.name},
                )
                extra.append((k, hints(c.options)[f.name], new))
        cls_name = core.__name__.strip("_").replace("Core", "") + ("Config" if core.__name__.startswith("_") else "")
        _TYPES[key] = dataclasses.make_dataclass(
            cls_name, extra, bases=(core,), namespace={"__doc__": core.__doc__, "__module__": __name__}
        )
    return _TYPES[key]


def __getattr__(name: str) -> Any:
    """The composed section types of the sections with components (``ModelConfig``, ``DiffusionConfig``,
    ``TimestepsConfig``, ``TermsConfig``, ``OptimConfig``: ``section_type``); ``SECTIONS``: every section's type."""
    composed = {f"{sec.capitalize()}Config": sec for sec in COMPONENTS}
    if name in composed:
        return section_type(composed[name])
    if name == "SECTIONS":
        return {sec: section_type(sec) for sec in SECTION_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The fields whose ``auto`` follows diffusion.formulation -> their key in the formulation's ``defaults`` (and in its
# ``limits``, where it limits their values).
FORMULATION_FIELDS = {
    ("diffusion", "prediction"): "prediction",
    ("diffusion", "learn_sigma"): "learn_sigma",
    ("diffusion", "weighting"): "weighting",
    ("logging", "sampler"): "sampler",
    ("eval", "sampler"): "sampler",
}


@dataclass
class TrainConfig:
    """The whole training configuration (module doc)."""

    model: Any = field(default_factory=lambda: section_type("model")())
    diffusion: Any = field(default_factory=lambda: section_type("diffusion")())
    curriculum: CurriculumConfig = field(default_factory=CurriculumConfig)
    timesteps: Any = field(default_factory=lambda: section_type("timesteps")())
    terms: Any = field(default_factory=lambda: section_type("terms")())
    data: DataConfig = field(default_factory=DataConfig)
    optim: Any = field(default_factory=lambda: section_type("optim")())
    engine: EngineConfig = field(default_factory=EngineConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    tdc: TDCConfig = field(default_factory=TDCConfig)

    def validate(self) -> TrainConfig:
        """Resolve ``auto`` (``resolve_auto``), check every field (types, choices, ranges), the sections' own rules,
        the rules of each component the run uses and the options of those it does not (``check_unused``), then the
        cross-section rules; returns self."""
        self.resolve_auto()
        for sec in SECTION_NAMES:
            section = getattr(self, sec)
            for f in dataclasses.fields(section):
                check_value(f"{sec}.{f.name}", f, getattr(section, f.name), hints(type(section))[f.name])
            if hasattr(section, "validate"):  # the section's own cross-field rules, where it has any
                section.validate()
        self._check_formulation_fields()
        for comp, opts, used in self.components():
            if used:
                opts.validate(self)
            else:
                self.check_unused(comp)
        if self.curriculum.num_clusters > self.diffusion.num_timesteps:
            raise ValueError(
                f"curriculum.num_clusters ({self.curriculum.num_clusters}) must be <= diffusion.num_timesteps "
                f"({self.diffusion.num_timesteps})"
            )
        if self.engine.cuda_graphs:
            if self.optim.impl == "apex":
                raise ValueError(
                    "engine.cuda_graphs does not work with optim.impl 'apex' (its FusedAdam cannot skip an update on "
                    "the device); set engine.cuda_graphs=false"
                )
            self.check_refusals("cuda_graphs")
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

    def components(self) -> Iterator[tuple[Component, Options, bool]]:
        """(component, its options as this config holds them, whether the run uses it) of every section."""
        for sec in COMPONENTS:
            section = getattr(self, sec)
            for comp in components(sec):
                yield comp, comp.options.of(section), comp.used(section)

    def used(self) -> list[tuple[Component, Options]]:
        """(component, its options) of each component this run uses, in section and registry order."""
        return [(comp, opts) for comp, opts, used in self.components() if used]

    def check_refusals(self, use: str) -> None:
        """ValueError with the first refusal of ``use`` by a component the run uses (``Options.refusal``)."""
        for _, opts in self.used():
            reason = opts.refusal(self, use)
            if reason:
                raise ValueError(reason)

    def check_unused(self, comp: Component) -> None:
        """An option of ``comp``, which the run does not use, that the user set to another value than its default,
        in the same source as what turns the component off or a later one, is an error naming how to use it. Set in
        an earlier source (the recipe's, when a --set turns the component off) it yields; a record's (a saved
        config, which holds every key) is not a request."""
        section = getattr(self, comp.section)
        switch = comp.selector or comp.options.SWITCH
        off_rank = source_of(section, switch)[0]
        defaults = comp.options()
        for key, name in comp.options.keys().items():
            rank, label = source_of(section, key)
            if key == switch or getattr(section, key) == getattr(defaults, name):
                continue
            if rank == 0 or is_record(self, rank) or rank < off_rank:
                continue
            raise ValueError(
                f"{comp.section}.{key} ({label}) is an option of {comp.name!r}, which this run does not use: "
                f"{comp.how_to_use(section)}, or drop {comp.section}.{key}"
            )

    def _check_formulation_fields(self) -> None:
        """The fields of ``FORMULATION_FIELDS`` hold values the formulation allows (its ``limits``; the prediction is
        the diffusion section's own check, the evaluation sampler counts only when evaluations run)."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion.registry import formulation_class

        form = self.diffusion.formulation
        limits = formulation_class(form).limits
        for (sec, key), name in FORMULATION_FIELDS.items():
            valid, value = limits.get(name), getattr(getattr(self, sec), key)
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
        """The fields of ``FORMULATION_FIELDS`` that are ``auto`` take the formulation's own choice (its
        ``defaults``). One set by an earlier source than ``diffusion.formulation`` (the recipe when the formulation is
        an override) that does not apply to that formulation yields to it as well; set in the same source or a later
        one, it stays, and ``validate`` says why it cannot be used."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion.registry import formulation_class

        form = self.diffusion.formulation
        rank, where = source_of(self.diffusion, "formulation")
        cls = formulation_class(form)
        own, limits = cls.defaults, cls.limits
        for (sec, key), default_key in FORMULATION_FIELDS.items():
            section = getattr(self, sec)
            value, done = getattr(section, key), filled(section)
            fits = default_key not in limits or value in limits[default_key]
            yields = not fits and source_of(section, key)[0] < rank and value != "auto" and key not in done
            if value == "auto" or key in done or yields:
                note = f"; {value!r} ({source_of(section, key)[1]}) does not apply to {form}" if yields else ""
                setattr(section, key, own[default_key])
                done.add(key)
                sources(section)[key] = (rank, f"auto: diffusion.formulation {form!r} ({where}){note}")
        for comp, opts, used in self.components():  # a component a later choice rules out turns off
            overruled = opts.overruled(self) if used and comp.selector is None else None
            if overruled is not None:
                section = getattr(self, comp.section)
                setattr(section, comp.options.SWITCH, getattr(comp.options(), comp.options.SWITCH))
                filled(section).add(comp.options.SWITCH)
                sources(section)[comp.options.SWITCH] = overruled

    def sources(self) -> dict[str, str]:
        """``section.field`` -> the source that set it (a recipe, the demo, --set, a preset, auto), for the fields
        not left at their defaults."""
        return {
            f"{sec.name}.{k}": label
            for sec in dataclasses.fields(self)
            for k, (_, label) in sources(getattr(self, sec.name)).items()
        }

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON-serialisable): every key, but the options of the components the run does
        not use (they take their defaults when it is read back)."""
        out = dataclasses.asdict(self)
        for comp, _, used in self.components():
            if not used:
                switch = comp.selector or comp.options.SWITCH
                for key in comp.options.keys():
                    if key != switch:
                        out[comp.section].pop(key, None)
        return out


# ---- building ------------------------------------------------------------------------------------------
def config_from_dict(
    data: dict[str, Any] | None, base: TrainConfig | None = None, source: str = "config", *, record: bool = False
) -> TrainConfig:
    """Build (and validate) a config from a nested dict over ``base`` (defaults); unknown keys are errors. The dict
    is one source, named ``source`` in the recorded provenance (``TrainConfig.sources``); ``record``: a saved config
    (a run's ``config.yaml``, a checkpoint's), which holds the options of the components it did not use too."""
    cfg = base if base is not None else TrainConfig()
    src = new_source(cfg, source, record=record)
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"a config must be a mapping of sections, got {type(data).__name__}")
    for sec_name, values in data.items():
        if sec_name not in SECTION_NAMES:
            raise ValueError(f"unknown config section {sec_name!r}; valid sections: {', '.join(SECTION_NAMES)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"config section {sec_name!r} must be a mapping, got {values!r}")
        for key, value in values.items():
            set_key(cfg, f"{sec_name}.{key}", value, src)
    return cfg.validate()


# Keys that configs saved by earlier versions hold (a checkpoint's, a TDC run's tdc.json, a bundle's
# train_config.json): removed (None) or renamed. ``upgrade_saved`` reads them; a recipe or --set that names one is an
# error (saying what a renamed key became).
LEGACY_KEYS = {("diffusion", "fused_ops"): None, ("tdc", "k"): "budget_floor"}


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``TrainConfig.to_dict`` of this or an earlier version) in today's keys: its ``LEGACY_KEYS``
    dropped or renamed. A new dict; ``data`` is not changed. (A key an earlier version did not have takes its
    default.)"""
    out = {sec: dict(values) if isinstance(values, dict) else values for sec, values in data.items()}
    for (sec, old), new in LEGACY_KEYS.items():
        if isinstance(out.get(sec), dict) and old in out[sec]:
            value = out[sec].pop(old)
            if new is not None:
                out[sec].setdefault(new, value)
    return out


def key_type(dotted: str) -> Any:
    """The type of the config key ``section.field``; None for an unknown key."""
    sec, _, name = dotted.partition(".")
    return hints(section_type(sec)).get(name) if sec in SECTION_NAMES else None


def set_key(cfg: TrainConfig, dotted: str, value: Any, source: tuple[int, str] = DEFAULT_SOURCE) -> None:
    """Set ``section.field`` of ``cfg`` to ``value`` (checked: ``options.check_value``) as set by ``source``
    (``options.new_source``); ValueError naming the key for an unknown one (and what a renamed key became)."""
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"config keys look like section.field, got {dotted!r}; sections: {', '.join(SECTION_NAMES)}")
    sec_name, key = parts
    if sec_name not in SECTION_NAMES:
        raise ValueError(
            f"unknown config section {sec_name!r} in {dotted!r}; valid sections: {', '.join(SECTION_NAMES)}"
        )
    section = getattr(cfg, sec_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        renamed = f" (renamed {sec_name}.{LEGACY_KEYS[sec_name, key]})" if LEGACY_KEYS.get((sec_name, key)) else ""
        raise ValueError(f"unknown config key {dotted!r}{renamed}; valid keys of {sec_name}: {', '.join(fields)}")
    tp = hints(type(section))[key]
    value = check_value(dotted, fields[key], coerce(dotted, value, tp), tp)
    setattr(section, key, value)
    filled(section).discard(key)  # set by the user now, not filled from a preset or auto
    if value is None or value == "auto":  # back to what validate fills in
        sources(section).pop(key, None)
    else:
        sources(section)[key] = source


# Sections whose values must match between a checkpoint and the run resuming from it (they define the model,
# the objective and the curriculum's state); the others (steps, LR, logging, ...) may change on resume.
RESUME_LOCKED = ("model", "diffusion", "curriculum", "timesteps", "terms")
# Keys of other sections that must match too: the batches (their size and order) and every RNG stream derive from
# them, and the optimizer's state is of the kind optim.name names, so a resume with another value could not continue
# the run it names.
RESUME_LOCKED_KEYS = (("data", "batch_size"), ("engine", "seed"), ("optim", "name"))
# Keys of the locked sections that may differ: the initial weights only matter for a fresh start.
RESUME_FREE = {("model", "init_from")}


def resume_mismatches(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Keys of the locked sections whose values differ between ``saved`` (a ``to_dict``) and ``cfg``; a key the
    saved config predates counts as its default (a checkpoint written before a section or a key existed), and the
    options of a component ``cfg`` does not use are not compared (what turns it off is)."""
    now = cfg.to_dict()
    diffs = []
    for sec in RESUME_LOCKED:
        defaults = dataclasses.asdict(section_type(sec)())
        a, b = saved.get(sec, defaults), now[sec]
        for key in sorted(b):
            if (sec, key) in RESUME_FREE:
                continue
            was = a[key] if key in a else defaults.get(key)  # a key newer than the checkpoint
            if was != b.get(key):
                diffs.append(f"{sec}.{key}: checkpoint {was!r} vs now {b.get(key)!r}")
    for sec, key in RESUME_LOCKED_KEYS:  # a key newer than the checkpoint: its default
        a, b = saved.get(sec, {}).get(key, getattr(section_type(sec)(), key)), now[sec][key]
        if a != b:
            diffs.append(f"{sec}.{key}: checkpoint {a!r} vs now {b!r}")
    return diffs
