"""Proxy-based pruning (TDC, arXiv 2312.13307, Sec. 3.3): pruning as a multi-round decision process.

Each round a proposer sees the state (base per-block widths, the FLOPs budget, per-unit costs and the memory bank of
candidates tried so far with their FLOPs and proxy scores) and proposes width allocations (heads and MLP channels
per block). A candidate is pruned from the base model by importance (``prune_to_widths``), fine-tuned for a few
steps on the group's timesteps (``recover``) and scored by the proxy: the group's diffusion loss on held-out
batches with fixed t and noise, so candidates are compared on identical draws (lower is better). Invalid proposals
(widths out of range, over budget, duplicates) are rejected and counted. The memory bank keeps every scored
candidate and steers the next round. Proposers:

- ``local`` (default): the importance-greedy allocation first, then mutations of the best candidates in the bank
  (move heads / channel chunks between blocks, then refill the budget greedily);
- ``uniform``: the same keep ratio in every block, varying the split between attention and MLP;
- ``llm``: an OpenAI-compatible chat endpoint (see ``llm.py``), off unless configured.
"""

from __future__ import annotations

import json
import logging
import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from diffcurr_fast.tdc.flops import default_widths, dit_flops, widths_flops
from diffcurr_fast.tdc.prune import Batches, Importance, group_loss, prune_to_widths, select_widths, unit_costs

__all__ = [
    "PROPOSERS",
    "Candidate",
    "LocalProposer",
    "MemoryBank",
    "Proposer",
    "SearchResult",
    "SearchState",
    "UniformProposer",
    "make_proposer",
    "plot_history",
    "proxy_loss",
    "proxy_search",
    "recover",
    "validate_widths",
]

PROPOSERS = ("local", "uniform", "llm")
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


