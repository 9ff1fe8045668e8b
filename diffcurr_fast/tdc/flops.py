"""Analytic FLOPs of a (heterogeneous) DiT forward pass: matrix multiplies and attention.

FLOPs = 2 x multiply-accumulates, the convention of ``torch.utils.flop_counter.FlopCounterMode``. Counted per
sample: the patch-embedding convolution, the timestep MLP, per block the adaLN modulation, qkv, the two attention
products (q k^T and softmax(.) v: 4 T^2 H Dh), the output projection and the MLP, then the final adaLN and linear
layer. Element-wise work (LayerNorm, softmax, GELU, modulation, residuals) and the label-embedding lookup are not
counted; they are a small fraction and FlopCounterMode does not count them either.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.nn as nn

__all__ = ["block_flops", "dit_config", "dit_flops", "dit_flops_breakdown", "widths_flops"]


def dit_config(model_or_config: nn.Module | dict[str, Any]) -> dict[str, Any]:
    """The ``config()`` dict of a DiT, or the dict itself."""
    if isinstance(model_or_config, dict):
        return model_or_config
    if hasattr(model_or_config, "config") and callable(model_or_config.config):
        return model_or_config.config()
    raise ValueError(f"expected a DiT or its config() dict, got {type(model_or_config).__name__}")


def _geometry(cfg: dict[str, Any]) -> tuple[int, int, int, int, int]:
    """(tokens T, hidden D, head_dim Dh, patch p, out_channels)."""
    p = int(cfg["patch_size"])
    tokens = (int(cfg["input_size"]) // p) ** 2
    d = int(cfg["hidden_size"])
    head_dim = d // int(cfg["num_heads"])
    out_ch = int(cfg["in_channels"]) * (2 if cfg.get("learn_sigma", True) else 1)
    return tokens, d, head_dim, p, out_ch


def default_widths(cfg: dict[str, Any]) -> tuple[list[int], list[int]]:
    """Per-block (heads, mlp hidden) of a DiT config, filling the homogeneous defaults."""
    depth = int(cfg["depth"])
    heads = cfg.get("block_num_heads") or [int(cfg["num_heads"])] * depth
    mlp = cfg.get("block_mlp_hidden") or [int(int(cfg["hidden_size"]) * float(cfg.get("mlp_ratio", 4.0)))] * depth
    return [int(h) for h in heads], [int(m) for m in mlp]


def block_flops(tokens: int, hidden: int, head_dim: int, heads: int, mlp_hidden: int) -> dict[str, int]:
    """FLOPs of one DiT block for one sample: adaLN, qkv, attention products, proj, fc1, fc2."""
    inner = heads * head_dim
    return {
        "adaln": 2 * hidden * 6 * hidden,  # (1, D) @ (D, 6D)
        "qkv": 2 * tokens * hidden * 3 * inner,  # (T, D) @ (D, 3 H Dh)
        "attn": 4 * tokens * tokens * inner,  # q k^T and softmax(.) v, each 2 T^2 H Dh
        "proj": 2 * tokens * inner * hidden,  # (T, H Dh) @ (H Dh, D)
        "fc1": 2 * tokens * hidden * mlp_hidden,  # (T, D) @ (D, M)
        "fc2": 2 * tokens * mlp_hidden * hidden,  # (T, M) @ (M, D)
    }


def dit_flops_breakdown(
    model_or_config: nn.Module | dict[str, Any], batch_size: int = 1, route: tuple[int, int, int] | None = None
) -> dict[str, int]:
    """FLOPs of one forward by component (``embed``, ``t_embed``, ``adaln``, ``qkv``, ``attn``, ``proj``, ``fc1``,
    ``fc2``, ``final``) and ``total``, for ``batch_size`` samples. ``route`` (K, start, end): token routing in
    training (``models/routing.py``), the blocks [start, end) on K tokens, the others on all T."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    cfg = dit_config(model_or_config)
    tokens, d, head_dim, p, out_ch = _geometry(cfg)
    heads, mlp = default_widths(cfg)
    out = {
        "embed": 2 * tokens * int(cfg["in_channels"]) * p * p * d,  # p x p conv, stride p
        "t_embed": 2 * 256 * d + 2 * d * d,  # sinusoidal (256) -> D -> D
        "adaln": 0,
        "qkv": 0,
        "attn": 0,
        "proj": 0,
        "fc1": 0,
        "fc2": 0,
        "final": 2 * d * 2 * d + 2 * tokens * d * p * p * out_ch,  # adaLN (D -> 2D) and linear
    }
    for i, (h, m) in enumerate(zip(heads, mlp, strict=True)):
        n = route[0] if route is not None and route[1] <= i < route[2] else tokens
        for key, value in block_flops(n, d, head_dim, h, m).items():
            out[key] += value
    out = {key: value * batch_size for key, value in out.items()}
    out["total"] = sum(out.values())
    return out


def dit_flops(
    model_or_config: nn.Module | dict[str, Any], batch_size: int = 1, route: tuple[int, int, int] | None = None
) -> int:
    """Total FLOPs (2 x MACs) of one DiT forward on ``batch_size`` samples (``route``: ``dit_flops_breakdown``)."""
    return dit_flops_breakdown(model_or_config, batch_size, route)["total"]


def widths_flops(config: dict[str, Any], heads: Sequence[int], mlp_hidden: Sequence[int]) -> int:
    """Per-sample FLOPs of ``config``'s DiT with per-block widths ``heads`` / ``mlp_hidden`` (same depth)."""
    depth = int(config["depth"])
    if len(heads) != depth or len(mlp_hidden) != depth:
        raise ValueError(f"need {depth} per-block widths, got {len(heads)} heads and {len(mlp_hidden)} mlp entries")
    cfg = dict(config, block_num_heads=[int(h) for h in heads], block_mlp_hidden=[int(m) for m in mlp_hidden])
    return dit_flops(cfg)
