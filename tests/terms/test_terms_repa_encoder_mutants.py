"""The REPA encoder reader of terms/repa.py, pinned whole: ``encoder_format`` on hand-made files (each rule of its
docstring: TorchScript archives by their entries, pickles refused, safetensors by its 8-byte header length and JSON
brace), ``ViTEncoder`` against a plain float64 DINOv2 / timm forward written here (class token or none, a position
for the class token or none, register tokens, optional biases and layer scales, the plain and the SwiGLU MLP, the
position grid resampled up or down), and every error the state dict reader raises, word for word."""

import math
import zipfile

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from diffcurr_fast.terms.repa import ViTEncoder, encoder_format

pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")

WHAT = "a TorchScript file saved with torch.jit.save, or a safetensors file of a DINOv2-style ViT"
PICKLED = (
    "is a pickled torch.save file, which is not read (loading a pickle can run code); save the encoder with "
    "torch.jit.save(torch.jit.script(encoder), path) or its weights with safetensors.torch.save_file"
)
NEITHER = "is not an encoder: neither a TorchScript file (torch.jit.save) nor a safetensors file"


def _name(path):
    return f"terms.repa_encoder '{path}'"


# ---- encoder_format -----------------------------------------------------------------------------------------------


def _zip(path, names):
    with zipfile.ZipFile(path, "w") as z:
        for n in names:
            z.writestr(n, b"x")
    return path


def _safetensors_like(path, n, total):
    """An 8-byte little-endian length ``n``, a ``{``, then spaces up to ``total`` bytes."""
    path.write_bytes(n.to_bytes(8, "little") + b"{" + b" " * (total - 9))
    return path


def _raises(path, exc, text):
    with pytest.raises(exc) as err:
        encoder_format(path)
    assert str(err.value) == f"{_name(path)} {text}"


def test_encoder_format_reads_torchscript_archives_by_their_entries(tmp_path):
    """A zip with a ``*/constants.pkl`` and a ``*/code/`` entry is TorchScript; a real torch.jit.save file is one."""
    real = tmp_path / "real.pt"
    torch.jit.save(torch.jit.script(nn.Linear(2, 2)), str(real))
    assert encoder_format(real) == "torchscript"
    assert encoder_format(str(real)) == "torchscript"
    assert encoder_format(_zip(tmp_path / "a.zip", ["m/constants.pkl", "m/code/__torch__.py"])) == "torchscript"
    assert encoder_format(_zip(tmp_path / "b.zip", ["m/code/x.py", "m/data.pkl", "m/constants.pkl"])) == "torchscript"
    # one of the two is not enough: with a data.pkl it is a pickle, without it is nothing
    _raises(_zip(tmp_path / "c.zip", ["m/code/x.py", "m/data.pkl"]), ValueError, PICKLED)
    _raises(_zip(tmp_path / "d.zip", ["m/constants.pkl", "m/data.pkl"]), ValueError, PICKLED)
    _raises(_zip(tmp_path / "e.zip", ["m/constants.pkl"]), ValueError, NEITHER)
    _raises(_zip(tmp_path / "f.zip", ["m/code/x.py"]), ValueError, NEITHER)
    _raises(_zip(tmp_path / "g.zip", ["readme.txt"]), ValueError, NEITHER)


def test_encoder_format_refuses_pickles_of_either_torch_save_format(tmp_path):
    new, old = tmp_path / "new.pt", tmp_path / "old.pt"
    torch.save({"w": torch.zeros(2)}, str(new))
    torch.save({"w": torch.zeros(2)}, str(old), _use_new_zipfile_serialization=False)
    _raises(new, ValueError, PICKLED)
    _raises(old, ValueError, PICKLED)
    short = tmp_path / "short"
    short.write_bytes(b"\x80\x02")  # a PROTO opcode is enough
    _raises(short, ValueError, PICKLED)


