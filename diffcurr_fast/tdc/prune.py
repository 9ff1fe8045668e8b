"""Structured pruning of a DiT to a FLOPs budget: attention heads and MLP hidden channels per block.

Pruning slices the base model's tensors into a heterogeneous ``DiT`` of the same class (``block_num_heads`` /
``block_mlp_hidden``; head_dim is kept): for a kept head h of block b the q, k and v rows
``j * H Dh + h Dh + [0, Dh)`` (j = 0, 1, 2) of ``qkv`` and the columns ``h Dh + [0, Dh)`` of ``proj``; for a kept
MLP channel c the row c of ``fc1`` and the column c of ``fc2``. Biases of ``proj`` and ``fc2`` are kept whole (a
removed sub-layer still adds its output bias). Kept units stay in their original order, so pruning nothing gives
exactly the base model. With ``drop_empty_blocks`` a block left with no head and no channel is removed entirely
(its adaLN and residual biases go too), which lowers depth.

Importance of a unit (head or channel) is
- ``taylor``: |w * dL/dw| summed over the unit's weights and biases (first-order Taylor expansion of the loss,
  Molchanov et al. 2019; Diff-Pruning, Fang et al. 2023, Eq. 8), with L the diffusion loss on the group's
  timesteps, gradients accumulated over the given batches;
- ``magnitude``: sum of |w| over the unit's weights and biases.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from diffcurr_fast.objective import Objective, batch_loss, default_objective
from diffcurr_fast.runs.sections import IMPORTANCE_METHODS
from diffcurr_fast.tdc.flops import block_flops, default_widths, widths_flops
from diffcurr_fast.timesteps.build import build_timesteps

__all__ = [
    "IMPORTANCE_METHODS",
    "Importance",
    "Batches",
    "group_cells",
    "group_loss",
    "group_weights",
    "importance_scores",
    "keep_indices",
    "prune_dit",
    "prune_to_budget",
    "prune_to_widths",
    "select_widths",
    "unit_costs",
]

Batches = Sequence[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class Importance:
    """Per-block unit scores: ``heads[b]`` is (H_b,), ``mlp[b]`` is (M_b,), float64 on the CPU."""

    heads: list[torch.Tensor]
    mlp: list[torch.Tensor]


def _check_batches(batches: Batches) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = list(batches)
    if not out:
        raise ValueError("batches must hold at least one (x0, y) pair, got none")
    for i, b in enumerate(out):
        if not (isinstance(b, (tuple, list)) and len(b) == 2):
            raise ValueError(f"batch {i} must be an (x0, y) pair, got {type(b).__name__}")
    return out


def group_cells(group) -> tuple[int, int]:
    """The [lo, hi) cell range of a ``TimestepGroup`` or an ``(lo, hi)`` pair."""
    lo, hi = (group.lo, group.hi) if hasattr(group, "lo") else (int(group[0]), int(group[1]))
    if hi <= lo:
        raise ValueError(f"group range must be non-empty, got [{lo}, {hi})")
    return lo, hi


def group_weights(objective: Objective, group) -> torch.Tensor:
    """(G,) cell weights of the group: the timesteps component's uniform strategy on the range [lo, hi), so t ~
    U[group] (times EDM's cell prior, as the group's fine-tune draws with ``timesteps.sampler=uniform``)."""
    lo, hi = group_cells(group)
    return build_timesteps(None, objective.formulation, objective.num_cells, timestep_range=(lo, hi)).weights()


def group_loss(model, objective, group, x0: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Mean training-objective loss of ``model`` on x0 with t ~ U[group] (``group_weights``; ``objective``: an
    ``Objective``, or a formulation for its plain eps objective)."""
    objective = default_objective(objective, model)
    return batch_loss(objective, model, x0, y, group_weights(objective, group), generator)


