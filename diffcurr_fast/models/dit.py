"""Diffusion Transformer (Peebles & Xie, "Scalable Diffusion Models with Transformers", ICCV 2023).

Architecture, initialization and state-dict names are those of the authors' release (facebookresearch/DiT
``models.py``), so its checkpoints load strictly. The timm layers it used (PatchEmbed, Attention, Mlp) are written
out here with the same parameter names. Extras, all off by default and none of them changing the math:

- ``attn_backend``: attention kernel (``auto`` / ``flash_attn`` / ``sdpa`` / ``math``), see ``attention.py``.
- ``grad_checkpointing``: recompute each block in the backward pass (non-reentrant ``torch.utils.checkpoint``).
- ``block_num_heads`` / ``block_mlp_hidden``: per-block head counts (fixed head_dim) and MLP widths for pruned,
  heterogeneous models; ``config()`` / ``from_config()`` rebuild them from a plain dict.
- ``fused_adaln``: the block's LayerNorm + modulate and gated residual run as the fused ops of
  ``diffcurr_fast.ops`` (``adaln_modulate``, ``gated_residual``; with the modern block's options also
  ``rmsnorm_modulate``, ``qk_norm_rope`` and ``swiglu``).
- ``dtr``: Denoising Task Routing (Park et al., ICLR 2024), see ``dtr.py``.
- ``routing`` / ``sprint``: token routing in training (TREAD; SPRINT, which adds a [MASK] token and a fusion
  layer), see ``routing.py``.
- ``norm`` / ``qk_norm`` / ``mlp`` / ``pos``: the modern block of LightningDiT (RMSNorm, QK-norm, SwiGLU, 2-D RoPE),
  see ``modern.py``. These change the math; their defaults (``layernorm``, False, ``gelu``, ``sincos``) are the
  release's block, with its parameter names.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn as nn

from diffcurr_fast.diffusion.samplers import guided_forward
from diffcurr_fast.models.attention import ATTENTION_BACKENDS, attention, prepare
from diffcurr_fast.models.dtr import DTRConfig, dtr_mask
from diffcurr_fast.models.modern import RMS_EPS, RMSNorm, apply_rope2d, check_modern, rope2d_tables, swiglu_hidden
from diffcurr_fast.models.routing import Routing
from diffcurr_fast.ops import adaln_modulate, gated_residual, gelu_tanh, qk_norm_rope, rmsnorm_modulate, swiglu

__all__ = [
    "DiT",
    "DiTBlock",
    "FinalLayer",
    "TimestepEmbedder",
    "LabelEmbedder",
    "PatchEmbed",
    "Attention",
    "Mlp",
    "SwiGLU",
    "DIT_PRESETS",
    "DiT_models",
    "check_dims",
    "create_dit",
    "get_2d_sincos_pos_embed",
    "modulate",
]

_LN_EPS = 1e-6


def modulate(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """adaLN modulation (DiT Sec. 3.2): x * (1 + scale) + shift, with (N, D) shift/scale broadcast over tokens."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


#################################################################################
#                    Transformer layers (timm-compatible names)                  #
#################################################################################


def _linear(in_features: int, out_features: int, bias: bool = True) -> nn.Linear:
    """nn.Linear that also accepts a zero width (pruned away) without the zero-element init warning."""
    if in_features * out_features > 0:
        return nn.Linear(in_features, out_features, bias=bias)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")
        return nn.Linear(in_features, out_features, bias=bias)


