"""Token routing in training (TREAD: Krause, Phan, Gui, Baumann, Hu, Ommer, "TREAD: Token Routing for Efficient
Architecture-agnostic Diffusion Training", ICCV 2025, arXiv 2501.04765; official code CompVis/tread).

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
  phase at the end of training (what SPRINT, arXiv 2510.21986, does after its sparse pre-training).
"""

from __future__ import annotations

from diffcurr_fast.ops.token_gather import draw_route, kept_tokens

__all__ = ["ROUTINGS", "draw_route", "kept_tokens"]

ROUTINGS = ("none", "tread")
