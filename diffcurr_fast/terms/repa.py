"""Representation alignment, REPA (Yu, Kwak, Jang, Jeong, Huang, Shin, Xie, "Representation Alignment for Generation:
Training Diffusion Transformers Is Easier Than You Think", arXiv 2410.06940, ICLR 2025; official code sihyun-yu/REPA,
``loss.py``, ``models/sit.py``, ``train.py``, ``utils.py``).

The DiT's tokens after block j, through a trainable projector h_phi, are pulled towards the patch features y* of the
CLEAN image x0 from a frozen pretrained encoder (DINOv2 in the paper), token by token (paper, section 3.2):

    y* = f_enc(x0)  (N, D_e),     L_REPA = -(1 / N) sum_n cos(h_phi(f_j(x_t, t, y))_n, y*_n)   (per sample)

Choices made here, each with its source:

- Loss: minus the cosine similarity of each token's features, averaged over the tokens; its value lies in [-1, 1]
  (-1: aligned). The official ``loss.py`` normalises both with ``F.normalize`` and takes
  ``mean_flat(-(z * z~).sum(-1))`` per sample: the same. Weight (``terms.repa_weight``, default 0.5): the official
  ``--proj-coeff 0.5``.
- Block (``terms.repa_block``, 0-based index of the block whose output tokens are read): default depth // 3 - 1 (at
  least 0), the block that ends the first third of the depth. The maintainers align the 4th block of SiT-B/2 (12
  blocks) and the 8th of SiT-L/2 (24) and SiT-XL/2 (28) (REPA issues #5 and #12; ``--encoder-depth`` counts from 1
  and ``models/sit.py`` reads the output of block ``encoder_depth``): this rule gives exactly the first two, and the
  9th of 28 blocks; ``terms.repa_block=7`` is the official XL choice.
- Projector (``terms.repa_projector_dim``, default 2048): the official ``build_mlp``, Linear(D, P) - SiLU - Linear(P,
  P) - SiLU - Linear(P, D_e), P = 2048, initialised as the official model initialises every ``nn.Linear`` (Xavier
  uniform, zero bias), from its own generator (seed ``engine.seed``): it takes nothing from the model's random stream
  and every rank builds the same one. The trainer attaches the term to the model (``model.term_heads``): the
  optimizer, the EMA, checkpoints and DDP see the projector as they see the model; sampling and export drop it.
- Encoder input: the model's pixels x0 (``data.scale`` times images in [-1, 1]) mapped to [0, 1], a gray image
  repeated to three channels, normalised with the ImageNet mean (0.485, 0.456, 0.406) and standard deviation (0.229,
  0.224, 0.225), then resized bicubically (``F.interpolate``, ``align_corners=False``, no antialiasing) to
  ``terms.repa_encoder_size`` (default 224), as the official ``preprocess_raw_image`` does for DINOv2 (it resizes
  256-pixel images to 224: a 16 x 16 grid of 14-pixel patches, the SiT's 16 x 16 tokens).
- Encoder (``terms.repa_encoder``, a local file; nothing is downloaded): a TorchScript module (``torch.jit.save``)
  whose forward maps (B, 3, S, S) to patch tokens (B, N, D_e), or a safetensors state dict of a DINOv2-style ViT read
  into ``ViTEncoder`` below, which returns the patch tokens after the final norm (DINOv2's ``x_norm_patchtokens``,
  what the official code aligns to). A pickled ``torch.save`` file is refused: loading a pickle can run code. The
  encoder is frozen (no gradient, eval mode), run under ``torch.no_grad()`` in the objective's precision, moved to
  the batch's device on first use, and never a submodule of the term: its weights stay out of checkpoints.
- Patch grids: the encoder's g_e x g_e tokens are matched to the DiT's g x g = (input_size / patch_size)^2 tokens by
  2-D adaptive average pooling when g_e > g (for an integer ratio r: the mean of each r x r block); a DiT grid
  finer than the encoder's is refused, naming the ``terms.repa_encoder_size`` that gives it.
- Everything is per sample: nothing is gathered across ranks.
"""

