"""Candidate proposers of the proxy search (``search.proxy_search``) and their registry.

- ``local`` (default): the importance-greedy allocation first, then mutations of the best candidates in the bank
  (move heads / channel chunks between blocks, then refill the budget greedily);
- ``uniform``: the same keep ratio in every block, varying the split between attention and MLP;
- ``llm``: an OpenAI-compatible chat endpoint (``llm.py``), off unless configured.

A proposer only proposes: the search checks and deduplicates what it returns.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable
from typing import Any

from diffcurr_fast.runs.sections import PROPOSERS
from diffcurr_fast.tdc.llm import LLMProposer
from diffcurr_fast.tdc.prune import select_widths
from diffcurr_fast.tdc.search import Proposer, SearchState

__all__ = ["PROPOSERS", "LocalProposer", "UniformProposer", "make_proposer"]


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


# The registry: ``PROPOSERS`` (the names the config accepts for tdc.proposer) -> constructor.
_REGISTRY: dict[str, Callable[..., Proposer]] = {"local": LocalProposer, "uniform": UniformProposer, "llm": LLMProposer}


def make_proposer(name: str, **kwargs: Any) -> Proposer:
    """Build a proposer by name (``local``, ``uniform``, ``llm``); kwargs go to its constructor."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown proposer {name!r}; valid choices: {', '.join(PROPOSERS)}")
    return _REGISTRY[name](**kwargs)
