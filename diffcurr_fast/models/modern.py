"""The modern DiT block (LightningDiT: Yao, Yang, Wang, "Reconstruction vs. Generation: Taming Optimization Dilemma
in Latent Diffusion Models", CVPR 2025, arXiv 2501.01423; official code hustvl/LightningDiT ``models/``):
RMSNorm, QK-norm, SwiGLU and 2-D rotary position embedding, each an option of ``DiT``, all off by default (the
defaults are the release's block, parameter for parameter and bit for bit).

- ``norm='rmsnorm'`` (``model.norm``): the blocks' two pre-norms and the final layer's norm are RMSNorm
  (Zhang & Sennrich 2019, Eq. 4), y = x / sqrt(mean(x^2) + eps), eps 1e-6, without an affine weight: the adaLN
  modulation that follows is the affine map, as the release's LayerNorm has ``elementwise_affine=False``. (The
  official code gives its RMSNorm a learnable weight; it is multiplied into the modulation's scale here, so it is
  left out.)
- ``qk_norm=True`` (``model.qk_norm``): q and k of each head are RMS-normalised over head_dim with a learnable
  weight (one per channel, shared by the heads: ``attn.q_norm.weight``, ``attn.k_norm.weight``, timm's names),
  before the rotation and the attention, as the official code and timm's ``qk_norm`` do.
- ``mlp='swiglu'`` (``model.mlp``): the MLP is w3(silu(w1 x) * w2 x) (Shazeer 2020, Eq. 6, the FFN_SwiGLU with
  biases), with w1 and w2 stored stacked as one linear ``mlp.w12`` (one GEMM, the official code's layout) and ``w3``
  the output. Its hidden width is 2/3 of the GELU MLP's, rounded down: ``swiglu_hidden(H) = (2 * H) // 3`` with
  H = int(hidden_size * mlp_ratio) (or the block's ``block_mlp_hidden``), which is the official ``int(2/3 * H)``
  (the two agree for every H below 10^6). The weights then have the GELU MLP's count when 3 divides H
  (3 D (2H/3) = 2 D H); the biases differ: SwiGLU has 2 H' + D, GELU H + D, i.e. H/3 more (512 per block of
  DiT-S, 1536 of DiT-XL).
- ``pos='rope2d'`` (``model.pos``): 2-D rotary position embedding (RoFormer, Su et al. 2021, Eq. 34, in two
  dimensions as in EVA-02 and the official code) on q and k of every block; the fixed 2-D sin-cos embedding is then
  neither stored nor added (the official code adds both; here rope2d replaces it). Channels come in adjacent pairs
  (x_{2m}, x_{2m+1}) of head_dim; the first head_dim/2 channels (pairs m < head_dim/4) rotate with the token's row
  i, the second half with its column j (token n = i * grid + j, the patch order), each pair by the angle
  pos * theta_m with theta_m = 10000^(-m / (head_dim/4)), m = 0 .. head_dim/4 - 1 (base 10000; the official
  ``VisionRotaryEmbeddingFast`` with ``freqs_for='lang'``). The rotation runs in float32 (float64 for float64
  tensors) and returns q's dtype. head_dim must be a multiple of 4. Under token routing the tables are gathered by
  the route's indices, so the kept tokens rotate with their original positions.

With ``fused_adaln`` each option runs as a fused op of ``diffcurr_fast.ops`` (the same function, docs/ops.md): the
norms and their modulation as ``rmsnorm_modulate``, the heads' split with the QK-norm and the rotation as
``qk_norm_rope``, the SwiGLU activation as ``swiglu``; the code here stays the reference.

Not covered: diffusers' ``DiTTransformer2DModel`` has none of these (``export`` refuses them, ``diffusers_dit.py``),
and TDC's pruning (``tdc/prune.py``) reads the GELU MLP's ``fc1`` / ``fc2``, so a TDC run refuses a SwiGLU model
(``tdc/preflight.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from diffcurr_fast.options import Options, option

__all__ = [
    "MLPS",
    "ModernOptions",
    "NORMS",
    "POSITIONS",
    "ROPE_BASE",
    "RMSNorm",
    "apply_rope2d",
    "check_modern",
    "rope2d_tables",
    "swiglu_hidden",
]

NORMS = ("layernorm", "rmsnorm")
MLPS = ("gelu", "swiglu")
POSITIONS = ("sincos", "rope2d")
ROPE_BASE = 10000.0
RMS_EPS = 1e-6


def check_modern(norm: str, qk_norm: bool, mlp: str, pos: str, head_dim: int) -> None:
    """ValueError naming the option unless the block options are valid choices and fit the head dim."""
    for name, value, choices in (("norm", norm, NORMS), ("mlp", mlp, MLPS), ("pos", pos, POSITIONS)):
        if value not in choices:
            raise ValueError(f"unknown {name} {value!r}; valid choices: {', '.join(choices)}")
    if not isinstance(qk_norm, bool):
        raise ValueError(f"qk_norm must be a bool, got {qk_norm!r}")
    if pos == "rope2d" and head_dim % 4:
        raise ValueError(
            f"pos rope2d needs a head dim (hidden_size / num_heads) divisible by 4 (half rotates with the row, half "
            f"with the column, in pairs), got {head_dim}"
        )


@dataclass
class ModernOptions(Options):
    """The block options in the ``model`` section (module doc), each off at its first choice."""

    norm: str = option(
        "layernorm", "the blocks' pre-norms and final norm: layernorm (DiT) or rmsnorm (LightningDiT; no affine)", NORMS
    )
    qk_norm: bool = option(False, "RMSNorm of q and k per head over head_dim, with a learnable weight (LightningDiT)")
    mlp: str = option(
        "gelu", "the blocks' MLP: gelu (DiT) or swiglu (w3(silu(w1 x) * w2 x), 2/3 the width; LightningDiT)", MLPS
    )
    pos: str = option(
        "sincos",
        "positions: sincos (the fixed embedding added to the tokens, DiT) or rope2d (2-D rotary q and k; LightningDiT)",
        POSITIONS,
    )

    def validate(self, cfg: Any) -> None:
        m = cfg.model
        try:  # the choices are checked with the fields; what is left is rope2d's head dim
            check_modern(self.norm, self.qk_norm, self.mlp, self.pos, m.hidden_size // m.num_heads)
        except ValueError as exc:
            raise ValueError(f"model.{exc}") from None
        width = swiglu_hidden(int(m.hidden_size * m.mlp_ratio))
        if self.mlp == "swiglu" and width < 1:
            raise ValueError(
                f"model.mlp swiglu with model.mlp_ratio {m.mlp_ratio!r} gives the SwiGLU {width} hidden units "
                f"(2/3 of int({m.hidden_size} x {m.mlp_ratio!r})); it needs at least 1"
            )

    def refusal(self, cfg: Any, use: str) -> str | None:
        if use == "tdc" and self.mlp != "gelu":  # tdc/prune.py prunes the hidden units of fc1 / fc2
            return (
                f"model.mlp {self.mlp!r}: TDC's pruning removes hidden units of the GELU MLP (fc1, fc2) only; "
                "use model.mlp=gelu for a TDC run"
            )
        return None

    def dit_kwargs(self, cfg: Any) -> dict[str, Any]:
        return {"norm": self.norm, "qk_norm": self.qk_norm, "mlp": self.mlp, "pos": self.pos}

    def fused_ops(self, cfg: Any) -> list[str]:
        """The block's norm-and-modulate op (this option's norm), QK-norm with RoPE and SwiGLU when on."""
        ops = ["rmsnorm_modulate_fwd" if self.norm == "rmsnorm" else "adaln_modulate_fwd"]
        ops += ["qk_norm_rope_fwd"] if self.qk_norm or self.pos == "rope2d" else []
        return ops + (["swiglu_fwd"] if self.mlp == "swiglu" else [])


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension (Zhang & Sennrich 2019, Eq. 4): x / sqrt(mean(x^2) + eps), times ``weight``
    when ``affine``. Computed in float32 (float64 for float64 inputs), returned in x's dtype, like LayerNorm."""

    def __init__(self, dim: int, eps: float = RMS_EPS, affine: bool = False):
        super().__init__()
        self.dim = dim
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
        else:
            self.register_parameter("weight", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, torch.float32)
        w = None if self.weight is None else self.weight.to(dt)  # (dim,)
        return F.rms_norm(x.to(dt), (self.dim,), w, self.eps).to(x.dtype)  # (..., dim)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