from __future__ import annotations

import contextlib
import math
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from diffcurr_fast._files import read_safetensors
from diffcurr_fast.options import Options, option
from diffcurr_fast.terms.base import TermInputs, TrainingTerm, check_block

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
HEAD_DIM = 64  # every DINOv2 ViT (S/B/L/g: 6/12/16/24 heads) and timm's ViTs: the state dict does not say
WHAT = "a TorchScript file saved with torch.jit.save, or a safetensors file of a DINOv2-style ViT"


def default_block(depth: int) -> int:
    """The 0-based block whose output tokens are aligned: the end of the first third of ``depth`` (module doc)."""
    return max(depth // 3 - 1, 0)


def _name(path: str | Path) -> str:
    return f"terms.repa_encoder {str(path)!r}"


def encoder_format(path: str | Path) -> str:
    """``'torchscript'`` or ``'safetensors'``: what the file ``path`` is, from its first bytes and, for a zip archive,
    its entries (nothing is loaded); FileNotFoundError / ValueError in one line otherwise, a pickle included."""
    p, name = Path(path), _name(path)
    if not p.exists():
        raise FileNotFoundError(f"{name} does not exist ({WHAT})")
    if not p.is_file():
        raise ValueError(f"{name} is a folder, not an encoder file ({WHAT})")
    pickled = (
        f"{name} is a pickled torch.save file, which is not read (loading a pickle can run code); save the encoder "
        "with torch.jit.save(torch.jit.script(encoder), path) or its weights with safetensors.torch.save_file"
    )
    with p.open("rb") as f:
        head = f.read(9)
    size = p.stat().st_size
    if zipfile.is_zipfile(p):
        try:
            with zipfile.ZipFile(p) as z:
                names = z.namelist()
        except (OSError, zipfile.BadZipFile) as exc:
            raise ValueError(f"{name} is not a readable archive ({type(exc).__name__}); {WHAT}") from None
        if any(n.endswith("/constants.pkl") for n in names) and any("/code/" in n for n in names):
            return "torchscript"
        if any(n.endswith("data.pkl") for n in names):
            raise ValueError(pickled)
    elif head[:1] == b"\x80":  # a pickle's PROTO opcode: torch.save before its zip format
        raise ValueError(pickled)
    elif len(head) == 9 and head[8:9] == b"{" and 0 < int.from_bytes(head[:8], "little") <= size - 8:
        return "safetensors"  # an 8-byte little-endian header length, then the JSON header
    raise ValueError(f"{name} is not an encoder: neither a TorchScript file (torch.jit.save) nor a safetensors file")


# ---- a DINOv2-style ViT from a safetensors state dict -------------------------------------------------------------


class _Block(nn.Module):
    """A pre-norm ViT block as DINOv2's ``Block``: x + ls1(attn(norm1(x))), then x + ls2(mlp(norm2(x)))."""

    def __init__(self, dim: int, hidden: int, swiglu: bool, layerscale: bool, bias: dict[str, bool]):
        super().__init__()
        self.heads = dim // HEAD_DIM
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = nn.Module()
        self.attn.qkv = nn.Linear(dim, 3 * dim, bias=bias["attn.qkv"])
        self.attn.proj = nn.Linear(dim, dim, bias=bias["attn.proj"])
        self.mlp = nn.Module()
        if swiglu:  # DINOv2's SwiGLUFFNFused (ViT-g): w3(silu(x1) * x2), (x1, x2) = w12(x)
            self.mlp.w12 = nn.Linear(dim, 2 * hidden, bias=bias["mlp.w12"])
            self.mlp.w3 = nn.Linear(hidden, dim, bias=bias["mlp.w3"])
        else:  # Mlp: fc2(gelu(fc1(x)))
            self.mlp.fc1 = nn.Linear(dim, hidden, bias=bias["mlp.fc1"])
            self.mlp.fc2 = nn.Linear(hidden, dim, bias=bias["mlp.fc2"])
        self.swiglu = swiglu
        if layerscale:
            self.ls1, self.ls2 = nn.Module(), nn.Module()
            self.ls1.gamma, self.ls2.gamma = nn.Parameter(torch.ones(dim)), nn.Parameter(torch.ones(dim))
        self.layerscale = layerscale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        qkv = self.attn.qkv(self.norm1(x)).reshape(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(qkv[0], qkv[1], qkv[2])  # (B, H, N, d / H)
        a = self.attn.proj(a.transpose(1, 2).reshape(b, n, d))  # (B, N, D)
        x = x + (a * self.ls1.gamma if self.layerscale else a)
        h = self.norm2(x)
        if self.swiglu:
            x1, x2 = self.mlp.w12(h).chunk(2, dim=-1)
            h = self.mlp.w3(F.silu(x1) * x2)
        else:
            h = self.mlp.fc2(F.gelu(self.mlp.fc1(h)))
        return x + (h * self.ls2.gamma if self.layerscale else h)  # (B, N, D)


class ViTEncoder(nn.Module):
    """The patch tokens after the final norm, (B, N, D), of a DINOv2-style ViT read from its state dict
    (``__init__``), at one input size S (a multiple of the patch size p; N = (S / p)^2).

    Keys (facebookresearch/dinov2 and timm names): ``patch_embed.proj.weight`` (D, C, p, p) and its bias,
    ``pos_embed`` (1, [1 +] M^2, D), ``cls_token`` (1, 1, D; optional), register tokens ``register_tokens`` (DINOv2's
    ``_reg`` models) or ``reg_token`` (timm) (1, R, D; optional: inserted after the class token without a position, as
    DINOv2 does, or first without a class token, as timm does, and dropped from the output), ``blocks.N.{norm1,
    attn.qkv, attn.proj, ls1.gamma, norm2, mlp.fc1, mlp.fc2, ls2.gamma}`` (``mlp.w12``, ``mlp.w3``: the SwiGLU MLP of
    ViT-g; the layer scales optional), ``norm``.
    ``mask_token`` and ``head.*`` are ignored. Heads: D / 64. The position embedding's M x M grid is resampled to S / p
    once, bicubically with antialiasing, the class token's entry kept (timm's ``resample_abs_pos_embed``, which the
    official REPA code applies to DINOv2's 37 x 37 grid).
    """

    def __init__(self, sd: dict[str, torch.Tensor], size: int, name: str = "terms.repa_encoder"):
        super().__init__()
        sd = {k: v for k, v in sd.items() if k != "mask_token" and not k.startswith("head.")}
        if "reg_token" in sd:
            sd["register_tokens"] = sd.pop("reg_token")
        need = ("patch_embed.proj.weight", "pos_embed", "norm.weight", "blocks.0.attn.qkv.weight")
        missing = [k for k in need if k not in sd]
        if missing:
            raise ValueError(
                f"{name} is a safetensors file but not a DINOv2-style ViT: it has no {', '.join(map(repr, missing))}"
            )
        w = sd["patch_embed.proj.weight"]
        if w.dim() != 4 or w.shape[2] != w.shape[3]:
            raise ValueError(f"{name}: patch_embed.proj.weight has shape {tuple(w.shape)}, not (D, C, p, p)")
        dim, chans, patch = w.shape[0], w.shape[1], w.shape[2]
        if dim % HEAD_DIM:
            raise ValueError(f"{name}: width {dim} is not a multiple of the head width {HEAD_DIM} this reader assumes")
        if size % patch:
            raise ValueError(
                f"terms.repa_encoder_size {size} is not a multiple of the encoder's patch size {patch}; "
                f"set it to {max(1, round(size / patch)) * patch}"
            )
        depth = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"blocks\.(\d+)\.", k)))
        swiglu = "blocks.0.mlp.w12.weight" in sd
        hidden = sd["blocks.0.mlp.w3.weight" if swiglu else "blocks.0.mlp.fc1.weight"].shape[1 if swiglu else 0]
        layerscale = "blocks.0.ls1.gamma" in sd
        linears = ("attn.qkv", "attn.proj", "mlp.w12", "mlp.w3") if swiglu else ("attn.qkv", "attn.proj", "mlp.fc1")
        bias = {k: f"blocks.0.{k}.bias" in sd for k in (*linears, "mlp.fc2")}
        self.patch, self.size, self.chans = int(patch), int(size), int(chans)
        self.grid = size // patch
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Conv2d(chans, dim, patch, stride=patch, bias="patch_embed.proj.bias" in sd)
        self.cls_token = nn.Parameter(sd["cls_token"].clone()) if "cls_token" in sd else None
        self.register_tokens = nn.Parameter(sd["register_tokens"].clone()) if "register_tokens" in sd else None
        self.blocks = nn.ModuleList(_Block(dim, hidden, swiglu, layerscale, bias) for _ in range(depth))
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        pos = sd.pop("pos_embed").float()  # (1, P, D)
        count = pos.shape[1] if pos.dim() == 3 else 0
        lead = 1 if self.cls_token is not None and count and math.isqrt(count - 1) ** 2 == count - 1 else 0
        side = math.isqrt(count - lead)
        if pos.dim() != 3 or side < 1 or side * side != count - lead:
            raise ValueError(f"{name}: pos_embed has shape {tuple(pos.shape)}, not a square grid of positions")
        grid = pos[:, lead:].reshape(1, side, side, -1).permute(0, 3, 1, 2)  # (1, D, M, M)
        if side != self.grid:
            grid = F.interpolate(grid, size=(self.grid, self.grid), mode="bicubic", antialias=True)  # (1, D, g, g)
        grid = grid.permute(0, 2, 3, 1).reshape(1, self.grid * self.grid, -1)  # (1, g^2, D)
        self.lead = lead
        self.register_buffer("pos_embed", torch.cat([pos[:, :lead], grid], dim=1), persistent=False)
        try:
            self.load_state_dict(sd, strict=True)
        except RuntimeError as exc:
            text = str(exc).replace("\n", " ")
            raise ValueError(f"{name} does not fit a DINOv2-style ViT ({text[:300]})") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b = x.shape[0]
        x = self.patch_embed.proj(x).flatten(2).transpose(1, 2)  # (B, N, D), N = (S / p)^2
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1)  # (B, 1 + N, D)
        if self.lead:
            x = x + self.pos_embed  # (B, 1 + N, D): the class token has a position
        else:
            x = torch.cat([x[:, : x.shape[1] - self.grid**2], x[:, -(self.grid**2) :] + self.pos_embed], dim=1)
        if self.register_tokens is not None:  # after the class token, without a position (DINOv2); first without one
            c = 0 if self.cls_token is None else 1  # (timm's reg_token models without a class token)
            x = torch.cat([x[:, :c], self.register_tokens.expand(b, -1, -1), x[:, c:]], dim=1)  # (B, c + R + N, D)
        for block in self.blocks:
            x = block(x)
        return self.norm(x)[:, -(self.grid**2) :]  # (B, N, D): the patch tokens after the final norm


