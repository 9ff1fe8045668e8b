import argparse
import importlib.util
import re
import sys

import numpy as np
import pytest
import torch
from conftest import _main
from PIL import Image
from torch import nn

from diffcurr_fast.data import cli_extract
from diffcurr_fast.data.extract import encode_latents, extract_latents
from diffcurr_fast.data.images import ImageDataset, ImageFolder
from diffcurr_fast.data.latents import open_latents


class _Posterior:
    """Diagonal Gaussian with diffusers' ``sample(generator=)`` / ``mode()`` interface."""

    def __init__(self, moments):
        self.mean, logvar = moments.chunk(2, dim=1)
        self.std = torch.exp(0.5 * logvar.clamp(-30, 20))

    def sample(self, generator=None):
        noise = torch.randn(self.mean.shape, generator=generator, device=self.mean.device, dtype=self.mean.dtype)
        return self.mean + self.std * noise

    def mode(self):
        return self.mean


class _Encoded:
    def __init__(self, moments):
        self.latent_dist = _Posterior(moments)


class TinyVAE(nn.Module):
    """Stand-in for ``AutoencoderKL``: ``encode(x).latent_dist`` with 4 latent channels at 1/8 resolution."""

    def __init__(self, fail_after=None):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, kernel_size=8, stride=8)
        self.calls, self.fail_after = 0, fail_after

    def encode(self, x):
        self.calls += 1
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("simulated crash")
        return _Encoded(self.conv(x))  # (B, 8, H/8, W/8)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    for c in range(2):
        (root / f"c{c}").mkdir()
        for j in range(6 + c):  # 13 images: not a multiple of the batch or shard size
            Image.fromarray(rng.integers(0, 256, (16, 20, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{j}.png")
    return root


@pytest.mark.parametrize("layout", ["sharded", "fastdit"])
def test_extract_matches_direct_encoding(folder, tmp_path, layout):
    vae = TinyVAE()
    n = extract_latents(
        vae,
        folder,
        tmp_path / "out",
        image_size=16,
        batch_size=3,
        layout=layout,
        shard_size=4,
        dtype="float32",
        sample=False,
        progress=False,
    )
    assert n == 13
    ds = open_latents(tmp_path / "out")
    images = ImageDataset(ImageFolder(folder), 16)
    x = torch.stack([images[i][0] for i in range(13)])  # (13, 3, 16, 16)
    ref = encode_latents(vae, x, sample=False).numpy()  # (13, 4, 2, 2)
    got = np.stack([ds.read(i)[0] for i in range(13)])
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert [ds.read(i)[1] for i in range(13)] == [0] * 6 + [1] * 7
    np.testing.assert_allclose(ref, 0.18215 * vae.encode(x).latent_dist.mode().detach().numpy(), rtol=1e-6)


@pytest.mark.parametrize("layout", ["sharded", "fastdit"])
def test_extract_resumes_after_a_crash(folder, tmp_path, layout):
    kwargs = dict(image_size=16, batch_size=3, layout=layout, shard_size=4, dtype="float32", seed=5, progress=False)
    extract_latents(TinyVAE(), folder, tmp_path / "full", hflip=True, **kwargs)
    with pytest.raises(RuntimeError, match="simulated crash"):
        extract_latents(TinyVAE(fail_after=2), folder, tmp_path / "part", hflip=True, **kwargs)
    assert len(open_latents(tmp_path / "part")) == (4 if layout == "sharded" else 6)
    assert extract_latents(TinyVAE(), folder, tmp_path / "part", hflip=True, **kwargs) == 13
    full, part = open_latents(tmp_path / "full"), open_latents(tmp_path / "part")
    for i in range(13):
        np.testing.assert_array_equal(full.read(i)[0], part.read(i)[0])
        assert full.read(i)[1] == part.read(i)[1]
    # a finished extraction is not redone
    vae = TinyVAE()
    assert extract_latents(vae, folder, tmp_path / "full", hflip=True, **kwargs) == 13 and vae.calls == 0


def test_extract_errors(folder, tmp_path):
    with pytest.raises(ValueError, match="layout must be one of"):
        extract_latents(TinyVAE(), folder, tmp_path, layout="lmdb")
    empty = tmp_path / "empty" / "c"
    empty.mkdir(parents=True)
    with pytest.raises(ValueError, match="no usable images"):
        extract_latents(TinyVAE(), empty.parent, tmp_path / "o", progress=False)


def test_cli_without_diffusers(folder, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers raises ImportError, installed or not
    parser = argparse.ArgumentParser()
    cli_extract.add_arguments(parser)
    args = parser.parse_args(["--vae", str(tmp_path), "--data", str(folder), "--out", str(tmp_path / "o")])
    assert cli_extract.run(args) == 2
    assert "pip install diffusers" in capsys.readouterr().err


def test_a_rerun_with_other_options_is_refused(folder, tmp_path):
    """A rerun into the same folder resumes the same extraction; one with another image size, mode, dtype, seed, flip
    or data, or the other layout, is refused in one line and leaves the latents as they were."""
    kw = dict(image_size=16, batch_size=3, layout="sharded", shard_size=4, dtype="float32", progress=False)
    out = tmp_path / "out"
    assert extract_latents(TinyVAE(), folder, out, **kw) == 13
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir() if p.is_file())
    for change, word in (
        ({"image_size": 24}, "image_size 16 (now 24)"),
        ({"sample": False}, "sample True (now False)"),
        ({"dtype": "float16"}, "dtype 'float32' (now 'float16')"),
        ({"seed": 3}, "seed 0 (now 3)"),
        ({"hflip": True}, "hflip False (now True)"),
    ):
        with pytest.raises(
            ValueError, match=rf"holds latents extracted with other options: {re.escape(word)}; a rerun"
        ):
            extract_latents(TinyVAE(), folder, out, **{**kw, **change})
    with pytest.raises(ValueError, match="holds latents of the sharded layout; give another --out"):
        extract_latents(TinyVAE(), folder, out, **{**kw, "layout": "fastdit"})
    assert sorted((p.name, p.read_bytes()) for p in out.iterdir() if p.is_file()) == before
    vae = TinyVAE()
    assert extract_latents(vae, folder, out, **kw) == 13 and vae.calls == 0  # the same command: nothing to redo
    fast = tmp_path / "fast"
    extract_latents(TinyVAE(), folder, fast, **{**kw, "layout": "fastdit"})
    with pytest.raises(ValueError, match="holds latents of the fastdit layout"):
        extract_latents(TinyVAE(), folder, fast, **kw)


@pytest.mark.skipif(importlib.util.find_spec("diffusers") is None, reason="diffusers is not installed")
def test_cli_checks_vae_data_and_out_before_loading_the_vae(folder, tmp_path, capsys, monkeypatch):
    """extract-latents checks the VAE folder's config, --data and --out (can be written, no latents of other options)
    before it loads the VAE (it loaded it first); a folder that is not an AutoencoderKL is one line naming it."""
    from diffcurr_fast import _files
    from diffcurr_fast.data import extract

    dit = tmp_path / "dit"  # a diffusers export's transformer: diffusers loaded it as a VAE of random weights
    dit.mkdir()
    (dit / "config.json").write_text('{"_class_name": "DiTTransformer2DModel", "sample_size": 8}')
    with pytest.raises(ValueError, match=r"^VAE directory '.*dit' is not a diffusers AutoencoderKL \(its config"):
        extract.load_vae(dit)  # sample --vae and eval --vae load with it too
    (tmp_path / "pipe" / "vae").mkdir(parents=True)  # a DiTPipeline: its VAE is in vae/
    (tmp_path / "pipe" / "vae" / "config.json").write_text('{"_class_name": "AutoencoderKL"}')
    loaded = []
    monkeypatch.setattr(extract, "load_vae", lambda path, device: loaded.append(path) or TinyVAE())
    vae = tmp_path / "pipe" / "vae"
    flags = ("--image-size", "16", "--batch-size", "4", "--num-workers", "0", "--no-progress")

    def main(vae_dir, data, out, *extra):
        argv = ["--vae", str(vae_dir), "--data", str(data), "--out", str(out), *flags, *extra]
        return _main(capsys, "extract-latents", *argv)

    def refuse(*a, **k):  # a read-only folder (as root, permissions alone do not tell)
        raise PermissionError(13, "Permission denied")

    rc, err = main(dit, folder, tmp_path / "o")
    assert rc == 2 and "describes a DiTTransformer2DModel" in err and len(err.strip().splitlines()) == 1, err
    rc, err = main(vae.parent, folder, tmp_path / "o")
    assert rc == 2 and f"no diffusers config.json naming one); its VAE is the folder '{vae}'" in err, err
    rc, err = main(vae, tmp_path / "nope", tmp_path / "o")
    assert rc == 2 and "--data '" in err and "nope' does not exist; give the image folder" in err, err
    (tmp_path / "notes.txt").write_text("mine")
    rc, err = main(vae, folder, tmp_path / "notes.txt" / "o")
    assert rc == 2 and "notes.txt' is a file, not a directory; give another --out" in err, err
    with monkeypatch.context() as mp:
        mp.setattr(_files.tempfile, "mkdtemp", refuse)
        rc, err = main(vae, folder, tmp_path / "ro")
    assert rc == 2 and "cannot be written" in err and "(Permission denied); give another --out" in err, err
    assert loaded == [] and not (tmp_path / "ro").exists()
    assert main(vae, folder, tmp_path / "o")[0] == 0 and loaded == [str(vae)]
    rc, err = main(vae, folder, tmp_path / "o", "--seed", "3")
    assert rc == 2 and "holds latents extracted with other options: seed 0 (now 3)" in err, err
    assert loaded == [str(vae)]  # the refused rerun did not load the VAE
