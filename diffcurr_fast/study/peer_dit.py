"""The official DiT training step (facebookresearch/DiT) as a benchmark provider, imported from a checkout.

``official_step(path, ...)`` imports ``models.py`` and the IDDPM ``diffusion/`` package from the checkout at ``path``
(the peer's code stays outside this project) and returns one training step as the authors' ``train.py`` runs it:
``t = randint(0, T)``, ``diffusion.training_losses(model, x, t, dict(y=y))["loss"].mean()`` (learned-range variance,
MSE + VB), ``opt.zero_grad(); loss.backward(); opt.step()`` with ``AdamW(lr=1e-4, weight_decay=0)``, then
``update_ema(ema, model)`` (its per-parameter ``mul_`` / ``add_`` loop, copied from ``train.py`` because that
module imports the VAE and the distributed setup at the top). The model is a ``DiT_models`` preset, or (``dims``)
the official ``DiT`` class at any size: the study's reference arm times the official step at the study's model.
``benchmarks/bench_train.py --peer-dit`` and ``diffcurr-fast study --peer-dit`` both use it.

``models.py`` imports ``PatchEmbed``, ``Attention`` and ``Mlp`` from ``timm.models.vision_transformer``. When timm
is not installed (it pulls torchvision and a CUDA torch) those three layers are provided here with timm's forward
passes (SDPA attention, as timm uses with ``fused_attn``), so the peer runs its own code everywhere else.
"""

from __future__ import annotations

import importlib
import sys
import types
from collections import OrderedDict
from collections.abc import Callable
from copy import deepcopy
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F


class PatchEmbed(nn.Module):
    """timm's ``PatchEmbed`` (flatten, NCHW -> NLC, no norm)."""

    def __init__(
        self, img_size=224, patch_size=16, in_chans=3, embed_dim=768, norm_layer=None, flatten=True, bias=True, **_
    ):
        super().__init__()
        img_size = (img_size, img_size) if isinstance(img_size, int) else tuple(img_size)
        patch_size = (patch_size, patch_size) if isinstance(patch_size, int) else tuple(patch_size)
        self.img_size, self.patch_size = img_size, patch_size
        self.grid_size = (img_size[0] // patch_size[0], img_size[1] // patch_size[1])
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.flatten = flatten
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size, bias=bias)
        self.norm = norm_layer(embed_dim) if norm_layer else nn.Identity()

    def forward(self, x):
        x = self.proj(x)
        if self.flatten:
            x = x.flatten(2).transpose(1, 2)  # NCHW -> NLC
        return self.norm(x)


class Attention(nn.Module):
    """timm's ``Attention`` with ``fused_attn`` (``F.scaled_dot_product_attention``)."""

    def __init__(
        self,
        dim,
        num_heads=8,
        qkv_bias=False,
        qk_norm=False,
        attn_drop=0.0,
        proj_drop=0.0,
        norm_layer=nn.LayerNorm,
        **_,
    ):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.q_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(proj_drop)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        x = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        x = x.transpose(1, 2).reshape(B, N, C)
        return self.proj_drop(self.proj(x))


class Mlp(nn.Module):
    """timm's ``Mlp`` (fc1, act, drop, fc2, drop)."""

    def __init__(
        self, in_features, hidden_features=None, out_features=None, act_layer=nn.GELU, bias=True, drop=0.0, **_
    ):
        super().__init__()
        out_features = out_features or in_features
        hidden_features = hidden_features or in_features
        self.fc1 = nn.Linear(in_features, hidden_features, bias=bias)
        self.act = act_layer()
        self.drop1 = nn.Dropout(drop)
        self.norm = nn.Identity()
        self.fc2 = nn.Linear(hidden_features, out_features, bias=bias)
        self.drop2 = nn.Dropout(drop)

    def forward(self, x):
        x = self.drop1(self.act(self.fc1(x)))
        return self.drop2(self.fc2(self.norm(x)))