# ---- loading and checking ------------------------------------------------------------------------------------------


def load_encoder(path: str | Path, size: int) -> nn.Module:
    """The frozen encoder of ``path`` (``encoder_format``) in eval mode on the CPU, for inputs of ``size`` pixels;
    one line naming the file when it is not an encoder."""
    name = _name(path)
    if encoder_format(path) == "torchscript":
        try:
            module = torch.jit.load(str(path), map_location="cpu")
        except Exception as exc:  # torch raises RuntimeError, or its own error types, on a bad archive
            first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
            raise ValueError(f"{name} is not a readable TorchScript file ({type(exc).__name__}: {first})") from None
    else:
        try:
            sd = read_safetensors(path)
        except ValueError as exc:
            raise ValueError(f"{name}: {exc}") from None
        module = ViTEncoder(sd, size, name)
    for p in module.parameters():
        p.requires_grad_(False)
    return module.eval()


def encoder_grid(encoder: nn.Module, size: int, name: str = "terms.repa_encoder") -> tuple[int, int]:
    """(g_e, D_e): the side of the square grid of patch tokens and their width that ``encoder`` returns for a batch
    of two different images of ``size`` x ``size`` (one forward); one line when it fails, returns no square grid,
    does not keep the batch (an encoder traced at batch 1 returns one row for any batch: every sample would be
    aligned to the first one's features) or returns NaN or inf."""
    x = torch.linspace(-2, 2, 2 * 3 * size * size).reshape(2, 3, size, size)  # (2, 3, S, S): two distinct images
    shape = f"2x3x{size}x{size}"
    try:
        with torch.no_grad():
            out = encoder(x.to(_device_of(encoder)))
    except Exception as exc:  # whatever the user's module raises
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ValueError(
            f"{name} fails on a {shape} batch of images ({type(exc).__name__}: {first}); check "
            "terms.repa_encoder_size, the input size the encoder expects"
        ) from None
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        got = tuple(out.shape) if isinstance(out, torch.Tensor) else type(out).__name__
        raise ValueError(
            f"{name} returns {got} for a {shape} batch of images, not patch tokens (B, N, D); save a module whose "
            "forward returns them (DINOv2: forward_features(x)['x_norm_patchtokens'])"
        )
    if out.shape[0] != 2:
        raise ValueError(
            f"{name} returns {tuple(out.shape)} for a {shape} batch of images: its first dimension must follow the "
            "batch (a module traced with a batch of 1 may keep that size); save it with torch.jit.script, or trace it "
            "with a batch of 2 or more"
        )
    if not bool(torch.isfinite(out).all()):
        raise ValueError(
            f"{name} returns NaN or inf for a {shape} batch of images: its weights or its arithmetic are broken; "
            "check the encoder (the data is not involved)"
        )
    n = out.shape[1]
    side = math.isqrt(n)
    if side * side != n:
        raise ValueError(
            f"{name} returns {n} tokens, not a square grid of patch tokens; leave out the class and register tokens"
        )
    return side, int(out.shape[2])