class PatchEmbed(nn.Module):
    """Image to patch tokens: a p x p convolution with stride p (ViT, Dosovitskiy et al. 2021, Eq. 1)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int, bias: bool = True):
        super().__init__()
        self.img_size = (img_size, img_size)
        self.patch_size = (patch_size, patch_size)
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj(x)  # (N, D, H/p, W/p)
        return x.flatten(2).transpose(1, 2)  # (N, T, D)


class Mlp(nn.Module):
    """Transformer MLP: fc2(GELU_tanh(fc1(x))). A width of 0 leaves only fc2's bias. ``fused``: the activation
    runs through ``diffcurr_fast.ops.gelu_tanh`` (the same function, a faster CPU kernel)."""

    def __init__(self, in_features: int, hidden_features: int, fused: bool = False):
        super().__init__()
        self.fc1 = _linear(in_features, hidden_features)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = _linear(hidden_features, in_features)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.fc1(x)  # (N, T, hidden)
        if self.fused:
            return self.fc2(gelu_tanh(x))  # (N, T, D)
        return self.fc2(self.act(x))  # (N, T, D)


class SwiGLU(nn.Module):
    """SwiGLU MLP (Shazeer 2020, Eq. 6; LightningDiT): w3(silu(w1 x) * w2 x), with [w1; w2] stacked as one linear
    ``w12`` of 2 * hidden outputs. ``hidden`` is 2/3 of the GELU width (``modern.swiglu_hidden``). ``fused``: the
    SiLU and product run as the fused op ``diffcurr_fast.ops.swiglu`` (the same function)."""

    def __init__(self, in_features: int, hidden_features: int, fused: bool = False):
        super().__init__()
        self.w12 = _linear(in_features, 2 * hidden_features)
        self.w3 = _linear(hidden_features, in_features)
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return self.w3(swiglu(self.w12(x)))  # (N, T, D)
        x1, x2 = self.w12(x).chunk(2, dim=-1)  # (N, T, hidden) each: w1 x, w2 x
        return self.w3(nn.functional.silu(x1) * x2)  # (N, T, D)


class Attention(nn.Module):
    """Multi-head self-attention (Vaswani et al. 2017, Eq. 1) with qkv / proj projections.

    ``num_heads`` heads of ``head_dim`` each (``head_dim`` defaults to dim // num_heads; a pruned block keeps the
    original head_dim with fewer heads). With 0 heads the attention is skipped and only ``proj.bias`` remains.
    ``qk_norm``: q and k RMS-normalised per head over head_dim with a learnable weight (``modern.py``). ``forward``'s
    ``rope``: (cos, sin) tables that rotate q and k (``modern.apply_rope2d``), or None. ``fused``: the heads' split,
    the QK-norm and the rotation run as one fused op (``diffcurr_fast.ops.qk_norm_rope``, the same function).
    """

    def __init__(
        self,
        dim: int,
        num_heads: int,
        head_dim: int | None = None,
        qkv_bias: bool = True,
        backend: str = "auto",
        qk_norm: bool = False,
        fused: bool = False,
    ):
        super().__init__()
        self.fused = fused
        if head_dim is None:
            if num_heads < 1 or dim % num_heads:
                raise ValueError(f"dim {dim} must be divisible by num_heads {num_heads} (num_heads >= 1)")
            head_dim = dim // num_heads
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        prepare(backend)  # the flash-attn import happens here, not inside a compiled forward
        inner = num_heads * head_dim
        self.qkv = _linear(dim, 3 * inner, bias=qkv_bias)
        self.proj = _linear(inner, dim)
        self.qk_norm = bool(qk_norm)
        if self.qk_norm:  # absent otherwise: the release's state dict has no such keys
            self.q_norm = RMSNorm(head_dim, RMS_EPS, affine=True)
            self.k_norm = RMSNorm(head_dim, RMS_EPS, affine=True)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, N, _ = x.shape
        if self.num_heads == 0:
            return self.proj(x.new_zeros(B, N, 0))  # (B, N, D): bias only
        qkv = self.qkv(x)  # (B, N, 3 * H * Dh)
        if self.fused and (self.qk_norm or rope is not None):
            weights = (self.q_norm.weight, self.k_norm.weight) if self.qk_norm else (None, None)
            tables = rope or (None, None)
            q, k, v = qk_norm_rope(qkv, self.num_heads, *weights, *tables, eps=RMS_EPS)  # (B, H, N, Dh) each
        else:
            qkv = qkv.reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)  # (3, B, H, N, Dh)
            q, k, v = qkv.unbind(0)  # (B, H, N, Dh) each
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)  # (B, H, N, Dh) each: RMSNorm over Dh (modern.py)
            if rope is not None:
                q, k = apply_rope2d(q, *rope), apply_rope2d(k, *rope)  # (B, H, N, Dh) each: RoFormer Eq. 34 in 2-D
        x = attention(q, k, v, self.backend, scale=self.scale)  # (B, H, N, Dh)
        x = x.transpose(1, 2).reshape(B, N, self.num_heads * self.head_dim)  # (B, N, H * Dh)
        return self.proj(x)  # (B, N, D)


#################################################################################
#               Embedding Layers for Timesteps and Class Labels                 #
#################################################################################


class TimestepEmbedder(nn.Module):
    """Embeds scalar timesteps: sinusoidal features (256 frequencies) followed by a 2-layer SiLU MLP."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256):
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(
        t: torch.Tensor, dim: int, max_period: float = 10000, dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """Sinusoidal embedding [cos(t f_i), sin(t f_i)], f_i = max_period^(-i / half) (GLIDE / ADM).

        Args:
            t: (N,) timesteps, possibly fractional.
            dim: output width; odd widths get a trailing zero column.
            max_period: controls the lowest frequency.
            dtype: computation dtype (float32 as in the release; float64 for float64 models).

        Returns:
            (N, dim) embedding.
        """
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(0, half, dtype=dtype, device=t.device) / half)  # (half,)
        args = t[:, None].to(dtype) * freqs[None]  # (N, half)
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # (N, 2 * half)
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)  # (N, dim)
        return embedding

    def forward(self, t: torch.Tensor) -> torch.Tensor:
        w = self.mlp[0].weight
        dtype = torch.float64 if w.dtype == torch.float64 else torch.float32
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size, dtype=dtype)  # (N, 256)
        return self.mlp(t_freq.to(w.dtype))  # (N, D)


