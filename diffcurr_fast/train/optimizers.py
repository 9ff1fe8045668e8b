"""The optimizer of a run (``optim.name``), built from ``optim.*``, and the one check of its options.

- ``adamw`` (the default): torch's AdamW, ``fused=True`` on CUDA and CPU, or NVIDIA apex's FusedAdam in AdamW mode
  (``optim.impl=apex``, CUDA only).
- ``muon``: ``torch.optim.Muon`` (Jordan et al. 2024; Liu et al., "Muon is Scalable for LLM Training", arXiv
  2502.16982) on the hidden matrices of the DiT blocks, the weights of each block's attention (qkv, proj) and MLP
  (fc1, fc2; SwiGLU's w12, w3): ``muon_params``. Muon orthogonalises a matrix's momentum (Newton-Schulz, 5 steps,
  Nesterov momentum ``optim.muon_momentum``), which only means something for a matrix that maps hidden features to
  hidden features. Every other parameter, the patch embedding (a convolution), the timestep and label embedders (an
  embedding table and the layers on the sinusoidal frequencies), the adaLN modulation (the conditioning's map to
  per-channel shifts and scales), the final layer, the norms, the biases, SPRINT's fusion layer and the training
  terms' heads, takes torch's fused AdamW. ``MuonAdamW`` steps both as one optimizer, at one learning rate: Muon
  scales each matrix's orthogonalised update by 0.2 sqrt(max(A, B)) (``adjust_lr_fn="match_rms_adamw"``, Moonlight),
  which gives it the update RMS of AdamW (about 0.2), so the ``optim.lr`` and ``optim.weight_decay`` tuned for AdamW
  serve both groups. torch's Muon runs its Newton-Schulz products in bfloat16, as the reference code does: native
  on a GPU, emulated (slow) on a CPU without bf16 arithmetic.
- ``schedule_free``: ``schedulefree.AdamWScheduleFree`` (Defazio et al., "The Road Less Scheduled", arXiv
  2405.15682; the ``schedulefree`` extra). It keeps z (the base sequence of AdamW steps) in its state and two points
  on the parameters: the gradient is taken at y = (1 - beta1) z + beta1 x, and x, the average of the z with weights
  c_t = lr_t^2 / sum_i lr_i^2, is the point a run evaluates, with no decay schedule (``optim.schedule`` constant).
  Between steps the parameters hold x: ``at_train_point`` moves them to y for the step's forward, backward and
  update only (the optimizer's ``train()`` and ``eval()``), so everything that reads the weights between steps (the
  EMA and the post-hoc EMA updates, evaluation during training, the sample grid, checkpoints, the EMA export, TDC's
  stages) reads x, and a checkpoint (x, z and the moments) resumes bit-identically. The trainer's linear warmup
  (``optim.warmup_steps``) is schedule-free's own: the ramp of the learning rate it is given enters the weights
  c_t through lr_t^2, as its ``warmup_steps`` would (``tests/train/test_train_optimizers.py``).
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from diffcurr_fast.runs.config import TrainConfig

MUON_ADJUST_LR = "match_rms_adamw"  # Muon's update scaled to AdamW's RMS: one optim.lr for both groups


def apex_fused_adam():
    """NVIDIA apex's ``FusedAdam`` class, or None (apex absent, or the unrelated PyPI package of that name)."""
    try:
        from apex.optimizers import FusedAdam  # optional dependency (NVIDIA apex, CUDA builds only)
    except Exception:  # ImportError, or a broken apex build
        return None
    return FusedAdam