def _fill(state: SearchState, heads: list[int], mlp: list[int], rng: random.Random) -> tuple[list[int], list[int]]:
    """Shrink until within budget (random blocks), then grow random blocks while the budget allows."""
    heads, mlp = list(heads), list(mlp)
    slack = state.budget - state.flops(heads, mlp)
    depth = len(heads)
    while slack < 0:
        b = rng.randrange(depth)
        if rng.random() < 0.5 and heads[b] > 0:
            heads[b] -= 1
            slack += state.head_cost
        elif mlp[b] > 0:
            step = min(mlp[b], max(1, math.ceil(-slack / state.mlp_cost)), max(1, state.max_mlp[b] // 8))
            mlp[b] -= step
            slack += step * state.mlp_cost
    for _ in range(4 * depth):
        grow = [b for b in range(depth) if heads[b] < state.max_heads[b] and state.head_cost <= slack]
        grow_m = [b for b in range(depth) if mlp[b] < state.max_mlp[b] and state.mlp_cost <= slack]
        if not grow and not grow_m:
            break
        if grow and (not grow_m or rng.random() < 0.3):
            b = rng.choice(grow)
            heads[b] += 1
            slack -= state.head_cost
        else:
            b = rng.choice(grow_m)
            step = min(state.max_mlp[b] - mlp[b], int(slack // state.mlp_cost))
            mlp[b] += step
            slack -= step * state.mlp_cost
    return heads, mlp


class LocalProposer:
    """Evolutionary / greedy search around the best candidates in the memory bank.

    Round 0 (empty bank) proposes the importance-greedy allocation (``select_widths``) and mutations of it; later
    rounds mutate the ``parents`` best entries: ``moves`` transfers of one head or an MLP chunk (1/``mlp_chunks`` of
    the base width) from one block to another, then a greedy refill of the remaining budget.
    """

    name = "local"

    def __init__(self, parents: int = 2, moves: int = 2, mlp_chunks: int = 8):
        for key, v in (("parents", parents), ("moves", moves), ("mlp_chunks", mlp_chunks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be an int >= 1, got {v!r}")
        self.parents, self.moves, self.mlp_chunks = parents, moves, mlp_chunks

    def mutate(self, state: SearchState, heads: list[int], mlp: list[int], rng: random.Random):
        """One mutation of an allocation (moves between blocks, then refill)."""
        heads, mlp = list(heads), list(mlp)
        depth = len(heads)
        for _ in range(self.moves):
            src, dst = rng.randrange(depth), rng.randrange(depth)
            if rng.random() < 0.5:
                if heads[src] > 0 and heads[dst] < state.max_heads[dst]:
                    heads[src] -= 1
                    heads[dst] += 1
            else:
                chunk = max(1, state.max_mlp[src] // self.mlp_chunks)
                step = min(chunk, mlp[src], state.max_mlp[dst] - mlp[dst])
                mlp[src] -= step
                mlp[dst] += step
        return _fill(state, heads, mlp, rng)

    def propose(self, state: SearchState, n: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
        out: list[tuple[list[int], list[int]]] = []
        seen = set()
        if len(state.bank) == 0:
            parents = [select_widths(state.config, state.importance, state.budget)]
            out.append(parents[0])
            seen.add((tuple(parents[0][0]), tuple(parents[0][1])))
        else:
            parents = [(c.heads, c.mlp) for c in state.bank.best(self.parents)]
        tries = 0
        while len(out) < n and tries < 50 * n:
            tries += 1
            h, m = parents[tries % len(parents)]
            h, m = self.mutate(state, h, m, rng)
            key = (tuple(h), tuple(m))
            if key in seen or (h, m) in state.bank:
                continue
            seen.add(key)
            out.append((h, m))
        return out


class UniformProposer:
    """The same keep ratio in every block; candidates differ in the attention share of the removed FLOPs."""

    name = "uniform"

    def propose(self, state: SearchState, n: int, rng: random.Random) -> list[tuple[list[int], list[int]]]:
        out = []
        shares = [0.5] if n == 1 else [i / (n - 1) for i in range(n)]
        for share in shares:  # share of the kept-width ratio tilt towards attention
            lo, hi = 0.0, 1.0
            for _ in range(40):  # largest ratio r with FLOPs <= budget
                r = 0.5 * (lo + hi)
                h, m = self._widths(state, r, share)
                if state.flops(h, m) <= state.budget:
                    lo = r
                else:
                    hi = r
            h, m = self._widths(state, lo, share)
            if (h, m) not in state.bank and (h, m) not in out:
                out.append((h, m))
        return out

    @staticmethod
    def _widths(state: SearchState, r: float, share: float) -> tuple[list[int], list[int]]:
        rh = min(1.0, r * (0.5 + share))  # share 0.5: heads and channels kept at the same ratio r
        rm = min(1.0, r * (1.5 - share))
        heads = [int(math.floor(rh * h)) for h in state.max_heads]
        mlp = [int(math.floor(rm * m)) for m in state.max_mlp]
        return heads, mlp


def make_proposer(name: str, **kwargs: Any) -> Proposer:
    """Build a proposer by name (``local``, ``uniform``, ``llm``); kwargs go to its constructor."""
    if name == "local":
        return LocalProposer(**kwargs)
    if name == "uniform":
        return UniformProposer(**kwargs)
    if name == "llm":
        from diffcurr_fast.tdc.llm import LLMProposer

        return LLMProposer(**kwargs)
    raise ValueError(f"unknown proposer {name!r}; valid choices: {', '.join(PROPOSERS)}")


def recover(
    model,
    group,
    data: Batches,
    steps: int,
    *,
    schedule,
    lr: float = 1e-4,
    weight_decay: float = 0.0,
    seed: int = 0,
) -> list[float]:
    """Short recovery fine-tune of ``model`` on the group's timesteps (AdamW, t ~ U[group]); returns the losses.

    ``data`` is a sequence of ``(x0, y)`` batches, cycled. The model is left in eval mode.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    if not (lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    data = list(data)
    if steps and not data:
        raise ValueError("recover needs at least one (x0, y) batch")
    params = [p for p in model.parameters() if p.requires_grad]
    losses: list[float] = []
    if steps:
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        gen = torch.Generator().manual_seed(seed)
        model.train()
        for step in range(steps):
            x0, y = data[step % len(data)]
            loss = group_loss(model, schedule, group, x0, y, gen)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    model.eval()
    return losses


@torch.no_grad()
def proxy_loss(model, group, heldout: Batches, *, schedule, seed: int = 1234) -> float:
    """The proxy: mean group diffusion loss on held-out batches with t and noise drawn from ``seed``."""
    heldout = list(heldout)
    if not heldout:
        raise ValueError("proxy_loss needs at least one held-out (x0, y) batch")
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    total = 0.0
    for x0, y in heldout:
        total += float(group_loss(model, schedule, group, x0, y, gen))
    model.train(was_training)
    return total / len(heldout)


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
    schedule,
    importance: Importance,
    proposer: str | Proposer = "local",
    rounds: int = 3,
    candidates_per_round: int = 4,
    recover_steps: int = 10,
    lr: float = 1e-4,
    seed: int = 0,
    fallback: bool = True,
    drop_empty_blocks: bool = False,
    log_path: str | Path | None = None,
) -> SearchResult:
    """Multi-round proxy-based pruning of ``model`` for one group under ``budget`` per-sample FLOPs.

    Each round asks ``proposer`` for ``candidates_per_round`` allocations, rejects invalid ones (counted by
    reason), fills the round with ``LocalProposer`` when ``fallback`` and the proposer fell short, prunes, recovers
    (``recover_steps``) and scores each candidate, and stores it in the memory bank. ``history`` holds per-round
    proxy mean / std / min. ``log_path`` (JSON) receives ``SearchResult.to_dict()``.
    """
    for key, v, lo in (("rounds", rounds, 1), ("candidates_per_round", candidates_per_round, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{key} must be an int >= {lo}, got {v!r}")
    if isinstance(proposer, str):
        proposer = make_proposer(proposer)
    cfg = model.config()
    max_heads, max_mlp = default_widths(cfg)
    floor = widths_flops(cfg, [0] * len(max_heads), [0] * len(max_mlp))
    if not (math.isfinite(float(budget)) and budget >= floor):
        raise ValueError(f"budget {budget!r} must be a finite number >= {floor} (the FLOPs with every unit removed)")
    bank = MemoryBank()
    rng = random.Random(seed)
    local = LocalProposer()
    history: list[dict[str, Any]] = []
    rejected: dict[str, int] = {}
    best_model = None
    for r in range(rounds):
        state = SearchState.for_model(model, budget, importance, bank, r)
        proposals = [(h, m, proposer.name) for h, m in proposer.propose(state, candidates_per_round, rng)]
        valid: list[tuple[list[int], list[int], str]] = []
        for h, m, src in proposals:
            reason = validate_widths(state, h, m)
            if reason is None and ((h, m) in bank or any((h, m) == (v[0], v[1]) for v in valid)):
                reason = "duplicate"
            if reason is not None:
                kind = "invalid"  # malformed or widths out of range
                if reason.startswith("over budget"):
                    kind = "over_budget"
                elif reason == "duplicate":
                    kind = "duplicate"
                rejected[kind] = rejected.get(kind, 0) + 1
                continue
            valid.append((list(h), list(m), src))
        if fallback and len(valid) < candidates_per_round and proposer.name != "local":
            for h, m in local.propose(state, candidates_per_round + len(valid), rng):
                if len(valid) == candidates_per_round:
                    break
                if validate_widths(state, h, m) is None and all((h, m) != (v[0], v[1]) for v in valid):
                    valid.append((h, m, "local"))
        scores = []
        for h, m, src in valid:
            cand_model = prune_to_widths(model, importance, h, m, drop_empty_blocks=drop_empty_blocks)
            recover(cand_model, group, train_batches, recover_steps, schedule=schedule, lr=lr, seed=seed + r)
            score = proxy_loss(cand_model, group, heldout_batches, schedule=schedule)
            if not math.isfinite(score):
                rejected["nonfinite"] = rejected.get("nonfinite", 0) + 1
                continue
            cand = Candidate(h, m, state.flops(h, m), score, r, src)
            if not bank.entries or score < bank.best()[0].score:
                best_model = cand_model
            bank.add(cand)
            scores.append(score)
        history.append(
            {
                "round": r,
                "n": len(scores),
                "mean": statistics.fmean(scores) if scores else float("nan"),
                "std": statistics.pstdev(scores) if scores else float("nan"),
                "min": min(scores) if scores else float("nan"),
                "best_so_far": bank.best()[0].score if bank.entries else float("nan"),
            }
        )
        h = history[-1]
        logger.info(
            "proxy search round %d: %d candidates, proxy mean %.5g std %.5g, best so far %.5g",
            r, h["n"], h["mean"], h["std"], h["best_so_far"],
        )  # fmt: skip
    if not bank.entries:
        raise ValueError(f"proxy search produced no valid candidate in {rounds} rounds (rejected: {rejected})")
    if hasattr(proposer, "stats"):
        rejected = {**rejected, **{f"{proposer.name}_{k}": v for k, v in proposer.stats.items()}}
    result = SearchResult(best=bank.best()[0], model=best_model, bank=bank, history=history, rejected=rejected)
    if log_path is not None:
        Path(log_path).parent.mkdir(parents=True, exist_ok=True)
        Path(log_path).write_text(json.dumps(result.to_dict(), indent=2))
    return result


def plot_history(history: Sequence[dict[str, Any]], path: str | Path, title: str = "proxy-based pruning") -> Path:
    """Mean +- std of the proxy loss per round and the best so far (TDC Fig. 5), saved with matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not history:
        raise ValueError("history is empty; run proxy_search first")
    rounds = [h["round"] for h in history]
    mean = [h["mean"] for h in history]
    std = [h["std"] for h in history]
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
