"""The run config's sections that hold no component's options: the diffusion section's own fields (the formulation,
its prediction and weighting; each formulation's fields are its own, ``diffusion/``), and the trainer's sections
(engine, logging, checkpoint, evaluation during training, TDC), which the config below the trainer declares for it
(``train``, ``eval`` and ``tdc`` import their choices from here). Light: a command's ``--help`` imports it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from diffcurr_fast.options import nonneg, option, positive, unit


def _owned(module: str, name: str, *, before: tuple = ()) -> Callable[[], tuple]:
    """The valid values of a choice field as its owner defines them (``module.name``, after ``before``), read when a
    value is checked, so that importing the config (a command's ``--help``) stays light and a registry may grow."""

    def values() -> tuple:
        return (*before, *getattr(importlib.import_module(module), name))

    return values


# Every choice of a lower layer is defined by the module that implements it; a section only refers to it.
FORMULATIONS = _owned("diffcurr_fast.diffusion.registry", "FORMULATIONS")
PREDICTIONS = _owned("diffcurr_fast.diffusion", "ALL_PREDICTIONS", before=("auto",))
WEIGHTINGS = _owned("diffcurr_fast.diffusion.weights", "WEIGHTINGS", before=("auto",))
OPS_BACKENDS = _owned("diffcurr_fast.ops._backend", "BACKENDS", before=("auto",))
PRECISIONS = _owned("diffcurr_fast.objective", "PRECISIONS")
SAMPLERS = _owned("diffcurr_fast.runs.sampling", "SAMPLERS", before=("auto",))
LEARN_SIGMA = ("auto", True, False)
# The trainer's choices are defined here, below it (``train`` imports them from this module).
ENGINE_KINDS = ("auto", "single", "ddp", "deepspeed")
DEVICES = ("auto", "cpu", "cuda")
NAN_POLICIES = ("skip", "stop")


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


@dataclass
class DiffusionOptions:
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