def check_optimizer(cfg: TrainConfig, device: torch.device) -> None:
    """ValueError (ImportError for a missing package) unless the optimizer of ``cfg.optim`` can run on ``device``
    with the run's schedule and engine; the preflight runs it before anything is written."""
    o, e = cfg.optim, cfg.engine
    if o.name != "adamw":
        if o.impl == "apex":
            raise ValueError(
                f"optim.impl=apex picks AdamW's kernel (apex FusedAdam); optim.name={o.name} steps with its own "
                "optimizer: use optim.impl=auto, or optim.name=adamw"
            )
        if e.kind == "deepspeed":
            raise ValueError(
                f"optim.name={o.name} does not run under engine.kind=deepspeed: DeepSpeed hands the optimizer flat "
                "partitions of the weights (ZeRO 1-3), where Muon finds no matrices and schedule-free's switch to "
                "the averaged point never reaches the model; use engine.kind=ddp"
            )
        if e.cuda_graphs:
            raise ValueError(
                f"engine.cuda_graphs skips a non-finite step on the device through torch's fused AdamW, which "
                f"optim.name={o.name} does not step with; set engine.cuda_graphs=false or optim.name=adamw"
            )
    if o.name == "schedule_free":
        if o.schedule != "constant":
            raise ValueError(
                f"optim.name=schedule_free replaces the learning-rate decay by its average of the iterates; "
                f"optim.schedule={o.schedule} would decay it too: set optim.schedule=constant (optim.warmup_steps "
                "is its warmup)"
            )
        if importlib.util.find_spec("schedulefree") is None:
            raise ImportError(
                "optim.name=schedule_free needs the schedulefree package: pip install 'diffcurr-fast[schedulefree]'"
            )
    if o.impl != "apex":
        return
    if apex_fused_adam() is None:
        raise ValueError(
            "optim.impl=apex needs NVIDIA apex (apex.optimizers.FusedAdam, built from NVIDIA's "
            "sources; the PyPI package 'apex' is unrelated); use optim.impl=auto"
        )
    if device.type != "cuda":
        raise ValueError(f"optim.impl=apex runs on CUDA only, the trainer's device is {device}")


def muon_params(model: nn.Module) -> list[str]:
    """The names of the parameters Muon takes (module doc): the non-empty 2-D weights of each block's ``attn`` and
    ``mlp``. A pruned-away width (TDC) leaves an empty matrix, which stays with AdamW."""
    names = []
    for i, block in enumerate(getattr(model, "blocks", ())):
        for part in ("attn", "mlp"):
            for name, p in getattr(block, part).named_parameters():
                if p.requires_grad and p.ndim == 2 and p.numel():
                    names.append(f"blocks.{i}.{part}.{name}")
    return names


class MuonAdamW:
    """``torch.optim.Muon`` over some parameters and AdamW over the others, stepped as one optimizer:
    ``param_groups`` lists the groups of both (the engine sets each one's ``lr``), ``state_dict`` holds both."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer):
        self.muon, self.adamw = muon, adamw

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [*self.muon.param_groups, *self.adamw.param_groups]

    @torch.no_grad()
    def step(self) -> None:
        self.muon.step()
        self.adamw.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none=set_to_none)
        self.adamw.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_optimizer(model: nn.Module, cfg: TrainConfig, device: torch.device) -> Any:
    """The optimizer of ``cfg.optim.name`` over the trainable parameters of ``model`` (module doc), once
    ``check_optimizer`` has passed."""
    check_optimizer(cfg, device)
    optim = cfg.optim
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=optim.weight_decay)
    if optim.name == "schedule_free":
        import schedulefree  # optional dependency (the schedulefree extra; check_optimizer said how to install it)

        # warmup_steps=0: the trainer's warmup ramps the lr it sets every step, which the averaging weights see
        return schedulefree.AdamWScheduleFree(params, warmup_steps=0, **kw)
    if optim.impl == "apex":
        return apex_fused_adam()(params, adam_w_mode=True, **kw)
    # torch's fused AdamW (one kernel over all parameters) runs on CUDA and on CPU; it matches the per-parameter
    # loop to float32 rounding (tests/train/test_train_sync.py), and a resumed run repeats the uninterrupted one
    # exactly.
    fused = device.type in ("cuda", "cpu")
    if optim.name == "adamw":
        return torch.optim.AdamW(params, fused=fused, **kw)
    named = dict(model.named_parameters())
    to_muon = muon_params(model)
    if not to_muon:
        raise ValueError(f"optim.name=muon found no block matrices in the {type(model).__name__} (model.blocks)")
    chosen = {id(named[n]) for n in to_muon}
    muon = torch.optim.Muon(
        [named[n] for n in to_muon],
        lr=optim.lr,
        weight_decay=optim.weight_decay,
        momentum=optim.muon_momentum,
        nesterov=True,
        adjust_lr_fn=MUON_ADJUST_LR,
    )
    return MuonAdamW(muon, torch.optim.AdamW([p for p in params if id(p) not in chosen], fused=fused, **kw))


@contextlib.contextmanager
def at_train_point(optimizer: Any) -> Iterator[None]:
    """Inside: the parameters at the point where the optimizer takes its gradient and updates; outside, at the
    point that every reader of the weights gets. One point for AdamW and Muon; schedule-free AdamW: y inside and
    the averaged point x outside (module doc), through its ``train()`` and ``eval()``."""
    points = callable(getattr(optimizer, "train", None))  # schedulefree's optimizers; torch's have no train()
    if points:
        optimizer.train()
    try:
        yield
    finally:
        if points:
            optimizer.eval()