def _stub_timm() -> bool:
    """Register the three layers as ``timm.models.vision_transformer`` when timm is missing; True if stubbed."""
    try:
        importlib.import_module("timm.models.vision_transformer")
        return False
    except ImportError:
        pass
    vt = types.ModuleType("timm.models.vision_transformer")
    vt.PatchEmbed, vt.Attention, vt.Mlp = PatchEmbed, Attention, Mlp
    timm, models = types.ModuleType("timm"), types.ModuleType("timm.models")
    timm.models, models.vision_transformer = models, vt
    sys.modules.update({"timm": timm, "timm.models": models, "timm.models.vision_transformer": vt})
    return True


def check_checkout(path: str | Path) -> Path:
    """``path`` resolved; FileNotFoundError in one line unless it is a facebookresearch/DiT checkout."""
    root = Path(path).resolve()
    if not (root / "models.py").is_file() or not (root / "diffusion" / "__init__.py").is_file():
        raise FileNotFoundError(
            f"{root} is not a facebookresearch/DiT checkout (models.py, diffusion/ missing); "
            "git clone https://github.com/facebookresearch/DiT and pass its path"
        )
    return root


def import_peer(path: str | Path) -> tuple[types.ModuleType, types.ModuleType, bool]:
    """(models, diffusion, timm_stubbed) imported from the DiT checkout at ``path``."""
    root = check_checkout(path)
    stubbed = _stub_timm()
    sys.path.insert(0, str(root))
    try:
        models = importlib.import_module("models")
        diffusion = importlib.import_module("diffusion")
    finally:
        sys.path.remove(str(root))
    return models, diffusion, stubbed


@torch.no_grad()
def update_ema(ema_model: nn.Module, model: nn.Module, decay: float = 0.9999) -> None:
    """The official ``train.py`` EMA update (verbatim semantics)."""
    ema_params = OrderedDict(ema_model.named_parameters())
    model_params = OrderedDict(model.named_parameters())
    for name, param in model_params.items():
        ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)


def official_dims(model_cfg: object) -> dict[str, object]:
    """``official_step``'s ``dims`` for a custom model of ours (``ModelConfig``): the official ``DiT`` class built at
    the same sizes."""
    keys = ("patch_size", "hidden_size", "depth", "num_heads", "mlp_ratio", "class_dropout_prob")
    return {k: getattr(model_cfg, k) for k in keys}


def official_step(
    path: str | Path,
    *,
    preset: str,
    input_size: int,
    in_channels: int,
    num_classes: int,
    seed: int = 0,
    label: Callable[[str, Callable], Callable] | None = None,
    dims: dict[str, object] | None = None,
    ema_decay: float = 0.9999,
) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], dict[str, object]]:
    """(step(x, y) -> loss, info) of the official DiT training step for ``preset`` (e.g. ``DiT-S/2``), or with
    ``preset='custom'`` for the official ``DiT`` class built with ``dims`` (patch_size, hidden_size, depth,
    num_heads, mlp_ratio, class_dropout_prob).

    ``label(name, fn)`` may wrap the parts a profile should name (``timesteps``, ``forward process``, ``ema``).
    """
    models, diffusion_pkg, stubbed = import_peer(path)
    torch.manual_seed(seed)
    size = {"input_size": input_size, "num_classes": num_classes, "in_channels": in_channels}
    if preset == "custom":
        if not dims:
            raise ValueError("official_step with preset 'custom' needs dims (patch_size, hidden_size, depth, ...)")
        model = models.DiT(**size, **dims)
    else:
        model = models.DiT_models[preset](**size)
    ema = deepcopy(model)
    for p in ema.parameters():
        p.requires_grad = False
    diffusion = diffusion_pkg.create_diffusion(timestep_respacing="")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    update_ema(ema, model, decay=0)
    model.train()
    ema.eval()
    label = label or (lambda _name, fn: fn)
    randint = label("timesteps", torch.randint)
    diffusion.q_sample = label("forward process", diffusion.q_sample)
    ema_update = label("ema", update_ema)

    def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        t = randint(0, diffusion.num_timesteps, (x.shape[0],), device=x.device)
        loss_dict = diffusion.training_losses(model, x, t, dict(y=y))
        loss = loss_dict["loss"].mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema_update(ema, model, ema_decay)
        return loss.detach()

    return step, {"model": model, "timm_stubbed": stubbed}