def check_grid(encoder_side: int, model_side: int, size: int) -> None:
    """A DiT grid of ``model_side``^2 tokens can be matched from the encoder's ``encoder_side``^2: equal, or coarser
    (then pooled, ``match_tokens``); one line naming the ``terms.repa_encoder_size`` to set otherwise."""
    if model_side <= encoder_side:
        return
    patch = size / encoder_side
    fit = model_side * int(patch) if patch.is_integer() else math.ceil(size * model_side / encoder_side)
    raise ValueError(
        f"terms.repa_encoder_size {size} gives a {encoder_side}x{encoder_side} grid of encoder patch tokens, coarser "
        f"than the model's {model_side}x{model_side} tokens (model.input_size / model.patch_size); set "
        f"terms.repa_encoder_size={fit}"
    )


def check_encoder(path: str | Path, size: int, model_side: int) -> tuple[nn.Module, int]:
    """(encoder, D_e): ``path`` loaded (``load_encoder``), its grid at ``size`` matched to the DiT's
    (``check_grid``): the preflight's check, the same steps as the term's ``from_config`` (``--dry-run`` refuses
    what the start refuses)."""
    encoder = load_encoder(path, size)
    side, dim = encoder_grid(encoder, size, _name(path))
    check_grid(side, model_side, size)
    return encoder, dim


