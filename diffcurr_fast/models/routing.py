"""Token routing in training: TREAD (Krause, Phan, Gui, Baumann, Hu, Ommer, "TREAD: Token Routing for Efficient
Architecture-agnostic Diffusion Training", ICCV 2025, arXiv 2501.04765; official code CompVis/tread) and SPRINT (Park,
Haji-Ali, Li, Menapace, Tulyakov, Kim, Siarohin, Kag, "Sprint: Sparse-Dense Residual Fusion for Efficient Diffusion
Transformers", arXiv 2510.21986; official code snap-research/Sprint, ``src/models/sit.py``).

TREAD (``model.routing=tread``):

A random share of each sample's tokens skips a span of blocks: at the span's first block the kept tokens are
gathered (B, K, D), the blocks of the span run on them alone, and after the span's last block they are written back
among the tokens that skipped it, which keep the value they had when the span began (the paper's x_D_last). No
parameters are added; the loss covers every token (the routed ones included), as in the paper. The step is cheaper
in proportion to the tokens the span leaves out: attention by (K/T)^2 and the MLP and projections by K/T.

What was chosen here, and where it follows the official code:

- The kept count is K = T - floor(T (1 - keep)) (the code's ``num_keep = T - int(T * selection_rate)``, with
  ``selection_rate`` the share routed past the span, 1 - ``model.routing_keep``); it is fixed per run, so shapes
  are static (``torch.compile``, CUDA graphs).
- The kept set is uniform without replacement per sample and per step, as the code's argsort of uniform noise. It
  is drawn here by the objective from the step's generator (never inside the model), so a resumed run draws the same
  sets and every rank its own. The kept indices are sorted: the blocks are permutation-equivariant over tokens (the
  position embedding is added before the route), so the order only changes memory locality.
- With ``model.pos=rope2d`` (``modern.py``) positions enter every block as rotations of q and k: inside the span the
  rotary cos / sin tables are gathered by the same indices as the tokens, so each kept token rotates with its
  original position (and the blocks stay permutation-equivariant).
- The span is blocks [start, end) (``model.routing_start``, ``model.routing_end``, end exclusive; the code's
  ``end_layer_idx`` is inclusive). One span per model (the code allows a list).
- The code runs the block after a span in fp32 under autocast (``fp32_next``); this is not done here: autocast
  choices are the engine's.
- Training only: ``forward`` without ``route`` (sampling, evaluation, the probes of timestep strategies, export) runs
  every token through every block. ``model.routing_until`` > 0 turns routing off from that step on, a full-token
  phase at the end of training (what SPRINT does after its sparse pre-training).

SPRINT (``model.routing=sprint``): the blocks [0, start) (the encoder) run on every token; their output h_enc is the
dense shallow path. The kept tokens of h_enc are gathered and the middle blocks [start, end) run on them alone (the
sparse deep path); the dropped positions are then filled with a [MASK] token m, the kept ones put back at their
positions (h_deep, (B, T, D)), and the two paths are fused, h = W [h_deep ; h_enc] + b with W of shape (D, 2D),
before the last blocks [end, depth) (the decoder) run on every token. Two parameters are added, ``sprint_mask_token``
(D,) and ``sprint_fusion`` (Linear 2D -> D); a model built without SPRINT has neither. What was chosen here, and
where it follows the official code:

- The fusion is the code's ``residual_type='concat_linear'``: ``cat([x_deep, x_shallow], dim=-1)`` then
  ``renoise_linear = nn.Linear(2 D, D, bias=True)``, deep path first. It runs on every forward, with or without a
  route: at inference (every token kept) it fuses the dense deep path with the encoder's output, as the code does.
- Initialisation as the code's: the fusion linear is xavier-uniform with a zero bias (the DiT's ``_basic_init``,
  which the code applies to it too; no identity init), the mask token N(0, 0.02) (``nn.init.normal_(mask_token,
  std=.02)``).
- The mask token is frozen (``requires_grad=False``), as in the code (``nn.Parameter(..., requires_grad=False)``;
  its comment says "learnable", its flag says otherwise): it is a fixed random vector saved in the state dict, like
  ``pos_embed``. The fusion's W_deep m, which the decoder sees at every dropped position, is still learned through
  W_deep. A frozen token also keeps every trained parameter used on every step (the full-token phase and keep 1.0
  never reach the mask token), which DDP without ``find_unused_parameters`` requires.
- The kept set is drawn exactly as TREAD's (uniform without replacement per sample, sorted, from the step's
  generator; the same ``route`` argument and K = T - floor(T (1 - keep))). This is the code's ``mask_type: random``;
  its configs use ``structured_with_random_offset`` (one token of each 2x2 group at 75% drop), which is not built.
- The split: the code's SiT-XL config (``configs/train/SIT_XL_SPRINT_256.yaml``) has ``encoder_depth: 2,
  middle_depth: 24, decoder_depth: 2`` of 28 blocks, i.e. ``model.routing_start=2`` and ``model.routing_end`` =
  depth - 2, the defaults here. For DiT-B's 12 blocks the same two dense blocks at each end give [2, 10) (the
  code ships no config at that size; this split is that rule, not a figure taken from the paper). Its drop
  ratio is ``mask_ratio: 0.75``: set ``model.routing_keep=0.25`` (the field's default, 0.5, is TREAD's).
- The two-stage schedule: the code pre-trains with the mask, then fine-tunes with ``mask_ratio: 0.0``
  (``SIT_XL_SPRINT_256_ft.yaml``, 200k steps after 2M); here ``model.routing_until`` starts the full-token phase.
- The loss covers every token (the code's ``mean_flat`` over the whole output), as TREAD's.
- ``rope2d`` and the features of a training term read inside the span follow TREAD's rules above (a feature of a
  middle block holds the encoder output at the dropped positions; the span's last block's feature is its output,
  before the fusion).
- The fused tokens are cast back to the residual stream's dtype (float32 under bf16 autocast; the code's decoder
  runs on the linear's bf16 output).
- Not built: Path-Drop Guidance (PDG, the paper's sampler that replaces CFG's unconditional pass by the
  decoder on the [MASK]-filled path) and its training-side companion, the code's ``cfg_mask_prob`` (10 % of the
  samples of a step get the mask token at every position of the deep path). Sampling uses ordinary CFG.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from diffcurr_fast.ops import token_gather, token_scatter
from diffcurr_fast.options import Options, option, unit

__all__ = ["ROUTINGS", "Route", "Routing", "RoutingOptions", "draw_route", "kept_tokens"]

ROUTINGS = ("none", "tread", "sprint")


def kept_tokens(tokens: int, keep: float) -> int:
    """K of T tokens kept for ``keep`` in (0, 1]: T - floor(T (1 - keep)), at least 1 (TREAD's ``num_keep``)."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"model.routing_keep must be in (0, 1], got {keep!r}")
    return max(1, tokens - math.floor(tokens * (1.0 - keep) + 1e-9))


def draw_route(
    batch: int, tokens: int, kept: int, generator: torch.Generator | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """(B, K) int64 sorted indices of the kept tokens of each sample: K of T uniform without replacement, from
    ``generator`` (on its device; the indices are moved to ``device``)."""
    gen_device = generator.device if generator is not None else torch.device("cpu")
    noise = torch.rand(batch, tokens, generator=generator, device=gen_device)  # (B, T)
    idx = noise.argsort(dim=1)[:, :kept].sort(dim=1).values  # (B, K)
    return idx.to(device, non_blocking=True)


@dataclass
class RoutingOptions(Options):
    """Token routing's options in the ``model`` section (module doc); ``model.routing`` turns it on."""

    SWITCH = "routing"
    routing: str = option(
        "none",
        "token routing in training: tread (a share of the tokens skips a span) or sprint (the span runs on the kept "
        "tokens alone, its output fused with the tokens before it; adds a [MASK] token and a fusion layer)",
        ROUTINGS,
    )
    routing_keep: float = unit(
        0.5,
        "routing: share of each sample's tokens that the span's blocks process (SPRINT's paper: 0.25)",
        lo_open=True,
    )
    routing_start: int = option(2, "routing: the span's first block (0-based; sprint: the dense encoder's depth)", lo=0)
    routing_end: int | None = option(None, "routing: the block after the span (exclusive; None: depth - 2)", lo=1)
    routing_until: int = option(0, "routing: the step from which every token runs every block again (0: never)", lo=0)

    def active(self) -> bool:
        return self.routing != "none"

    def span(self, depth: int) -> tuple[int, int]:
        """The blocks [start, end) that token routing spans (``routing_end`` None: depth - 2)."""
        return self.routing_start, self.routing_end if self.routing_end is not None else depth - 2

    def validate(self, cfg: Any) -> None:
        depth = cfg.model.depth
        start, end = self.span(depth)
        if not start < end <= depth:
            fit = (1, depth - 1) if depth >= 3 else (0, depth)
            raise ValueError(
                f"model.routing spans blocks [{start}, {end}) (model.routing_start, model.routing_end), which must "
                f"hold at least one of the {depth} blocks (0 <= start < end <= depth); e.g. "
                f"model.routing_start={fit[0]} model.routing_end={fit[1]}"
            )

    def refusal(self, cfg: Any, use: str) -> str | None:
        if use == "tdc" and self.routing == "sprint":  # tdc/prune.py prunes the blocks, not the fusion layer
            return (
                "model.routing 'sprint': TDC's pruning does not know SPRINT's fusion layer and [MASK] token; use "
                "model.routing=tread or none for a TDC run"
            )
        return None

    def dit_kwargs(self, cfg: Any) -> dict[str, Any]:
        span = self.span(cfg.model.depth) if self.active() else None
        return {"routing": span, "sprint": self.routing == "sprint"}


class Route:
    """The per-step draw of token routing: K of each sample's T tokens (``kept_tokens``), uniform without
    replacement, drawn by the objective from the step's generator (``draw``) until the full-token phase
    (``routed(step)``)."""

    def __init__(self, tokens: int, keep: float, until: int = 0):
        self.tokens, self.kept, self.until = int(tokens), kept_tokens(tokens, keep), int(until)

    @classmethod
    def from_config(cls, cfg: Any) -> Route | None:
        """The draw of the run's routing (None without routing)."""
        opts, m = RoutingOptions.of(cfg.model), cfg.model
        if not opts.active():
            return None
        return cls((m.input_size // m.patch_size) ** 2, opts.routing_keep, opts.routing_until)

    def routed(self, step: int) -> bool:
        """Whether step ``step`` routes (``routing_until`` 0: always; else before it)."""
        return self.until == 0 or step < self.until

    def draw(self, batch: int, generator: torch.Generator | None, device: torch.device | str) -> torch.Tensor | None:
        """(B, K) kept indices, or None when every token is kept (K = T: the plain model)."""
        if self.kept >= self.tokens:
            return None
        return draw_route(batch, self.tokens, self.kept, generator, device)


class Routing:
    """One DiT's token routing (module doc): the span [start, end) of its blocks and whether SPRINT fuses the span's
    output with the dense path. ``DiT.forward`` runs its blocks through ``blocks``; the plain model is
    ``Routing(None)``. SPRINT's two parameters are the DiT's own (``add_parameters``: the state dict keeps the names
    ``sprint_mask_token``, ``sprint_fusion``)."""

    def __init__(self, span: tuple[int, int] | None, sprint: bool = False):
        if sprint and span is None:
            raise ValueError("sprint needs the routing span: DiT(routing=(start, end), sprint=True)")
        self.span, self.sprint = span, bool(sprint)

    def add_parameters(self, dit: nn.Module, hidden_size: int) -> None:
        """SPRINT's [MASK] token (D,), frozen as in the official code, and its fusion W [h_deep ; h_enc] + b."""
        if self.sprint:  # absent otherwise: the state dict of a model without SPRINT is the release's
            dit.sprint_mask_token = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)
            dit.sprint_fusion = nn.Linear(2 * hidden_size, hidden_size, bias=True)

    def init_parameters(self, dit: nn.Module) -> None:
        """After the DiT's initialisation (the fusion keeps its xavier-uniform and zero bias): the [MASK] token
        N(0, 0.02), as in the official code."""
        if self.sprint:
            nn.init.normal_(dit.sprint_mask_token, std=0.02)

    def blocks(
        self,
        dit: nn.Module,
        x: torch.Tensor,
        c: torch.Tensor,
        mask: torch.Tensor | None,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        route: torch.Tensor | None,
        features: tuple[int, ...] | list[int],
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """x (N, T, D) through ``dit.blocks`` with the kept tokens ``route`` (N, K) running the span alone (TREAD:
        the others keep their value from before it; SPRINT: they come back as the [MASK] token and the two paths are
        fused); returns (N, T, D) and {j: (N, T, D) tokens after block j} for ``features``."""
        if route is not None and self.span is None:
            raise ValueError("route given to a DiT built without routing (DiT(routing=(start, end)))")
        # SPRINT splits the blocks at the span with or without a route (the fusion always runs); TREAD without one
        # is the plain model
        start, end = self.span if route is not None or self.sprint else (-1, -1)
        inside = end if self.sprint else end - 1  # blocks [start, inside) whose features are put back by hand
        kept: dict[int, torch.Tensor] = {}
        all_rope = rope
        for j, block in enumerate(dit.blocks):
            if j == start:
                before = x  # (N, T, D): the value the routed tokens keep (TREAD's x_D_last); SPRINT's dense path
                if route is None:  # SPRINT unrouted: a node of its own, so that the middle blocks' gradient is summed
                    x = x.view_as(x)  # before it meets the fusion's, as through token_gather (keep 1.0 is bitwise)
                else:
                    x = token_gather(x, route)  # (N, K, D)
                    if rope is not None:  # the kept tokens rotate with their original positions
                        rope = tuple(r[route].unsqueeze(1) for r in rope)  # (N, 1, K, Dh / 2) cos and sin
            if dit.grad_checkpointing and torch.is_grad_enabled():
                x = checkpoint(block, x, c, mask, rope, use_reentrant=False)  # (N, T or K, D)
            else:
                x = block(x, c, mask, rope)  # (N, T or K, D)
            if j == end - 1 and not self.sprint:
                x = token_scatter(before, route, x)  # (N, T, D)
                rope = all_rope  # (T, Dh / 2) cos and sin
            if j in features:
                put_back = route is not None and start <= j < inside
                kept[j] = token_scatter(before, route, x) if put_back else x  # (N, T, D)
            if j == end - 1 and self.sprint:
                x = self.fuse(dit, x, before, route)  # (N, T, D)
                rope = all_rope  # (T, Dh / 2) cos and sin
        return x, kept

    @staticmethod
    def fuse(dit: nn.Module, deep: torch.Tensor, shallow: torch.Tensor, route: torch.Tensor | None) -> torch.Tensor:
        """SPRINT's sparse-dense residual fusion: the deep path (N, K, D) back among the [MASK] token at the dropped
        positions (N, T, D) when routed, then W [h_deep ; h_enc] + b (N, T, D)."""
        if route is not None:
            n, tokens, width = shallow.shape
            masks = dit.sprint_mask_token.to(deep.dtype).expand(n, tokens, width)  # (N, T, D): [MASK] everywhere
            deep = token_scatter(masks, route, deep)  # (N, T, D): the kept tokens at their positions
        fused = dit.sprint_fusion(torch.cat([deep, shallow], dim=-1))  # (N, T, D): concat_linear
        return fused.to(shallow.dtype)  # (N, T, D): the residual stream's dtype (float32 under bf16 autocast)
