"""Representation alignment's term (terms/repa.py, from load_encoder to REPA.forward): the encoder loaded frozen on
the CPU, each refusal of a file, an encoder or a grid in its exact line, the probe batch two distinct images in a
normalised image's range on the encoder's device, the encoder input of RGB images, the loss by hand, the frozen
encoder moved once to the batch's device, the options' checks, the term's defaults, ``from_config`` reading every
option, the target's precision context and ``data.scale``, and the refusal of a partitioned projector."""

import contextlib
import math
import zipfile
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from diffcurr_fast.terms.base import TermInputs
from diffcurr_fast.terms.repa import (
    REPA,
    REPAOptions,
    _device_of,
    _Frozen,
    alignment_loss,
    check_encoder,
    check_grid,
    encoder_grid,
    encoder_input,
    load_encoder,
    match_tokens,
)

# torch 2.13 deprecates torch.jit in favour of torch.export; the TorchScript form is still read (terms/repa.py)
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.:DeprecationWarning")

WHAT = "a TorchScript file saved with torch.jit.save, or a safetensors file of a DINOv2-style ViT"
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


class Tokens(nn.Module):
    """(B, 3, S, S) -> (B, (S / patch)^2, dim): one patch embedding, row-major tokens (scriptable)."""

    def __init__(self, dim: int = 5, patch: int = 2, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.proj = nn.Conv2d(3, dim, patch, stride=patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class Returns(nn.Module):
    """An encoder that returns ``make(x)`` (or raises it when it is an exception), recording each input."""

    def __init__(self, make, device: str = "cpu"):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1, device=device))
        self.make, self.seen = make, []

    def forward(self, x):
        self.seen.append(x)
        out = self.make(x)
        if isinstance(out, Exception):
            raise out
        return out


def _name(path) -> str:
    return f"terms.repa_encoder {str(path)!r}"


def _script(path, module=None):
    torch.jit.save(torch.jit.script(module if module is not None else Tokens()), str(path))
    return path


def _vit(path, dim=64, patch=2, side=4):
    """A one-block DINOv2-style ViT state dict in safetensors (facebookresearch key names)."""
    g = torch.Generator().manual_seed(0)

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.05

    sd = {
        "cls_token": r(1, 1, dim),
        "pos_embed": r(1, 1 + side * side, dim),
        "patch_embed.proj.weight": r(dim, 3, patch, patch),
        "patch_embed.proj.bias": r(dim),
        "norm.weight": 1 + r(dim),
        "norm.bias": r(dim),
    }
    for k, shape in {
        "norm1.weight": (dim,),
        "norm1.bias": (dim,),
        "attn.qkv.weight": (3 * dim, dim),
        "attn.qkv.bias": (3 * dim,),
        "attn.proj.weight": (dim, dim),
        "attn.proj.bias": (dim,),
        "norm2.weight": (dim,),
        "norm2.bias": (dim,),
        "mlp.fc1.weight": (2 * dim, dim),
        "mlp.fc1.bias": (2 * dim,),
        "mlp.fc2.weight": (dim, 2 * dim),
        "mlp.fc2.bias": (dim,),
    }.items():
        sd[f"blocks.0.{k}"] = r(*shape)
    save_file(sd, str(path))
    return path


def _tokens_by_hand(enc: nn.Module, x0: torch.Tensor, size: int, scale: float = 1.0) -> torch.Tensor:
    """The encoder on x0 / scale mapped to [0, 1], gray repeated to RGB, ImageNet-normalised, at ``size``."""
    x = (x0.double() / scale + 1) / 2
    x = x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x
    x = (x - torch.tensor(MEAN, dtype=torch.float64).view(1, 3, 1, 1)) / torch.tensor(STD, dtype=torch.float64).view(
        1, 3, 1, 1
    )
    if x.shape[-1] != size:
        x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False)
    with torch.no_grad():
        return enc(x.float())


# ---- load_encoder, encoder_grid, check_grid, check_encoder ---------------------------------------------------------


def test_a_torchscript_encoder_is_loaded_frozen_in_eval_mode_on_the_cpu(tmp_path):
    """The loaded module computes what the saved one does, in eval mode, with no parameter requiring a gradient."""
    src = Tokens().train()
    path = _script(tmp_path / "enc.pt", src)
    enc = load_encoder(path, 8)
    assert not enc.training
    params = list(enc.parameters())
    assert params and all(not p.requires_grad and p.device.type == "cpu" for p in params)
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(enc(x), src(x))


