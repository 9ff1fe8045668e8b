"""Proxy-based pruning (TDC, arXiv 2312.13307, Sec. 3.3): pruning as a multi-round decision process.

Each round a proposer sees the state (base per-block widths, the FLOPs budget, per-unit costs and the memory bank of
candidates tried so far with their FLOPs and proxy scores) and proposes width allocations (heads and MLP channels
per block). Proposals are checked here, once, whatever proposed them: invalid ones (widths out of range, over
budget), repeats of the bank or of the round, and any beyond the round's size are rejected and counted by reason. A
candidate is pruned from the base model by importance (``prune_to_widths``), fine-tuned for a few steps on the
group's timesteps (``recover``) and scored by the proxy (``proxy_loss``: the group's diffusion loss on held-out
batches with fixed t and noise, so candidates are compared on identical draws; lower is better). The memory bank
keeps every scored candidate and steers the next round.

A proposer is any object with a ``name`` and ``propose(state, n, rng)`` (``Proposer``); the built-in ones
(``local``, ``uniform``, ``llm``) live in ``proposers.py`` and ``llm.py`` and are built by name with
``make_proposer``. This module imports none of them.
"""

from __future__ import annotations

import logging
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from diffcurr_fast._files import write_json
from diffcurr_fast._lazy import pyplot
from diffcurr_fast.runs.checkpoint import atomic_save
from diffcurr_fast.tdc.flops import default_widths, dit_flops, widths_flops
from diffcurr_fast.tdc.proxy import proxy_loss, recover
from diffcurr_fast.tdc.prune import Batches, Importance, prune_to_widths, unit_costs

__all__ = [
    "Candidate",
    "MemoryBank",
    "Proposer",
    "ProposerUnavailable",
    "SearchResult",
    "SearchState",
    "plot_history",
    "proxy_search",
    "validate_widths",
]

logger = logging.getLogger(__name__)


@dataclass
class Candidate:
    """A width allocation with its per-sample FLOPs and proxy score (None until scored)."""

    heads: list[int]
    mlp: list[int]
    flops: int
    score: float | None = None
    round: int = 0
    source: str = ""

    def key(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Hashable identity of the allocation."""
        return tuple(self.heads), tuple(self.mlp)


class MemoryBank:
    """Every candidate tried so far, with FLOPs and proxy score; lookups by allocation and best-first views."""

    def __init__(self) -> None:
        self.entries: list[Candidate] = []
        self._keys: set = set()

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, widths: tuple[Sequence[int], Sequence[int]]) -> bool:
        return (tuple(widths[0]), tuple(widths[1])) in self._keys

    def add(self, cand: Candidate) -> None:
        """Store a scored candidate (a repeated allocation is an error: proposals are deduplicated first)."""
        if cand.score is None or not math.isfinite(cand.score):
            raise ValueError(f"only candidates with a finite score can be stored, got score={cand.score!r}")
        if cand.key() in self._keys:
            raise ValueError(f"allocation already in the memory bank: heads={cand.heads}, mlp={cand.mlp}")
        self.entries.append(cand)
        self._keys.add(cand.key())

    def best(self, n: int = 1) -> list[Candidate]:
        """The ``n`` lowest-score candidates."""
        return sorted(self.entries, key=lambda c: c.score)[:n]

    def to_list(self) -> list[dict[str, Any]]:
        """JSON-serializable entries."""
        return [asdict(c) for c in self.entries]


class ProposerUnavailable(ConnectionError):
    """A proposer that cannot answer at all (e.g. an unreachable LLM endpoint) and is not allowed to fall back."""


@dataclass
class SearchState:
    """What a proposer sees: the base widths, budget, unit costs, importance, the bank and the round."""

    config: dict[str, Any]
    max_heads: list[int]
    max_mlp: list[int]
    budget: float
    head_cost: int
    mlp_cost: int
    importance: Importance
    bank: MemoryBank
    round: int
    base_flops: int

    @classmethod
    def for_model(
        cls, model, budget: float, importance: Importance, bank: MemoryBank | None = None, round: int = 0
    ) -> SearchState:
        """The state of a search over ``model``'s widths under ``budget`` per-sample FLOPs."""
        cfg = model.config()
        max_heads, max_mlp = default_widths(cfg)
        head_cost, mlp_cost = unit_costs(cfg)
        bank = MemoryBank() if bank is None else bank
        return cls(cfg, max_heads, max_mlp, float(budget), head_cost, mlp_cost, importance, bank, round, dit_flops(cfg))

    def flops(self, heads: Sequence[int], mlp: Sequence[int]) -> int:
        """Per-sample FLOPs of an allocation."""
        return widths_flops(self.config, heads, mlp)

    def describe(self, top: int = 8) -> dict[str, Any]:
        """Compact JSON view for prompts and logs."""
        return {
            "depth": len(self.max_heads),
            "max_heads": self.max_heads,
            "max_mlp_hidden": self.max_mlp,
            "flops_budget": self.budget,
            "base_flops": self.base_flops,
            "flops_per_head": self.head_cost,
            "flops_per_mlp_channel": self.mlp_cost,
            "round": self.round,
            "memory_bank_best_first": [
                {"heads": c.heads, "mlp_hidden": c.mlp, "flops": c.flops, "proxy_loss": c.score}
                for c in self.bank.best(top)
            ],
        }


def validate_widths(state: SearchState, heads: Any, mlp: Any) -> str | None:
    """Why an allocation is invalid (wrong length / type, out of range, over budget), or None if valid."""
    depth = len(state.max_heads)
    for name, values, limits in (("heads", heads, state.max_heads), ("mlp_hidden", mlp, state.max_mlp)):
        if not isinstance(values, (list, tuple)) or len(values) != depth:
            return f"{name} must be a list of {depth} ints"
        for b, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, int):
                return f"{name}[{b}] must be an int, got {v!r}"
            if not 0 <= v <= limits[b]:
                return f"{name}[{b}]={v} out of range [0, {limits[b]}]"
    if state.flops(heads, mlp) > state.budget:
        return f"over budget: {state.flops(heads, mlp)} > {state.budget:.0f} FLOPs"
    return None


