"""The official DiT state dict (``DiT``) and diffusers' ``DiTTransformer2DModel`` state dict, both ways.

The two hold the same weights under different names. diffusers splits the fused ``qkv`` projection into
``to_q`` / ``to_k`` / ``to_v`` and gives every block its own copy of the timestep and label embedders
(``transformer_blocks.i.norm1.emb``); the final adaLN projection is ``proj_out_1`` and the output linear
``proj_out_2``. The frozen 2-D sin-cos ``pos_embed`` is a non-persistent buffer there (rebuilt from the config),
a parameter here. Only torch is needed: reading or writing a diffusers *directory* is plain JSON and safetensors.

One difference is not in the weights: diffusers embeds the timestep with frequencies 10000^(-i / (half - 1))
(``Timesteps(downscale_freq_shift=1)``), the release with 10000^(-i / half) (``TimestepEmbedder``). The same
weights therefore give slightly different outputs (``test_timestep_frequency_gap`` in
``tests/cli/test_diffusers_export.py`` pins it; docs/training.md gives its size on the demo model); everything else is
identical. Only plain DiTs map: a DTR model (timestep channel masks), a pruned model (per-block widths), an
MLP ratio other than 4 (diffusers' feed-forward is fixed at 4x) or the modern block's options (RMSNorm, QK-norm,
SwiGLU, 2-D RoPE: ``modern.py``; diffusers' DiT has LayerNorm, a GELU feed-forward and the added sin-cos embedding)
has no diffusers counterpart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from diffcurr_fast._files import read_json, read_safetensors

__all__ = [
    "DIFFUSERS_CLASS",
    "diffusers_config",
    "export_dims",
    "from_diffusers_state",
    "is_diffusers_dir",
    "read_diffusers_dir",
    "to_diffusers_state",
]

DIFFUSERS_CLASS = "DiTTransformer2DModel"
_WEIGHTS = ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin")
# the modern block's options (``modern.py``) and the values diffusers' DiT has (the release's block)
MODERN_DEFAULTS: dict[str, Any] = {"norm": "layernorm", "qk_norm": False, "mlp": "gelu", "pos": "sincos"}

# ours -> diffusers, for the keys that are renamed one to one (block keys get the prefix of their block)
_BLOCK = {
    "adaLN_modulation.1": "norm1.linear",
    "attn.proj": "attn1.to_out.0",
    "mlp.fc1": "ff.net.0.proj",
    "mlp.fc2": "ff.net.2",
}
_EMB = {  # ours -> the per-block embedder copy of diffusers (norm1.emb.<...>)
    "t_embedder.mlp.0": "timestep_embedder.linear_1",
    "t_embedder.mlp.2": "timestep_embedder.linear_2",
}
_TOP = {
    "x_embedder.proj": "pos_embed.proj",
    "final_layer.adaLN_modulation.1": "proj_out_1",
    "final_layer.linear": "proj_out_2",
}


def diffusers_config(config: dict[str, Any]) -> dict[str, Any]:
    """The ``DiTTransformer2DModel`` config of a DiT (``DiT.config()``); ValueError for a DiT diffusers cannot hold."""
    why = []
    if config.get("dtr"):
        why.append("it uses Denoising Task Routing (model.dtr), which diffusers' DiT has no place for")
    if config.get("block_num_heads") is not None or config.get("block_mlp_hidden") is not None:
        why.append("it is pruned (per-block heads or MLP widths); diffusers' blocks are all the same width")
    if config.get("sprint"):
        why.append(
            "it uses SPRINT (model.routing=sprint), whose fusion layer and [MASK] token diffusers' DiT has no place for"
        )
    if float(config["mlp_ratio"]) != 4.0:
        why.append(f"its model.mlp_ratio is {config['mlp_ratio']} (diffusers' DiT feed-forward is 4x wide)")
    modern = [  # as a --set writes them (model.qk_norm=true)
        f"model.{key}={str(value).lower() if isinstance(value, bool) else value}"
        for key, default in MODERN_DEFAULTS.items()
        if (value := config.get(key, default)) != default
    ]
    if modern:
        why.append(
            f"it uses the modern block ({', '.join(modern)}), which diffusers' DiT has no equivalent for (it has "
            "LayerNorm, no QK-norm, a GELU feed-forward and the added sin-cos position embedding)"
        )
    if why:
        raise ValueError("this DiT cannot be written as a diffusers DiTTransformer2DModel: " + "; ".join(why))
    c = config["in_channels"]
    return {
        "_class_name": DIFFUSERS_CLASS,
        "num_attention_heads": config["num_heads"],
        "attention_head_dim": config["hidden_size"] // config["num_heads"],
        "in_channels": c,
        "out_channels": 2 * c if config["learn_sigma"] else c,
        "num_layers": config["depth"],
        "dropout": 0.0,
        "norm_num_groups": 32,
        "attention_bias": True,
        "sample_size": config["input_size"],
        "patch_size": config["patch_size"],
        "activation_fn": "gelu-approximate",
        "num_embeds_ada_norm": config["num_classes"],
        "upcast_attention": False,
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
        "norm_eps": 1e-5,
    }


def export_dims(path: str | Path) -> dict[str, int]:
    """The model dimensions (our ``model.*`` names) of the diffusers DiT saved in ``path`` (or ``path/transformer``),
    from its ``config.json`` alone: the inverse of ``diffusers_config``."""
    p = Path(path)
    cfg_file = p / "config.json" if (p / "config.json").is_file() else p / "transformer" / "config.json"
    c = read_json(cfg_file, "diffusers config")
    keys = ("sample_size", "in_channels", "patch_size", "num_layers", "num_attention_heads", "attention_head_dim")
    missing = [k for k in keys if k not in c] if isinstance(c, dict) else []
    why = ""
    if not isinstance(c, dict):
        why = "it is not a JSON object"
    elif c.get("_class_name") != DIFFUSERS_CLASS:
        why = f"its _class_name is {c.get('_class_name')!r}"
    elif missing:
        why = f"it lacks {', '.join(missing)}"
    if why:
        raise ValueError(f"{str(cfg_file)!r} does not describe a {DIFFUSERS_CLASS} ({why})")
    return {
        "input_size": int(c["sample_size"]),
        "in_channels": int(c["in_channels"]),
        "num_classes": int(c.get("num_embeds_ada_norm") or 1000),
        "patch_size": int(c["patch_size"]),
        "hidden_size": int(c["num_attention_heads"]) * int(c["attention_head_dim"]),
        "depth": int(c["num_layers"]),
        "num_heads": int(c["num_attention_heads"]),
    }


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``torch.equal`` that takes NaN as equal to NaN: a copy holds the same values, NaN where the original has it."""
    return a.shape == b.shape and bool(((a == b) | (a.isnan() & b.isnan())).all())