class LabelEmbedder(nn.Module):
    """Class-label embedding table with label dropout for classifier-free guidance (Ho & Salimans 2022).

    The table has ``num_classes + 1`` rows when ``dropout_prob > 0``; row ``num_classes`` is the null label.
    """

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float):
        super().__init__()
        use_cfg_embedding = dropout_prob > 0
        self.embedding_table = nn.Embedding(num_classes + int(use_cfg_embedding), hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels: torch.Tensor, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Replace labels by the null label, at random (p = dropout_prob) or where ``force_drop_ids == 1``."""
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        return torch.where(drop_ids, self.num_classes, labels)

    def forward(self, labels: torch.Tensor, train: bool, force_drop_ids: torch.Tensor | None = None) -> torch.Tensor:
        use_dropout = self.dropout_prob > 0
        if (train and use_dropout) or (force_drop_ids is not None):
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)  # (N, D)


#################################################################################
#                                 Core DiT Model                                #
#################################################################################


def _norm(kind: str, dim: int) -> nn.Module:
    """The pre-norm of a block (and of the final layer): the release's LayerNorm, or RMSNorm (``modern.py``); both
    without an affine weight, as the adaLN modulation follows."""
    if kind == "rmsnorm":
        return RMSNorm(dim, RMS_EPS)
    return nn.LayerNorm(dim, elementwise_affine=False, eps=_LN_EPS)


class DiTBlock(nn.Module):
    """A DiT block with adaptive layer norm zero (adaLN-Zero) conditioning (DiT Sec. 3.2).

    ``x = x + gate_msa * Attn(modulate(LN(x), shift_msa, scale_msa))``, then the same with the MLP. With a DTR
    mask m the block runs on ``x * m`` and adds back ``x * (1 - m)``. ``norm``, ``qk_norm``, ``mlp``: the modern
    block's options (``modern.py``); ``forward``'s ``rope``: the (cos, sin) tables of its tokens, or None.
    """

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        *,
        head_dim: int | None = None,
        mlp_hidden: int | None = None,
        attn_backend: str = "auto",
        fused_adaln: bool = False,
        norm: str = "layernorm",
        qk_norm: bool = False,
        mlp: str = "gelu",
    ):
        super().__init__()
        self.fused_adaln = fused_adaln
        self.norm_kind = norm
        self.norm1 = _norm(norm, hidden_size)
        self.attn = Attention(
            hidden_size,
            num_heads=num_heads,
            head_dim=head_dim,
            qkv_bias=True,
            backend=attn_backend,
            qk_norm=qk_norm,
            fused=fused_adaln,
        )
        self.norm2 = _norm(norm, hidden_size)
        mlp_hidden_dim = int(hidden_size * mlp_ratio) if mlp_hidden is None else mlp_hidden
        if mlp == "swiglu":  # mlp_hidden (a pruned block's) is then the SwiGLU width itself
            hidden = swiglu_hidden(mlp_hidden_dim) if mlp_hidden is None else mlp_hidden
            self.mlp = SwiGLU(hidden_size, hidden, fused=fused_adaln)
        else:
            self.mlp = Mlp(in_features=hidden_size, hidden_features=mlp_hidden_dim, fused=fused_adaln)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(
        self,
        x: torch.Tensor,
        c: torch.Tensor,
        mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        if mask is not None:
            x_in = x  # (N, T, D)
            x = x * mask.unsqueeze(1)  # (N, T, D): routed channels only
        if self.fused_adaln:
            x = self._fused(x, shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, rope)  # (N, T, D)
        else:
            h = self.attn(modulate(self.norm1(x), shift_msa, scale_msa), rope)  # (N, T, D)
            x = x + gate_msa.unsqueeze(1) * h  # (N, T, D)
            x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))  # (N, T, D)
        if mask is not None:
            x = x + x_in * (1 - mask.unsqueeze(1))  # (N, T, D): unrouted channels pass through
        return x

    def _fused(self, x, shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp, rope=None) -> torch.Tensor:
        dt = torch.promote_types(x.dtype, shift_msa.dtype)
        x = x.to(dt)
        h = self.attn(self._norm_modulate(self.norm1, x, shift_msa.to(dt), scale_msa.to(dt)), rope)  # (N, T, D)
        x = gated_residual(x, gate_msa, h)  # (N, T, D): h, gate keep their (autocast) dtype; the result has x's
        h = self.mlp(self._norm_modulate(self.norm2, x, shift_mlp.to(dt), scale_mlp.to(dt)))  # (N, T, D)
        return gated_residual(x, gate_mlp, h)  # (N, T, D)

    def _norm_modulate(self, norm: nn.Module, x, shift, scale) -> torch.Tensor:
        if self.norm_kind == "rmsnorm":
            return rmsnorm_modulate(x, shift, scale, eps=RMS_EPS)  # (N, T, D)
        return adaln_modulate(x, shift, scale, eps=_LN_EPS)  # (N, T, D)


class FinalLayer(nn.Module):
    """The final layer of DiT: adaLN modulation then a linear map to p * p * out_channels per token. ``fused`` with
    the RMSNorm: the norm and modulation run as ``diffcurr_fast.ops.rmsnorm_modulate`` (the same function)."""

    def __init__(
        self, hidden_size: int, patch_size: int, out_channels: int, norm: str = "layernorm", fused: bool = False
    ):
        super().__init__()
        self.norm_final = _norm(norm, hidden_size)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))
        self.fused_rms = fused and norm == "rmsnorm"

    def forward(self, x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)  # (N, D) each
        if self.fused_rms:
            dt = torch.promote_types(x.dtype, shift.dtype)
            x = rmsnorm_modulate(x.to(dt), shift.to(dt), scale.to(dt), eps=RMS_EPS)  # (N, T, D)
        else:
            x = modulate(self.norm_final(x), shift, scale)  # (N, T, D)
        return self.linear(x)  # (N, T, p * p * out_channels)


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def check_dims(input_size: int, patch_size: int, hidden_size: int, num_heads: int) -> None:
    """The DiT's rules between its dimensions (ValueError naming them): patches tile the input, the heads split the
    width, and the 2-D sin-cos position embedding needs a width divisible by 4. The run config checks them too."""
    if input_size % patch_size:
        raise ValueError(f"input_size {input_size} is not divisible by patch_size {patch_size}")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if hidden_size % 4:
        raise ValueError(f"hidden_size must be a multiple of 4 for the 2-D sin-cos embedding, got {hidden_size}")


def _block_list(name: str, values: Sequence[int] | None, depth: int) -> list[int] | None:
    if values is None:
        return None
    values = list(values)
    if len(values) != depth:
        raise ValueError(f"{name} must have one entry per block (depth={depth}), got {len(values)} entries")
    for i, v in enumerate(values):
        _check_int(f"{name}[{i}]", v, 0)
    return values


class DiT(nn.Module):
    """Diffusion model with a Transformer backbone.

    The positional arguments are those of the release. Keyword extras:

    Args:
        attn_backend: ``auto`` | ``flash_attn`` | ``sdpa`` | ``math``.
        grad_checkpointing: recompute every block in the backward pass (saves activation memory).
        block_num_heads: per-block head counts (head_dim stays hidden_size // num_heads); 0 disables attention.
        block_mlp_hidden: per-block MLP widths; 0 disables the MLP.
        fused_adaln: use ``diffcurr_fast.ops.adaln_modulate`` / ``gated_residual`` / ``gelu_tanh`` in the blocks.
        dtr: Denoising Task Routing settings (a ``DTRConfig`` or its dict), or None.
        num_timesteps: T; integer t must lie in [0, T). Also the DTR task count.
        routing: (start, end), the blocks [start, end) that token routing lets a share of the tokens skip in
            training (``models.routing``, TREAD); the kept tokens are given to ``forward`` as ``route``. None: no
            routing. No parameters: the state dict is the plain model's.
        sprint: SPRINT (``models.routing``) around the ``routing`` span: the blocks before it are the dense shallow
            path, the span the sparse deep path (the routed tokens are dropped and come back as the [MASK] token),
            fused with the shallow path by a linear 2D -> D before the blocks after it. Adds ``sprint_mask_token``
            (D,) and ``sprint_fusion``; the fusion runs on every forward, with or without ``route``.
        norm: ``layernorm`` (the release) | ``rmsnorm``: the blocks' pre-norms and the final norm (``modern.py``).
        qk_norm: RMSNorm of q and k per head, with a learnable weight (``modern.py``).
        mlp: ``gelu`` (the release) | ``swiglu``, 2/3 as wide (``modern.py``).
        pos: ``sincos`` (the release's fixed embedding, added to the tokens) | ``rope2d`` (2-D rotary embedding of q
            and k in every block; no ``pos_embed`` then, ``modern.py``).
    """

    def __init__(
        self,
        input_size: int = 32,
        patch_size: int = 2,
        in_channels: int = 4,
        hidden_size: int = 1152,
        depth: int = 28,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        class_dropout_prob: float = 0.1,
        num_classes: int = 1000,
        learn_sigma: bool = True,
        *,
        attn_backend: str = "auto",
        grad_checkpointing: bool = False,
        block_num_heads: Sequence[int] | None = None,
        block_mlp_hidden: Sequence[int] | None = None,
        fused_adaln: bool = False,
        dtr: DTRConfig | dict[str, float] | None = None,
        num_timesteps: int = 1000,
        routing: Sequence[int] | None = None,
        sprint: bool = False,
        norm: str = "layernorm",
        qk_norm: bool = False,
        mlp: str = "gelu",
        pos: str = "sincos",
    ):
        super().__init__()
        _check_int("input_size", input_size, 1)
        _check_int("patch_size", patch_size, 1)
        _check_int("in_channels", in_channels, 1)
        _check_int("hidden_size", hidden_size, 4)
        _check_int("depth", depth, 1)
        _check_int("num_heads", num_heads, 1)
        _check_int("num_classes", num_classes, 1)
        _check_int("num_timesteps", num_timesteps, 1)
        check_dims(input_size, patch_size, hidden_size, num_heads)
        check_modern(norm, qk_norm, mlp, pos, hidden_size // num_heads)
        if not 0.0 <= class_dropout_prob < 1.0:
            raise ValueError(f"class_dropout_prob must be in [0, 1), got {class_dropout_prob!r}")
        if not mlp_ratio >= 0:
            raise ValueError(f"mlp_ratio must be >= 0, got {mlp_ratio!r}")
        if attn_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attn_backend {attn_backend!r}; valid choices: {', '.join(ATTENTION_BACKENDS)}")
        if isinstance(dtr, dict):
            dtr = DTRConfig.from_dict(dtr)
        if dtr is not None and not isinstance(dtr, DTRConfig):
            raise ValueError(f"dtr must be None, a DTRConfig or a dict of its fields, got {type(dtr).__name__}")
        if dtr is not None and num_timesteps < 2:
            raise ValueError(f"dtr needs num_timesteps >= 2, got {num_timesteps}")
        if routing is not None:
            routing = [int(v) for v in routing]
            if len(routing) != 2 or not 0 <= routing[0] < routing[1] <= depth:
                raise ValueError(
                    f"routing must be (start, end) blocks with 0 <= start < end <= depth {depth}, got {routing}"
                )
        router = Routing(None if routing is None else (routing[0], routing[1]), sprint)
        block_num_heads = _block_list("block_num_heads", block_num_heads, depth)
        block_mlp_hidden = _block_list("block_mlp_hidden", block_mlp_hidden, depth)

        self._config = dict(
            input_size=input_size,
            patch_size=patch_size,
            in_channels=in_channels,
            hidden_size=hidden_size,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=float(mlp_ratio),
            class_dropout_prob=float(class_dropout_prob),
            num_classes=num_classes,
            learn_sigma=bool(learn_sigma),
            attn_backend=attn_backend,
            grad_checkpointing=bool(grad_checkpointing),
            block_num_heads=block_num_heads,
            block_mlp_hidden=block_mlp_hidden,
            fused_adaln=bool(fused_adaln),
            dtr=None if dtr is None else dtr.to_dict(),
            num_timesteps=num_timesteps,
            routing=routing,
            sprint=bool(sprint),
            norm=norm,
            qk_norm=qk_norm,
            mlp=mlp,
            pos=pos,
        )
        self.learn_sigma = learn_sigma
        self.in_channels = in_channels
        self.out_channels = in_channels * 2 if learn_sigma else in_channels
        self.patch_size = patch_size
        self.num_heads = num_heads
        self.hidden_size = hidden_size
        self.input_size = input_size
        self.num_classes = num_classes
        self.num_timesteps = num_timesteps
        self.grad_checkpointing = bool(grad_checkpointing)
        self.dtr = dtr
        self.router = router  # token routing's span and SPRINT's fusion (``models.routing``)
        self.routing, self.sprint = router.span, router.sprint
        self.pos = pos
        self.norm = norm
        # The range checks of t and y read values back to the host (a device sync); a trainer whose t come from
        # its own sampler and whose labels were checked at load switches them off for its steps.
        self.check_values = True

        self.x_embedder = PatchEmbed(input_size, patch_size, in_channels, hidden_size, bias=True)
        self.t_embedder = TimestepEmbedder(hidden_size)
        self.y_embedder = LabelEmbedder(num_classes, hidden_size, class_dropout_prob)
        num_patches = self.x_embedder.num_patches
        # Fixed 2-D sin-cos embedding, kept as a frozen parameter as in the release (it is in state_dict()); with
        # rope2d the blocks rotate q and k instead, and there is none.
        if pos == "sincos":
            self.pos_embed = nn.Parameter(torch.zeros(1, num_patches, hidden_size), requires_grad=False)
        else:
            self.register_parameter("pos_embed", None)

        head_dim = hidden_size // num_heads
        self.blocks = nn.ModuleList(
            [
                DiTBlock(
                    hidden_size,
                    num_heads if block_num_heads is None else block_num_heads[i],
                    mlp_ratio=mlp_ratio,
                    head_dim=head_dim,
                    mlp_hidden=None if block_mlp_hidden is None else block_mlp_hidden[i],
                    attn_backend=attn_backend,
                    fused_adaln=bool(fused_adaln),
                    norm=norm,
                    qk_norm=qk_norm,
                    mlp=mlp,
                )
                for i in range(depth)
            ]
        )
        self.final_layer = FinalLayer(hidden_size, patch_size, self.out_channels, norm=norm, fused=bool(fused_adaln))
        router.add_parameters(self, hidden_size)  # SPRINT's [MASK] token and fusion layer
        self.initialize_weights()

    # ------------------------------------------------------------------ config

    def config(self) -> dict[str, Any]:
        """Constructor arguments as a plain (JSON-serializable) dict; ``DiT.from_config`` rebuilds the model."""
        cfg = dict(self._config)
        cfg["grad_checkpointing"] = self.grad_checkpointing
        for key in ("block_num_heads", "block_mlp_hidden"):
            cfg[key] = None if cfg[key] is None else list(cfg[key])
        cfg["dtr"] = None if cfg["dtr"] is None else dict(cfg["dtr"])
        cfg["routing"] = None if cfg.get("routing") is None else list(cfg["routing"])
        return cfg

    @classmethod
    def from_config(cls, config: dict[str, Any], **overrides: Any) -> DiT:
        """Build a DiT from ``config()`` output; ``overrides`` replace entries (e.g. ``attn_backend``)."""
        cfg = {**config, **overrides}
        valid = set(inspect.signature(cls.__init__).parameters) - {"self"}
        unknown = set(cfg) - valid
        if unknown:
            raise ValueError(f"unknown DiT config keys {sorted(unknown)}; valid keys: {', '.join(sorted(valid))}")
        return cls(**cfg)

    # ------------------------------------------------------------------ init

    def initialize_weights(self) -> None:
        """The release's initialization: xavier-uniform linears with zero bias, patch embedding like a linear,
        N(0, 0.02) label table and timestep MLP weights, zero adaLN modulation and zero output layer."""

        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                if module.weight.numel() > 0:
                    torch.nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(_basic_init)

        # Initialize (and freeze) pos_embed by sin-cos embedding:
        if self.pos_embed is not None:
            grid = self.x_embedder.grid_size[0]
            pos_embed = get_2d_sincos_pos_embed(self.pos_embed.shape[-1], grid)  # (T, D) float64
            self.pos_embed.data.copy_(pos_embed.float().unsqueeze(0))

        # Initialize patch_embed like nn.Linear (instead of nn.Conv2d):
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view([w.shape[0], -1]))
        nn.init.constant_(self.x_embedder.proj.bias, 0)

        # Initialize label embedding table:
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)

        # Initialize timestep embedding MLP:
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)

        # Zero-out adaLN modulation layers in DiT blocks:
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)

        # Zero-out output layers:
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

        self.router.init_parameters(self)  # SPRINT's [MASK] token

    # ------------------------------------------------------------------ forward

    def unpatchify(self, x: torch.Tensor) -> torch.Tensor:
        """(N, T, p * p * C) tokens to (N, C, H, W) images."""
        c = self.out_channels
        p = self.x_embedder.patch_size[0]
        h = w = int(round(x.shape[1] ** 0.5))
        if h * w != x.shape[1] or x.shape[2] != p * p * c:
            raise ValueError(f"unpatchify expects (N, h*h, {p * p * c}) tokens, got {tuple(x.shape)}")
        x = x.reshape(x.shape[0], h, w, p, p, c)  # (N, h, w, p, p, C)
        x = torch.einsum("nhwpqc->nchpwq", x)  # (N, C, h, p, w, p)
        return x.reshape(x.shape[0], c, h * p, w * p)  # (N, C, H, W)

    def _check_inputs(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor) -> None:
        if x.dim() != 4:
            raise ValueError(f"x must be (N, C, H, W), got shape {tuple(x.shape)}")
        n, ch, h, w = x.shape
        if ch != self.in_channels:
            raise ValueError(f"x has {ch} channels, the model expects in_channels={self.in_channels}")
        if h != self.input_size or w != self.input_size:
            raise ValueError(f"x is {h}x{w}, the model expects {self.input_size}x{self.input_size} inputs")
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"t must have shape ({n},) (or be a scalar), got {tuple(t.shape)}")
        if t.dtype == torch.bool or t.is_complex():
            raise ValueError(f"t must be an integer or floating tensor, got {t.dtype}")
        if y.dim() != 1 or y.shape[0] != n:
            raise ValueError(f"y must have shape ({n},), got {tuple(y.shape)}")
        if y.dtype == torch.bool or y.is_floating_point() or y.is_complex():
            raise ValueError(f"y must be an integer tensor of class labels, got {y.dtype}")
        if t.is_meta or y.is_meta or torch.compiler.is_compiling() or not self.check_values:
            return
        if t.is_cuda and torch.cuda.is_current_stream_capturing():
            return
        num_labels = self.y_embedder.embedding_table.num_embeddings
        t_int = not t.is_floating_point()
        bad_t = ((t < 0) | (t >= self.num_timesteps)).any() if t_int else ~torch.isfinite(t).all()
        bad_y = ((y < 0) | (y >= num_labels)).any()
        if bool(bad_t | bad_y.to(bad_t.device)):  # one host sync for both checks
            if bool(bad_t):
                if t_int:
                    raise ValueError(
                        f"integer t must lie in [0, {self.num_timesteps}) (num_timesteps={self.num_timesteps}), "
                        f"got values in [{int(t.min())}, {int(t.max())}]"
                    )
                raise ValueError("float t must be finite, got NaN or inf")
            null = f" ({self.num_classes} is the null label)" if num_labels > self.num_classes else ""
            raise ValueError(f"y must lie in [0, {num_labels}){null}, got values in [{int(y.min())}, {int(y.max())}]")

    def forward(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        *,
        force_drop_ids: torch.Tensor | None = None,
        features: Sequence[int] = (),
        route: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Forward pass of DiT.

        Args:
            x: (N, C, H, W) images or latents.
            t: (N,) diffusion timesteps (integer in [0, num_timesteps), or float), or a scalar.
            y: (N,) class labels (``num_classes`` is the null label when class dropout is on).
            force_drop_ids: optional (N,) tensor; entries equal to 1 use the null label.
            features: block indices j (0-based) whose output tokens to return as well, from the same pass (what a
                training term reads, ``diffcurr_fast.terms``); empty: the output alone.
            route: (N, K) int64 indices of the tokens that the blocks of ``routing`` process (token routing in
                training, ``models.routing``; the others skip them, or with ``sprint`` come back as the [MASK]
                token); None: every token, every block.

        Returns:
            (N, out_channels, H, W); with ``features``, also {j: (N, T, D) tokens after block j}.
        """
        if any(not 0 <= j < len(self.blocks) for j in features):
            raise ValueError(f"features {list(features)}: this DiT has blocks 0 to {len(self.blocks) - 1}")
        if t.dim() == 0 and x.dim() > 0:
            t = t.expand(x.shape[0])  # (N,)
        self._check_inputs(x, t, y)
        x = self.x_embedder(x)  # (N, T, D), where T = H * W / patch_size ** 2
        if self.norm == "rmsnorm":
            # dense tokens (the embedding's are a transposed view; LayerNorm makes its input dense itself): RMSNorm's
            # sums and their backward then run in one order whether or not the tokens were routed
            x = x.contiguous()  # (N, T, D)
        rope = None
        if self.pos_embed is not None:
            x = x + self.pos_embed  # (N, T, D): the fixed 2-D sin-cos embedding
        else:
            rope = self._rope_tables(x)  # (T, Dh / 2) cos and sin: rope2d rotates q and k in every block instead
        mask = None
        if self.dtr is not None:
            mask = dtr_mask(t, self.hidden_size, self.num_timesteps, self.dtr, dtype=x.dtype)  # (N, D)
        t = self.t_embedder(t)  # (N, D)
        y = self.y_embedder(y, self.training, force_drop_ids)  # (N, D)
        c = t + y  # (N, D)
        x, kept = self.router.blocks(self, x, c, mask, rope, route, features)  # (N, T, D), {j: (N, T, D)}
        x = self.final_layer(x, c)  # (N, T, patch_size ** 2 * out_channels)
        out = self.unpatchify(x)  # (N, out_channels, H, W)
        return (out, kept) if features else out

    def _rope_tables(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The 2-D rotary (cos, sin) tables of the token grid, (T, head_dim / 2) each (``modern.rope2d_tables``), in
        float32 (float64 for a float64 model), on x's device."""
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        grid = self.x_embedder.grid_size[0]
        return rope2d_tables(grid, self.hidden_size // self.num_heads, dtype=dtype, device=x.device)

    def forward_with_cfg(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor,
        cfg_scale: float,
        *,
        guide_all_channels: bool = False,
    ) -> torch.Tensor:
        """Forward pass with classifier-free guidance (Ho & Salimans 2022, Eq. 6), batched as in the release.

        The batch is [conditional half; unconditional half] (y's second half holds the null label); only x's
        first half is used for both. guided = uncond + cfg_scale * (cond - uncond). As in the release, guidance is
        applied to the first 3 output channels by default; ``guide_all_channels=True`` guides all in_channels
        (the standard form). The other channels are returned unguided.
        """
        return guided_forward(self.forward, x, t, y, cfg_scale, self.in_channels if guide_all_channels else 3)


#################################################################################
#                   Sine/Cosine Positional Embedding Functions                  #
#################################################################################


def get_1d_sincos_pos_embed_from_grid(embed_dim: int, pos: torch.Tensor) -> torch.Tensor:
    """(M,) positions to (M, embed_dim) [sin(pos w_i), cos(pos w_i)], w_i = 10000^(-2i / embed_dim) (float64)."""
    if embed_dim % 2:
        raise ValueError(f"embed_dim must be even, got {embed_dim}")
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega  # (D/2,)
    out = pos.reshape(-1).to(torch.float64)[:, None] * omega[None, :]  # (M, D/2), outer product
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)  # (M, D)


def get_2d_sincos_pos_embed(embed_dim: int, grid_size: int) -> torch.Tensor:
    """2-D sin-cos embedding of a grid_size x grid_size grid (MAE), (grid_size**2, embed_dim) float64.

    Token n = i * grid_size + j (row i, column j); as in the release the first half of the channels encodes the
    column j and the second half the row i.
    """
    if embed_dim % 4:
        raise ValueError(f"embed_dim must be a multiple of 4, got {embed_dim}")
    coords = torch.arange(grid_size, dtype=torch.float64)
    col = coords.repeat(grid_size)  # (T,): j
    row = coords.repeat_interleave(grid_size)  # (T,): i
    emb_col = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, col)  # (T, D/2)
    emb_row = get_1d_sincos_pos_embed_from_grid(embed_dim // 2, row)  # (T, D/2)
    return torch.cat([emb_col, emb_row], dim=1)  # (T, D)


#################################################################################
#                                   DiT Configs                                  #
#################################################################################


# The official presets (facebookresearch/DiT ``models.py``): name -> dimensions.
DIT_PRESETS: dict[str, dict[str, int]] = {
    f"DiT-{size}/{patch}": {"depth": depth, "hidden_size": hidden, "patch_size": patch, "num_heads": heads}
    for size, depth, hidden, heads in (("XL", 28, 1152, 16), ("L", 24, 1024, 16), ("B", 12, 768, 12), ("S", 12, 384, 6))
    for patch in (2, 4, 8)
}

DiT_models: dict[str, Callable[..., DiT]] = {name: functools.partial(DiT, **dims) for name, dims in DIT_PRESETS.items()}


def create_dit(name: str, **kwargs: Any) -> DiT:
    """Build a preset from ``DiT_models`` by name (e.g. ``"DiT-XL/2"``); kwargs go to ``DiT``."""
    if name not in DiT_models:
        raise ValueError(f"unknown DiT preset {name!r}; valid names: {', '.join(DiT_models)}")
    return DiT_models[name](**kwargs)
