"""Adaptive non-uniform timestep sampling (Kim, Ki, Shim, Lee, "Adaptive Non-uniform Timestep Sampling for
Accelerating Diffusion Model Training", CVPR 2025, arXiv 2411.09998; official code ku-dmlab/Adaptive-Timestep-Sampler).

The paper learns the sampling distribution online: a policy pi_phi over timesteps is trained by policy gradient
(REINFORCE) to choose the timesteps whose update most decreases the objective. The decrease over all timesteps is
too costly to measure, so its surrogate is the decrease at a small subset S of timesteps, chosen as the timesteps
whose decrease best predicts the total decrease (a univariate regression score over a buffer of recent
measurements), measured on the training batch before and after the step.

Here, every ``every`` steps (the paper's and the official code's update interval 20):

1. ``probe``: the trainer measures the per-sample training loss at ``candidates`` cells evenly spaced over
   the axis, on the first ``probe_batch`` samples of the batch, with one fixed noise draw, before the step and
   after it; D = before - after, (C, n).
2. d = mean_n D (C,) and its total sum(d) go into a buffer of the last ``buffer`` updates. S is the ``probes``
   candidates with the largest squared correlation of d_c with the total over the buffer (the F statistic of
   scikit-learn's ``f_regression``, which ``SelectKBest`` ranks by, is monotone in it); until the buffer holds two
   updates, S is ``probes`` evenly spaced candidates.
3. The reward r = sum_{c in S} d_c (the surrogate of the objective's decrease, the paper's Delta~). REINFORCE:
   ascend mean_i (r - b) grad log pi(k_i) + ``entropy`` grad H(pi) over the step's draws k_i, with Adam (lr
   ``lr``); b is a running mean of r (decay 0.9; the official ``use_baseline`` option).

Choices made here (the paper's policy is a network of x0 giving a Beta over t; t is drawn here for the whole batch
from one weight vector): pi is one Beta(a, b) over the cell axis u = (k + 0.5) / G, parameters log a, log b (start
a = b = 1: uniform), its cell probabilities the Beta density at the cell centres, normalised (the discretisation of
the official round(Beta sample x (T - 1))); the loss is the trainer's objective (its per-sample loss, for every
formulation), not the L_vlb term that only DDPM has; the candidates are ``candidates`` cells, not all T; the
probe samples are the batch's first ``probe_batch``. The policy is updated on the host once per ``every`` steps
(one read-back); the reward and the gradient are averaged over the ranks, so every rank holds the same policy.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch

from diffcurr_fast.options import Options, nonneg, option, positive
from diffcurr_fast.timesteps.base import TimestepSampler, all_reduce_mean


@dataclass
class ANUTSOptions(Options):
    """anuts's options in the ``timesteps`` section (keys ``timesteps.anuts_*``)."""

    PREFIX = "anuts_"
    every: int = positive(20, "anuts: steps between policy updates (each probes the loss before and after)")
    candidates: int = positive(16, "anuts: cells, evenly spaced, whose loss decrease is measured")
    probes: int = positive(3, "anuts: size of the subset S whose decrease is the reward")
    probe_batch: int = positive(4, "anuts: samples of the batch the probes are measured on")
    buffer: int = option(10, "anuts: updates kept to choose S by correlation with the total decrease", lo=2)
    lr: float = option(0.02, "anuts: Adam learning rate of the policy's log a, log b", lo=0.0, lo_open=True)
    entropy: float = nonneg(0.0, "anuts: weight of the policy's entropy bonus")

    def validate(self, cfg: Any) -> None:
        if self.probes > self.candidates:
            raise ValueError(
                f"timesteps.anuts_probes {self.probes} must be <= timesteps.anuts_candidates {self.candidates}"
            )

    def refusal(self, cfg: Any, use: str) -> str | None:
        if use == "cuda_graphs":
            return (
                "engine.cuda_graphs does not work with timesteps.sampler 'anuts' (its policy update reads losses "
                "back); set engine.cuda_graphs=false"
            )
        return None