def _unit_sums(block, values: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum per-parameter scores into per-head (H,) and per-channel (M,) scores."""
    attn, h, dh = block.attn, block.attn.num_heads, block.attn.head_dim
    heads = torch.zeros(h, dtype=torch.float64)
    if h > 0:
        heads += values["attn.qkv.weight"].sum(1).view(3, h, dh).sum((0, 2))
        if attn.qkv.bias is not None:
            heads += values["attn.qkv.bias"].view(3, h, dh).sum((0, 2))
        heads += values["attn.proj.weight"].sum(0).view(h, dh).sum(1)
    m = block.mlp.fc1.out_features
    mlp = torch.zeros(m, dtype=torch.float64)
    if m > 0:
        mlp += values["mlp.fc1.weight"].sum(1) + values["mlp.fc1.bias"] + values["mlp.fc2.weight"].sum(0)
    return heads, mlp


_UNIT_PARAMS = (
    "attn.qkv.weight",
    "attn.qkv.bias",
    "attn.proj.weight",
    "mlp.fc1.weight",
    "mlp.fc1.bias",
    "mlp.fc2.weight",
)


def importance_scores(
    model,
    method: str = "taylor",
    *,
    objective=None,
    group=None,
    batches: Batches | None = None,
    seed: int = 0,
    engine=None,
) -> Importance:
    """Score every head and MLP channel of ``model`` (see the module docstring).

    ``taylor`` needs the training ``objective`` (or a formulation, for its plain eps objective), ``group`` (a
    ``TimestepGroup`` or an ``(lo, hi)`` range) and ``batches`` of ``(x0, y)``; batch i draws its t and noise from
    seed ``seed + i``. The model's gradients are left untouched (scores use their own backward passes). With a
    multi-rank ``engine`` (``train.engine``) rank r takes the batches i = r mod world size and the float64
    gradient sums are all-reduced, so every rank ends with the same scores.
    """
    if method not in IMPORTANCE_METHODS:
        raise ValueError(f"unknown importance method {method!r}; valid choices: {', '.join(IMPORTANCE_METHODS)}")
    blocks = list(model.blocks)
    if method == "magnitude":
        per_block = []
        for block in blocks:
            params = dict(block.named_parameters())
            per_block.append({k: params[k].detach().abs().double().cpu() for k in _UNIT_PARAMS if k in params})
    else:
        if objective is None or group is None or batches is None:
            raise ValueError("taylor importance needs objective, group and batches")
        batches = _check_batches(batches)
        params = [p for block in blocks for n, p in block.named_parameters() if n in _UNIT_PARAMS]
        grads = [torch.zeros_like(p, dtype=torch.float64) for p in params]
        was_training = model.training
        model.eval()  # no label dropout: the scores see the true conditioning
        rank, world = (engine.rank, engine.world_size) if engine is not None else (0, 1)
        try:
            for i in range(rank, len(batches), world):
                x0, y = batches[i]
                loss = group_loss(model, objective, group, x0, y, torch.Generator().manual_seed(seed + i))
                for acc, g in zip(grads, torch.autograd.grad(loss, params, allow_unused=True), strict=True):
                    if g is not None:
                        acc += g.double()
        finally:
            model.train(was_training)
        if world > 1:
            engine.all_reduce_sum(grads)
        it = iter(zip(params, grads, strict=True))
        per_block = []
        for block in blocks:
            names = [n for n, _ in block.named_parameters() if n in _UNIT_PARAMS]
            d = {}
            for n in names:
                p, g = next(it)
                d[n] = (p.detach().double() * g).abs().cpu()  # |w * dL/dw| (Diff-Pruning Eq. 8)
            per_block.append(d)
    heads, mlp = [], []
    for block, values in zip(blocks, per_block, strict=True):
        h, m = _unit_sums(block, values)
        heads.append(h)
        mlp.append(m)
    return Importance(heads=heads, mlp=mlp)


def unit_costs(config: dict) -> tuple[int, int]:
    """Per-sample FLOPs of one attention head and of one MLP channel in ``config``'s DiT."""
    p = int(config["patch_size"])
    tokens = (int(config["input_size"]) // p) ** 2
    d = int(config["hidden_size"])
    dh = d // int(config["num_heads"])
    head = block_flops(tokens, d, dh, 1, 0)
    chan = block_flops(tokens, d, dh, 0, 1)
    return head["qkv"] + head["attn"] + head["proj"], chan["fc1"] + chan["fc2"]


def keep_indices(scores: torch.Tensor, width: int) -> torch.Tensor:
    """Indices of the ``width`` highest-scoring units, in ascending (original) order."""
    n = scores.numel()
    if isinstance(width, bool) or not isinstance(width, int) or not 0 <= width <= n:
        raise ValueError(f"width must be an int in [0, {n}], got {width!r}")
    if width == n:
        return torch.arange(n)
    order = torch.argsort(scores, descending=True, stable=True)
    return order[:width].sort().values


def select_widths(
    config: dict,
    importance: Importance,
    budget_flops: float,
    *,
    normalize: str = "cost",
) -> tuple[list[int], list[int]]:
    """Global greedy allocation: remove the lowest-ranked heads / channels until FLOPs <= ``budget_flops``.

    Units are ranked by score / FLOPs cost (``normalize="cost"``, default) or by raw score (``"none"``). Removal
    stops at the first unit that brings the model within budget, so the result is at most one unit's cost
    below the budget. Returns per-block ``(heads, mlp_hidden)``.
    """
    if normalize not in ("cost", "none"):
        raise ValueError(f"unknown normalize {normalize!r}; valid choices: cost, none")
    heads, mlp = default_widths(config)
    full = widths_flops(config, heads, mlp)
    if not (math.isfinite(float(budget_flops)) and budget_flops > 0):
        raise ValueError(f"budget_flops must be a finite number > 0, got {budget_flops!r}")
    if budget_flops >= full:
        return heads, mlp
    floor = widths_flops(config, [0] * len(heads), [0] * len(mlp))
    if budget_flops < floor:
        raise ValueError(f"budget_flops {budget_flops:.4g} is below the FLOPs with every unit removed ({floor:.4g})")
    head_cost, chan_cost = unit_costs(config)
    keys, costs, blocks, kinds = [], [], [], []
    for b, (hs, ms) in enumerate(zip(importance.heads, importance.mlp, strict=True)):
        if hs.numel() != heads[b] or ms.numel() != mlp[b]:
            raise ValueError(
                f"importance of block {b} has {hs.numel()} heads / {ms.numel()} channels, "
                f"the model has {heads[b]} / {mlp[b]}"
            )
        for kind, s, c in ((0, hs, head_cost), (1, ms, chan_cost)):
            if s.numel():
                keys.append(s.double() / (c if normalize == "cost" else 1.0))
                costs.append(torch.full((s.numel(),), float(c), dtype=torch.float64))
                blocks.append(torch.full((s.numel(),), b, dtype=torch.long))
                kinds.append(torch.full((s.numel(),), kind, dtype=torch.long))
    key, cost, blk, kind = torch.cat(keys), torch.cat(costs), torch.cat(blocks), torch.cat(kinds)
    order = torch.argsort(key, stable=True)
    saved = torch.cumsum(cost[order], 0)  # FLOPs saved after removing the first j + 1 units
    n_remove = int(torch.searchsorted(saved, torch.tensor([full - budget_flops], dtype=torch.float64))[0]) + 1
    removed = order[:n_remove]
    for b, k in zip(blk[removed].tolist(), kind[removed].tolist(), strict=True):
        if k == 0:
            heads[b] -= 1
        else:
            mlp[b] -= 1
    return heads, mlp


def prune_dit(
    model,
    keep_heads: Sequence[torch.Tensor],
    keep_mlp: Sequence[torch.Tensor],
    *,
    drop_empty_blocks: bool = False,
):
    """A new DiT of the same class holding only the kept heads / channels of every block (slices copied).

    ``keep_heads[b]`` / ``keep_mlp[b]`` are index tensors into block b's heads / MLP channels.
    """
    blocks = list(model.blocks)
    if len(keep_heads) != len(blocks) or len(keep_mlp) != len(blocks):
        raise ValueError(f"need one keep list per block ({len(blocks)}), got {len(keep_heads)} and {len(keep_mlp)}")
    keep_heads = [torch.as_tensor(k, dtype=torch.long).cpu().sort().values for k in keep_heads]
    keep_mlp = [torch.as_tensor(k, dtype=torch.long).cpu().sort().values for k in keep_mlp]
    for b, block in enumerate(blocks):
        for name, keep, n in (
            ("heads", keep_heads[b], block.attn.num_heads),
            ("mlp", keep_mlp[b], block.mlp.fc1.out_features),
        ):
            if keep.numel() and (int(keep.min()) < 0 or int(keep.max()) >= n or keep.unique().numel() != keep.numel()):
                raise ValueError(f"keep_{name}[{b}] must be distinct indices in [0, {n}), got {keep.tolist()}")
    alive = [
        b
        for b in range(len(blocks))
        if not (drop_empty_blocks and keep_heads[b].numel() == 0 and keep_mlp[b].numel() == 0)
    ]
    if not alive:
        alive = [0]  # a DiT needs depth >= 1: keep one (empty) block
    cfg = model.config()
    cfg["depth"] = len(alive)
    cfg["block_num_heads"] = [int(keep_heads[b].numel()) for b in alive]
    cfg["block_mlp_hidden"] = [int(keep_mlp[b].numel()) for b in alive]
    ref = next(model.parameters())
    new = type(model).from_config(cfg).to(device=ref.device, dtype=ref.dtype)
    src = model.state_dict()
    dst = {k: v.clone() for k, v in src.items() if not k.startswith("blocks.")}
    for nb, b in enumerate(alive):
        block = blocks[b]
        dh, inner = block.attn.head_dim, block.attn.num_heads * block.attn.head_dim
        pre, npre = f"blocks.{b}.", f"blocks.{nb}."
        per_head = (keep_heads[b][:, None] * dh + torch.arange(dh)[None]).flatten()  # (H' Dh,)
        rows = torch.cat([j * inner + per_head for j in range(3)])  # q, k, v rows
        rows, cols, ch = rows.to(ref.device), per_head.to(ref.device), keep_mlp[b].to(ref.device)
        for k, v in src.items():
            if not k.startswith(pre):
                continue
            name = k[len(pre) :]
            if name in ("attn.qkv.weight", "attn.qkv.bias"):
                v = v.index_select(0, rows)
            elif name == "attn.proj.weight":
                v = v.index_select(1, cols)
            elif name in ("mlp.fc1.weight", "mlp.fc1.bias"):
                v = v.index_select(0, ch)
            elif name == "mlp.fc2.weight":
                v = v.index_select(1, ch)
            dst[npre + name] = v.clone()
    new.load_state_dict(dst, strict=True)
    new.train(model.training)
    return new


def prune_to_widths(
    model,
    importance: Importance,
    heads: Sequence[int],
    mlp_hidden: Sequence[int],
    *,
    drop_empty_blocks: bool = False,
):
    """Keep the ``heads[b]`` / ``mlp_hidden[b]`` most important units of every block b."""
    n = len(model.blocks)
    if len(heads) != n or len(mlp_hidden) != n:
        raise ValueError(f"need {n} per-block widths, got {len(heads)} heads and {len(mlp_hidden)} mlp entries")
    keep_h = [keep_indices(importance.heads[b], int(heads[b])) for b in range(n)]
    keep_m = [keep_indices(importance.mlp[b], int(mlp_hidden[b])) for b in range(n)]
    return prune_dit(model, keep_h, keep_m, drop_empty_blocks=drop_empty_blocks)


def prune_to_budget(
    model,
    budget_flops: float,
    importance: Importance,
    *,
    normalize: str = "cost",
    drop_empty_blocks: bool = False,
):
    """Prune ``model`` to at most ``budget_flops`` per-sample FLOPs (``select_widths`` then ``prune_to_widths``).

    The result is within one unit (head or channel) of the budget; a budget >= the model's FLOPs returns an
    exact copy.
    """
    heads, mlp = select_widths(model.config(), importance, budget_flops, normalize=normalize)
    pruned = prune_to_widths(model, importance, heads, mlp, drop_empty_blocks=drop_empty_blocks)
    return pruned