def to_diffusers_state(state: dict[str, torch.Tensor], config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """Our (official DiT) state dict of a DiT with ``config`` (``DiT.config()``) as a ``DiTTransformer2DModel`` state
    dict (tensors contiguous and unshared). Without label dropout our table has no null-label row, which diffusers
    always has: a zero row is appended (never used by conditional sampling)."""
    depth = config["depth"]
    table = state["y_embedder.embedding_table.weight"]  # (num_classes [+ 1], D)
    if table.shape[0] == config["num_classes"]:
        table = torch.cat([table, table.new_zeros(1, table.shape[1])])  # (num_classes + 1, D)
    out: dict[str, torch.Tensor] = {}
    for ours, theirs in _TOP.items():
        for p in ("weight", "bias"):
            out[f"{theirs}.{p}"] = state[f"{ours}.{p}"]
    for i in range(depth):
        pre, blk = f"transformer_blocks.{i}.", f"blocks.{i}."
        for ours, theirs in _BLOCK.items():
            for p in ("weight", "bias"):
                out[f"{pre}{theirs}.{p}"] = state[f"{blk}{ours}.{p}"]
        for p in ("weight", "bias"):
            q, k, v = state[f"{blk}attn.qkv.{p}"].chunk(3, dim=0)  # (3 D, ...) -> 3 x (D, ...)
            out[f"{pre}attn1.to_q.{p}"], out[f"{pre}attn1.to_k.{p}"], out[f"{pre}attn1.to_v.{p}"] = q, k, v
            for ours, theirs in _EMB.items():
                out[f"{pre}norm1.emb.{theirs}.{p}"] = state[f"{ours}.{p}"]
        out[f"{pre}norm1.emb.class_embedder.embedding_table.weight"] = table
    return {k: v.detach().clone().contiguous() for k, v in out.items()}


def from_diffusers_state(state: dict[str, torch.Tensor], own: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``DiTTransformer2DModel`` state dict as ours, for the model whose state dict is ``own``: its fixed sin-cos
    ``pos_embed`` is taken, and for a model without label dropout (no null-label row) the all-zero row that
    ``to_diffusers_state`` appended is dropped.

    ValueError when a key is missing or the per-block embedder copies differ (the release has one embedder)."""
    depth = 1 + max((int(k.split(".")[1]) for k in state if k.startswith("transformer_blocks.")), default=-1)
    if depth < 1:
        raise ValueError("not a DiTTransformer2DModel state dict: no transformer_blocks.* keys")
    used: set[str] = set()

    def take(key: str) -> torch.Tensor:
        if key not in state:
            raise ValueError(f"the diffusers DiT state dict has no key {key!r}")
        used.add(key)
        return state[key]

    out: dict[str, torch.Tensor] = {"pos_embed": own["pos_embed"]}
    for ours, theirs in _TOP.items():
        for p in ("weight", "bias"):
            out[f"{ours}.{p}"] = take(f"{theirs}.{p}")
    emb = {f"{ours}.{p}": f"norm1.emb.{theirs}.{p}" for ours, theirs in _EMB.items() for p in ("weight", "bias")}
    emb["y_embedder.embedding_table.weight"] = "norm1.emb.class_embedder.embedding_table.weight"
    for ours, theirs in emb.items():
        out[ours] = take(f"transformer_blocks.0.{theirs}")
        for i in range(1, depth):
            if not _same(take(f"transformer_blocks.{i}.{theirs}"), out[ours]):
                raise ValueError(
                    f"transformer_blocks.{i}.{theirs} differs from block 0's copy; the DiT release "
                    "has one timestep / label embedder shared by all blocks, so this model does not map "
                    "to it"
                )
    key, table = "y_embedder.embedding_table.weight", out["y_embedder.embedding_table.weight"]
    rows = own[key].shape[0] if key in own else table.shape[0]
    if table.shape[0] == rows + 1:  # a null-label row that this model, trained without label dropout, has not
        if table[-1].any():
            raise ValueError(
                "the diffusers DiT has a trained null-label row (it was trained with label dropout) and this model "
                "has none: set model.class_dropout_prob > 0 to keep it"
            )
        out[key] = table[:-1]  # the all-zero row padded on export
    for i in range(depth):
        pre, blk = f"transformer_blocks.{i}.", f"blocks.{i}."
        for ours, theirs in _BLOCK.items():
            for p in ("weight", "bias"):
                out[f"{blk}{ours}.{p}"] = take(f"{pre}{theirs}.{p}")
        for p in ("weight", "bias"):
            qkv = [take(f"{pre}attn1.to_{n}.{p}") for n in "qkv"]
            out[f"{blk}attn.qkv.{p}"] = torch.cat(qkv, dim=0)  # 3 x (D, ...) -> (3 D, ...)
    left = sorted(set(state) - used)
    if left:
        more = f" (+{len(left) - 3} more)" if len(left) > 3 else ""
        raise ValueError(f"the diffusers DiT state dict has keys with no DiT counterpart: {', '.join(left[:3])}{more}")
    return out


def is_diffusers_dir(path: str | Path) -> bool:
    """Whether ``path`` is a diffusers DiT directory: a transformer folder or a pipeline with ``transformer/``."""
    p = Path(path)
    return p.is_dir() and ((p / "config.json").is_file() or (p / "transformer" / "config.json").is_file())


def read_diffusers_dir(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(state dict, config) of the ``DiTTransformer2DModel`` saved in ``path`` (or ``path/transformer``), read with
    safetensors or ``torch.load(weights_only=True)``; diffusers itself is not needed."""
    p = Path(path)
    if not (p / "config.json").is_file():
        p = p / "transformer"
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(path)!r} is not a diffusers model directory (no config.json)")
    config = read_json(cfg_file, "diffusers config")
    if not isinstance(config, dict) or config.get("_class_name") != DIFFUSERS_CLASS:
        config = config if isinstance(config, dict) else {}
        raise ValueError(f"{str(cfg_file)!r} describes a {config.get('_class_name')!r}, not a {DIFFUSERS_CLASS}")
    weights = next((p / w for w in _WEIGHTS if (p / w).is_file()), None)
    if weights is None:
        raise FileNotFoundError(
            f"{str(p)!r} holds no weights ({' or '.join(_WEIGHTS)}); sharded or variant files are not read"
        )
    if weights.suffix == ".safetensors":
        state = read_safetensors(weights)
    else:
        state = torch.load(weights, map_location="cpu", weights_only=True)
    return state, config
