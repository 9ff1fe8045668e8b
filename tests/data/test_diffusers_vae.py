"""A real (tiny, random) diffusers ``AutoencoderKL`` end to end: saved with ``save_pretrained``, loaded offline by
``extract-latents`` and by ``sample --vae`` (``load_decoder``), with a latent DiT trained on the extracted latents in
between. Skipped, with the reason, when diffusers is not installed."""

import argparse

import numpy as np
import pytest
import torch
from PIL import Image

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install diffusers)")

from conftest import save_tiny_vae  # noqa: E402

from diffcurr_fast import cli_sample as sample_cli  # noqa: E402
from diffcurr_fast.data import cli_extract, extract  # noqa: E402
from diffcurr_fast.data.images import ImageDataset, ImageFolder  # noqa: E402
from diffcurr_fast.runs.recipes import load_config  # noqa: E402
from diffcurr_fast.train.loop import train  # noqa: E402


@pytest.fixture(autouse=True)
def _offline_one_thread(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return save_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae", levels=4, sample_size=32)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("imgs")
    rng = np.random.default_rng(0)
    for c in range(3):
        (root / f"c{c}").mkdir()
        for j in range(3 + c):  # 12 images of 36 x 40, centre-cropped to 32 x 32
            Image.fromarray(rng.integers(0, 256, (36, 40, 3), dtype=np.uint8)).save(root / f"c{c}" / f"{j}.png")
    return root


def _parse(add, argv):
    p = argparse.ArgumentParser()
    add(p)
    return p.parse_args([str(a) for a in argv])


def test_extract_train_and_decode_with_a_real_autoencoder(vae_dir, folder, tmp_path, capsys):
    from diffcurr_fast.data.latents import open_latents

    lat = tmp_path / "latents"
    argv = [
        "--vae",
        vae_dir,
        "--data",
        folder,
        "--out",
        lat,
        "--image-size",
        32,
        "--batch-size",
        5,
        "--mode",
        "--scale",
        0.5,
        "--dtype",
        "float32",
        "--device",
        "cpu",
        "--num-workers",
        0,
        "--no-progress",
    ]
    assert cli_extract.run(_parse(cli_extract.add_arguments, argv)) == 0
    vae = diffusers.AutoencoderKL.from_pretrained(vae_dir, local_files_only=True).eval()
    x = torch.stack([im for im, _ in ImageDataset(ImageFolder(folder), 32)])  # (12, 3, 32, 32) in [-1, 1]
    with torch.no_grad():
        want = 0.5 * vae.encode(x).latent_dist.mode()  # (12, 4, 4, 4)
    ds = open_latents(lat)
    got = np.stack([ds.read(i)[0] for i in range(len(ds))])
    assert got.shape == (12, 4, 4, 4) and [ds.read(i)[1] for i in range(12)] == [0] * 3 + [1] * 4 + [2] * 5
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-5)

    run = tmp_path / "run"
    train(
        load_config(
            None,
            [
                f"checkpoint.run_dir={run}",
                "data.dataset=latents",
                f"data.path={lat}",
                "data.scale=0.5",
                "data.backend=torch",
                "data.batch_size=4",
                "model.hidden_size=32",
                "model.depth=1",
                "model.num_heads=2",
                "model.input_size=4",
                "model.in_channels=4",
                "model.num_classes=3",
                "diffusion.num_timesteps=40",
                "curriculum.num_clusters=4",
                "engine.max_steps=2",
                "engine.device=cpu",
                "logging.progress=false",
                "logging.num_samples=0",
                "logging.plots=false",
                "checkpoint.export_ema=false",
            ],
        )
    )
    common = ["--ckpt", run, "--num", 5, "--steps", 3, "--device", "cpu", "--seed", 3]
    assert sample_cli.run(_parse(sample_cli.add_arguments, [*common, "--out", tmp_path / "z.npz"])) == 0
    z = torch.from_numpy(np.load(tmp_path / "z.npz")["x"])  # (5, 4, 4, 4): unscaled latents
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint
    from diffcurr_fast.runs.config import config_from_dict
    from diffcurr_fast.runs.sampling import build_model, build_schedule, sample, sampling_readout

    state = load_checkpoint(latest_checkpoint(run))
    cfg = config_from_dict(state["config"])
    model = build_model(cfg)
    model.load_state_dict(state["ema"]["module"])
    direct = sample(
        model.eval(),
        build_schedule(cfg),
        sampler="ddim",
        steps=3,
        labels=torch.arange(5) % 3,
        channels=4,
        size=4,
        num_classes=3,
        readout=sampling_readout(cfg),
        seed=3,
    )
    torch.testing.assert_close(z, direct / 0.5)  # the model's samples are 0.5 z: the decoder gets z
    argv = [*common, "--out", tmp_path / "img.npz", "--vae", vae_dir, "--vae-batch", 2]
    assert sample_cli.run(_parse(sample_cli.add_arguments, argv)) == 0
    img = np.load(tmp_path / "img.npz")  # decoded images: the ADM layout, uint8 (N, H, W, C) and the labels
    with torch.no_grad():
        ref = vae.decode(z).sample.clamp(-1, 1)
    from diffcurr_fast.runs.sampling import to_uint8_nhwc

    assert img["arr_0"].shape == (5, 32, 32, 3) and img["arr_0"].dtype == np.uint8 and img["arr_0"].max() > 0
    assert img["arr_1"].tolist() == (torch.arange(5) % 3).tolist()
    diff = img["arr_0"].astype(np.int16) - to_uint8_nhwc(ref).numpy().astype(np.int16)
    assert np.abs(diff).max() <= 1  # the same decoded images (1: float rounding at a .5 boundary)
    dec = extract.load_decoder(str(vae_dir), torch.device("cpu"))
    assert isinstance(dec, diffusers.AutoencoderKL) and not dec.training
    torch.testing.assert_close(extract.decode_latents(dec, z, batch=3), ref, rtol=1e-4, atol=1e-5)
    argv = [*common, "--out", tmp_path / "g.png", "--vae", vae_dir]
    assert sample_cli.run(_parse(sample_cli.add_arguments, argv)) == 0
    assert Image.open(tmp_path / "g.png").size[0] > 32
