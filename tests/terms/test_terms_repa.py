"""Representation alignment (terms/repa.py): the encoder from a local file (a TorchScript module, or a DINOv2-style ViT
state dict in safetensors read into the adapter, checked against a plain reference), the loss against a hand
computation on odd batch sizes, the encoder frozen and outside the state dict while the projector and the student
learn, weight 0 leaves the loss bitwise unchanged, the encoder's grid pooled to the DiT's, each bad input refused in
one line (also by --dry-run, before anything is written), and a run with it resumes bit for bit and leaves its
projector out of sampling and export."""

import copy
import json
import math
import os
import subprocess

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY_SETS, TORCHRUN2, _main, assert_resumed_state, tiny
from safetensors.torch import save_file
from torch import nn

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.models import DiT
from diffcurr_fast.objective import Objective
from diffcurr_fast.runs.config import DiffusionConfig
from diffcurr_fast.terms.base import TermInputs
from diffcurr_fast.terms.repa import (
    REPA,
    ViTEncoder,
    check_encoder,
    default_block,
    encoder_input,
    load_encoder,
    match_tokens,
)

# torch 2.13 deprecates torch.jit in favour of torch.export; the TorchScript form is still read (terms/repa.py)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")

KW = dict(
    input_size=8,
    patch_size=2,
    in_channels=1,
    hidden_size=32,
    depth=3,
    num_heads=2,
    num_classes=10,
    class_dropout_prob=0.0,
)
G = 50


def _model(seed=0, **kw):
    torch.manual_seed(seed)
    m = DiT(**{**KW, **kw})
    with torch.no_grad():  # the zero-initialised adaLN and final layers would hide the blocks
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    return m


class TinyEncoder(nn.Module):
    """A TorchScript-able encoder: (B, 3, S, S) -> (B, (S / patch)^2, dim) patch tokens."""

    def __init__(self, dim: int = 12, patch: int = 2):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)
        self.mix = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.proj(x).flatten(2).transpose(1, 2)  # (B, N, dim)
        return self.mix(torch.tanh(z))


def _torchscript(path, dim=12, patch=2, seed=0):
    torch.manual_seed(seed)
    torch.jit.save(torch.jit.script(TinyEncoder(dim, patch)), str(path))
    return path


