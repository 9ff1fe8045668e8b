"""The training objective: one definition of the per-sample diffusion loss, shared by every trainer.

For a batch x0 (B, C, H, W), cells k (B,) on the formulation's difficulty axis and a Philox seed:

    draw  = formulation.training_draw(k)              # t, t_in and per-sample a, c, p, q, w
    x_in  = a x0 + c eps(seed)                         # ops.q_sample_coef, the noise made in-kernel
    out   = model(x_in, t_in, y)                       # (B, C or 2C, H, W)
    loss  = w * mean_j (out - (p x0 + q eps(seed)))^2  # ops.diffusion_loss_coef, the same noise regenerated
          (+ the formulation's variance term when the variance is learned: IDDPM's L_vlb)
          (+ sum_i lambda_i term_i(...): training terms that read the same pass's features, ``terms.base``)

in the spirit of Karras et al.'s ``training/loss.py`` (NVlabs): the formulation owns its equations and this module never
asks which one it has; nor does it name a training term or a model option: each comes with its own options. The trainer
(``train.loop``), TDC (importance, proxy recovery and scoring, fine-tuning) and the difficulty analysis
(``analysis.difficulty``) all call it; ``fit_steps`` is the plain AdamW loop the short fine-tunes share. The fused ops'
``reference`` backend is the pure-torch definition of the same computation (``diffusion.ops_backend``), not a separate
code path."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from diffcurr_fast.diffusion import Formulation, TrainingDraw, build_formulation
from diffcurr_fast.models.routing import Route
from diffcurr_fast.ops import diffusion_loss_coef, philox_randn, q_sample_coef, sample_timesteps
from diffcurr_fast.terms.base import TermInputs, TrainingTerm
from diffcurr_fast.terms.registry import build_terms, noise_pairing

PRECISIONS = ("fp32", "bf16", "auto")


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """``fp32`` or ``bf16`` for ``precision`` on ``device``: ``auto`` is bf16 on a CUDA device that supports it and
    fp32 elsewhere (bf16 autocast brings no speed on CPUs, and is emulated, much slower, on those without bf16
    instructions)."""
    if precision != "auto":
        return precision
    dev = torch.device(device)
    return "bf16" if dev.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"


class Objective:
    """Per-sample training loss of a diffusion model on cells of ``formulation``'s axis (module doc).

    Args:
        formulation: a ``DDPMSchedule``, ``EDMFormulation`` or ``FlowFormulation``.
        num_cells: G, the cells the timesteps are drawn from (DDPM: its T timesteps).
        prediction, weighting, gamma: the regression target and its per-sample weight (MinSNR gamma).
        learn_sigma: add the formulation's variance term (the network outputs 2C channels).
        backend: backend of the fused ops (``auto``, ``cuda``, ``triton``, ``cpu``, ``reference``).
        precision: ``fp32``, or ``bf16`` autocast around the network call.
        terms: (weight, term) pairs added to the per-sample loss (``terms.base``); the network is asked for the
            features they read.
        route: token routing in training (``models.routing.Route``): the kept tokens of each sample, drawn from the
            step's generator and passed as ``route=`` when the network is in training mode.
        pairing: x0, noise -> the image each noise stream trains on (a switch of the ``terms`` section,
            ``terms.registry.noise_pairing``); the data are permuted, the noise stays in place. None: in order.
    """

    def __init__(
        self,
        formulation: Formulation,
        *,
        num_cells: int,
        prediction: str,
        weighting: str = "none",
        gamma: float = 5.0,
        learn_sigma: bool = False,
        backend: str = "auto",
        precision: str = "fp32",
        terms: Sequence[tuple[float, TrainingTerm]] = (),
        route: Route | None = None,
        pairing: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ):
        formulation.check_prediction(prediction)
        self.formulation, self.num_cells = formulation, int(num_cells)
        self.prediction, self.weighting, self.gamma = prediction, weighting, float(gamma)
        self.learn_sigma, self.backend, self.precision = bool(learn_sigma), backend, precision
        self.terms = [(float(w), term) for w, term in terms]
        self.features = tuple(sorted({j for _, term in self.terms for j in term.features}))
        self.route = route
        self.needs_noise = any(term.needs_noise for _, term in self.terms)
        self.pairing = pairing

    @classmethod
    def from_config(cls, cfg: Any, formulation: Formulation | None = None) -> Objective:
        """The objective of a ``TrainConfig`` (its diffusion section, engine precision, token routing and terms)."""
        d = cfg.diffusion
        return cls(
            formulation if formulation is not None else build_formulation(d),
            num_cells=d.num_timesteps,
            prediction=d.prediction,
            weighting=d.weighting,
            gamma=d.min_snr_gamma,
            learn_sigma=d.learn_sigma,
            backend=d.ops_backend,
            precision=cfg.engine.precision,
            terms=build_terms(cfg),
            route=Route.from_config(cfg),
            pairing=noise_pairing(cfg),
        )

    def draw(self, k: torch.Tensor, generator: torch.Generator | None = None) -> TrainingDraw:
        """The per-sample terms at cells ``k`` (B,) (a point inside each continuous cell drawn from ``generator``)."""
        return self.formulation.training_draw(k, self.num_cells, self.prediction, self.weighting, self.gamma, generator)

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """bf16 autocast for ``precision`` bf16 (``auto``: see ``resolve_precision``), else a no-op context."""
        if resolve_precision(self.precision, device) == "bf16":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def __call__(
        self,
        model: Callable[..., torch.Tensor],
        x0: torch.Tensor,
        y: torch.Tensor,
        k: torch.Tensor,
        *,
        seed: int,
        generator: torch.Generator | None = None,
        routed: bool = True,
    ) -> torch.Tensor:
        """(B,) per-sample loss of ``model(x_in, t_in, y)`` on x0 (B, C, H, W) at cells ``k`` with noise ``seed``.
        ``routed``: draw the kept tokens of token routing (when the objective has ``route`` and the model trains)."""
        noise = philox_randn(seed, tuple(x0.shape), x0.device) if self.pairing else None  # (B, C, H, W) eps
        if noise is not None:  # noise stream b trains on the image the pairing assigns it
            order = self.pairing(x0, noise)  # (B,)
            x0, y = x0[order], y[order]  # (B, C, H, W), (B,)
        draw = self.draw(k, generator)
        x_in = q_sample_coef(x0, draw.a, draw.c, seed=seed, backend=self.backend)  # (B, C, H, W)
        t_in = draw.t_in.to(x0.dtype) if draw.t_in.is_floating_point() else draw.t_in
        kw: dict[str, Any] = {}
        if self.route is not None and routed and getattr(model, "training", False):
            idx = self.route.draw(x0.shape[0], generator, x0.device)  # (B, K), None when every token is kept
            if idx is not None:
                kw["route"] = idx
        with self.autocast(x0.device):
            if not self.features:
                out, feats = model(x_in, t_in, y, **kw), {}  # (B, C or 2C, H, W)
            else:  # the features the terms read come from the same pass
                out, feats = model(x_in, t_in, y, features=self.features, **kw)  # feats: {j: (B, T, D)}
        per = self.loss(out, x0, x_in, draw, seed)  # (B,)
        if self.terms:
            if noise is None and self.needs_noise:
                noise = philox_randn(seed, tuple(x0.shape), x0.device)  # (B, C, H, W) eps
            inputs = TermInputs(x0, y, draw, x_in, seed, out[:, : x0.shape[1]].to(x0.dtype), feats, noise)
            inputs.cells, inputs.num_cells, inputs.redraw = k, self.num_cells, self.draw  # a teacher's other levels
            inputs.autocast = lambda: self.autocast(x0.device)
            for weight, term in self.terms:
                per = per + weight * term(inputs).to(per.dtype)  # (B,)
        return per

    @staticmethod
    def mean(per_sample: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
        """The batch loss: mean_b w_b L_b, with ``weights`` (B,) a timestep sampler's importance correction (e.g.
        1 / (G p_k), Nichol & Dhariwal 2021 Sec. 3.3: the mean stays the uniform-t one), or the plain mean."""
        return per_sample.mean() if weights is None else (per_sample * weights.to(per_sample.dtype)).mean()

    def loss(
        self, out: torch.Tensor, x0: torch.Tensor, x_in: torch.Tensor, draw: TrainingDraw, seed: int
    ) -> torch.Tensor:
        """(B,) loss of the network output ``out`` for the draw (``x_in``, ``draw``, ``seed``)."""
        out = out.to(x0.dtype)  # bf16 autocast output: the loss reads it in the data's precision
        pred = out[:, : x0.shape[1]]  # (B, C, H, W), a view with out's batch stride: the loss reads it in place
        per = diffusion_loss_coef(
            pred, x0, None, draw.p, draw.q, draw.w, reduction="none", seed=seed, backend=self.backend
        )
        if self.learn_sigma:  # only DDPM has one; its network input is x_t itself (a, c = sqrt(abar), ...)
            per = per + self.formulation.variance_loss(out, x0, x_in, draw.t, self.prediction)
        return per


def default_objective(formulation: Formulation | Objective, model: nn.Module) -> Objective:
    """``formulation`` itself when it is an ``Objective``; otherwise its plain eps objective (DDPM's timesteps as
    cells, the variance term when ``model`` learns sigma)."""
    if isinstance(formulation, Objective):
        return formulation
    return Objective(
        formulation,
        num_cells=formulation.num_timesteps,
        prediction="eps",
        learn_sigma=bool(getattr(model, "learn_sigma", False)),
    )


def draw_seed(generator: torch.Generator) -> int:
    """A Philox seed for one batch, drawn from ``generator`` in [0, 2**62): micro-batch i uses seed + i, which must
    stay a valid seed (``ops.philox.draw_seed`` spans all of int64, so it cannot serve here)."""
    return int(torch.randint(0, 2**62, (1,), generator=generator))


def batch_loss(
    objective: Objective,
    model: Callable[..., torch.Tensor],
    x0: torch.Tensor,
    y: torch.Tensor,
    weights: torch.Tensor,
    generator: torch.Generator,
) -> torch.Tensor:
    """Mean loss of ``model`` on x0 with cells drawn from ``weights`` (G,) by ``ops.sample_timesteps`` (as the
    trainer draws; e.g. the timesteps component's ``weights()`` on a TDC group or an analysis interval), its seed and
    the noise's from ``generator``."""
    if not isinstance(weights, torch.Tensor) or weights.shape != (objective.num_cells,):
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights).__name__
        raise ValueError(f"cell weights must be a ({objective.num_cells},) tensor, got {got}")
    k = sample_timesteps(x0.shape[0], weights, generator=generator, device=x0.device, backend=objective.backend)
    return objective(model, x0, y, k, seed=draw_seed(generator), generator=generator).mean()