class Proposer(Protocol):
    """Proposes up to ``n`` allocations ``(heads, mlp)`` for the current state."""

    name: str

    def propose(self, state: SearchState, n: int, rng: random.Random) -> list[tuple[list[int], list[int]]]: ...


@dataclass
class SearchResult:
    """Outcome of ``proxy_search``: the best candidate and its recovered model, the bank and per-round stats."""

    best: Candidate
    model: Any
    bank: MemoryBank
    history: list[dict[str, Any]] = field(default_factory=list)
    rejected: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serializable summary (no weights)."""
        return {
            "best": asdict(self.best),
            "history": self.history,
            "rejected": self.rejected,
            "bank": self.bank.to_list(),
        }


def proxy_search(
    model,
    group,
    budget: float,
    train_batches: Batches,
    heldout_batches: Batches,
    *,
    objective,
    importance: Importance,
    proposer: Proposer,
    fallback: Proposer | None = None,
    rounds: int = 3,
    candidates_per_round: int = 4,
    recover_steps: int = 10,
    lr: float = 1e-4,
    seed: int = 0,
    drop_empty_blocks: bool = False,
    log_path: str | Path | None = None,
    engine=None,
    state_path: str | Path | None = None,
) -> SearchResult:
    """Multi-round proxy-based pruning of ``model`` for one group under ``budget`` per-sample FLOPs.

    Each round asks ``proposer`` (e.g. ``make_proposer("local")``) for ``candidates_per_round`` allocations, keeps
    the admissible ones (the rest are counted by reason in ``rejected``), fills the round from ``fallback`` (e.g.
    the local proposer) when the proposer fell short, then prunes, recovers (``recover_steps``) and scores each
    candidate and stores it in the memory bank. ``history`` holds per-round proxy mean / std / min. ``log_path``
    (JSON) receives ``SearchResult.to_dict()``.

    With a multi-rank ``engine`` (``train.engine``) rank 0 proposes and broadcasts the round, candidate j is
    recovered and scored on rank j mod world size, and the scores are gathered into the same bank on every rank
    (the best candidate's weights are broadcast from its rank). Candidate j of round r draws everything from seeds
    of (``seed``, r, j), so the result does not depend on the number of ranks. ``state_path``: the search state
    (bank, history, proposer RNG, best weights) is written there after every round and, when the file exists,
    the search continues from it.
    """
    _check_search(model, budget, proposer, fallback, rounds, candidates_per_round)
    rank, world = (engine.rank, engine.world_size) if engine is not None else (0, 1)
    bank, rng, n = MemoryBank(), random.Random(seed), candidates_per_round
    history: list[dict[str, Any]] = []
    rejected: dict[str, int] = {}
    best_model, start = None, 0
    if state_path is not None and Path(state_path).is_file():
        start, best_model = _load_state(Path(state_path), model, bank, rng, history, rejected)
    for r in range(start, rounds):
        state = SearchState.for_model(model, budget, importance, bank, r)
        batch: Any = None
        if rank == 0:
            try:
                batch = _propose_round(state, proposer, fallback, n, rng, rejected)
            except ProposerUnavailable as exc:  # every rank stops, not only the one that asked
                batch = exc
        if world > 1:
            batch, rejected = engine.broadcast_object((batch, rejected))
        if isinstance(batch, ProposerUnavailable):
            raise batch
        mine = {}  # candidate index -> (score, recovered model), this rank's share
        for j in range(rank, len(batch), world):
            mine[j] = _score_candidate(
                model,
                batch[j],
                group,
                train_batches,
                heldout_batches,
                objective,
                importance,
                recover_steps,
                lr,
                seed,
                r,
                j,
                drop_empty_blocks,
            )
        scores_of = {j: s for j, (s, _) in mine.items()}
        if world > 1:
            scores_of = {j: s for part in engine.gather_objects(scores_of) for j, s in part.items()}
        scores, new_best = [], None
        for j, cand in enumerate(batch):
            cand.score = scores_of[j]
            if not math.isfinite(cand.score):
                rejected["nonfinite"] = rejected.get("nonfinite", 0) + 1
                continue
            if not bank.entries or cand.score < bank.best()[0].score:
                new_best = j
            bank.add(cand)
            scores.append(cand.score)
        if new_best is not None:
            best_model = _share_model(engine, mine, new_best, world, model)
        history.append(_round_stats(r, scores, bank))
        if state_path is not None and rank == 0:
            _save_state(Path(state_path), r + 1, bank, rng, history, rejected, best_model)
    if not bank.entries:
        raise ValueError(f"proxy search produced no valid candidate in {rounds} rounds (rejected: {rejected})")
    if hasattr(proposer, "stats"):
        stats = {**rejected, **{f"{proposer.name}_{k}": v for k, v in proposer.stats.items()}}
        rejected = engine.broadcast_object(stats) if world > 1 else stats
    result = SearchResult(best=bank.best()[0], model=best_model, bank=bank, history=history, rejected=rejected)
    if log_path is not None and rank == 0:
        write_json(result.to_dict(), log_path)
    return result


def _propose_round(state: SearchState, proposer, fallback, n: int, rng: random.Random, rejected: dict[str, int]):
    """The round's admitted candidates: the proposer's, filled from ``fallback`` when it fell short."""
    batch = _admit(state, proposer.propose(state, n, rng), proposer.name, n, rejected)
    if fallback is not None and len(batch) < n and fallback.name != proposer.name:
        extra = fallback.propose(state, n + len(batch), rng)
        batch += _admit(state, extra, fallback.name, n - len(batch), {}, taken=batch)
    return batch


def _score_candidate(
    model,
    cand,
    group,
    train_batches,
    heldout_batches,
    objective,
    importance,
    recover_steps,
    lr,
    seed,
    r,
    j,
    drop_empty_blocks,
):
    """(proxy score, recovered model) of candidate ``j`` of round ``r``; torch's global RNG (label dropout) is
    seeded from (seed, r, j) for the recovery and restored after."""
    cand_model = prune_to_widths(model, importance, cand.heads, cand.mlp, drop_empty_blocks=drop_empty_blocks)
    dev = next(model.parameters()).device
    with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
        torch.manual_seed(((seed * 1_000_003 + r) * 1009 + j) % 2**63)
        recover(cand_model, group, train_batches, recover_steps, objective=objective, lr=lr, seed=seed + r)
    return proxy_loss(cand_model, group, heldout_batches, objective=objective), cand_model


def _share_model(engine, mine: dict, j: int, world: int, like):
    """Candidate ``j``'s recovered model on every rank (broadcast from the rank that scored it)."""
    if world == 1:
        return mine[j][1]
    owner = j % world
    m = mine[j][1] if j in mine else None
    payload = (m.config(), {k: v.detach().cpu() for k, v in m.state_dict().items()}) if m is not None else None
    cfg, sd = engine.broadcast_object(payload, src=owner)
    return m if m is not None else _rebuild(like, cfg, sd)


def _rebuild(like, config: dict, state_dict: dict):
    """A model of ``like``'s class and device from a pruned ``config`` and its weights."""
    ref = next(like.parameters())
    new = type(like).from_config(config).to(device=ref.device, dtype=ref.dtype)
    new.load_state_dict(state_dict, strict=True)
    return new.eval()


def _save_state(path: Path, next_round: int, bank: MemoryBank, rng: random.Random, history, rejected, best) -> None:
    """The search after a round, written atomically (one file: a crash leaves the previous round's)."""
    weights = None if best is None else {k: v.detach().cpu() for k, v in best.state_dict().items()}
    state = {
        "next_round": next_round,
        "bank": bank.to_list(),
        "history": history,
        "rejected": rejected,
        "rng": rng.getstate(),
        "best_config": None if best is None else best.config(),
        "best_weights": weights,
    }

    atomic_save(state, path)


def _load_state(path: Path, model, bank: MemoryBank, rng: random.Random, history: list, rejected: dict):
    """Fill ``bank``, ``rng``, ``history`` and ``rejected`` from a saved search; (next round, best model)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    for c in state["bank"]:
        bank.add(Candidate(**c))
    v, internal, gauss = state["rng"]
    rng.setstate((v, tuple(internal), gauss))
    history.extend(state["history"])
    rejected.update(state["rejected"])
    best = None if state["best_config"] is None else _rebuild(model, state["best_config"], state["best_weights"])
    return int(state["next_round"]), best


def _check_search(model, budget, proposer, fallback, rounds, candidates_per_round) -> None:
    for key, v in (("rounds", rounds), ("candidates_per_round", candidates_per_round)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{key} must be an int >= 1, got {v!r}")
    for key, p in (("proposer", proposer), ("fallback", fallback)):
        if (p is not None or key == "proposer") and not callable(getattr(p, "propose", None)):
            raise TypeError(f"{key} must be a Proposer (e.g. make_proposer('local')), got {p!r}")
    cfg = model.config()
    max_heads, max_mlp = default_widths(cfg)
    floor = widths_flops(cfg, [0] * len(max_heads), [0] * len(max_mlp))
    if not (math.isfinite(float(budget)) and budget >= floor):
        raise ValueError(f"budget {budget!r} must be a finite number >= {floor} (the FLOPs with every unit removed)")


def _admit(
    state: SearchState, proposals: list, source: str, n: int, rejected: dict[str, int], taken: Sequence[Candidate] = ()
) -> list[Candidate]:
    """The first ``n`` admissible proposals as unscored candidates; every other one counted in ``rejected`` by
    reason (``invalid``: malformed or out of range, ``over_budget``, ``duplicate`` of the bank or of ``taken`` or
    an earlier proposal, ``surplus``: beyond ``n``)."""
    out: list[Candidate] = []
    seen = {c.key() for c in taken}
    for heads, mlp in proposals:
        reason = validate_widths(state, heads, mlp)
        if reason is None:
            key = (tuple(heads), tuple(mlp))
            reason = "duplicate" if key in seen or key in state.bank else "surplus" if len(out) == n else None
        if reason is not None:
            kind = reason if reason in ("duplicate", "surplus") else "invalid"
            kind = "over_budget" if reason.startswith("over budget") else kind
            rejected[kind] = rejected.get(kind, 0) + 1
            continue
        seen.add(key)
        out.append(Candidate(list(heads), list(mlp), state.flops(heads, mlp), None, state.round, source))
    return out


def _round_stats(r: int, scores: list[float], bank: MemoryBank) -> dict[str, Any]:
    nan = float("nan")
    h = {
        "round": r,
        "n": len(scores),
        "mean": statistics.fmean(scores) if scores else nan,
        "std": statistics.pstdev(scores) if scores else nan,
        "min": min(scores) if scores else nan,
        "best_so_far": bank.best()[0].score if bank.entries else nan,
    }
    logger.info(
        "proxy search round %d: %d candidates, proxy mean %.5g std %.5g, best so far %.5g",
        r,
        h["n"],
        h["mean"],
        h["std"],
        h["best_so_far"],
    )
    return h


def plot_history(history: Sequence[dict[str, Any]], path: str | Path, title: str = "proxy-based pruning") -> Path:
    """Mean +- std of the proxy loss per round and the best so far (TDC Fig. 5), saved with matplotlib."""
    if not history:
        raise ValueError("history is empty; run proxy_search first")
    rounds = [h["round"] for h in history]
    mean = [h["mean"] for h in history]
    std = [h["std"] for h in history]
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5, 3.5))
    ax.plot(rounds, mean, marker="o", label="round mean")
    ax.fill_between(rounds, [m - s for m, s in zip(mean, std)], [m + s for m, s in zip(mean, std)], alpha=0.25)
    ax.plot(rounds, [h["best_so_far"] for h in history], linestyle="--", label="best so far")
    ax.set_xlabel("round")
    ax.set_ylabel("proxy loss (held-out)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