def _vit_state(dim=128, patch=2, side=5, depth=2, registers=0, swiglu=False, seed=0):
    """A random DINOv2-style ViT state dict (facebookresearch key names), with its unused mask token."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    sd = {
        "cls_token": r(1, 1, dim),
        "pos_embed": r(1, 1 + side * side, dim),
        "mask_token": torch.zeros(1, dim),
        "patch_embed.proj.weight": r(dim, 3, patch, patch, std=0.2),
        "patch_embed.proj.bias": r(dim, std=0.1),
        "norm.weight": 1 + r(dim, std=0.1),
        "norm.bias": r(dim, std=0.1),
    }
    if registers:
        sd["register_tokens"] = r(1, registers, dim)
    hidden = 3 * dim
    for i in range(depth):
        b = f"blocks.{i}."
        sd.update(
            {
                b + "norm1.weight": 1 + r(dim, std=0.1),
                b + "norm1.bias": r(dim, std=0.1),
                b + "attn.qkv.weight": r(3 * dim, dim, std=0.05),
                b + "attn.qkv.bias": r(3 * dim, std=0.1),
                b + "attn.proj.weight": r(dim, dim, std=0.05),
                b + "attn.proj.bias": r(dim, std=0.1),
                b + "ls1.gamma": r(dim, std=0.5),
                b + "norm2.weight": 1 + r(dim, std=0.1),
                b + "norm2.bias": r(dim, std=0.1),
                b + "ls2.gamma": r(dim, std=0.5),
            }
        )
        if swiglu:
            sd[b + "mlp.w12.weight"], sd[b + "mlp.w12.bias"] = r(2 * hidden, dim, std=0.05), r(2 * hidden, std=0.1)
            sd[b + "mlp.w3.weight"], sd[b + "mlp.w3.bias"] = r(dim, hidden, std=0.05), r(dim, std=0.1)
        else:
            sd[b + "mlp.fc1.weight"], sd[b + "mlp.fc1.bias"] = r(hidden, dim, std=0.05), r(hidden, std=0.1)
            sd[b + "mlp.fc2.weight"], sd[b + "mlp.fc2.bias"] = r(dim, hidden, std=0.05), r(dim, std=0.1)
    return sd


def _vit_reference(sd, x, size):
    """DINOv2's forward_features(x)['x_norm_patchtokens'] written plainly in float64 (64-wide heads)."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    w = sd["patch_embed.proj.weight"]
    dim, patch = w.shape[0], w.shape[2]
    grid = size // patch
    b = x.shape[0]
    t = F.conv2d(x, w, sd["patch_embed.proj.bias"], stride=patch).flatten(2).transpose(1, 2)  # (B, N, D)
    t = torch.cat([sd["cls_token"].expand(b, -1, -1), t], dim=1)
    pos = sd["pos_embed"]
    side = math.isqrt(pos.shape[1] - 1)
    patch_pos = pos[:, 1:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
    if side != grid:  # timm's resample_abs_pos_embed, as the official code resamples DINOv2's grid
        patch_pos = F.interpolate(patch_pos, size=(grid, grid), mode="bicubic", antialias=True)
    t = t + torch.cat([pos[:, :1], patch_pos.permute(0, 2, 3, 1).reshape(1, grid * grid, dim)], dim=1)
    if "register_tokens" in sd:
        t = torch.cat([t[:, :1], sd["register_tokens"].expand(b, -1, -1), t[:, 1:]], dim=1)
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    heads = dim // 64
    for i in range(depth):
        p = {k[len(f"blocks.{i}.") :]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        h = F.layer_norm(t, (dim,), p["norm1.weight"], p["norm1.bias"], eps=1e-6)
        q, k, v = (h @ p["attn.qkv.weight"].T + p["attn.qkv.bias"]).reshape(b, -1, 3, heads, 64).unbind(2)
        att = torch.softmax(torch.einsum("bnhd,bmhd->bhnm", q, k) / 8.0, dim=-1)
        a = torch.einsum("bhnm,bmhd->bnhd", att, v).reshape(b, -1, dim)
        t = t + p["ls1.gamma"] * (a @ p["attn.proj.weight"].T + p["attn.proj.bias"])
        h = F.layer_norm(t, (dim,), p["norm2.weight"], p["norm2.bias"], eps=1e-6)
        if "mlp.w12.weight" in p:
            x1, x2 = (h @ p["mlp.w12.weight"].T + p["mlp.w12.bias"]).chunk(2, dim=-1)
            h = (F.silu(x1) * x2) @ p["mlp.w3.weight"].T + p["mlp.w3.bias"]
        else:
            h = F.gelu(h @ p["mlp.fc1.weight"].T + p["mlp.fc1.bias"]) @ p["mlp.fc2.weight"].T + p["mlp.fc2.bias"]
        t = t + p["ls2.gamma"] * h
    t = F.layer_norm(t, (dim,), sd["norm.weight"], sd["norm.bias"], eps=1e-6)
    return t[:, -grid * grid :]


@pytest.fixture(params=["torchscript", "safetensors"])
def encoder_file(request, tmp_path):
    """(path, encoder size) of a tiny encoder giving a 4x4 grid at size 8, in either form."""
    if request.param == "torchscript":
        return _torchscript(tmp_path / "enc.pt"), 8
    path = tmp_path / "vit.safetensors"
    save_file(_vit_state(dim=64, side=5, depth=1), str(path))
    return path, 8


def _inputs(b, model, block, seed=1234):
    """TermInputs of a flow draw on images in [-1, 1], with ``model``'s block features from the same pass."""
    form = build_formulation(DiffusionConfig(formulation="flow", prediction="velocity", num_timesteps=G))
    g = torch.Generator().manual_seed(b)
    k = torch.randint(0, G, (b,), generator=g)
    x0 = torch.rand(b, 1, 8, 8, generator=g) * 2 - 1
    draw = form.training_draw(k, G, "velocity", "none", 5.0, g)
    y = torch.arange(b) % 10
    x_in = draw.a.view(-1, 1, 1, 1) * x0 + draw.c.view(-1, 1, 1, 1) * torch.randn(x0.shape, generator=g)
    x_in, t_in = x_in.float(), draw.t_in.float()  # the draw's coefficients are float64
    out, feats = model(x_in, t_in, y, features=(block,))
    return TermInputs(x0, y, draw, x_in, seed, out, feats)


def test_default_block_ends_the_first_third():
    # the official 4th block of SiT-B/2 (12) and 8th of SiT-L/2 (24), 1-based; the 9th of 28 (official XL: 8th)
    assert default_block(12) == 3 and default_block(24) == 7 and default_block(28) == 8
    assert default_block(1) == 0 and default_block(3) == 0 and default_block(4) == 0


@pytest.mark.parametrize("registers, side, swiglu", [(0, 4, False), (0, 5, False), (3, 5, False), (2, 4, True)])
def test_the_vit_adapter_matches_a_plain_dinov2_forward(registers, side, swiglu):
    sd = _vit_state(dim=128, side=side, depth=2, registers=registers, swiglu=swiglu)
    enc = ViTEncoder(dict(sd), 8).eval()
    x = torch.randn(3, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = enc(x)
    assert got.shape == (3, 16, 128)
    torch.testing.assert_close(got.double(), _vit_reference(sd, x, 8), rtol=1e-4, atol=1e-4)
    timm = {("reg_token" if k == "register_tokens" else k): v for k, v in sd.items()}  # timm's name
    with torch.no_grad():
        assert torch.equal(ViTEncoder(timm, 8).eval()(x), got)


def test_the_encoder_input_is_imagenet_normalised_and_resized_bicubically():
    x0 = torch.rand(3, 1, 8, 8, generator=torch.Generator().manual_seed(0)) * 2 - 1
    got = encoder_input(x0, 8)
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    for c in range(3):  # gray repeated to RGB, in [0, 1], then normalised per channel
        torch.testing.assert_close(got[:, c], ((x0[:, 0] + 1) / 2 - mean[c]) / std[c])
    big = encoder_input(x0, 14)
    want = F.interpolate(got, size=(14, 14), mode="bicubic", align_corners=False)  # normalise, then resize
    torch.testing.assert_close(big, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(encoder_input(0.5 * x0, 8, scale=0.5), got)  # data.scale undone


@pytest.mark.parametrize("b", [3, 5])
def test_the_loss_is_minus_the_mean_token_cosine_to_the_encoders_features_by_hand(b, encoder_file):
    path, size = encoder_file
    encoder = load_encoder(path, size)
    model = _model(0).train()
    term = REPA(32, 1, encoder, encoder_size=size, model_side=4, projector_dim=24)
    inputs = _inputs(b, model, 1)
    got = term(inputs)
    assert got.shape == (b,) and got.dtype == torch.float32
    # by hand: the encoder on the clean images, the projector on block 1's tokens, -mean cos per sample
    x = (inputs.x0.repeat(1, 3, 1, 1) + 1) / 2
    x = (x - torch.tensor([0.485, 0.456, 0.406]).view(1, 3, 1, 1)) / torch.tensor([0.229, 0.224, 0.225]).view(
        1, 3, 1, 1
    )
    with torch.no_grad():
        y = encoder(x)  # (b, 16, D_e): the 4x4 grid is the DiT's
    h = term.projector(inputs.features[1]).detach()  # (b, 16, D_e)
    for i in range(b):
        u, v = h[i].double(), y[i].double()
        cos = (u * v).sum(-1) / (u.norm(dim=-1) * v.norm(dim=-1))
        torch.testing.assert_close(got[i].double(), -cos.mean(), rtol=1e-5, atol=1e-6)
    assert len(term.projector) == 5 and term.projector[2].weight.shape == (24, 24)  # 3 linear layers, 2 SiLU
    assert term.projector[4].weight.shape[0] == y.shape[-1]  # to the encoder's width


def test_building_the_projector_leaves_the_cuda_random_stream_alone(monkeypatch):
    """The projector's seed goes to the host's generator only: each rank's CUDA stream (label dropout on a GPU), seeded
    engine.seed + rank by the trainer, is not reseeded, and the host stream is restored after."""
    seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seeds.append(int(s)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: seeds.append(int(s)))
    encoders = TinyEncoder(), TinyEncoder()
    before = torch.get_rng_state()
    a, b = (REPA(32, 0, e, encoder_size=8, model_side=4, projector_dim=24, seed=3) for e in encoders)
    assert seeds == [] and torch.equal(torch.get_rng_state(), before)
    assert torch.equal(a.projector[0].weight, b.projector[0].weight)  # still seeded


def test_the_encoder_gets_no_gradient_and_stays_out_of_the_state_dict(tmp_path):
    encoder = load_encoder(_torchscript(tmp_path / "enc.pt"), 8)
    model, term = _model(0).train(), REPA(32, 0, encoder, encoder_size=8, model_side=4, projector_dim=24)
    grad_on = []
    ref = TinyEncoder()  # a plain module too: its weights would require grad
    term_plain = REPA(32, 0, ref, encoder_size=8, model_side=4, projector_dim=24)
    ref.register_forward_pre_hook(lambda mod, args: grad_on.append(torch.is_grad_enabled()))
    form = build_formulation(DiffusionConfig(formulation="ddpm", prediction="eps", num_timesteps=1000))
    x0, y, k = torch.rand(5, 1, 8, 8) * 2 - 1, torch.arange(5), torch.tensor([3, 250, 500, 750, 999])
    for t in (term, term_plain):
        obj = Objective(form, num_cells=1000, prediction="eps", backend="reference", terms=[(0.5, t)])
        model.zero_grad()
        obj(model, x0, y, k, seed=7).mean().backward()
        assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in t.projector.parameters())
    assert grad_on == [False] and not ref.training  # under no_grad, in eval mode
    assert all(not p.requires_grad and p.grad is None for e in (encoder, ref) for p in e.parameters())
    block0 = model.blocks[0].attn.qkv.weight.grad
    only = _model(0).train()
    Objective(form, num_cells=1000, prediction="eps", backend="reference")(only, x0, y, k, seed=7).mean().backward()
    assert not torch.equal(block0, only.blocks[0].attn.qkv.weight.grad)  # the student block learns from it
    assert list(term.state_dict()) == [f"projector.{i}.{w}" for i in (0, 2, 4) for w in ("weight", "bias")]
    assert all(id(p) not in {id(q) for q in encoder.parameters()} for p in term.parameters())
    twin = copy.deepcopy(term)  # the EMA's copy shares the frozen encoder, never copies it
    assert twin.encoder is term.encoder
    a, b = (
        REPA(32, 0, encoder, encoder_size=8, model_side=4, seed=3),
        REPA(32, 0, encoder, encoder_size=8, model_side=4, seed=3),
    )
    assert a.projector[0].weight.shape == (2048, 32)  # the official hidden width
    assert all(torch.equal(u, v) for u, v in zip(a.state_dict().values(), b.state_dict().values()))
    assert float(a.projector[4].bias.detach().abs().sum()) == 0.0


def test_weight_zero_leaves_the_loss_bitwise_unchanged(tmp_path):
    encoder = load_encoder(_torchscript(tmp_path / "enc.pt"), 8)
    model, term = _model(0), REPA(32, 1, encoder, encoder_size=8, model_side=4, projector_dim=24)
    form = build_formulation(DiffusionConfig(formulation="flow", prediction="velocity", num_timesteps=G))
    x0, y, k = torch.rand(5, 1, 8, 8) * 2 - 1, torch.arange(5), torch.tensor([0, 7, 21, 33, 49])

    def loss(*terms):
        obj = Objective(form, num_cells=G, prediction="velocity", backend="reference", terms=terms)
        return obj(model, x0, y, k, seed=3, generator=torch.Generator().manual_seed(0))

    base = loss()
    assert torch.equal(loss((0.0, term)), base)
    assert not torch.equal(loss((0.5, term)), base)


def test_a_finer_encoder_grid_is_pooled_to_the_dits_by_hand(tmp_path):
    z = torch.randn(3, 16, 5, generator=torch.Generator().manual_seed(0))  # a 4x4 grid, row-major
    pooled = match_tokens(z, 2)
    grid = z.reshape(3, 4, 4, 5)
    for r in range(2):
        for c in range(2):
            want = grid[:, 2 * r : 2 * r + 2, 2 * c : 2 * c + 2].mean(dim=(1, 2))  # (3, 5): the 2x2 block's mean
            torch.testing.assert_close(pooled[:, 2 * r + c], want)
    assert match_tokens(z, 4) is z
    # the term: a 4x4 encoder grid (size 8, patch 2) against a DiT with 2x2 tokens (input 8, patch 4)
    encoder = load_encoder(_torchscript(tmp_path / "enc.pt"), 8)
    model = _model(0, patch_size=4)
    term = REPA(32, 0, encoder, encoder_size=8, model_side=2, projector_dim=24)
    inputs = _inputs(3, model, 0)
    with torch.no_grad():
        full = encoder(encoder_input(inputs.x0, 8)).reshape(3, 4, 4, -1)
    want = full.unflatten(1, (2, 2)).unflatten(3, (2, 2)).mean(dim=(2, 4)).reshape(3, 4, -1)  # (3, 4, D_e)
    torch.testing.assert_close(term.target(inputs.x0), want)
    assert term(inputs).shape == (3,)


def _text(path):
    path.write_text("not an encoder\n" * 4)
    return path


def _pickled(path):
    torch.save(TinyEncoder(), str(path))
    return path


def _legacy_pickle(path):
    torch.save(TinyEncoder().state_dict(), str(path), _use_new_zipfile_serialization=False)
    return path


def _not_a_vit(path):
    save_file({"weight": torch.zeros(3, 3)}, str(path))
    return path


def test_repa_encoder_errors_are_one_line(tmp_path):
    cases = {
        "missing": (lambda p: p, "does not exist"),
        "text": (_text, "is not an encoder: neither a TorchScript file"),
        "pickled": (_pickled, "is a pickled torch.save file, which is not read"),
        "legacy": (_legacy_pickle, "is a pickled torch.save file, which is not read"),
        "not_vit": (
            _not_a_vit,
            "is a safetensors file but not a DINOv2-style ViT: it has no 'patch_embed.proj.weight'",
        ),
    }
    for name, (make, line) in cases.items():
        path = make(tmp_path / name)
        with pytest.raises((ValueError, FileNotFoundError), match=line) as err:
            check_encoder(path, 8, 4)
        assert "\n" not in str(err.value) and str(path) in str(err.value)
    ts = _torchscript(tmp_path / "enc.pt")
    with pytest.raises(
        ValueError, match=r"terms.repa_encoder_size 4 gives a 2x2 grid .* set terms.repa_encoder_size=8"
    ):
        check_encoder(ts, 4, 4)
    with pytest.raises(ValueError, match="fails on a 2x3x5x5 batch of images"):  # a 7-pixel patch on a 5-pixel image
        check_encoder(_torchscript(tmp_path / "p3.pt", patch=7), 5, 4)
    vit = tmp_path / "vit.safetensors"
    save_file(_vit_state(dim=64, side=4, depth=1), str(vit))
    with pytest.raises(ValueError, match="terms.repa_encoder_size 7 is not a multiple of the encoder's patch size 2"):
        check_encoder(vit, 7, 4)
    assert check_encoder(vit, 16, 4)[1] == 64  # an 8x8 grid pooled to 4x4
    flat = tmp_path / "flat.pt"
    torch.jit.save(torch.jit.script(nn.Sequential(nn.Flatten(), nn.Linear(192, 5))), str(flat))
    with pytest.raises(ValueError, match=r"returns \(2, 5\) for a 2x3x8x8 batch of images, not patch tokens \(B, N"):
        check_encoder(flat, 8, 4)


class _WithClass(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = x.flatten(2).transpose(1, 2)  # (B, S^2, 3)
        return torch.cat([z[:, :1], z], dim=1)  # a class token in front


def test_a_torchscript_encoder_with_a_class_token_is_refused(tmp_path):
    path = tmp_path / "cls.pt"
    torch.jit.save(torch.jit.script(_WithClass()), str(path))
    with pytest.raises(ValueError, match="returns 17 tokens, not a square grid of patch tokens"):
        check_encoder(path, 4, 4)


def test_repa_options_are_checked(tmp_path):
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.runs.sections import TDCConfig
    from diffcurr_fast.tdc.preflight import check_tdc_run

    with pytest.raises(ValueError, match="terms.repa_encoder is required with terms.use repa"):
        load_config(None, ["terms.use=[repa]"])
    enc = f"terms.repa_encoder={_torchscript(tmp_path / 'enc.pt')}"
    with pytest.raises(ValueError, match="terms.repa_block 4 must be a block of the model: 0 to 3"):
        load_config(None, ["model.depth=4", "terms.use=[repa]", enc, "terms.repa_block=4"])
    with pytest.raises(ValueError, match="terms.use repa needs images"):
        load_config(
            None,
            [
                "data.dataset=npz",
                "data.path=x.npz",
                "model.in_channels=4",
                "logging.eval_every=0",
                "terms.use=[repa]",
                enc,
            ],
        )
    with pytest.raises(ValueError, match="terms.repa_weight"):
        load_config(None, ["terms.repa_weight=0"])
    cfg = tiny(tmp_path / "z", "curriculum.pacing=none", "terms.use=[repa]", enc, "terms.repa_encoder_size=8")
    with pytest.raises(ValueError, match="terms.use 'repa' trains a projector attached to the model"):
        check_tdc_run(cfg, TDCConfig(num_groups=3), tmp_path / "tdc")
    assert not (tmp_path / "tdc").exists()


def test_a_recipes_encoder_path_is_relative_to_the_recipe(tmp_path):
    from diffcurr_fast.runs.recipes import load_config

    (tmp_path / "r").mkdir()
    _torchscript(tmp_path / "r" / "enc.pt")
    recipe = tmp_path / "r" / "repa.yaml"
    recipe.write_text("terms:\n  use: [repa]\n  repa_encoder: enc.pt\n  repa_encoder_size: 8\n")
    assert load_config(str(recipe), []).terms.repa_encoder == str(tmp_path / "r" / "enc.pt")


@pytest.mark.parametrize("case", ["missing", "text", "pickled", "not_vit", "grid"])
def test_dry_run_and_start_refuse_a_bad_encoder(tmp_path, capsys, monkeypatch, case):
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    makers = {"missing": lambda p: p, "text": _text, "pickled": _pickled, "not_vit": _not_a_vit, "grid": _torchscript}
    lines = {
        "missing": "does not exist",
        "text": "is not an encoder",
        "pickled": "is a pickled torch.save file",
        "not_vit": "not a DINOv2-style ViT",
        "grid": "set terms.repa_encoder_size=8",
    }
    path = makers[case](tmp_path / "enc")
    size = "4" if case == "grid" else "8"
    sets = [*TINY_SETS, "terms.use=[repa]", f"terms.repa_encoder={path}", f"terms.repa_encoder_size={size}"]
    run = tmp_path / "run"
    argv = [a for s in sets for a in ("--set", s)]
    for extra in (["--dry-run"], []):
        rc, err = _main(capsys, "train", "--run-dir", str(run), *extra, *argv)
        assert rc == 2 and err.count("\n") == 1 and lines[case] in err, err
        assert not run.exists()


class _Broken(TinyEncoder):
    """An encoder that returns one sample's tokens for any batch (as one traced with a batch of 1 may), or NaN."""

    def __init__(self, nan: bool):
        super().__init__()
        self.nan = nan

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.mix(torch.tanh(self.proj(x).flatten(2).transpose(1, 2)))  # (B, N, dim)
        return z * float("nan") if self.nan else z[:1]  # (1, N, dim)


@pytest.mark.parametrize("case", ["first_only", "nan"])
def test_an_encoder_that_drops_the_batch_or_returns_nan_is_refused(tmp_path, capsys, case):
    """An encoder that returns batch 1 for any batch (every sample would be aligned to sample 0's features) or NaN
    (the first step's failure was blamed on the data and data.scale) is refused by the dry run and the start, in one
    line naming the encoder, before anything is written."""
    path = tmp_path / "enc.pt"
    torch.jit.save(torch.jit.script(_Broken(nan=case == "nan")), str(path))
    line = {
        "first_only": "returns (1, 16, 12) for a 2x3x8x8 batch of images: its first dimension must follow the batch",
        "nan": "returns NaN or inf for a 2x3x8x8 batch of images: its weights or its arithmetic are broken; check",
    }[case]
    sets = [*TINY_SETS, "terms.use=[repa]", f"terms.repa_encoder={path}", "terms.repa_encoder_size=8"]
    sets.append("engine.max_steps=1")
    run = tmp_path / "run"
    for extra in (["--dry-run"], []):
        rc, err = _main(capsys, "train", "--run-dir", str(run), *extra, *[a for s in sets for a in ("--set", s)])
        assert rc == 2 and err.count("\n") == 1 and f"'{path}' {line}" in err, err
        assert not run.exists()


def test_a_first_step_failure_with_repa_names_the_encoder(tmp_path):
    """The advice of a run whose first step is non-finite names REPA's encoder beside the data when it is used."""
    from diffcurr_fast.train.skips import Skips

    enc = _torchscript(tmp_path / "enc.pt")
    cfg = tiny(tmp_path / "r", "terms.use=[repa]", f"terms.repa_encoder={enc}", "terms.repa_encoder_size=8")
    skips = Skips(cfg, torch.device("cpu"), on_device=False)
    skips.first = 1
    assert str(skips._error(1, 1, 1)).endswith(
        f"check the data and data.scale (now 1; the model sees data.scale x the data), and the REPA encoder "
        f"terms.repa_encoder '{enc}'"
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step run with repa, the same run stopped at 2 and resumed to 4, and a plain run."""
    from diffcurr_fast.train.loop import Trainer

    tmp = tmp_path_factory.mktemp("repa")
    enc = _torchscript(tmp / "enc.pt")
    sets = [
        "model.depth=4",
        "checkpoint.every=2",
        "terms.use=[repa]",
        f"terms.repa_encoder={enc}",
        "terms.repa_encoder_size=8",
        "terms.repa_projector_dim=16",
        "data.batch_size=15",
    ]
    whole = Trainer(tiny(tmp / "a", *sets, "engine.max_steps=4"))
    whole.fit()
    Trainer(tiny(tmp / "b", *sets, "engine.max_steps=2")).fit()
    resumed = Trainer(tiny(tmp / "b", *sets, "engine.max_steps=4"), resume=True)
    resumed.fit()
    plain = Trainer(tiny(tmp / "c", "model.depth=4", "data.batch_size=15", "engine.max_steps=4"))
    plain.fit()
    return tmp, whole, resumed, plain


def test_a_run_trains_the_projector_with_the_model_and_resumes_exactly(runs):
    tmp, whole, resumed, plain = runs
    ((w, term),) = whole.objective.terms
    assert w == 0.5 and isinstance(term, REPA) and term.features == (0,)  # depth 4: block 4 // 3 - 1 = 0
    assert whole.model.term_heads["repa"] is term
    in_opt = {id(p) for group in whole.opt.param_groups for p in group["params"]}
    assert all(id(p) in in_opt for p in term.parameters())
    assert not any(id(p) in in_opt for p in term.encoder.parameters())
    sd, ema = whole.model.state_dict(), whole.ema.module.state_dict()
    assert "term_heads.repa.projector.4.weight" in sd and "term_heads.repa.projector.4.weight" in ema
    assert not any("encoder" in k for k in sd)  # the frozen encoder is no part of the model or its checkpoint
    assert_resumed_state(whole, resumed)
    assert any(not torch.equal(sd[k], v) for k, v in plain.model.state_dict().items())


def test_sampling_and_export_leave_the_projector_out(runs):
    from safetensors.torch import load_file

    from diffcurr_fast.cli_export import load_model
    from diffcurr_fast.runs.checkpoint import latest_checkpoint

    tmp, whole, _, _ = runs
    ckpt = latest_checkpoint(tmp / "a")
    assert any(k.startswith("term_heads.repa.") for k in torch.load(ckpt, weights_only=True)["ema"]["module"])
    for weights in ("ema", "model"):
        model, _, _ = load_model(str(ckpt), weights)
        assert not hasattr(model, "term_heads")
    exported = load_file(str(tmp / "a" / "ema.safetensors"))
    assert exported and not any(k.startswith("term_heads.") for k in exported)


DDP_SCRIPT = """
import json, sys, warnings, torch
warnings.filterwarnings("ignore", category=DeprecationWarning)
torch.set_num_threads(1)
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.engine import create_engine
from diffcurr_fast.train.loop import Trainer

run_dir, out, enc = sys.argv[1:4]
sets = [f"checkpoint.run_dir={run_dir}", "model.hidden_size=32", "model.depth=2", "model.num_heads=2",
        "diffusion.num_timesteps=40", "data.batch_size=10", "logging.progress=false", "logging.num_samples=0",
        "logging.plots=false", "checkpoint.export_ema=false", "engine.kind=ddp", "engine.device=cpu",
        "engine.max_steps=3", "terms.use=[repa]", f"terms.repa_encoder={enc}", "terms.repa_encoder_size=8",
        "terms.repa_projector_dim=16"]
engine = create_engine("ddp", "cpu")
tr = Trainer(load_config(None, sets), engine)
tr.fit()
heads = torch.cat([p.detach().flatten() for p in tr.model.term_heads.parameters()])
flat = torch.cat([p.detach().flatten() for p in tr.model.parameters()])
with open(f"{out}.{engine.rank}.json", "w") as fh:
    json.dump({"rank": engine.rank, "params": flat.tolist(), "heads": heads.tolist()}, fh)
del tr
engine.close()
"""


@pytest.mark.slow
def test_two_gloo_ranks_keep_the_projector_in_sync(tmp_path):
    """Under DDP the projector (``model.term_heads``) is synchronised with the model; each rank runs its own frozen
    encoder on its own micro-batch (nothing gathered)."""
    script = tmp_path / "ddp_repa.py"
    script.write_text(DDP_SCRIPT)
    enc = _torchscript(tmp_path / "enc.pt")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [*TORCHRUN2, str(script), str(tmp_path / "run"), str(tmp_path / "res"), str(enc)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"res.{r}.json").read_text()) for r in (0, 1))
    assert (r0["rank"], r1["rank"]) == (0, 1)
    assert r0["params"] == r1["params"] and r0["heads"] == r1["heads"] and len(r0["heads"]) > 0