def test_a_torchscript_encoder_saved_on_a_gpu_is_loaded_on_the_cpu(tmp_path):
    """A file whose weights were saved from a GPU (its archive names the device ``cuda:0``) is loaded on the CPU,
    on a host with or without one (the term moves it to the batch's device)."""
    cpu = _script(tmp_path / "cpu.pt")
    path = tmp_path / "gpu.pt"
    with zipfile.ZipFile(cpu) as src, zipfile.ZipFile(path, "w") as dst:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename.endswith("/data.pkl"):  # the storages' location, a pickled string
                assert data.count(b"X\x03\x00\x00\x00cpu") == 1
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(info, data)
    enc = load_encoder(path, 8)
    assert all(p.device.type == "cpu" for p in enc.parameters())
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(enc(x), load_encoder(cpu, 8)(x))


@pytest.mark.parametrize(
    "message, line",
    [
        ("bad archive\nsecond line", "RuntimeError: bad archive"),
        ("  ", "RuntimeError: "),
        ("x" * 300, "RuntimeError: " + "x" * 200),
    ],
)
def test_an_unreadable_torchscript_file_is_refused_with_the_first_line_of_the_error(
    tmp_path, monkeypatch, message, line
):
    """torch's error is cut to its first line, at most 200 characters, after its type's name; none when empty."""
    path = _script(tmp_path / "enc.pt")

    def fail(*args, **kwargs):
        raise RuntimeError(message)

    monkeypatch.setattr(torch.jit, "load", fail)
    with pytest.raises(ValueError) as err:
        load_encoder(path, 8)
    assert str(err.value) == f"{_name(path)} is not a readable TorchScript file ({line})"


def test_a_broken_torchscript_archive_is_refused_in_one_line(tmp_path):
    """An archive laid out as TorchScript whose entries are not: one line naming the file and torch's error type."""
    path = tmp_path / "enc.pt"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("enc/constants.pkl", b"not a pickle")
        z.writestr("enc/code/__torch__.py", b"not code")
    with pytest.raises(ValueError) as err:
        load_encoder(path, 8)
    text = str(err.value)
    assert text.startswith(f"{_name(path)} is not a readable TorchScript file (") and "\n" not in text
    assert text[len(f"{_name(path)} is not a readable TorchScript file (") :].split(":")[0].isidentifier()


def test_an_unreadable_safetensors_file_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "enc.safetensors"
    path.write_bytes((5).to_bytes(8, "little") + b"{abcd")  # a safetensors header length, then no JSON
    with pytest.raises(ValueError) as err:
        load_encoder(path, 8)
    assert str(err.value).startswith(f"{_name(path)}: {str(path)!r} is not a readable safetensors file (")


def test_a_vit_file_is_read_for_the_given_size_frozen_and_named_in_its_errors(tmp_path):
    path = _vit(tmp_path / "vit.safetensors")
    for size, side in ((8, 4), (12, 6)):
        enc = load_encoder(path, size)
        assert not enc.training and all(not p.requires_grad for p in enc.parameters())
        assert encoder_grid(enc, size) == (side, 64)
        assert check_encoder(path, size, 4)[1] == 64  # read at that size: its grid pooled to the model's
    bad = tmp_path / "bad.safetensors"
    save_file({"patch_embed.proj.weight": torch.zeros(64, 3, 2, 2)}, str(bad))
    with pytest.raises(ValueError, match="is a safetensors file but not a DINOv2-style ViT") as err:
        load_encoder(bad, 8)
    assert str(err.value).startswith(f"{_name(bad)} is a safetensors file")


def test_the_probe_is_two_distinct_images_in_a_normalised_images_range():
    """One forward of a (2, 3, S, S) batch of two different finite images, within the range of an ImageNet-normalised
    image ((0 - 0.485) / 0.229 to (1 - 0.406) / 0.225): the grid side and the width of the tokens come back."""
    enc = Returns(lambda x: torch.zeros(x.shape[0], 9, 7))
    assert encoder_grid(enc, 6) == (3, 7)
    (x,) = enc.seen
    assert x.shape == (2, 3, 6, 6) and x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    assert not torch.equal(x[0], x[1])
    assert float(x.min()) >= -0.485 / 0.229 and float(x.max()) <= (1 - 0.406) / 0.225