class ANUTS(TimestepSampler):
    """The adaptive sampler of Kim et al. (CVPR 2025) on ``num_cells`` cells (module doc)."""

    name = "anuts"
    Options = ANUTSOptions

    def __init__(
        self,
        num_cells: int,
        every: int = 20,
        candidates: int = 16,
        probes: int = 3,
        probe_batch: int = 4,
        buffer: int = 10,
        lr: float = 0.02,
        entropy: float = 0.0,
    ):
        super().__init__(num_cells)
        for name, v, lo in (
            ("every", every, 1),
            ("candidates", candidates, 1),
            ("probes", probes, 1),
            ("probe_batch", probe_batch, 1),
            ("buffer", buffer, 2),
        ):
            if int(v) < lo:
                raise ValueError(f"timesteps.anuts_{name} must be >= {lo}, got {v}")
        if probes > min(candidates, num_cells):
            raise ValueError(f"timesteps.anuts_probes {probes} exceeds the candidates ({min(candidates, num_cells)})")
        self.every, self.probe_batch, self.buffer = int(every), int(probe_batch), int(buffer)
        self.entropy = float(entropy)
        c = min(int(candidates), num_cells)
        self.candidates = torch.linspace(0, num_cells - 1, c).round().long().unique()  # (C,)
        self.probes = int(probes)
        self.theta = torch.zeros(2, dtype=torch.float64, requires_grad=True)  # log a, log b
        self.opt = torch.optim.Adam([self.theta], lr=lr)
        self.baseline: float | None = None
        self.rows: list[torch.Tensor] = []  # buffer of d (C,) float64
        self.selected = self._spread()  # (P,) indices into candidates
        self.updates = 0
        self._k: torch.Tensor | None = None
        self._w: torch.Tensor | None = None
        self._u = (torch.arange(num_cells, dtype=torch.float64) + 0.5) / num_cells  # (G,) Beta axis

    @classmethod
    def from_config(cls, t: Any, formulation: Any, num_cells: int) -> ANUTS:
        return cls(
            num_cells,
            t.anuts_every,
            t.anuts_candidates,
            t.anuts_probes,
            t.anuts_probe_batch,
            t.anuts_buffer,
            t.anuts_lr,
            t.anuts_entropy,
        )

    def _spread(self) -> torch.Tensor:
        return torch.linspace(0, self.candidates.numel() - 1, self.probes).round().long()

    def log_probs(self) -> torch.Tensor:
        """(G,) float64 log pi(k): the Beta(a, b) log density at the cell centres, normalised (differentiable)."""
        a, b = self.theta.exp()
        logp = (a - 1.0) * torch.log(self._u) + (b - 1.0) * torch.log1p(-self._u)
        return torch.log_softmax(logp, 0)

    def weights(self) -> torch.Tensor:
        if self._w is None:
            with torch.no_grad():
                self._w = self.log_probs().exp()
        return self._w

    def probe(self, step: int) -> tuple[torch.Tensor, int, int] | None:
        """The candidates on ``probe_batch`` samples every ``every`` steps; the noise seed is a function of the
        update count (no random stream is used)."""
        if (step + 1) % self.every:
            return None
        return self.candidates, self.probe_batch, 1_000_003 * (self.updates + 1) + 17

    def observe(
        self, k: torch.Tensor, per_sample_loss: torch.Tensor, step: int | None = None, ok: torch.Tensor | None = None
    ) -> None:
        # ok: the config refuses anuts with engine.cuda_graphs (the policy update reads the probe losses on the host)
        self._k = k.detach()  # the draws of the step, for the policy gradient if it is probed

    def observe_probe(self, before: torch.Tensor, after: torch.Tensor) -> None:
        d = (before - after).to(torch.float64).mean(dim=1)
        d = all_reduce_mean(d, self.process_group).cpu()  # (C,) averaged over the run's ranks
        self.rows = (self.rows + [d])[-self.buffer :]
        if len(self.rows) >= 2:
            x = torch.stack(self.rows)  # (R, C)
            y = x.sum(dim=1)  # (R,) total decrease
            xc, yc = x - x.mean(0), y - y.mean()
            corr2 = (xc * yc[:, None]).sum(0) ** 2 / ((xc**2).sum(0) * (yc**2).sum()).clamp(min=1e-300)
            self.selected = torch.sort(torch.topk(corr2, self.probes).indices).values
        reward = float(d[self.selected].sum())  # the surrogate Delta~ of the objective's decrease
        self.baseline = reward if self.baseline is None else 0.9 * self.baseline + 0.1 * reward
        adv = reward - self.baseline
        k = self._k.cpu() if self._k is not None else torch.zeros(0, dtype=torch.long)
        self.opt.zero_grad()
        logp = self.log_probs()
        p = logp.exp()
        objective = adv * logp[k].mean() if k.numel() else logp.sum() * 0.0
        objective = objective - self.entropy * (p * logp).sum()  # + entropy bonus H(pi)
        (-objective).backward()
        self.theta.grad = all_reduce_mean(self.theta.grad, self.process_group)
        self.opt.step()
        self.updates += 1
        self._w = None

    def state_dict(self) -> dict[str, Any]:
        return {
            "theta": self.theta.detach().clone(),
            "opt": copy.deepcopy(self.opt.state_dict()),
            "baseline": self.baseline,
            "rows": [r.clone() for r in self.rows],
            "selected": self.selected.clone(),
            "updates": self.updates,
            "k": None if self._k is None else self._k.cpu().clone(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with torch.no_grad():
            self.theta.copy_(state["theta"])
        self.opt.load_state_dict(copy.deepcopy(state["opt"]))
        self.baseline = state["baseline"]
        self.rows = [r.clone() for r in state["rows"]]
        self.selected = state["selected"].clone()
        self.updates = int(state["updates"])
        self._k = state["k"]
        self._w = None
