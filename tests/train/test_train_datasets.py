"""Trainer data backends (latents in both layouts, image folders; torch and DALI), exact resume through the sharded
loader, fine-tuning from a state dict (``model.init_from``), and ``sample --vae`` decoding."""

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TORCHRUN2, assert_resumed_state
from PIL import Image
from torch import nn

from diffcurr_fast import cli_sample
from diffcurr_fast.data.latents import FastDiTLatentWriter, ShardedLatentWriter
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.runs.sampling import build_model
from diffcurr_fast.train.data import build_train_batches, load_init_weights, read_init_state
from diffcurr_fast.train.loop import Trainer, train

HAS_DALI = importlib.util.find_spec("nvidia") is not None and importlib.util.find_spec("nvidia.dali") is not None
BACKENDS = ["torch", pytest.param("dali", marks=pytest.mark.skipif(not HAS_DALI, reason="DALI not installed"))]
N_LATENTS, N_CLASSES = 11, 3  # 11 samples, batch 4: 2 batches per epoch, a 3-sample tail dropped


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def latents(tmp_path_factory):
    """The same 11 latents (4x4x4, stored as 0.5 z) in the fast-DiT and the sharded layout."""
    root = tmp_path_factory.mktemp("lat")
    rng = np.random.default_rng(0)
    z = rng.standard_normal((N_LATENTS, 4, 4, 4)).astype(np.float32)
    y = rng.integers(0, N_CLASSES, N_LATENTS)
    w = FastDiTLatentWriter(root / "fastdit")
    w.write(0.5 * z, y)
    w.close()
    w = ShardedLatentWriter(root / "sharded", (4, 4, 4), shard_size=4, dtype="float32", scale=0.5)
    w.write(0.5 * z, y)
    w.close()
    return {"fastdit": root / "fastdit", "sharded": root / "sharded", "z": z, "y": y}


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """An ImageNet-layout folder: 2 classes, 9 PNGs of 10x12 (centre-cropped to 8x8)."""
    root = tmp_path_factory.mktemp("img")
    rng = np.random.default_rng(1)
    for c in range(2):
        (root / f"class{c}").mkdir()
        for j in range(4 + c):
            Image.fromarray(rng.integers(0, 256, (10, 12, 3), dtype=np.uint8)).save(root / f"class{c}" / f"{j}.png")
    return root


def tiny(run_dir, *extra):
    return load_config(
        None,
        [
            f"checkpoint.run_dir={run_dir}",
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            "model.input_size=4",
            "model.in_channels=4",
            "model.num_classes=3",
            "diffusion.num_timesteps=40",
            "curriculum.num_clusters=4",
            "curriculum.patience=1",
            "curriculum.eval_every=2",
            "data.batch_size=4",
            "data.scale=0.5",
            "engine.max_steps=3",
            "engine.device=cpu",
            "logging.log_every=1",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
            "checkpoint.export_ema=false",
            *extra,
        ],
    )


def _latent_cfg(run_dir, path, *extra):
    return tiny(run_dir, "data.dataset=latents", f"data.path={path}", *extra)