def test_the_probe_goes_to_the_encoders_device():
    enc = Returns(lambda x: torch.zeros(x.shape[0], 4, 3), device="meta")
    assert encoder_grid(enc, 4) == (2, 3)
    assert enc.seen[0].device.type == "meta"


@pytest.mark.parametrize(
    "exc, line",
    [
        (RuntimeError("boom\nmore"), "RuntimeError: boom"),
        (ValueError(" "), "ValueError: "),
        (TypeError("y" * 250), "TypeError: " + "y" * 200),
    ],
)
def test_an_encoder_that_fails_is_refused_naming_the_error(exc, line):
    enc = Returns(lambda x: exc)
    with pytest.raises(ValueError) as err:
        encoder_grid(enc, 5)
    assert str(err.value) == (
        f"terms.repa_encoder fails on a 2x3x5x5 batch of images ({line}); check terms.repa_encoder_size, the input "
        "size the encoder expects"
    )
    with pytest.raises(ValueError, match=r"^enc 'x' fails on a 2x3x5x5 batch"):
        encoder_grid(enc, 5, "enc 'x'")


def test_an_encoder_that_returns_no_tokens_is_refused():
    tail = (
        "for a 2x3x4x4 batch of images, not patch tokens (B, N, D); save a module whose forward returns them "
        "(DINOv2: forward_features(x)['x_norm_patchtokens'])"
    )
    for make, got in (
        (lambda x: (x,), "tuple"),
        (lambda x: {"a": x}, "dict"),
        (lambda x: torch.zeros(2, 5, 2, 2), "(2, 5, 2, 2)"),
        (lambda x: torch.zeros(2, 4), "(2, 4)"),
    ):
        with pytest.raises(ValueError) as err:
            encoder_grid(Returns(make), 4, "E")
        assert str(err.value) == f"E returns {got} {tail}"


def test_an_encoder_that_does_not_follow_the_batch_is_refused():
    with pytest.raises(ValueError) as err:
        encoder_grid(Returns(lambda x: torch.zeros(1, 4, 3)), 4)
    assert str(err.value) == (
        "terms.repa_encoder returns (1, 4, 3) for a 2x3x4x4 batch of images: its first dimension must follow the "
        "batch (a module traced with a batch of 1 may keep that size); save it with torch.jit.script, or trace it "
        "with a batch of 2 or more"
    )
    with pytest.raises(ValueError, match=r"returns \(3, 4, 3\) for a 2x3x4x4 batch"):
        encoder_grid(Returns(lambda x: torch.zeros(3, 4, 3)), 4)
    assert encoder_grid(Returns(lambda x: torch.zeros(2, 1, 2)), 4) == (1, 2)  # one token, two wide


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_an_encoder_that_returns_nan_or_inf_is_refused(bad):
    def make(x):
        out = torch.zeros(2, 4, 3)
        out[1, 2, 0] = bad
        return out

    with pytest.raises(ValueError) as err:
        encoder_grid(Returns(make), 4)
    assert str(err.value) == (
        "terms.repa_encoder returns NaN or inf for a 2x3x4x4 batch of images: its weights or its arithmetic are "
        "broken; check the encoder (the data is not involved)"
    )


@pytest.mark.parametrize("n", [2, 5, 17])
def test_an_encoder_whose_tokens_are_no_square_grid_is_refused(n):
    with pytest.raises(ValueError) as err:
        encoder_grid(Returns(lambda x: torch.zeros(2, n, 3)), 4)
    assert str(err.value) == (
        f"terms.repa_encoder returns {n} tokens, not a square grid of patch tokens; leave out the class and register "
        "tokens"
    )