# ---- the term ------------------------------------------------------------------------------------------------------


def encoder_input(x0: torch.Tensor, size: int, scale: float = 1.0) -> torch.Tensor:
    """(B, 3, size, size) encoder input of the model's pixels x0 (B, 1 or 3, H, W) = ``scale`` x images in [-1, 1]:
    to [0, 1], gray repeated to RGB, ImageNet-normalised, resized bicubically (module doc)."""
    x = (x0.float() / scale + 1.0) / 2.0  # (B, C, H, W) in [0, 1]
    if x.shape[1] == 1:
        x = x.expand(-1, 3, -1, -1)  # (B, 3, H, W)
    mean = torch.tensor(IMAGENET_MEAN, device=x.device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=x.device).view(1, 3, 1, 1)
    x = (x - mean) / std
    if x.shape[-2:] != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)  # (B, 3, S, S)
    return x


def match_tokens(z: torch.Tensor, side: int) -> torch.Tensor:
    """(B, side^2, D) tokens of the encoder's square grid z (B, g_e^2, D), g_e >= side, by 2-D adaptive average
    pooling (row-major token order, as a ViT's and the DiT's patches)."""
    b, n, d = z.shape
    g = math.isqrt(n)
    if g == side:
        return z
    grid = z.transpose(1, 2).reshape(b, d, g, g)  # (B, D, g_e, g_e)
    return F.adaptive_avg_pool2d(grid, side).flatten(2).transpose(1, 2)  # (B, side^2, D)


