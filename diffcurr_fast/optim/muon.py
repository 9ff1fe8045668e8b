"""Muon (``optim.name=muon``): ``torch.optim.Muon`` (Jordan et al. 2024; Liu et al., "Muon is Scalable for LLM
Training", arXiv 2502.16982) on the hidden matrices of the DiT blocks, AdamW on the rest, stepped as one optimizer.

Muon takes the weights of each block's attention (qkv, proj) and MLP (fc1, fc2; SwiGLU's w12, w3): ``muon_params``.
It orthogonalises a matrix's momentum (Newton-Schulz, 5 steps, Nesterov momentum ``optim.muon_momentum``), which
only means something for a matrix that maps hidden features to hidden features. Every other parameter, the patch
embedding (a convolution), the timestep and label embedders (an embedding table and the layers on the sinusoidal
frequencies), the adaLN modulation (the conditioning's map to per-channel shifts and scales), the final layer, the
norms, the biases, SPRINT's fusion layer and the training terms' heads, takes torch's fused AdamW. ``MuonAdamW``
steps both at one learning rate: Muon scales each matrix's orthogonalised update by 0.2 sqrt(max(A, B))
(``adjust_lr_fn="match_rms_adamw"``, Moonlight), which gives it the update RMS of AdamW (about 0.2), so the
``optim.lr`` and ``optim.weight_decay`` tuned for AdamW serve both groups. torch's Muon runs its Newton-Schulz
products in bfloat16, as the reference code does: native on a GPU, emulated (slow) on a CPU without bf16
arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from diffcurr_fast.optim.adamw import check_own_step, torch_adamw
from diffcurr_fast.options import Options, unit

MUON_ADJUST_LR = "match_rms_adamw"  # Muon's update scaled to AdamW's RMS: one optim.lr for both groups


@dataclass
class MuonOptions(Options):
    """muon's options in the ``optim`` section (keys ``optim.muon_*``)."""

    PREFIX = "muon_"
    momentum: float = unit(0.95, "muon: momentum of the Muon matrices (Nesterov)", hi_open=True)

    def validate(self, cfg: Any) -> None:
        check_own_step(cfg)


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


class Muon:
    """Muon on the blocks' matrices, AdamW on the rest (module doc)."""

    Options = MuonOptions

    @staticmethod
    def check_device(cfg: Any, device: torch.device) -> None:
        """Nothing the device decides."""

    @staticmethod
    def build(model: nn.Module, cfg: Any, device: torch.device) -> MuonAdamW:
        o = cfg.optim
        named = {n: p for n, p in model.named_parameters() if p.requires_grad}
        to_muon = muon_params(model)
        if not to_muon:
            raise ValueError(f"optim.name=muon found no block matrices in the {type(model).__name__} (model.blocks)")
        chosen = {id(named[n]) for n in to_muon}
        muon = torch.optim.Muon(
            [named[n] for n in to_muon],
            lr=o.lr,
            weight_decay=o.weight_decay,
            momentum=MuonOptions.of(o).momentum,
            nesterov=True,
            adjust_lr_fn=MUON_ADJUST_LR,
        )
        rest = [p for p in model.parameters() if p.requires_grad and id(p) not in chosen]
        return MuonAdamW(muon, torch_adamw(rest, cfg, device))