def test_a_grid_equal_or_finer_than_the_models_is_accepted_and_a_coarser_one_names_the_size_to_set():
    """The size to set gives the model's grid: model side x the encoder's patch (an integer patch), else the size
    scaled by model side / encoder side, rounded up."""
    assert check_grid(4, 4, 8) is None and check_grid(8, 4, 16) is None and check_grid(1, 1, 3) is None

    def line(enc, model, size, fit):
        return (
            f"terms.repa_encoder_size {size} gives a {enc}x{enc} grid of encoder patch tokens, coarser than the "
            f"model's {model}x{model} tokens (model.input_size / model.patch_size); set terms.repa_encoder_size={fit}"
        )

    for enc, model, size, fit in ((2, 4, 4, 8), (3, 4, 42, 56), (3, 4, 10, 14), (4, 5, 10, 13), (2, 3, 3, 5)):
        with pytest.raises(ValueError) as err:
            check_grid(enc, model, size)
        assert str(err.value) == line(enc, model, size, fit)


def test_check_encoder_loads_the_file_and_matches_its_grid_to_the_models(tmp_path):
    path = _script(tmp_path / "enc.pt")
    enc, dim = check_encoder(path, 8, 4)
    assert dim == 5 and not enc.training and all(not p.requires_grad for p in enc.parameters())
    assert check_encoder(path, 16, 4)[1] == 5  # an 8x8 grid, pooled
    assert check_encoder(str(path), 6, 3)[1] == 5
    with pytest.raises(ValueError) as err:
        check_encoder(path, 4, 4)
    assert str(err.value).startswith("terms.repa_encoder_size 4 gives a 2x2 grid") and str(err.value).endswith(
        "than the model's 4x4 tokens (model.input_size / model.patch_size); set terms.repa_encoder_size=8"
    )
    assert check_encoder(path, 5, 2)[1] == 5  # 5 pixels: a 2x2 grid, the model's 2x2
    with pytest.raises(ValueError) as err:
        check_encoder(path, 1, 1)  # a 1-pixel image is smaller than the 2-pixel patch
    assert str(err.value).startswith(f"{_name(path)} fails on a 2x3x1x1 batch of images (RuntimeError: ")


def test_check_encoder_refuses_a_missing_file_naming_it(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        check_encoder(tmp_path / "none.pt", 8, 4)
    assert str(err.value) == f"{_name(tmp_path / 'none.pt')} does not exist ({WHAT})"


# ---- the encoder input, the tokens, the loss -------------------------------------------------------------------------


def test_an_rgb_image_is_normalised_per_channel_and_resized_bicubically():
    x0 = torch.rand(2, 3, 4, 4, generator=torch.Generator().manual_seed(0)) * 2 - 1
    want = torch.stack([((x0[:, c] + 1) / 2 - MEAN[c]) / STD[c] for c in range(3)], dim=1)
    torch.testing.assert_close(encoder_input(x0, 4), want)
    torch.testing.assert_close(encoder_input(3 * x0, 4, scale=3.0), want)
    big = F.interpolate(want.double(), size=(7, 7), mode="bicubic", align_corners=False)
    torch.testing.assert_close(encoder_input(x0, 7).double(), big, rtol=1e-5, atol=1e-5)
    gray = encoder_input(x0[:, :1], 7)
    torch.testing.assert_close(gray, encoder_input(x0[:, :1].expand(-1, 3, -1, -1), 7))
    assert gray.shape == (2, 3, 7, 7) and gray.dtype == torch.float32


def test_a_single_gray_image_of_one_row_is_repeated_to_rgb():
    x0 = torch.tensor([[[[-1.0, 0.0, 1.0]]]])  # (1, 1, 1, 3)
    got = encoder_input(x0, 3)
    assert got.shape == (1, 3, 3, 3)
    want = torch.tensor([[(v - MEAN[c]) / STD[c] for v in (0.0, 0.5, 1.0)] for c in range(3)])
    torch.testing.assert_close(got[0, :, 1], want, rtol=1e-5, atol=1e-5)


def test_the_encoder_input_stays_on_the_images_device():
    x0 = torch.zeros(2, 1, 4, 4, device="meta")
    assert encoder_input(x0, 4).device.type == "meta" and encoder_input(x0, 6).shape == (2, 3, 6, 6)


def test_an_uneven_pooling_averages_the_overlapping_windows_by_hand():
    """A 3x3 grid pooled to 2x2: rows and columns 0-1 and 1-2 (adaptive pooling's windows), row-major tokens."""
    z = torch.arange(2 * 9 * 2, dtype=torch.float64).reshape(2, 9, 2)
    got = match_tokens(z, 2)
    grid = z.reshape(2, 3, 3, 2)
    for r in range(2):
        for c in range(2):
            torch.testing.assert_close(got[:, 2 * r + c], grid[:, r : r + 2, c : c + 2].mean(dim=(1, 2)))
    assert got.shape == (2, 4, 2)
    assert match_tokens(z, 1).shape == (2, 1, 2) and torch.equal(match_tokens(z, 1)[:, 0], z.mean(dim=1))


def test_the_loss_is_minus_the_mean_cosine_of_each_tokens_pair_by_hand():
    """B = 2 samples of N = 3 tokens, D = 2: the cosines by hand, their mean over the tokens, negated."""
    h = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 4.0]], [[1.0, 1.0], [2.0, 0.0], [0.0, -1.0]]])
    y = torch.tensor([[[2.0, 0.0], [0.0, -1.0], [4.0, 3.0]], [[-1.0, -1.0], [1.0, 1.0], [0.0, 5.0]]])
    cos = [[1.0, -1.0, 24 / 25], [-1.0, 2 / (2 * math.sqrt(2)), -1.0]]
    want = torch.tensor([-sum(c) / 3 for c in cos], dtype=torch.float64)
    got = alignment_loss(h, y)
    assert got.shape == (2,) and got.dtype == torch.float32
    torch.testing.assert_close(got.double(), want)
    torch.testing.assert_close(alignment_loss(h.double(), y.to(torch.bfloat16)).double(), want)
    assert alignment_loss(h.to(torch.bfloat16), y).dtype == torch.float32