def test_encoder_format_reads_safetensors_by_its_header_length_and_brace(tmp_path):
    real = tmp_path / "real.safetensors"
    save_file({"w": torch.zeros(3)}, str(real))
    assert encoder_format(real) == "safetensors"
    # the header length n must satisfy 0 < n <= size - 8, and the 9th byte must be "{"
    assert encoder_format(_safetensors_like(tmp_path / "edge", 32, 40)) == "safetensors"
    assert encoder_format(_safetensors_like(tmp_path / "one", 1, 12)) == "safetensors"
    _raises(_safetensors_like(tmp_path / "long", 33, 40), ValueError, NEITHER)
    _raises(_safetensors_like(tmp_path / "zero", 0, 40), ValueError, NEITHER)
    brace = tmp_path / "brace"
    brace.write_bytes((4).to_bytes(8, "little") + b"[   ")
    _raises(brace, ValueError, NEITHER)
    eight = tmp_path / "eight"
    eight.write_bytes((0).to_bytes(8, "little"))
    _raises(eight, ValueError, NEITHER)
    text = tmp_path / "text"
    text.write_text("not an encoder\n" * 4)
    _raises(text, ValueError, NEITHER)
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    _raises(empty, ValueError, NEITHER)


def test_encoder_format_names_a_missing_file_a_folder_and_a_broken_archive(tmp_path):
    _raises(tmp_path / "missing", FileNotFoundError, f"does not exist ({WHAT})")
    with pytest.raises(FileNotFoundError) as err:
        encoder_format(str(tmp_path / "missing"))
    assert str(err.value) == f"{_name(tmp_path / 'missing')} does not exist ({WHAT})"
    _raises(tmp_path, ValueError, f"is a folder, not an encoder file ({WHAT})")
    # a zip whose end record is intact but whose central directory is not
    good = _zip(tmp_path / "good.zip", ["m/constants.pkl", "m/code/x.py"])
    data = bytearray(good.read_bytes())
    at = data.rfind(b"PK\x01\x02")
    while at >= 0:
        data[at : at + 4] = b"QQ\x01\x02"
        at = data.rfind(b"PK\x01\x02")
    bad = tmp_path / "bad.zip"
    bad.write_bytes(bytes(data))
    assert zipfile.is_zipfile(bad)
    _raises(bad, ValueError, f"is not a readable archive (BadZipFile); {WHAT}")


# ---- ViTEncoder against a plain float64 forward -------------------------------------------------------------------

DIM, HIDDEN, SIZE, PATCH = 128, 96, 8, 2  # two 64-wide heads, a 4x4 grid
GRID = SIZE // PATCH


