"""Curriculum pacing over timestep clusters (Kim et al., ICLR 2025: curriculum and pacing function).

Clusters are half-open ranges in ascending ``t`` (see ``clustering.py``); the easiest is the one with the highest
``t`` (lowest SNR). Training samples ``t`` uniformly from the *union* of unlocked clusters; after the last unlock
every timestep is live, which is ordinary uniform training (``finished``).

Pacing rules (each a small class, chosen by name from ``PACING_RULES``: ``PatiencePacing``, ``FixedPacing``,
``Pacing`` for none, ``AdaptivePacing``):

- ``patience`` (the paper's adaptive pacing): every ``eval_every`` steps the mean loss of that window (all-reduced
  across ranks) updates an EMA, the monitored loss. An evaluation *improves* when the EMA drops below the best
  value of the current stage by more than the fraction ``min_delta`` of it (relative, so one setting fits any loss
  scale; it must be > 0 in practice, because an EMA creeping down onto a flat loss improves by ever smaller
  amounts and would otherwise never stall); after ``patience`` consecutive evaluations without improvement the
  next cluster unlocks. The paper's maximum patience tau (in iterations) is
  ``patience * eval_every``; the defaults (``patience=20``, ``eval_every=10``) give its tau = 200 with N = 20.
- ``fixed`` (NaiveCL): the next cluster unlocks every ``stage_iters`` observed steps.
- ``none`` (vanilla): all clusters are unlocked from the start.
- ``adaptive`` (beyond the paper, its stated future work): ``patience`` pacing until every cluster is unlocked,
  then clusters are sampled in proportion to their recent learning progress, mixed with a floor (below).

Comparability across stages: adding a harder cluster changes the loss *scale* (an eps-prediction loss is larger
at low ``t``), so the union's loss after an unlock is not comparable with the best value before it: kept, it would
count every evaluation as "no improvement" and unlock the remaining clusters in quick succession. The best value,
the EMA and the no-improvement counter are therefore reset at every unlock; each stage is judged against itself.

Adaptive sampling: per-cluster losses (``observe_per_timestep``) feed a fast EMA (decay ``ema``) and a slow EMA
(decay ``1 - (1 - ema) / 2``, twice the time constant); progress_k = max(slow_k - fast_k, 0) / slow_k is the
relative recent decrease of cluster k's loss. Cluster k then gets probability
``floor * |C_k| / T + (1 - floor) * progress_k / sum_j progress_j`` (uniform training when no cluster is
improving), spread uniformly over its timesteps.

Synchronisation: ``observe`` keeps the window's loss sum on the loss's device and reads it back once per
``eval_every`` steps (one all-reduce and one host copy); a non-finite loss is detected at that read-back and
reported with the first step that produced it.

Masked steps (the trainer's device-side step, ``engine.cuda_graphs``): ``observe(..., ok)`` with a 0-d bool device
tensor counts the step only where ``ok`` holds, without reading it back. Its loss is added as 0 where it does not,
and the window and stage lengths count it until they are read: when one of them reaches its end, the skipped steps
(a device count) are read back and taken out, and the window or stage ends only if none was skipped. So windows,
evaluations and unlocks fall on the steps where they fall when skipped steps are not observed at all; each window
that had skipped steps costs one more read-back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from diffcurr_fast.curriculum.clustering import CLUSTER_METHODS, Clusters, check_clusters
from diffcurr_fast.options import nonneg, option, positive, unit


class Pacing:
    """When the next cluster unlocks. This base is ``none`` (vanilla): every cluster is unlocked from the start."""

    name = "none"
    starts_unlocked = True  # every cluster is unlocked from the start
    reweights = False  # once all are unlocked, clusters are sampled by their learning progress

    def unlock_after_step(self, cur: Curriculum) -> bool:
        """After each observed step: unlock the next cluster now?"""
        return False

    def unlock_after_eval(self, cur: Curriculum) -> bool:
        """After each evaluation window: unlock the next cluster now?"""
        return False


class PatiencePacing(Pacing):
    """The paper's pacing function (Kim et al., ICLR 2025; max patience tau = patience x eval_every): unlock after
    ``patience`` evaluations without improvement of the monitored loss."""

    name = "patience"
    starts_unlocked = False

    def unlock_after_eval(self, cur: Curriculum) -> bool:
        return cur.bad_evals >= cur.patience


class FixedPacing(Pacing):
    """NaiveCL (the paper's baseline): unlock every ``stage_iters`` observed steps."""

    name = "fixed"
    starts_unlocked = False

    def unlock_after_step(self, cur: Curriculum) -> bool:
        return cur._steps_in_stage >= cur.stage_iters


class AdaptivePacing(PatiencePacing):
    """Patience pacing, then clusters sampled by their recent learning progress (beyond the paper: its stated future
    work; module doc)."""

    name = "adaptive"
    reweights = True


PACING_RULES: dict[str, type[Pacing]] = {c.name: c for c in (PatiencePacing, FixedPacing, Pacing, AdaptivePacing)}
PACINGS = tuple(PACING_RULES)  # patience, fixed, none, adaptive
ORDERS = ("easy_to_hard", "hard_to_easy")

_NO_BAD_STEP = 2**62


def dist_active() -> bool:
    """``torch.distributed`` is initialised with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def collective_device(device: torch.device) -> torch.device:
    """Where a collective on tensors of ``device`` runs: NCCL reduces CUDA tensors, gloo (and MPI) CPU tensors."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device()) if device.type != "cuda" else device
    return torch.device("cpu")


class Curriculum:
    """Difficulty curriculum over timestep clusters with patience, fixed, vanilla or adaptive pacing.

    Args:
        clusters: half-open ranges in ascending ``t`` partitioning [0, num_timesteps) (``cluster_timesteps``).
        num_timesteps: T, the number of timesteps (or grid points) the weights are defined on.
        pacing: ``patience`` (default, the paper), ``fixed`` (NaiveCL), ``none`` (vanilla) or ``adaptive``.
        order: ``easy_to_hard`` (default: highest ``t`` first) or ``hard_to_easy`` (anti-curriculum).
        patience: evaluations without improvement tolerated before the next unlock (>= 0).
        ema: decay of the monitored-loss EMA per evaluation, in [0, 1) (0 = the window mean itself).
        min_delta: relative decrease of the EMA below the stage's best that counts as an improvement (>= 0):
            improved iff EMA < best - min_delta * |best|.
        stage_iters: observed steps per stage for ``fixed`` pacing (required there, >= 1).
        eval_every: steps per evaluation window (>= 1); the only steps that synchronise with the host.
        adaptive_floor: share of uniform sampling kept by ``adaptive`` pacing, in [0, 1].

    Under ``torch.distributed`` the window statistics are all-reduced over ``process_group`` (attribute; None:
    every rank), so all ranks of one run decide together.
    """

    process_group = None

    def __init__(
        self,
        clusters: Clusters,
        num_timesteps: int,
        pacing: str = "patience",
        order: str = "easy_to_hard",
        patience: int = 20,
        ema: float = 0.9,
        min_delta: float = 1e-3,
        stage_iters: int | None = None,
        eval_every: int = 10,
        adaptive_floor: float = 0.5,
    ) -> None:
        self.clusters = check_clusters(clusters, num_timesteps)
        self.num_timesteps = num_timesteps
        # The config's field check covers the ranges of a run's values; a direct caller still gets the rules that
        # would otherwise fail later or silently: the choices, and the stage length that ``fixed`` pacing needs.
        if pacing not in PACINGS:
            raise ValueError(f"unknown pacing {pacing!r}; choose one of {PACINGS}")
        if order not in ORDERS:
            raise ValueError(f"unknown order {order!r}; choose one of {ORDERS}")
        if pacing == "fixed" and not (isinstance(stage_iters, int) and stage_iters >= 1):
            raise ValueError(f"pacing='fixed' needs stage_iters, a positive int; got {stage_iters!r}")
        if not (isinstance(eval_every, int) and eval_every >= 1):
            raise ValueError(f"eval_every must be a positive int, got {eval_every!r}")
        self.pacing = pacing
        self._rule = PACING_RULES[pacing]()
        self.order = order
        self.patience = patience
        self.ema = float(ema)
        self.min_delta = float(min_delta)
        self.stage_iters = stage_iters
        self.eval_every = eval_every
        self.adaptive_floor = float(adaptive_floor)

        n = len(self.clusters)
        # Unlock order: cluster indices (into the ascending-t list), easiest first for easy_to_hard.
        self._order = list(range(n - 1, -1, -1)) if order == "easy_to_hard" else list(range(n))
        self._bounds = torch.tensor([hi for _, hi in self.clusters[:-1]], dtype=torch.long)  # (N - 1,)
        self._sizes = torch.tensor([hi - lo for lo, hi in self.clusters], dtype=torch.float64)  # (N,)
        self._bounds_on: dict[torch.device, torch.Tensor] = {}  # cluster boundaries cached per device

        # ---- decision state (all of it goes into state_dict) ----
        self._stage = n - 1 if self._rule.starts_unlocked else 0
        self.history: list[int] = []
        self._steps_in_stage = 0
        self._monitor: float | None = None  # EMA of window means in the current stage
        self._best = math.inf
        self._bad_evals = 0
        # ---- device accumulators of the current window ----
        self._win_sum: torch.Tensor | None = None  # 0-d float32
        self._win_count = 0
        self._bad_step: torch.Tensor | None = None  # 0-d int64, first step with a non-finite loss
        self._cl_sum: torch.Tensor | None = None  # (N,) float32
        self._cl_count: torch.Tensor | None = None  # (N,) float32
        self._skipped: torch.Tensor | None = None  # 0-d int64, masked steps skipped since the counts were exact
        # ---- per-cluster EMAs (host floats, NaN until a cluster has been seen) ----
        self._cl_fast = [math.nan] * n
        self._cl_slow = [math.nan] * n
        self._weights: torch.Tensor | None = None

    def __repr__(self) -> str:
        return (
            f"Curriculum(num_clusters={self.num_clusters}, num_timesteps={self.num_timesteps}, "
            f"pacing={self.pacing!r}, order={self.order!r}, stage={self.stage}, finished={self.finished})"
        )

    # ---- read-only views -----------------------------------------------------------------------------
    @property
    def num_clusters(self) -> int:
        """N, the number of clusters."""
        return len(self.clusters)

    @property
    def stage(self) -> int:
        """Number of unlocks so far: stage s trains on the first s + 1 clusters of the unlock order."""
        return self._stage

    @property
    def finished(self) -> bool:
        """True once every cluster is unlocked (uniform training, or adaptive sampling)."""
        return self._stage == self.num_clusters - 1

    @property
    def unlocked_clusters(self) -> list[int]:
        """Indices (into ``clusters``, ascending t) of the unlocked clusters, in unlock order."""
        return self._order[: self._stage + 1]

    @property
    def monitored_loss(self) -> float | None:
        """The current stage's EMA of window-mean losses (None before its first evaluation)."""
        return self._monitor

    @property
    def best_loss(self) -> float:
        """The lowest monitored loss of the current stage (inf before its first evaluation)."""
        return self._best

    @property
    def bad_evals(self) -> int:
        """Consecutive evaluations without improvement in the current stage."""
        return self._bad_evals

    def cluster_of(self, t: torch.Tensor) -> torch.Tensor:
        """Cluster index (into ``clusters``) of each timestep in ``t``, same shape, int64, on ``t``'s device."""
        t = torch.as_tensor(t)
        if t.dtype.is_floating_point or t.dtype == torch.bool:
            raise ValueError(f"t must be an integer tensor of timestep indices, got dtype {t.dtype}")
        bounds = self._bounds_on.get(t.device)
        if bounds is None:
            bounds = self._bounds_on[t.device] = self._bounds.to(t.device)
        return torch.bucketize(t.long(), bounds, right=True)

    # ---- sampling distribution -----------------------------------------------------------------------
    def cluster_probabilities(self) -> torch.Tensor:
        """(N,) float64 probability of sampling each cluster under the current state."""
        probs = torch.zeros(self.num_clusters, dtype=torch.float64)
        live = torch.tensor(self.unlocked_clusters, dtype=torch.long)
        probs[live] = self._sizes[live] / self._sizes[live].sum()  # uniform over the union
        if self._rule.reweights and self.finished:
            progress = torch.tensor(
                [
                    max(slow - fast, 0.0) / slow if math.isfinite(fast) and math.isfinite(slow) and slow > 0 else 0.0
                    for fast, slow in zip(self._cl_fast, self._cl_slow)
                ],
                dtype=torch.float64,
            )
            if float(progress.sum()) > 0:
                probs = self.adaptive_floor * probs + (1.0 - self.adaptive_floor) * progress / progress.sum()
        return probs

    def timestep_weights(self) -> torch.Tensor:
        """(T,) float32 sampling weights summing to 1, zero on every locked cluster (CPU tensor, cached)."""
        if self._weights is None:
            probs = self.cluster_probabilities()
            w = torch.zeros(self.num_timesteps, dtype=torch.float64)
            for k, (lo, hi) in enumerate(self.clusters):
                if probs[k] > 0:
                    w[lo:hi] = probs[k] / (hi - lo)
            self._weights = (w / w.sum()).to(torch.float32)
        return self._weights

    # ---- observing the training loss -----------------------------------------------------------------
    def observe(self, step: int, loss: float | torch.Tensor, ok: torch.Tensor | None = None) -> bool:
        """Record the training loss of ``step``; returns True when this call unlocked a cluster.

        ``loss`` is a float or a 0-d tensor on any device; it is accumulated where it lives and read back only at
        the end of each ``eval_every`` window. Raises ValueError (naming the step) on a NaN/inf loss. ``ok``: a 0-d
        bool tensor on the loss's device; the step counts only where it holds (module doc: masked steps).
        """
        step = int(step)
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                raise ValueError(f"loss must be a scalar (0-d tensor or float), got shape {tuple(loss.shape)}")
            value = loss.detach().reshape(()).to(torch.float32)
        else:
            value = float(loss)
            if not math.isfinite(value):
                raise ValueError(f"non-finite training loss {value} at step {step}")
            value = torch.tensor(value, dtype=torch.float32)
        if ok is not None:
            value = torch.where(ok, value, torch.zeros_like(value))
            self._skipped = (~ok).to(torch.int64) if self._skipped is None else self._skipped + ~ok
        if self._win_sum is None or self._win_sum.device != value.device:
            self._move_window(value.device)
        self._win_sum += value
        self._bad_step = torch.where(
            torch.isfinite(value) | (self._bad_step != _NO_BAD_STEP),
            self._bad_step,
            torch.full_like(self._bad_step, step),
        )
        self._win_count += 1
        self._steps_in_stage += 1
        unlocked = False
        if not self.finished and self._rule.unlock_after_step(self) and self._settled():
            self._unlock(step)
            unlocked = True
        if self._win_count >= self.eval_every and self._settled():
            unlocked = self._evaluate(step) or unlocked
        return unlocked

    def observe_per_timestep(
        self, t: torch.Tensor, per_sample_loss: torch.Tensor, ok: torch.Tensor | None = None
    ) -> None:
        """Accumulate per-sample losses by cluster on their device (for logging and ``adaptive`` pacing).

        ``t`` (B,) int timesteps and ``per_sample_loss`` (B,) losses; non-finite values are caught by ``observe``'s
        check of the batch mean. The sums are folded into per-cluster EMAs at the next evaluation. ``ok``: a 0-d
        bool tensor; where it is false nothing is added.
        """
        t = torch.as_tensor(t)
        loss = torch.as_tensor(per_sample_loss).detach()
        if t.ndim != 1 or loss.shape != t.shape:
            raise ValueError(
                f"t and per_sample_loss must both have shape (B,), got {tuple(t.shape)} and {tuple(loss.shape)}"
            )
        if self._cl_sum is None or self._cl_sum.device != loss.device:
            self._move_cluster_sums(loss.device)
        k = self.cluster_of(t.to(loss.device))  # (B,)
        loss, one = loss.to(torch.float32), torch.ones_like(loss, dtype=torch.float32)
        if ok is not None:  # a skipped step adds 0 to the sums and the counts
            loss, one = torch.where(ok, loss, 0.0), torch.where(ok, one, 0.0)
        self._cl_sum.index_add_(0, k, loss)
        self._cl_count.index_add_(0, k, one)

    def cluster_losses(self) -> torch.Tensor:
        """(N,) float64 per-cluster loss EMA as of the last evaluation (NaN for clusters not seen yet)."""
        return torch.tensor(self._cl_fast, dtype=torch.float64)

    # ---- internals -----------------------------------------------------------------------------------
    def _move_window(self, device: torch.device) -> None:
        self._win_sum = (torch.zeros((), dtype=torch.float32) if self._win_sum is None else self._win_sum).to(device)
        self._bad_step = (
            torch.tensor(_NO_BAD_STEP, dtype=torch.long) if self._bad_step is None else self._bad_step
        ).to(device)

    def _move_cluster_sums(self, device: torch.device) -> None:
        n = self.num_clusters
        self._cl_sum = (torch.zeros(n) if self._cl_sum is None else self._cl_sum).to(device)
        self._cl_count = (torch.zeros(n) if self._cl_count is None else self._cl_count).to(device)

    def _reduce_window(self) -> tuple[float, torch.Tensor, torch.Tensor]:
        """Read back (and all-reduce across ranks) the window mean and the per-cluster sums and counts."""
        if self._cl_sum is None:
            self._move_cluster_sums(self._win_sum.device)
        dev = self._win_sum.device
        packed = torch.cat([self._win_sum.reshape(1), self._cl_sum.to(dev), self._cl_count.to(dev)])  # (1 + 2N,)
        world = 1
        if dist_active():
            world = dist.get_world_size(self.process_group)
            dev = collective_device(dev)
            buf = packed.to(dev)
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.process_group)
            packed = buf
        host = packed.to("cpu", torch.float64)
        n = self.num_clusters
        mean = float(host[0]) / (self._win_count * world)
        return mean, host[1 : 1 + n], host[1 + n :]

    def _first_bad_step(self) -> int:
        bad = self._bad_step
        if dist_active():
            buf = bad.to(collective_device(bad.device)).clone()
            dist.all_reduce(buf, op=dist.ReduceOp.MIN, group=self.process_group)
            bad = buf
        value = int(bad)
        return value if value != _NO_BAD_STEP else -1

    def _evaluate(self, step: int) -> bool:
        mean, cl_sum, cl_count = self._reduce_window()
        if not math.isfinite(mean):
            first = self._first_bad_step()
            where = f"step {first}" if first >= 0 else f"the window ending at step {step} (another rank)"
            raise ValueError(f"non-finite training loss {mean} at {where}")
        self._win_sum.zero_()
        self._cl_sum.zero_()
        self._cl_count.zero_()
        self._win_count = 0
        self._update_cluster_emas(cl_sum, cl_count)
        # Kim et al. pacing function (max patience tau): count evaluations without improvement of the monitored loss.
        self._monitor = mean if self._monitor is None else self.ema * self._monitor + (1.0 - self.ema) * mean
        threshold = self._best - self.min_delta * abs(self._best) if math.isfinite(self._best) else math.inf
        if self._monitor < threshold:
            self._best = self._monitor
            self._bad_evals = 0
        else:
            self._bad_evals += 1
        if not self.finished and self._rule.unlock_after_eval(self):
            self._unlock(step)
            return True
        return False

    def _update_cluster_emas(self, cl_sum: torch.Tensor, cl_count: torch.Tensor) -> None:
        slow_decay = 1.0 - (1.0 - self.ema) / 2.0  # twice the fast EMA's time constant
        changed = False
        for k in range(self.num_clusters):
            if cl_count[k] <= 0:
                continue
            m = float(cl_sum[k] / cl_count[k])
            if not math.isfinite(m):
                raise ValueError(f"non-finite per-timestep loss in cluster {k} {self.clusters[k]}")
            fast, slow = self._cl_fast[k], self._cl_slow[k]
            self._cl_fast[k] = m if math.isnan(fast) else self.ema * fast + (1.0 - self.ema) * m
            self._cl_slow[k] = m if math.isnan(slow) else slow_decay * slow + (1.0 - slow_decay) * m
            changed = True
        if changed and self._rule.reweights and self.finished:
            self._weights = None

    def _settled(self) -> bool:
        """True when the window and stage lengths are exact; otherwise (masked steps were skipped since the last
        read) take the skipped steps out of both and return False. The count is read back here, at the end of a
        window or stage only."""
        if self._skipped is None:
            return True
        n = int(self._skipped)
        self._skipped = None
        self._win_count -= n
        self._steps_in_stage -= n
        return n == 0

    def _unlock(self, step: int) -> None:
        self._stage += 1
        self.history.append(step)
        self._steps_in_stage = 0
        # The union's loss scale changes at an unlock: judge the new stage only against itself.
        self._monitor = None
        self._best = math.inf
        self._bad_evals = 0
        self._weights = None

    # ---- checkpointing -------------------------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {
            "clusters": [list(c) for c in self.clusters],
            "num_timesteps": self.num_timesteps,
            "pacing": self.pacing,
            "order": self.order,
            "patience": self.patience,
            "ema": self.ema,
            "min_delta": self.min_delta,
            "stage_iters": self.stage_iters,
            "eval_every": self.eval_every,
            "adaptive_floor": self.adaptive_floor,
        }

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume: configuration, decision state and the current window's accumulators."""
        self._settled()  # exact counts: a skipped masked step is counted until the next read
        return {
            "config": self._config(),
            "stage": self._stage,
            "history": list(self.history),
            "steps_in_stage": self._steps_in_stage,
            "monitor": self._monitor,
            "best": self._best,
            "bad_evals": self._bad_evals,
            "win_count": self._win_count,
            "win_sum": None if self._win_sum is None else self._win_sum.detach().cpu().clone(),
            "bad_step": None if self._bad_step is None else self._bad_step.detach().cpu().clone(),
            "cl_sum": None if self._cl_sum is None else self._cl_sum.detach().cpu().clone(),
            "cl_count": None if self._cl_count is None else self._cl_count.detach().cpu().clone(),
            "cl_fast": list(self._cl_fast),
            "cl_slow": list(self._cl_slow),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore ``state_dict()``; raises ValueError if it was saved with a different configuration."""
        saved = state.get("config")
        mine = self._config()
        if saved != mine:
            diff = sorted(k for k in set(mine) | set(saved or {}) if (saved or {}).get(k) != mine.get(k))
            raise ValueError(f"curriculum state was saved with a different configuration (differs in {diff})")
        self._stage = int(state["stage"])
        self.history = [int(s) for s in state["history"]]
        self._steps_in_stage = int(state["steps_in_stage"])
        self._monitor = None if state["monitor"] is None else float(state["monitor"])
        self._best = float(state["best"])
        self._bad_evals = int(state["bad_evals"])
        self._win_count = int(state["win_count"])
        self._win_sum = None if state["win_sum"] is None else state["win_sum"].clone()
        self._bad_step = None if state["bad_step"] is None else state["bad_step"].clone()
        self._cl_sum = None if state["cl_sum"] is None else state["cl_sum"].clone()
        self._cl_count = None if state["cl_count"] is None else state["cl_count"].clone()
        self._cl_fast = [float(v) for v in state["cl_fast"]]
        self._cl_slow = [float(v) for v in state["cl_slow"]]
        self._weights = None
        self._skipped = None


@dataclass
class CurriculumOptions:
    """Difficulty curriculum over timestep clusters (Kim et al., ICLR 2025)."""

    pacing: str = option(
        "patience", "patience (the paper), fixed (NaiveCL), none (vanilla) or adaptive", lambda: PACINGS
    )
    num_clusters: int = positive(20, "N, the number of timestep clusters")
    method: str = option("snr", "clustering rule", lambda: CLUSTER_METHODS)
    order: str = option("easy_to_hard", "unlock order (hard_to_easy = anti-curriculum)", lambda: ORDERS)
    patience: int = nonneg(20, "evaluations without improvement before the next unlock")
    ema: float = unit(0.9, "decay of the monitored-loss EMA per evaluation, in [0, 1)", hi_open=True)
    min_delta: float = nonneg(1e-3, "relative decrease of the monitored loss that counts as an improvement")
    stage_iters: int = nonneg(0, "steps per stage for fixed pacing (0 = unset)")
    eval_every: int = positive(10, "steps per evaluation window")
    adaptive_floor: float = unit(0.5, "share of uniform sampling kept by adaptive pacing, in [0, 1]")

    def validate(self) -> None:
        if self.pacing == "fixed" and self.stage_iters < 1:
            raise ValueError("curriculum.stage_iters must be >= 1 when curriculum.pacing is 'fixed'")