# ---- the frozen encoder outside the module tree --------------------------------------------------------------------


def test_device_of_is_the_first_parameters_then_the_first_buffers_then_the_cpu():
    assert _device_of(nn.Linear(2, 2, device="meta")) == torch.device("meta")
    lin = nn.Linear(2, 2)
    lin.register_buffer("b", torch.zeros(1, device="meta"))
    assert _device_of(lin) == torch.device("cpu")  # the parameter first
    norm = nn.BatchNorm1d(2, affine=False, device="meta")  # buffers only
    assert _device_of(norm) == torch.device("meta")
    assert _device_of(nn.ReLU()) == torch.device("cpu")


def test_the_frozen_encoder_is_moved_to_the_batchs_device_once():
    enc = nn.Linear(2, 2)
    moves = []
    to = enc.to
    enc.to = lambda *a, **k: (moves.append(a), to(*a, **k))[1]
    frozen = _Frozen(enc)
    assert frozen.module is enc and frozen.device == torch.device("cpu")
    assert frozen.on(torch.device("cpu")) is enc and moves == []
    meta = torch.device("meta")
    assert frozen.on(meta) is enc and enc.weight.device == meta and frozen.device == meta
    assert frozen.on(meta) is enc and moves == [(meta,)]  # moved on first use only
    assert _Frozen(nn.Linear(2, 2, device="meta")).device == meta


# ---- the options ---------------------------------------------------------------------------------------------------


def _cfg(depth=4, in_channels=1, input_size=8, patch_size=2):
    return SimpleNamespace(
        model=SimpleNamespace(depth=depth, in_channels=in_channels, input_size=input_size, patch_size=patch_size)
    )


def test_the_options_require_an_encoder_a_block_of_the_model_and_images():
    with pytest.raises(ValueError) as err:
        REPAOptions().validate(_cfg())
    assert str(err.value) == (
        "terms.repa_encoder is required with terms.use repa: a local TorchScript file (torch.jit.save) or a "
        "safetensors file of a DINOv2-style ViT (docs/training.md, REPA from a local encoder)"
    )
    for block in (None, 0, 3):
        for c in (1, 3):
            assert REPAOptions(encoder="e.pt", block=block).validate(_cfg(in_channels=c)) is None
    with pytest.raises(ValueError) as err:
        REPAOptions(encoder="e.pt", block=4).validate(_cfg())
    assert str(err.value) == "terms.repa_block 4 must be a block of the model: 0 to 3"
    for c in (2, 4):
        with pytest.raises(ValueError) as err:
            REPAOptions(encoder="e.pt").validate(_cfg(in_channels=c))
        assert str(err.value) == (
            f"terms.use repa needs images (model.in_channels 1 or 3), got {c} channels: its encoder sees the clean "
            "image (latents would need the VAE decoder); drop repa from terms.use"
        )