def alignment_loss(projected: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """(B,) float32 -(1/N) sum_n cos(projected_n, target_n), both (B, N, D) (REPA; official ``loss.py``)."""
    h, y = F.normalize(projected.float(), dim=-1), F.normalize(target.float(), dim=-1)
    return -(h * y).sum(dim=-1).mean(dim=1)  # (B, N) -> (B,)


def _device_of(module: nn.Module) -> torch.device:
    """The device of ``module``'s first parameter or buffer (the CPU for a module with neither)."""
    first = next(iter(module.parameters()), None)
    if first is None:
        first = next(iter(module.buffers()), None)
    return first.device if first is not None else torch.device("cpu")


class _Frozen:
    """The frozen encoder, held outside the module tree: not a submodule (its weights stay out of the term's state
    dict, parameters and checkpoints, and out of ``.to``), shared by copies of the term (the EMA's deep copy), moved
    to the batch's device on first use."""

    def __init__(self, module: nn.Module):
        self.module, self.device = module, _device_of(module)

    def __deepcopy__(self, memo: dict) -> _Frozen:
        return self

    def on(self, device: torch.device) -> nn.Module:
        if device != self.device:
            self.module.to(device)
            self.device = device
        return self.module


@dataclass
class REPAOptions(Options):
    """repa's options in the ``terms`` section (keys ``terms.repa_*``)."""

    PREFIX = "repa_"
    weight: float = option(
        0.5, "repa (representation alignment, arXiv 2410.06940): its weight (the official 0.5)", lo=0.0, lo_open=True
    )
    block: int | None = option(
        None, "repa: the block whose output tokens are aligned, through the projector (None: depth // 3 - 1)", lo=0
    )
    encoder: str = option(
        "",
        "repa: the frozen encoder, a local file (required with repa): a TorchScript module (torch.jit.save) "
        "returning patch tokens (B, N, D), or a safetensors state dict of a DINOv2-style ViT; no torch.save pickles",
    )
    encoder_size: int = option(
        224, "repa: the encoder's input size (images resized to it bicubically; DINOv2: 224 for 16x16 tokens)", lo=1
    )
    projector_dim: int = option(2048, "repa: the projector MLP's hidden width (the official 2048)", lo=1)

    def validate(self, cfg: Any) -> None:
        if not self.encoder:
            raise ValueError(
                "terms.repa_encoder is required with terms.use repa: a local TorchScript file (torch.jit.save) or "
                "a safetensors file of a DINOv2-style ViT (docs/training.md, REPA from a local encoder)"
            )
        check_block("repa_block", self.block, cfg)
        if cfg.model.in_channels not in (1, 3):
            raise ValueError(
                f"terms.use repa needs images (model.in_channels 1 or 3), got {cfg.model.in_channels} channels: its "
                "encoder sees the clean image (latents would need the VAE decoder); drop repa from terms.use"
            )

    def refusal(self, cfg: Any, use: str) -> str | None:
        if use == "tdc":  # a projector attached to the model (model.term_heads); an expert has none
            return (
                "terms.use 'repa' trains a projector attached to the model, which TDC's pruned experts do not "
                "carry; drop it from terms.use for a TDC run"
            )
        return None

    def check_inputs(self, cfg: Any, read: bool) -> None:
        """The encoder file is TorchScript or safetensors, not a pickle; ``read``: it loads as the start loads it
        and its patch tokens at ``encoder_size`` match the model's grid (``check_encoder``)."""
        encoder_format(self.encoder)
        if read:
            m = cfg.model
            check_encoder(self.encoder, self.encoder_size, m.input_size // m.patch_size)


class REPA(TrainingTerm):
    """-(1/N) sum_n cos(h(f_j(x_t))_n, f_enc(x0)_n), the encoder frozen, the tokens averaged (module doc)."""

    Options = REPAOptions

    def __init__(
        self,
        hidden_size: int,
        block: int,
        encoder: nn.Module,
        *,
        encoder_size: int = 224,
        model_side: int,
        projector_dim: int = 2048,
        scale: float = 1.0,
        seed: int = 0,
        name: str = "terms.repa_encoder",
    ):
        super().__init__()
        for p in encoder.parameters():
            p.requires_grad_(False)
        encoder.eval()
        side, dim = encoder_grid(encoder, encoder_size, name)
        check_grid(side, model_side, encoder_size)
        self.features = (int(block),)
        self.encoder_size, self.model_side, self.scale = int(encoder_size), int(model_side), float(scale)
        width = int(projector_dim)
        with torch.random.fork_rng(devices=[]):  # its own stream: the model's initialisation is unchanged
            torch.default_generator.manual_seed(seed)  # the host's only: each rank's CUDA stream stays its own
            self.projector = nn.Sequential(
                nn.Linear(hidden_size, width),
                nn.SiLU(),
                nn.Linear(width, width),
                nn.SiLU(),
                nn.Linear(width, dim),
            )
            for lin in (self.projector[0], self.projector[2], self.projector[4]):
                nn.init.xavier_uniform_(lin.weight)
                nn.init.zeros_(lin.bias)
        self._encoder = _Frozen(encoder)

    @classmethod
    def from_config(cls, cfg: Any) -> REPA:
        t, m = cfg.terms, cfg.model
        if not t.repa_encoder:
            raise ValueError(f"terms.repa_encoder is required with terms.use repa ({WHAT})")
        side = m.input_size // m.patch_size
        return cls(
            m.hidden_size,
            t.repa_block if t.repa_block is not None else default_block(m.depth),
            load_encoder(t.repa_encoder, t.repa_encoder_size),  # its grid is checked in __init__
            encoder_size=t.repa_encoder_size,
            model_side=side,
            projector_dim=t.repa_projector_dim,
            scale=cfg.data.scale,
            seed=cfg.engine.seed,
            name=_name(t.repa_encoder),
        )

    @property
    def encoder(self) -> nn.Module:
        """The frozen encoder (not a submodule)."""
        return self._encoder.module

    def target(self, x0: torch.Tensor, autocast: Any = contextlib.nullcontext) -> torch.Tensor:
        """(B, T, D_e) float32 encoder tokens of the clean images x0, matched to the DiT's grid, without gradient;
        ``autocast()``: the precision context of the encoder's call (the objective's)."""
        encoder = self._encoder.on(x0.device)
        with torch.no_grad():
            with autocast():
                z = encoder(encoder_input(x0, self.encoder_size, self.scale))  # (B, N_e, D_e)
            return match_tokens(z.float(), self.model_side)  # (B, T, D_e)

    def forward(self, inputs: TermInputs) -> torch.Tensor:
        lin = self.projector[0].weight
        if lin.dim() != 2:  # DeepSpeed ZeRO-3 partitions it outside the model's forward
            raise ValueError("terms.use repa: its projector is partitioned (ZeRO stage 3); use ZeRO stage 0 to 2")
        target = self.target(inputs.x0, inputs.autocast)  # (B, T, D_e)
        z = inputs.features[self.features[0]]  # (B, T, D), the DiT's tokens after block j of the same pass
        return alignment_loss(self.projector(z.to(lin.dtype)), target)  # (B,)