def _state(
    side=GRID,
    cls=True,
    cls_pos=True,
    registers=0,
    swiglu=False,
    layerscale=True,
    no_bias=(),
    depth=2,
    scale=1.0,
    seed=0,
):
    """A random DINOv2 / timm ViT state dict; ``no_bias`` names the layers without a bias; ``scale`` scales what
    feeds the residual stream (patch embedding, positions, class and register tokens, layer scales)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std=1.0):
        return torch.randn(*shape, generator=g) * std

    sd = {
        "pos_embed": r(1, (1 if cls and cls_pos else 0) + side * side, DIM, std=scale),
        "patch_embed.proj.weight": r(DIM, 3, PATCH, PATCH, std=0.3 * scale),
        "norm.weight": 1 + r(DIM, std=0.2),
        "norm.bias": r(DIM, std=0.2),
    }
    if "patch_embed.proj" not in no_bias:
        sd["patch_embed.proj.bias"] = r(DIM, std=0.3 * scale)
    if cls:
        sd["cls_token"] = r(1, 1, DIM, std=scale)
    if registers:
        sd["register_tokens"] = r(1, registers, DIM, std=scale)
    mlp = {"mlp.w12": (2 * HIDDEN, DIM), "mlp.w3": (DIM, HIDDEN)} if swiglu else {}
    mlp = mlp or {"mlp.fc1": (HIDDEN, DIM), "mlp.fc2": (DIM, HIDDEN)}
    for i in range(depth):
        b = f"blocks.{i}."
        sd[b + "norm1.weight"], sd[b + "norm1.bias"] = 1 + r(DIM, std=0.2), r(DIM, std=0.2)
        sd[b + "norm2.weight"], sd[b + "norm2.bias"] = 1 + r(DIM, std=0.2), r(DIM, std=0.2)
        for k, shape in {"attn.qkv": (3 * DIM, DIM), "attn.proj": (DIM, DIM), **mlp}.items():
            sd[b + k + ".weight"] = r(*shape, std=0.15)
            if k not in no_bias:
                sd[b + k + ".bias"] = r(shape[0], std=0.3)
        if layerscale:
            sd[b + "ls1.gamma"], sd[b + "ls2.gamma"] = r(DIM, std=0.7 * scale), r(DIM, std=0.7 * scale)
    return sd


def _reference(sd, x, size, cls_pos):
    """The patch tokens after the final norm of a DINOv2 / timm ViT, written plainly in float64 (64-wide heads):
    patch embedding, positions (resampled bicubically with antialiasing; the class token's own when it has one),
    [class, registers, patches], pre-norm blocks, the final LayerNorm (eps 1e-6 throughout)."""
    sd = {k: v.double() for k, v in sd.items()}
    x = x.double()
    w = sd["patch_embed.proj.weight"]
    dim, patch = w.shape[0], w.shape[2]
    grid, b = size // patch, x.shape[0]
    t = F.conv2d(x, w, sd.get("patch_embed.proj.bias"), stride=patch).flatten(2).transpose(1, 2)  # (B, N, D)
    pos = sd["pos_embed"]
    lead = 1 if cls_pos else 0
    side = math.isqrt(pos.shape[1] - lead)
    grid_pos = pos[:, lead:].reshape(1, side, side, dim).permute(0, 3, 1, 2)
    if side != grid:
        grid_pos = F.interpolate(grid_pos, size=(grid, grid), mode="bicubic", antialias=True)
    t = t + grid_pos.permute(0, 2, 3, 1).reshape(1, grid * grid, dim)
    prefix = []
    if "cls_token" in sd:
        prefix.append(sd["cls_token"] + (pos[:, :1] if cls_pos else 0))
    if "register_tokens" in sd:
        prefix.append(sd["register_tokens"])
    t = torch.cat([p.expand(b, -1, -1) for p in prefix] + [t], dim=1)
    depth = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    heads = dim // 64

    def linear(h, p, k):
        return h @ p[k + ".weight"].T + p.get(k + ".bias", 0.0)

    for i in range(depth):
        p = {k[len(f"blocks.{i}.") :]: v for k, v in sd.items() if k.startswith(f"blocks.{i}.")}
        h = F.layer_norm(t, (dim,), p["norm1.weight"], p["norm1.bias"], eps=1e-6)
        q, k, v = linear(h, p, "attn.qkv").reshape(b, -1, 3, heads, 64).unbind(2)
        att = torch.softmax(torch.einsum("bnhd,bmhd->bhnm", q, k) / 8.0, dim=-1)
        a = linear(torch.einsum("bhnm,bmhd->bnhd", att, v).reshape(b, -1, dim), p, "attn.proj")
        t = t + p.get("ls1.gamma", 1.0) * a
        h = F.layer_norm(t, (dim,), p["norm2.weight"], p["norm2.bias"], eps=1e-6)
        if "mlp.w12.weight" in p:
            x1, x2 = linear(h, p, "mlp.w12").chunk(2, dim=-1)
            h = linear(F.silu(x1) * x2, p, "mlp.w3")
        else:
            h = linear(F.gelu(linear(h, p, "mlp.fc1")), p, "mlp.fc2")
        t = t + p.get("ls2.gamma", 1.0) * h
    t = F.layer_norm(t, (dim,), sd["norm.weight"], sd["norm.bias"], eps=1e-6)
    return t[:, -grid * grid :]


def _check(sd, cls_pos=True, extra=None, size=SIZE):
    """The encoder read from ``sd`` (plus ``extra`` keys it must ignore), in float64, against ``_reference``."""
    enc = ViTEncoder({**sd, **(extra or {})}, size).double().eval()
    x = torch.randn(2, 3, size, size, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        got = enc(x)
    grid = size // PATCH
    assert got.shape == (2, grid * grid, DIM) and got.dtype == torch.float64
    torch.testing.assert_close(got, _reference(sd, x, size, cls_pos), rtol=1e-5, atol=1e-5)
    return enc


CASES = {
    # DINOv2: class token with a position, registers, layer scales, a 5x5 position grid resampled to 4x4
    "dinov2_reg": dict(side=5, registers=2),
    # timm's no_embed_class: a class token without a position, no qkv / fc1 / patch bias, no layer scale
    "timm_no_embed_class": dict(cls_pos=False, layerscale=False, no_bias=("attn.qkv", "mlp.fc1", "patch_embed.proj")),
    # the other biases missing, a 3x3 grid resampled up, three blocks
    "other_biases": dict(side=3, no_bias=("attn.proj", "mlp.fc2"), depth=3),
    # no class token at all: every token is a patch token
    "no_class_token": dict(cls=False, cls_pos=False, side=5, no_bias=("mlp.fc2",)),
    # the SwiGLU MLP of ViT-g, with and without each of its biases
    "swiglu": dict(swiglu=True, registers=1, no_bias=("mlp.w12", "attn.proj")),
    # a residual stream of variance about 1e-6: every LayerNorm's eps (1e-6) shows
    "small_stream": dict(scale=1e-3, registers=1, side=5),
    "swiglu_other": dict(swiglu=True, layerscale=False, no_bias=("mlp.w3", "attn.qkv"), side=6),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_encoder_is_a_plain_float64_vit_forward(case):
    """Each variant of the state dict (module doc of terms/repa.py: keys, heads D / 64, positions resampled once,
    registers after the class token without a position, the patch tokens after the final norm) gives the plain
    forward's tokens."""
    kw = CASES[case]
    _check(_state(**kw), cls_pos=kw.get("cls", True) and kw.get("cls_pos", True))


def test_the_encoder_ignores_the_mask_token_and_head_and_reads_timms_register_name():
    sd = _state(registers=3, side=5)
    extra = {"mask_token": torch.zeros(1, DIM), "head.weight": torch.zeros(10, DIM), "head.bias": torch.zeros(10)}
    enc = _check(sd, extra=extra)
    timm = {("reg_token" if k == "register_tokens" else k): v for k, v in sd.items()}
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        assert torch.equal(ViTEncoder(timm, SIZE).eval()(x), enc.float()(x))
    assert (enc.patch, enc.size, enc.chans, enc.grid) == (PATCH, SIZE, 3, GRID)
    assert "pos_embed" not in enc.state_dict() and len(enc.blocks) == 2
    assert all(blk.heads == DIM // 64 for blk in enc.blocks)


def test_the_encoder_runs_at_a_larger_size_with_its_grid():
    _check(_state(side=5), size=12)  # a 6x6 grid from 5x5 positions


def _err(sd, size=SIZE, **kw):
    with pytest.raises(ValueError) as err:
        ViTEncoder(sd, size, **kw)
    assert "\n" not in str(err.value)
    return str(err.value)


def test_a_state_dict_without_a_vits_keys_names_them():
    base = _state(depth=1)
    no = "is a safetensors file but not a DINOv2-style ViT: it has no"
    for key in ("patch_embed.proj.weight", "pos_embed", "norm.weight", "blocks.0.attn.qkv.weight"):
        sd = {k: v for k, v in base.items() if k != key}
        assert _err(sd, name="NAME") == f"NAME {no} {key!r}"
    sd = {k: v for k, v in base.items() if k not in ("pos_embed", "norm.weight")}
    assert _err(sd) == f"terms.repa_encoder {no} 'pos_embed', 'norm.weight'"


def test_a_state_dict_of_the_wrong_shapes_is_refused_word_for_word():
    base = _state(depth=1)
    sd = {**base, "patch_embed.proj.weight": torch.zeros(DIM, 3, 2, 3)}
    assert _err(sd, name="N") == f"N: patch_embed.proj.weight has shape ({DIM}, 3, 2, 3), not (D, C, p, p)"
    sd = {**base, "patch_embed.proj.weight": torch.zeros(DIM, 3, 2)}
    assert _err(sd, name="N") == f"N: patch_embed.proj.weight has shape ({DIM}, 3, 2), not (D, C, p, p)"
    sd = {**base, "patch_embed.proj.weight": torch.zeros(96, 3, 2, 2)}
    assert _err(sd) == "terms.repa_encoder: width 96 is not a multiple of the head width 64 this reader assumes"
    sd = {**base, "pos_embed": torch.zeros(1, 11, DIM)}
    assert _err(sd, name="N") == f"N: pos_embed has shape (1, 11, {DIM}), not a square grid of positions"
    sd = {**base, "pos_embed": torch.zeros(17, 64)}  # 64 "positions": a square, but not (1, P, D)
    assert _err(sd, name="N") == "N: pos_embed has shape (17, 64), not a square grid of positions"


@pytest.mark.parametrize("size, patch, want", [(7, 2, 8), (1, 2, 2), (11, 4, 12), (9, 4, 8)])
def test_a_size_off_the_patch_grid_names_the_nearest_that_is_on_it(size, patch, want):
    sd = {**_state(depth=1), "patch_embed.proj.weight": torch.zeros(DIM, 3, patch, patch)}
    assert _err(sd, size) == (
        f"terms.repa_encoder_size {size} is not a multiple of the encoder's patch size {patch}; set it to {want}"
    )


def test_a_state_dict_that_does_not_fit_is_refused_in_one_short_line():
    sd = _state(depth=1)
    sd.update({f"blocks.0.extra{i}.weight": torch.zeros(1) for i in range(40)})  # a long error from torch
    text = _err(sd, name="N")
    prefix = "N does not fit a DINOv2-style ViT ("
    assert text.startswith(prefix + "Error(s) in loading state_dict") and text.endswith(")")
    assert len(text) == len(prefix) + 300 + 1
    sd = {k: v for k, v in _state(depth=1).items() if k != "blocks.0.ls2.gamma"}  # one layer scale of two
    assert _err(sd).startswith("terms.repa_encoder does not fit a DINOv2-style ViT (Error(s) in loading state_dict")


def test_register_tokens_without_a_class_token_come_first():
    """timm's ``reg_token`` models without a class token (``class_token=False``, ``no_embed_class=True``, the
    ``*_reg4_gap_*`` ViTs) put the registers in front of the patch tokens: none of them may replace a patch token in
    the output, nor may a patch token be dropped."""
    sd = _state(cls=False, cls_pos=False, registers=4)
    enc = _check(sd, cls_pos=False)
    x = torch.randn(2, 3, SIZE, SIZE, generator=torch.Generator().manual_seed(3))
    timm = {("reg_token" if k == "register_tokens" else k): v for k, v in sd.items()}
    with torch.no_grad():
        assert torch.equal(ViTEncoder(timm, SIZE).eval()(x), enc.float()(x))


def test_a_pos_embed_without_a_grid_of_positions_is_refused_in_one_line():
    """A position embedding of one dimension, or of the class token's position alone, is refused in the same one line
    as any other that is not a square grid."""
    base = _state(depth=1)
    for shape in [(DIM,), (1, 1, DIM)]:
        sd = {**base, "pos_embed": torch.zeros(*shape)}
        assert _err(sd, name="N") == f"N: pos_embed has shape {shape}, not a square grid of positions"