def test_a_tdc_run_is_refused_and_nothing_else():
    assert REPAOptions().refusal(_cfg(), "tdc") == (
        "terms.use 'repa' trains a projector attached to the model, which TDC's pruned experts do not carry; drop it "
        "from terms.use for a TDC run"
    )
    assert REPAOptions().refusal(_cfg(), "cuda_graphs") is None and REPAOptions().refusal(_cfg(), "TDC") is None


def test_the_encoder_file_is_checked_and_read_only_when_asked(tmp_path):
    missing = tmp_path / "none.pt"
    with pytest.raises(FileNotFoundError, match="does not exist"):
        REPAOptions(encoder=str(missing)).check_inputs(_cfg(), False)
    pickled = tmp_path / "p.pt"
    torch.save(Tokens(), str(pickled))
    with pytest.raises(ValueError, match="is a pickled torch.save file"):
        REPAOptions(encoder=str(pickled)).check_inputs(_cfg(), False)
    path = str(_script(tmp_path / "enc.pt"))
    opts = REPAOptions(encoder=path, encoder_size=4)
    assert opts.check_inputs(_cfg(), False) is None  # not read: its grid is not checked
    with pytest.raises(ValueError) as err:
        opts.check_inputs(_cfg(), True)
    assert str(err.value) == (
        "terms.repa_encoder_size 4 gives a 2x2 grid of encoder patch tokens, coarser than the model's 4x4 tokens "
        "(model.input_size / model.patch_size); set terms.repa_encoder_size=8"
    )
    assert REPAOptions(encoder=path, encoder_size=8).check_inputs(_cfg(), True) is None
    assert REPAOptions(encoder=path, encoder_size=6).check_inputs(_cfg(input_size=9, patch_size=3), True) is None
    with pytest.raises(ValueError, match=r"^terms.repa_encoder_size 6 gives a 3x3 grid .* model's 4x4 tokens"):
        REPAOptions(encoder=path, encoder_size=6).check_inputs(_cfg(input_size=9, patch_size=2), True)


# ---- the term ------------------------------------------------------------------------------------------------------


def test_the_terms_defaults_are_the_official_ones():
    """Encoder size 224, projector width 2048, data scale 1, seed 0; the encoder named ``terms.repa_encoder``."""
    enc = Tokens(patch=14)
    a = REPA(32, 0, enc, model_side=16)
    b = REPA(32, 0, enc, encoder_size=224, model_side=16, projector_dim=2048, scale=1.0, seed=0)
    assert (a.encoder_size, a.model_side, a.scale, a.features) == (224, 16, 1.0, (0,))
    assert a.projector[0].weight.shape == (2048, 32)
    assert all(torch.equal(u, v) for u, v in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError) as err:
        REPA(32, 0, Returns(lambda x: RuntimeError("no")), model_side=16)
    assert str(err.value).startswith("terms.repa_encoder fails on a 2x3x224x224 batch of images (RuntimeError: no)")


def test_the_term_freezes_the_encoder_and_builds_its_projector():
    enc = Tokens().train()
    term = REPA(6, 2, enc, encoder_size=8, model_side=4, projector_dim=24, scale=0.5, seed=3)
    assert not enc.training and all(not p.requires_grad for p in enc.parameters())
    assert term.encoder is enc and term.features == (2,)
    assert (term.encoder_size, term.model_side, term.scale) == (8, 4, 0.5) and isinstance(term.scale, float)
    kinds = [type(m) for m in term.projector]
    assert kinds == [nn.Linear, nn.SiLU, nn.Linear, nn.SiLU, nn.Linear]
    shapes = [tuple(term.projector[i].weight.shape) for i in (0, 2, 4)]
    assert shapes == [(24, 6), (24, 24), (5, 24)]
    for i in (0, 2, 4):  # Xavier uniform, zero bias
        lin = term.projector[i]
        bound = math.sqrt(6 / (lin.in_features + lin.out_features))
        top = float(lin.weight.detach().abs().max())
        assert 0.6 * bound < top <= bound
        assert float(lin.bias.detach().abs().sum()) == 0.0
    other = REPA(6, 2, enc, encoder_size=8, model_side=4, projector_dim=24, seed=4)
    assert not torch.equal(term.projector[0].weight, other.projector[0].weight)
    with pytest.raises(ValueError) as err:
        REPA(6, 0, Returns(lambda x: RuntimeError("no")), encoder_size=8, model_side=4, name="E 'f'")
    assert str(err.value).startswith("E 'f' fails on a 2x3x8x8 batch of images (RuntimeError: no)")
    with pytest.raises(ValueError) as err:
        REPA(6, 0, enc, encoder_size=4, model_side=4)
    assert str(err.value) == (
        "terms.repa_encoder_size 4 gives a 2x2 grid of encoder patch tokens, coarser than the model's 4x4 tokens "
        "(model.input_size / model.patch_size); set terms.repa_encoder_size=8"
    )