def swiglu_hidden(gelu_hidden: int) -> int:
    """SwiGLU hidden width for a GELU MLP of width ``gelu_hidden``: floor(2/3 * H) in integers (module doc)."""
    return (2 * gelu_hidden) // 3


def rope2d_tables(
    grid: int, head_dim: int, *, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the 2-D rotary angles of a grid x grid token map, (grid**2, head_dim / 2) each.

    Column m of the tables is channel pair m: for m < head_dim/4 the angle is i * theta_m (row i), else
    j * theta_{m - head_dim/4} (column j), theta_m = 10000^(-m / (head_dim/4)); token n = i * grid + j.
    """
    quarter = head_dim // 4
    theta = ROPE_BASE ** (-torch.arange(quarter, dtype=dtype, device=device) / quarter)  # (Dh/4,)
    coords = torch.arange(grid, dtype=dtype, device=device)  # (grid,)
    row = coords.repeat_interleave(grid)  # (T,): i
    col = coords.repeat(grid)  # (T,): j
    angles = torch.cat([row[:, None] * theta[None], col[:, None] * theta[None]], dim=1)  # (T, Dh/2)
    return angles.cos(), angles.sin()  # (T, Dh/2) each


def apply_rope2d(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each channel pair (x_{2m}, x_{2m+1}) of x (B, H, N, Dh) by its angle (RoFormer Eq. 34):
    (x_{2m} cos - x_{2m+1} sin, x_{2m} sin + x_{2m+1} cos). ``cos``, ``sin`` broadcast to (B, H, N, Dh/2): the
    (T, Dh/2) tables, or (B, 1, K, Dh/2) rows of them gathered by a route. Float32 (or wider) math, x's dtype out."""
    dt = torch.promote_types(x.dtype, torch.float32)
    pairs = x.to(dt).unflatten(-1, (-1, 2))  # (B, H, N, Dh/2, 2)
    x0, x1 = pairs.unbind(-1)  # (B, H, N, Dh/2) each
    cos, sin = cos.to(dt), sin.to(dt)  # (..., N, Dh/2)
    out = torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1)  # (B, H, N, Dh/2, 2)
    return out.flatten(-2).to(x.dtype)  # (B, H, N, Dh)