def fit_steps(
    model: nn.Module,
    objective: Objective,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]] | Callable[[int], tuple[torch.Tensor, torch.Tensor]],
    weights: torch.Tensor,
    steps: int,
    *,
    lr: float,
    weight_decay: float = 0.0,
    generator: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
) -> list[float]:
    """``steps`` plain AdamW steps of ``objective`` on cells drawn from ``weights`` (G,) (``batch_loss``); returns the
    per-step losses.

    ``batches`` is a sequence of ``(x0, y)`` batches (cycled) or a function of the step giving one. ``on_step(step,
    loss)`` runs after each step (1-based).
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    get = batches if callable(batches) else (lambda s, b=list(batches): b[s % len(b)])
    if steps and not callable(batches) and not batches:
        raise ValueError("fit_steps needs at least one (x0, y) batch")
    losses: list[float] = []
    if not steps:
        return losses
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay)
    model.train()
    for step in range(steps):
        x0, y = get(step)
        loss = batch_loss(objective, model, x0, y, weights, generator)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = float(loss.detach())
        losses.append(value)
        if on_step is not None:
            on_step(step + 1, value)
    return losses


__all__ = [
    "PRECISIONS",
    "Objective",
    "batch_loss",
    "default_objective",
    "draw_seed",
    "fit_steps",
    "resolve_precision",
]