def test_building_the_projector_touches_no_gpus_random_state(monkeypatch):
    """The projector's seed is forked from the host's generator only: no GPU's random state is read or written (on a
    multi-GPU node that would open a CUDA context on every GPU from every rank)."""
    touched = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_rng_state", lambda device="cuda": touched.append(device))
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device="cuda": touched.append(device))
    term = REPA(4, 0, Tokens(), encoder_size=4, model_side=2, projector_dim=3, seed=1)
    assert touched == [] and term.projector[0].weight.shape == (3, 4)


def _config(path, block=None, size=8, input_size=8, depth=9):
    return SimpleNamespace(
        terms=SimpleNamespace(
            repa_encoder=str(path), repa_block=block, repa_encoder_size=size, repa_projector_dim=6, repa_weight=0.5
        ),
        model=SimpleNamespace(hidden_size=32, depth=depth, input_size=input_size, patch_size=2, in_channels=1),
        data=SimpleNamespace(scale=0.5),
        engine=SimpleNamespace(seed=5),
    )


def test_from_config_reads_every_option(tmp_path):
    path = _script(tmp_path / "enc.pt", Tokens(dim=5))
    term = REPA.from_config(_config(path))
    assert term.features == (2,)  # depth 9: 9 // 3 - 1
    assert REPA.from_config(_config(path, block=0)).features == (0,)
    assert REPA.from_config(_config(path, block=7)).features == (7,)
    assert (term.encoder_size, term.model_side, term.scale) == (8, 4, 0.5)
    assert isinstance(term.model_side, int) and isinstance(term.encoder, torch.jit.ScriptModule)
    assert not term.encoder.training and all(not p.requires_grad for p in term.encoder.parameters())
    assert [tuple(term.projector[i].weight.shape) for i in (0, 2, 4)] == [(6, 32), (6, 6), (5, 6)]
    same = REPA(32, 2, load_encoder(path, 8), encoder_size=8, model_side=4, projector_dim=6, scale=0.5, seed=5)
    assert all(torch.equal(u, v) for u, v in zip(term.state_dict().values(), same.state_dict().values()))
    x0 = torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(0)) - 0.5
    pooled = REPA.from_config(_config(path, size=16))
    assert (pooled.encoder_size, pooled.model_side) == (16, 4)
    vit = REPA.from_config(_config(_vit(tmp_path / "vit.safetensors"), size=12))  # read at 12 pixels: 6x6 tokens
    assert vit.encoder.grid == 6 and vit.target(x0).shape == (2, 16, 64)
    odd = REPA.from_config(_config(path, size=4, input_size=5))  # 5 // 2: the model's 2x2 tokens, the encoder's
    assert odd.model_side == 2 and isinstance(odd.model_side, int)
    torch.testing.assert_close(term.target(x0), _tokens_by_hand(term.encoder, x0, 8, scale=0.5))