@pytest.mark.parametrize("layout", ["fastdit", "sharded"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_latents_train(tmp_path, latents, layout, backend):
    cfg = _latent_cfg(tmp_path / "run", latents[layout], f"data.backend={backend}")
    tr = Trainer(cfg)
    assert tr.loader.loader.backend == backend
    init = {k: v.clone() for k, v in tr.model.state_dict().items()}
    shapes = []
    tr.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    summary = tr.fit()
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
    assert shapes == [(4, 4, 4, 4)] * 3  # one batch of 4 latents (4 x 4 x 4) per step
    state = torch.load(tmp_path / "run" / "checkpoints" / "ckpt_00000003.pt", weights_only=True)
    moved = [k for k, v in state["model"].items() if v.is_floating_point() and not torch.equal(v, init[k])]
    assert "final_layer.linear.weight" in moved and "x_embedder.proj.weight" in moved  # trained end to end
    assert not torch.equal(
        state["ema"]["module"]["final_layer.linear.weight"], state["model"]["final_layer.linear.weight"]
    )
    # 3 batches of 4 from 2 per epoch: epoch 1, 4 samples consumed in it
    pos = state["data"]["ranks"][0]
    assert state["data"]["kind"] == "sharded" and (pos["epoch"], pos["start"], pos["shard_id"]) == (1, 4, 0)


def test_latent_batches_are_the_data(latents):
    """Both layouts give the same batches: 0.5 z, the model trains on data.scale * z; labels checked."""
    ref = None
    for layout in ("fastdit", "sharded"):
        cfg = _latent_cfg("unused", latents[layout], "data.backend=torch")
        b = build_train_batches(cfg)
        got = [next(b) for _ in range(5)]  # crosses two epoch boundaries
        seen = torch.cat([y for _, y in got[:2]])
        assert len(got[0][0]) == 4 and seen.dtype == torch.int64
        idx = b.loader.keys(0)[0][:8]
        torch.testing.assert_close(torch.cat([x for x, _ in got[:2]]), torch.from_numpy(0.5 * latents["z"][idx]))
        assert torch.equal(seen, torch.from_numpy(latents["y"][idx]))
        if ref is not None:
            assert all(torch.equal(a[0], c[0]) and torch.equal(a[1], c[1]) for a, c in zip(got, ref))
        ref = got
    # a sharded index written at scale 0.5 is rescaled to data.scale = 1 (raw z); fast-DiT is taken as scaled
    x, _ = next(build_train_batches(_latent_cfg("unused", latents["sharded"], "data.scale=1.0", "data.backend=torch")))
    xf, _ = next(build_train_batches(_latent_cfg("unused", latents["fastdit"], "data.scale=1.0", "data.backend=torch")))
    torch.testing.assert_close(x, 2.0 * xf)
    with pytest.raises(ValueError, match="data has label 2 but model.num_classes is 2"):
        b = build_train_batches(_latent_cfg("unused", latents["sharded"], "model.num_classes=2", "data.backend=torch"))
        for _ in range(3):
            next(b)


def test_ranks_split_the_epoch(latents):
    cfg = _latent_cfg("unused", latents["sharded"], "data.backend=torch")
    parts = [build_train_batches(cfg, r, 2) for r in range(2)]
    ys = [next(p)[1] for p in parts]
    assert all(len(y) == 2 for y in ys)  # per-rank batch = global 4 / 2 ranks
    keys = [set(p.loader.keys(0)[0].tolist()) for p in parts]
    assert not keys[0] & keys[1] and len(keys[0] | keys[1]) == 8  # disjoint; 11 // 2 = 5 each, 2 full batches
    with pytest.raises(ValueError, match="11 usable samples, 5 per rank: fewer than one per-rank batch of 6"):
        build_train_batches(_latent_cfg("unused", latents["sharded"], "data.batch_size=12", "data.backend=torch"), 0, 2)


@pytest.mark.parametrize("layout", ["fastdit", "sharded"])
def test_latents_resume_exact(tmp_path, latents, layout):
    """2 steps + resume + 3 steps == 5 steps, bit for bit (the data position crosses two epochs)."""
    full = Trainer(_latent_cfg(tmp_path / "full", latents[layout], "engine.max_steps=5", "data.backend=torch"))
    full.fit()
    part = _latent_cfg(tmp_path / "part", latents[layout], "engine.max_steps=2", "data.backend=torch")
    Trainer(part).fit()
    resumed = Trainer(
        _latent_cfg(tmp_path / "part", latents[layout], "engine.max_steps=5", "data.backend=torch"), resume=True
    )
    pos = resumed.loader.state_dict()
    assert resumed.step == 2 and (pos["epoch"], pos["start"]) == (0, 8)  # the end of epoch 0
    resumed.fit()
    assert_resumed_state(full, resumed)
    # an npz run's data position cannot be resumed as latents, nor the other way round
    npz = tmp_path / "arrays"
    npz.mkdir()
    np.save(npz / "x.npy", latents["z"])
    np.save(npz / "y.npy", latents["y"])
    Trainer(tiny(tmp_path / "n", "data.dataset=npz", f"data.path={npz}", "engine.max_steps=1")).fit()
    with pytest.raises(ValueError, match="data position is of the digits/npz loader, this run reads"):
        Trainer(_latent_cfg(tmp_path / "n", latents[layout], "data.backend=torch"), resume=True)
    with pytest.raises(ValueError, match="data position is of data.dataset latents/images, this run reads 'npz'"):
        Trainer(tiny(tmp_path / "part", "data.dataset=npz", f"data.path={npz}", "engine.max_steps=6"), resume=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_images_train(tmp_path, images, backend):
    cfg = tiny(
        tmp_path / "run",
        "data.dataset=images",
        f"data.path={images}",
        "model.in_channels=3",
        "model.input_size=8",
        "data.scale=1.0",
        f"data.backend={backend}",
        "data.image_size=8",
        "logging.num_samples=4",
        "logging.sample_steps=2",
    )
    tr = Trainer(cfg)
    x, y = next(tr.loader)
    assert x.shape == (4, 3, 8, 8) and float(x.abs().max()) <= 1.0 and set(y.tolist()) <= {0, 1}
    tr.loader.load_state_dict({**tr.loader.state_dict(), "epoch": 0, "start": 0})
    init = tr.model.final_layer.linear.weight.detach().clone()
    shapes = []
    tr.model.register_forward_pre_hook(lambda m, a: shapes.append(tuple(a[0].shape)))
    summary = tr.fit()
    assert summary["step"] == 3 and np.isfinite(summary["loss"])
    assert shapes[:3] == [(4, 3, 8, 8)] * 3  # three training batches of RGB 8 x 8 images, then sampling
    assert not torch.equal(tr.model.final_layer.linear.weight, init)
    grid = Image.open(tmp_path / "run" / "samples.png")
    assert grid.size == ((3 * 9 + 1) * 4, (2 * 9 + 1) * 4)  # 4 samples, 3 per row (3 classes), 8 px + 1 pad, x4


def test_images_flip_and_bad_files(tmp_path, images):
    cfg = tiny(
        "unused",
        "data.dataset=images",
        f"data.path={images}",
        "model.in_channels=3",
        "model.input_size=8",
        "data.backend=torch",
        "data.scale=1.0",
    )
    on = build_train_batches(cfg)
    cfg.data.hflip = False
    off = build_train_batches(cfg)
    xa, ya = next(on)
    xb, yb = next(off)
    flips = on.loader.keys(0)[1][:4]
    assert torch.equal(ya, yb) and flips.any()
    torch.testing.assert_close(xa[~torch.from_numpy(flips)], xb[~torch.from_numpy(flips)])
    torch.testing.assert_close(xa[torch.from_numpy(flips)], xb[torch.from_numpy(flips)].flip(-1))
    bad = tmp_path / "bad"
    for c in range(2):
        (bad / f"c{c}").mkdir(parents=True)
        for j in range(3):
            Image.fromarray(np.full((8, 8, 3), 40 * j, np.uint8)).save(bad / f"c{c}" / f"{j}.png")
    (bad / "c0" / "broken.png").write_bytes(b"\x89PNG not really")
    cfg.data.path = str(bad)
    with pytest.raises(ValueError, match="broken.png"):
        build_train_batches(cfg)
    cfg.data.on_bad = "skip"
    with pytest.warns(UserWarning, match="skipped 1 bad file"):
        b = build_train_batches(cfg)
    assert len(b.source) == 6 and next(b)[0].shape == (4, 3, 8, 8)


def test_data_config_errors(tmp_path):
    with pytest.raises(ValueError, match="data.path is required when data.dataset is 'latents'"):
        tiny(tmp_path, "data.dataset=latents")
    with pytest.raises(ValueError, match="invalid value 'nvjpeg' for data.backend; valid choices: auto, dali, torch"):
        tiny(tmp_path, "data.backend=nvjpeg")
    with pytest.raises(ValueError, match="invalid value 'ignore' for data.on_bad; valid choices: skip, stop"):
        tiny(tmp_path, "data.on_bad=ignore")
    with pytest.raises(ValueError, match="set model.in_channels=3, model.input_size=16"):
        tiny(tmp_path, "data.dataset=images", "data.path=x", "model.in_channels=3", "data.image_size=16")


def test_backend_auto_picks_dali_only_on_a_gpu(latents, monkeypatch):
    from diffcurr_fast.data import dali

    cfg = _latent_cfg("unused", latents["sharded"], "data.dali_py_workers=3")
    assert cfg.data.backend == "auto"
    gpu = torch.device("cuda", 0)  # the loader is only built here (nothing runs on the device)
    on_gpu = build_train_batches(cfg, device=gpu).loader
    assert on_gpu.backend == ("dali" if HAS_DALI else "torch")
    assert on_gpu.device_id == (0 if HAS_DALI else None)
    assert on_gpu.dali_py_workers == 3  # the trainer passes the parallel-worker setting through
    assert build_train_batches(cfg, device=torch.device("cpu")).loader.backend == "torch"  # a CPU run: DataLoader
    assert build_train_batches(cfg).loader.backend == "torch"
    monkeypatch.setattr(dali, "dali_available", lambda: False)
    assert build_train_batches(cfg, device=gpu).loader.backend == "torch"


def test_latent_shape_must_match_model(latents):
    with pytest.raises(ValueError, match="holds latents 4x4x4 but model.in_channels x model.input_size\\^2 is 4x8x8"):
        build_train_batches(_latent_cfg("unused", latents["fastdit"], "model.input_size=8"))


# ---- fine-tuning ----------------------------------------------------------------------------------------
def _tiny_dit_state(cfg, seed):
    torch.manual_seed(seed)
    return {k: v.clone() for k, v in build_model(cfg).state_dict().items()}


@pytest.mark.parametrize("fmt", ["pt", "safetensors", "checkpoint"])
def test_init_from(tmp_path, latents, fmt):
    cfg = _latent_cfg(tmp_path / "run", latents["sharded"], "data.backend=torch", "engine.max_steps=1")
    state = _tiny_dit_state(cfg, seed=123)
    if fmt == "pt":
        path = tmp_path / "DiT-tiny.pt"
        torch.save(state, path)
    elif fmt == "safetensors":
        from safetensors.torch import save_file

        path = tmp_path / "ema.safetensors"
        save_file(state, str(path))
    else:  # a training checkpoint (DiT's train.py layout): the EMA weights are taken
        path = tmp_path / "ckpt.pt"
        torch.save({"model": {k: v + 1 for k, v in state.items()}, "ema": state}, path)
    cfg.model.init_from = str(path)
    tr = Trainer(cfg)
    for k, v in tr.model.state_dict().items():
        assert torch.equal(v, state[k]), k
    for k, v in tr.ema.module.state_dict().items():  # the EMA starts from the loaded weights
        assert torch.equal(v, state[k]), k
    tr.fit()
    # on resume the checkpoint wins: init_from (even another file) is ignored
    trained = {k: v.clone() for k, v in tr.model.state_dict().items()}
    other = tmp_path / "other.pt"
    torch.save(_tiny_dit_state(cfg, seed=7), other)
    cfg2 = _latent_cfg(tmp_path / "run", latents["sharded"], "data.backend=torch", f"model.init_from={other}")
    resumed = Trainer(cfg2, resume=True)
    assert resumed.step == 1
    for k, v in resumed.model.state_dict().items():
        assert torch.equal(v, trained[k]), k


def test_init_from_errors(tmp_path, latents):
    cfg = _latent_cfg(tmp_path / "run", latents["sharded"])
    model = build_model(cfg)
    wider = _tiny_dit_state(tiny("unused", "model.hidden_size=48"), seed=0)
    torch.save(wider, tmp_path / "wide.pt")
    with pytest.raises(ValueError, match=r"does not fit the model: \d+ shape mismatches: \S+ \(1, \d+, 48\) vs model"):
        load_init_weights(model, tmp_path / "wide.pt")
    state = dict(_tiny_dit_state(cfg, seed=0))
    state.pop("final_layer.linear.bias")
    state["extra.weight"] = torch.zeros(1)
    torch.save(state, tmp_path / "keys.pt")
    with pytest.raises(ValueError, match="1 missing keys: final_layer.linear.bias; 1 unexpected keys: extra.weight"):
        load_init_weights(model, tmp_path / "keys.pt")
    torch.save({"args": argparse.Namespace(lr=1)}, tmp_path / "pickled.pt")
    with pytest.raises(ValueError, match="is corrupt or not a weights-only torch file") as e:
        read_init_state(tmp_path / "pickled.pt")
    assert "weights_only=False" not in str(e.value) and "two options" not in str(e.value)  # no unsafe advice
    with pytest.raises(FileNotFoundError, match="model.init_from .* does not exist"):
        read_init_state(tmp_path / "nope.pt")
    torch.save({f"module.{k}": v for k, v in _tiny_dit_state(cfg, seed=3).items()}, tmp_path / "ddp.pt")
    load_init_weights(model, tmp_path / "ddp.pt")  # DDP prefix stripped
    assert torch.equal(
        model.state_dict()["final_layer.linear.bias"], _tiny_dit_state(cfg, seed=3)["final_layer.linear.bias"]
    )


# ---- sample --vae --------------------------------------------------------------------------------------
class TinyDecoder(nn.Module):
    """Stand-in for ``AutoencoderKL``: ``decode(z).sample`` (B, 3, 8H, 8W); remembers its inputs."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.ConvTranspose2d(4, 3, kernel_size=8, stride=8)
        self.inputs = []

    def decode(self, z):
        self.inputs.append(z.clone())
        return argparse.Namespace(sample=torch.tanh(self.conv(z)) * 1.5)


def _sample_args(ckpt, out, *extra):
    parser = argparse.ArgumentParser()
    cli_sample.add_arguments(parser)
    return parser.parse_args(
        ["--ckpt", str(ckpt), "--out", str(out), "--num", "5", "--steps", "3", "--device", "cpu", *extra]
    )


def test_sample_vae_decodes(tmp_path, latents, monkeypatch):
    from diffcurr_fast.data import extract

    run = tmp_path / "run"
    train(_latent_cfg(run, latents["sharded"], "data.backend=torch", "engine.max_steps=1"))
    assert cli_sample.run(_sample_args(run, tmp_path / "lat.npz")) == 0
    z = torch.from_numpy(np.load(tmp_path / "lat.npz")["x"])  # (5, 4, 4, 4): model samples / data.scale
    dec = TinyDecoder()
    calls = []
    monkeypatch.setattr(extract, "load_vae", lambda path, device: calls.append(path) or dec)
    assert cli_sample.run(_sample_args(run, tmp_path / "img.npz", "--vae", "vae_dir", "--vae-batch", "2")) == 0
    x = torch.from_numpy(np.load(tmp_path / "img.npz")["arr_0"])  # decoded images: ADM's uint8 (N, H, W, C)
    assert calls == ["vae_dir"] and x.shape == (5, 32, 32, 3) and [len(i) for i in dec.inputs] == [2, 2, 1]
    torch.testing.assert_close(torch.cat(dec.inputs), z)  # the decoder saw the latents divided by data.scale
    with torch.no_grad():
        want = ((dec.decode(z).sample.clamp(-1, 1) + 1) * 127.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
    assert (x.int() - want.int()).abs().max() <= 1  # float rounding at a quantisation edge
    assert cli_sample.run(_sample_args(run, tmp_path / "img.png", "--vae", "vae_dir")) == 0
    assert Image.open(tmp_path / "img.png").mode in ("RGB", "RGBA")
    with pytest.raises(ValueError, match="a PNG grid needs 1- or 3-channel data, this model has 4"):
        cli_sample.run(_sample_args(run, tmp_path / "lat.png"))


def test_sample_vae_without_diffusers(tmp_path, monkeypatch):
    from diffcurr_fast.data import extract

    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers raises ImportError, installed or not
    with pytest.raises(ImportError, match="sample --vae needs diffusers to decode latents: pip install diffusers"):
        extract.load_decoder(str(tmp_path), torch.device("cpu"))


# ---- recipes ---------------------------------------------------------------------------------------------
RECIPES = Path(__file__).resolve().parents[2] / "diffcurr_fast" / "recipes"
SMALL = [
    "model.preset=custom",
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "engine.max_steps=2",
    "engine.precision=fp32",
    "engine.device=cpu",
    "data.num_workers=0",
    "data.backend=torch",
    "data.batch_size=4",
    "logging.progress=false",
    "logging.plots=false",
    "checkpoint.export_ema=false",
]


def test_edm_cifar10_recipe(tmp_path, images):
    cfg = load_config(f"{RECIPES}/edm_cifar10.yaml")
    d, o = cfg.diffusion, cfg.optim
    assert (d.formulation, d.prediction, d.sigma_data, d.P_mean, d.P_std, d.sigma_min, d.sigma_max) == (
        "edm",
        "x0",
        0.5,
        -1.2,
        1.2,
        0.002,
        80.0,
    )
    assert (cfg.data.dataset, cfg.data.batch_size, o.lr, o.weight_decay, cfg.engine.max_steps) == (
        "images",
        512,
        1e-3,
        0.0,
        390625,
    )
    assert o.ema_decay == pytest.approx(0.5 ** (512 / 500_000), abs=1e-5) and o.warmup_steps == 10_000_000 // 512
    assert (cfg.model.in_channels, cfg.model.input_size, cfg.logging.sampler, cfg.logging.sample_steps) == (
        3,
        32,
        "heun",
        18,
    )
    small = [
        *SMALL,
        f"data.path={images}",
        "model.input_size=8",
        "data.image_size=8",
        "logging.num_samples=2",
        "logging.sample_steps=2",
        f"checkpoint.run_dir={tmp_path / 'r'}",
    ]
    run = load_config(f"{RECIPES}/edm_cifar10.yaml", small)
    summary = train(run)
    assert summary["step"] == 2 and np.isfinite(summary["loss"])


def test_sit_b2_ffhq256_recipe(tmp_path, latents):
    cfg = load_config(f"{RECIPES}/sit_b2_ffhq256.yaml")
    d, o = cfg.diffusion, cfg.optim
    assert (d.formulation, d.prediction, d.learn_sigma, cfg.model.preset) == ("flow", "velocity", False, "DiT-B/2")
    assert (cfg.data.dataset, cfg.data.scale, cfg.data.batch_size, o.lr, o.weight_decay, o.ema_decay) == (
        "latents",
        0.18215,
        256,
        1e-4,
        0.0,
        0.9999,
    )
    assert (cfg.model.in_channels, cfg.model.input_size, cfg.model.num_classes) == (4, 32, 1)
    run = load_config(
        f"{RECIPES}/sit_b2_ffhq256.yaml",
        [
            *SMALL,
            f"data.path={latents['sharded']}",
            "model.input_size=4",
            "model.num_classes=3",
            f"checkpoint.run_dir={tmp_path / 'r'}",
        ],
    )
    summary = train(run)
    assert summary["step"] == 2 and np.isfinite(summary["loss"])


DDP_SCRIPT = """
import json, sys, torch
torch.set_num_threads(1)
sys.path.insert(0, sys.argv[4])  # tests/, for conftest
from conftest import assert_resumed_state
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.engine import create_engine
from diffcurr_fast.train.loop import Trainer

data, root, out = sys.argv[1], sys.argv[2], sys.argv[3]
def cfg(run, steps):
    return load_config(None, [f"checkpoint.run_dir={root}/{run}", "model.hidden_size=32", "model.depth=1",
        "model.num_heads=2", "model.input_size=4", "model.in_channels=4", "model.num_classes=3",
        "diffusion.num_timesteps=40", "curriculum.num_clusters=4", "curriculum.eval_every=2", "data.batch_size=4",
        "data.dataset=latents", f"data.path={data}", "data.backend=torch", "data.scale=0.5", "logging.progress=false",
        "logging.num_samples=0", "logging.plots=false", "checkpoint.export_ema=false", "engine.kind=ddp",
        "engine.device=cpu", f"engine.max_steps={steps}"])
def run(engine):  # the trainers (and their DDP reducers) die on return, before the process group is destroyed
    full = Trainer(cfg("full", 4), engine)
    full.fit()
    Trainer(cfg("part", 2), engine).fit()
    resumed = Trainer(cfg("part", 4), engine, resume=True)
    pos = resumed.loader.state_dict()
    resumed.fit()
    whole, part = full.state_dict(), resumed.state_dict()  # every rank's RNG streams and data position, gathered
    try:
        assert_resumed_state(whole, part)
        same = True
    except AssertionError as exc:
        same = str(exc)
    return {"same": same, "shard": pos["shard_id"], "epoch": pos["epoch"], "start": pos["start"]}
engine = create_engine("ddp", "cpu")
res = run(engine)
with open(f"{out}.{engine.rank}.json", "w") as fh:
    json.dump(res, fh)
engine.close()
"""


@pytest.mark.slow
def test_latents_ddp_two_ranks_resume(tmp_path, latents):
    """2 gloo ranks read disjoint shards; 2 steps + resume + 2 steps equals 4 steps on both ranks."""
    import json
    import os
    import subprocess

    script = tmp_path / "ddp_latents.py"
    script.write_text(DDP_SCRIPT)
    cmd = [
        *TORCHRUN2,
        str(script),
        str(latents["sharded"]),
        str(tmp_path),
        str(tmp_path / "res"),
        str(Path(__file__).resolve().parents[1]),
    ]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"res.{r}.json").read_text()) for r in (0, 1))
    assert r0["same"] is True and r1["same"] is True, (r0["same"], r1["same"])
    assert (r0["shard"], r1["shard"]) == (0, 1)  # each rank resumed its own shard's position
    assert (r0["epoch"], r0["start"]) == (r1["epoch"], r1["start"]) == (0, 4)  # the end of epoch 0: 2 batches of 2