def test_from_config_refuses_a_missing_encoder_a_coarse_grid_and_names_the_file(tmp_path):
    with pytest.raises(ValueError) as err:
        REPA.from_config(_config(""))
    assert str(err.value) == f"terms.repa_encoder is required with terms.use repa ({WHAT})"
    path = _script(tmp_path / "enc.pt")
    with pytest.raises(ValueError) as err:
        REPA.from_config(_config(path, size=4))
    assert str(err.value) == (
        "terms.repa_encoder_size 4 gives a 2x2 grid of encoder patch tokens, coarser than the model's 4x4 tokens "
        "(model.input_size / model.patch_size); set terms.repa_encoder_size=8"
    )
    with pytest.raises(ValueError) as err:
        REPA.from_config(_config(path, size=1))
    assert str(err.value).startswith(f"{_name(path)} fails on a 2x3x1x1 batch of images (")


class Recorder(contextlib.AbstractContextManager):
    """A precision context that records when it is entered and left."""

    def __init__(self, log):
        self.log = log

    def __enter__(self):
        self.log.append("enter")

    def __exit__(self, *exc):
        self.log.append("exit")


def test_the_target_is_the_encoders_tokens_of_the_clean_images_in_the_given_precision_pooled():
    log = []
    enc = Tokens()
    enc.register_forward_pre_hook(lambda m, a: log.append(("call", torch.is_grad_enabled())))
    term = REPA(4, 0, enc, encoder_size=8, model_side=2, projector_dim=3, scale=2.0)
    x0 = 2 * (torch.rand(3, 1, 4, 4, generator=torch.Generator().manual_seed(1)) * 2 - 1)
    log.clear()
    got = term.target(x0, lambda: Recorder(log))
    assert log == ["enter", ("call", False), "exit"]
    full = _tokens_by_hand(enc, x0, 8, scale=2.0)  # (3, 16, 5): a 4x4 grid
    want = full.reshape(3, 2, 2, 2, 2, 5).mean(dim=(2, 4)).reshape(3, 4, 5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert got.dtype == torch.float32 and not got.requires_grad
    wide = Returns(lambda x: torch.ones(x.shape[0], 4, 3, dtype=torch.float64))
    assert REPA(4, 0, wide, encoder_size=4, model_side=2, projector_dim=3).target(x0).dtype == torch.float32


def test_the_target_moves_the_encoder_to_the_images_device():
    enc = Tokens()
    term = REPA(4, 0, enc, encoder_size=4, model_side=2, projector_dim=3)
    out = term.target(torch.zeros(2, 1, 4, 4, device="meta"))
    assert out.device.type == "meta" and out.shape == (2, 4, 5) and enc.proj.weight.device.type == "meta"


def _term_inputs(x0, features, autocast=contextlib.nullcontext):
    return TermInputs(x0, torch.zeros(x0.shape[0]), None, x0, 0, x0, features, autocast=autocast)


def test_the_term_aligns_the_projected_tokens_of_its_block_to_the_target_by_hand():
    """Block 1's tokens (not block 0's) through the projector, in the projector's precision, against the target."""
    enc = Tokens()
    term = REPA(4, 1, enc, encoder_size=4, model_side=2, projector_dim=3, seed=2).double()
    g = torch.Generator().manual_seed(3)
    x0 = torch.rand(2, 1, 4, 4, generator=g) * 2 - 1
    feats = {0: torch.randn(2, 4, 4, generator=g), 1: torch.randn(2, 4, 4, generator=g)}
    log = []
    got = term(_term_inputs(x0, feats, lambda: Recorder(log)))
    assert log == ["enter", "exit"] and got.shape == (2,) and got.dtype == torch.float32
    with torch.no_grad():
        h = term.projector(feats[1].double())
    y = term.target(x0).double()
    cos = (h * y).sum(-1) / (h.norm(dim=-1) * y.norm(dim=-1))
    torch.testing.assert_close(got.double(), -cos.mean(dim=1), rtol=1e-5, atol=1e-6)


def test_a_partitioned_projector_is_refused():
    """DeepSpeed ZeRO-3 leaves an empty 1-D stand-in for each weight outside the forward: refused in one line."""
    term = REPA(4, 0, Tokens(), encoder_size=4, model_side=2, projector_dim=3)
    term.projector[0].weight = nn.Parameter(torch.empty(0))
    x0 = torch.zeros(2, 1, 4, 4)
    with pytest.raises(ValueError) as err:
        term(_term_inputs(x0, {0: torch.zeros(2, 4, 4)}))
    assert str(err.value) == "terms.use repa: its projector is partitioned (ZeRO stage 3); use ZeRO stage 0 to 2"
