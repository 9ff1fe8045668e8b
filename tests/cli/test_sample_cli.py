"""``diffcurr-fast sample``: every sampler from a trained checkpoint to PNG and NPZ; the VE-ODE wrapper's math."""

import argparse

import numpy as np
import pytest
import torch

from diffcurr_fast import cli_sample
from diffcurr_fast.diffusion import DDPMSchedule, Readout
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.runs.sampling import VEDenoiser, grid_image
from diffcurr_fast.train.loop import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("sample") / "run"
    cfg = load_config(
        None,
        [
            f"checkpoint.run_dir={run}",
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            "diffusion.num_timesteps=40",
            "curriculum.num_clusters=4",
            "data.batch_size=17",
            "engine.max_steps=3",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
        ],
    )
    train(cfg)
    yield run
    torch.set_num_threads(n)


def _args(*argv):
    p = argparse.ArgumentParser()
    cli_sample.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "heun", "euler"])
def test_samplers_write_png(run_dir, tmp_path, sampler, capsys):
    out = tmp_path / f"{sampler}.png"
    assert (
        cli_sample.run(
            _args(
                "--ckpt",
                str(run_dir),
                "--sampler",
                sampler,
                "--steps",
                "4",
                "--num",
                "7",
                "--cfg",
                "1.5",
                "--out",
                str(out),
            )
        )
        == 0
    )
    assert out.is_file() and out.stat().st_size > 100
    assert f"wrote 7 samples ({sampler}, 4 steps, cfg 1.5) from step 3" in capsys.readouterr().out


def test_npz_output_and_labels(run_dir, tmp_path):
    out = tmp_path / "s.npz"
    ckpt = sorted((run_dir / "checkpoints").iterdir())[-1]
    assert (
        cli_sample.run(
            _args(
                "--ckpt",
                str(ckpt),
                "--steps",
                "3",
                "--num",
                "5",
                "--labels",
                "2,7",
                "--weights",
                "model",
                "--out",
                str(out),
            )
        )
        == 0
    )
    z = np.load(out)  # images are written in the ADM evaluation suite's layout
    assert z["arr_0"].shape == (5, 8, 8, 1) and z["arr_0"].dtype == np.uint8 and z["arr_1"].tolist() == [2, 7, 2, 7, 2]


@pytest.mark.parametrize(
    "argv, exc, match",
    [
        (["--out", "x.jpg"], ValueError, "must end in .png or .npz"),
        (["--labels", "3,11", "--out", "a.png"], ValueError, r"--labels \[11\] out of range; valid labels are 0..9"),
        (["--num", "0", "--out", "a.png"], ValueError, "--num-samples must be >= 1"),
        (["--steps", "41", "--out", "a.png"], ValueError, r"steps must be an int in \[1, 40\]"),
    ],
)
def test_bad_arguments(run_dir, tmp_path, argv, exc, match):
    argv = [a if not a.endswith((".png", ".jpg")) else str(tmp_path / a) for a in argv]
    with pytest.raises(exc, match=match):
        cli_sample.run(_args("--ckpt", str(run_dir), *argv))


def test_refuses_to_overwrite_and_missing_ckpt(run_dir, tmp_path):
    out = tmp_path / "a.png"
    out.write_bytes(b"x")
    with pytest.raises(FileExistsError, match="pass --overwrite"):
        cli_sample.run(_args("--ckpt", str(run_dir), "--out", str(out)))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        cli_sample.run(_args("--ckpt", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "b.png")))
    with pytest.raises(FileNotFoundError, match="has no checkpoint"):
        cli_sample.run(_args("--ckpt", str(tmp_path), "--out", str(tmp_path / "b.png")))


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_ve_denoiser_matches_vp_reparameterisation(prediction, batch):
    """D(x_ve; sigma(t)) equals the DDPM x0 estimate at integer t (float64), and sigma -> t inverts the table."""
    sched = DDPMSchedule(50)
    t = torch.randint(0, 50, (batch,))
    x_vp = torch.randn(batch, 3, 5, 5, dtype=torch.float64)
    net_out = torch.randn(batch, 3, 5, 5, dtype=torch.float64)
    seen = {}

    def model(x, tt, y):
        seen["x"], seen["t"] = x, tt
        return net_out

    den = VEDenoiser(model, sched, prediction, channels=3)
    abar = sched.coef("alphas_cumprod", t, x_vp)
    sigma = ((1 - abar) / abar).sqrt().flatten()
    x_ve = x_vp / abar.sqrt()
    x0 = den(x_ve, sigma, None)
    torch.testing.assert_close(seen["t"], t.double(), rtol=0, atol=1e-9)
    torch.testing.assert_close(seen["x"], x_vp)
    torch.testing.assert_close(x0, sched.predict_x0(net_out, x_vp, t, prediction))


def test_grid_layout():
    x = torch.linspace(-1, 1, 5 * 4).reshape(5, 1, 2, 2)
    g = grid_image(x, nrow=3, pad=1)
    assert g.shape == (2 * 3 + 1, 3 * 3 + 1, 1)
    torch.testing.assert_close(g[1:3, 1:3, 0], (x[0, 0] + 1) / 2)
    torch.testing.assert_close(g[4:6, 4:6, 0], (x[4, 0] + 1) / 2)
    with pytest.raises(ValueError, match="a grid needs images"):
        grid_image(torch.zeros(2, 4, 3, 3))


@pytest.mark.parametrize(
    "form, pred, sampler", [("flow", "velocity", "heun"), ("edm", "x0", "heun"), ("edm", "x0", "euler")]
)
def test_continuous_checkpoints_sample_with_ode_samplers(tmp_path, form, pred, sampler):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path / form
    cfg = load_config(
        None,
        [
            f"checkpoint.run_dir={run}",
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            f"diffusion.formulation={form}",
            f"diffusion.prediction={pred}",
            "diffusion.learn_sigma=false",
            "diffusion.weighting=none",
            "logging.sampler=heun",
            "curriculum.num_clusters=4",
            "data.batch_size=17",
            "engine.max_steps=2",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
        ],
    )
    try:
        train(cfg)
        out = tmp_path / "f.npz"
        assert (
            cli_sample.run(
                _args(
                    "--ckpt",
                    str(run),
                    "--sampler",
                    sampler,
                    "--steps",
                    "3",
                    "--num",
                    "4",
                    "--cfg",
                    "2",
                    "--out",
                    str(out),
                )
            )
            == 0
        )
        x = np.load(out)["arr_0"]  # digits are images: ADM's uint8 (N, H, W, C)
        assert x.shape == (4, 8, 8, 1) and x.dtype == np.uint8
        article = "an" if form == "edm" else "a"
        with pytest.raises(ValueError, match=f"sampler 'ddim' cannot sample {article} {form} model; valid choices"):
            cli_sample.run(_args("--ckpt", str(run), "--sampler", "ddim", "--out", str(tmp_path / "g.png")))
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def distinct_run(run_dir, tmp_path_factory):
    """The run's newest checkpoint with its raw and EMA weights moved apart (3 training steps barely move a DiT
    from its zero-initialised output layer, so every sample would clip to the same +-1 image)."""
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    state = load_checkpoint(latest_checkpoint(run_dir))
    gen = torch.Generator().manual_seed(0)
    for key, scale in (("model", 0.05), ("ema", 0.03)):
        sd = state["ema"]["module"] if key == "ema" else state["model"]
        for name, v in sd.items():
            if v.is_floating_point():
                sd[name] = v + scale * torch.randn(v.shape, generator=gen, dtype=v.dtype)
    # without model_config, as a checkpoint of a plain DiT may be: the model is rebuilt from the training config
    # (the pruned-expert path, which reads model_config, is covered by the TDC pipeline tests)
    state.pop("model_config", None)
    out = tmp_path_factory.mktemp("distinct") / "run"
    save_checkpoint(out, int(state["step"]), state, 1)
    return out


def _direct(ckpt_dir, weights, *, seed, cfg_scale, steps=3, num=6, sampler="ddim"):
    """What the CLI should write: ``sample()`` on the named weights of the newest checkpoint."""
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint
    from diffcurr_fast.runs.config import config_from_dict
    from diffcurr_fast.runs.sampling import build_model, build_schedule, sample

    state = load_checkpoint(latest_checkpoint(ckpt_dir))
    cfg = config_from_dict(state["config"])
    model = build_model(cfg)
    model.load_state_dict(state["ema"]["module"] if weights == "ema" else state["model"])
    labels = torch.arange(num) % cfg.model.num_classes
    x = sample(
        model.eval(),
        build_schedule(cfg),
        sampler=sampler,
        steps=steps,
        labels=labels,
        channels=1,
        size=8,
        num_classes=10,
        readout=Readout(cfg.diffusion.prediction, learn_sigma=cfg.diffusion.learn_sigma),
        cfg_scale=cfg_scale,
        seed=seed,
    )
    return (x / cfg.data.scale).numpy(), labels.numpy()


@pytest.fixture
def float_npz(monkeypatch):
    """The sample command's float layout (``x``, ``y``, unclipped) for the digits model: its ADM uint8 layout
    would hide the small differences these tests look for."""
    from diffcurr_fast.runs import sampling

    monkeypatch.setattr(sampling, "pixel_range", lambda cfg: False)


@pytest.mark.parametrize("weights", ["ema", "model"])
@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("sampler", ["ddim", "heun"])
def test_npz_equals_direct_sample_of_the_named_weights(float_npz, distinct_run, tmp_path, weights, cfg_scale, sampler):
    run_dir = distinct_run
    out = tmp_path / "s.npz"
    assert (
        cli_sample.run(
            _args(
                "--ckpt",
                str(run_dir),
                "--sampler",
                sampler,
                "--steps",
                "3",
                "--num",
                "6",
                "--cfg",
                str(cfg_scale),
                "--seed",
                "11",
                "--weights",
                weights,
                "--out",
                str(out),
            )
        )
        == 0
    )
    z = np.load(out)
    x, y = _direct(run_dir, weights, seed=11, cfg_scale=cfg_scale, sampler=sampler)
    assert z["y"].tolist() == y.tolist()
    np.testing.assert_allclose(z["x"], x, rtol=0, atol=1e-6)
    other = _direct(run_dir, "model" if weights == "ema" else "ema", seed=11, cfg_scale=cfg_scale, sampler=sampler)[0]
    assert np.abs(other - x).max() > 1e-3  # the EMA and the raw weights give different samples


def test_cfg_and_seed_change_the_samples(float_npz, distinct_run, tmp_path):
    run_dir = distinct_run
    outs = {}
    for key, argv in {"cfg1": ("--cfg", "1"), "cfg3": ("--cfg", "3"), "seed1": ("--cfg", "1", "--seed", "1")}.items():
        out = tmp_path / f"{key}.npz"
        assert (
            cli_sample.run(_args("--ckpt", str(run_dir), "--steps", "3", "--num", "6", *argv, "--out", str(out))) == 0
        )
        outs[key] = np.load(out)["x"]
    assert np.abs(outs["cfg1"] - outs["cfg3"]).max() > 1e-3
    assert np.abs(outs["cfg1"] - outs["seed1"]).max() > 1e-3
    np.testing.assert_allclose(outs["cfg1"], _direct(run_dir, "ema", seed=0, cfg_scale=1.0)[0], rtol=0, atol=1e-6)


def test_png_grid_layout(run_dir, tmp_path):
    """One row per class without --labels (10 classes: 10 columns), a square grid with them; 8 px images shown x4."""
    from PIL import Image

    rows = {}
    for key, extra in {"classes": (), "labels": ("--labels", "2,7")}.items():
        out = tmp_path / f"{key}.png"
        assert (
            cli_sample.run(_args("--ckpt", str(run_dir), "--steps", "2", "--num", "7", "--out", str(out), *extra)) == 0
        )
        rows[key] = Image.open(out).size  # (width, height)
    assert rows["classes"] == ((10 * 9 + 1) * 4, (1 * 9 + 1) * 4)  # nrow = num_classes, 1 pixel padding
    assert rows["labels"] == ((3 * 9 + 1) * 4, (3 * 9 + 1) * 4)  # ceil(sqrt(7)) = 3 per row


def test_threads_default_to_the_runs_own_setting(run_dir, tmp_path):
    """`sample` runs at the run's engine.cpu_threads (the demo recipe's 2) unless --threads says otherwise; on a busy
    2-core machine torch's default made a 100-image draw 70x slower than one thread."""
    from diffcurr_fast.runs.recipes import load_config as load

    assert load(None).engine.cpu_threads == 2  # the recipe the run was trained from
    torch.set_num_threads(1)
    assert (
        cli_sample.run(
            _args("--ckpt", str(run_dir), "--num-samples", "2", "--steps", "2", "--out", str(tmp_path / "a.npz"))
        )
        == 0
    )
    assert torch.get_num_threads() == 2
    argv = (
        "--ckpt",
        str(run_dir),
        "--num-samples",
        "2",
        "--steps",
        "2",
        "--threads",
        "1",
        "--out",
        str(tmp_path / "b.npz"),
    )
    assert cli_sample.run(_args(*argv)) == 0 and torch.get_num_threads() == 1
    with pytest.raises(ValueError, match=r"^--threads must be >= 0 \(0: torch's default\), got -1$"):
        cli_sample.run(_args(*argv[:-4], "--threads=-1", "--out", str(tmp_path / "c.npz")))
    assert not (tmp_path / "c.npz").exists()


def _read_only(monkeypatch):
    """Every folder refuses new entries, as a read-only mount does (as root, permissions alone do not tell)."""
    from diffcurr_fast import _files

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_files.tempfile, "mkdtemp", refuse)


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--steps", "0"], r"^--steps must be >= 1, got 0$"),
        (["--batch-size", "0"], r"^--batch-size must be >= 1, got 0$"),
        (["--labels", "1,x"], r"^--labels must be comma-separated ints, got '1,x'$"),
        (["--vae", "vae", "--vae-batch", "0"], r"^--vae-batch must be >= 1, got 0$"),
        (["--cfg=-1"], r"^--cfg must be >= 0 \(1 = no guidance\), got -1.0$"),
        (["read-only"], r"^--out '.*s\.npz' cannot be written: '.*' refuses new files \(Permission denied\); choose"),
    ],
)
def test_arguments_are_checked_before_the_checkpoint_is_read(run_dir, tmp_path, monkeypatch, argv, match):
    """What needs no checkpoint is checked first: a read-only --out is refused before anything is drawn (it was
    refused only when the samples were written), --steps 0 before the model is loaded."""
    from diffcurr_fast.runs import checkpoint, sampling

    def read(*a, **k):
        raise AssertionError("the checkpoint was read")

    monkeypatch.setattr(checkpoint, "load_checkpoint", read)
    monkeypatch.setattr(sampling, "sample", read)
    if argv == ["read-only"]:
        _read_only(monkeypatch)
        argv = []
    with pytest.raises(ValueError, match=match):
        cli_sample.run(_args("--ckpt", str(run_dir), "--out", str(tmp_path / "s.npz"), *argv))
    assert not (tmp_path / "s.npz").exists()


def _weightless_checkpoint(tmp_path, *sets):
    """A checkpoint of a tiny config with no weights at all: a check that runs after the weights are loaded would
    fail on them, so an error about the arguments shows that its check ran first."""
    from diffcurr_fast.runs.checkpoint import atomic_save

    run = tmp_path / "run"
    tiny = ["model.hidden_size=32", "model.depth=1", "model.num_heads=2", "diffusion.num_timesteps=40"]
    cfg = load_config(None, [f"checkpoint.run_dir={run}", *tiny, "curriculum.num_clusters=4", *sets])
    state = {"config": cfg.to_dict(), "model": {}, "ema": {"module": {}}, "step": 1}
    return atomic_save(state, run / "checkpoints" / "ckpt_00000001.pt")


FLOW = ["diffusion.formulation=flow", "diffusion.prediction=velocity", "diffusion.learn_sigma=false"]


@pytest.mark.parametrize(
    "sets, argv, match",
    [
        (FLOW + ["diffusion.weighting=none", "logging.sampler=heun"], ["--sampler", "ddim"], "--sampler 'ddim' cannot"),
        (
            [],
            ["--steps", "41"],
            r"^--steps must be an int in \[1, 40\] \(the model's diffusion.num_timesteps\), got 41$",
        ),
        ([], ["--labels", "3,11"], r"^--labels \[11\] out of range; valid labels are 0..9$"),
    ],
)
def test_what_needs_the_config_is_checked_before_the_model_is_built(tmp_path, sets, argv, match):
    """The sampler against the formulation, the steps against T and the labels against the classes are checked
    right after the config is read (they were checked after the model was loaded, or while sampling)."""
    ckpt = _weightless_checkpoint(tmp_path, *sets)
    with pytest.raises(ValueError, match=match):
        cli_sample.run(_args("--ckpt", str(ckpt), "--out", str(tmp_path / "s.npz"), *argv))


def test_a_damaged_rank_shard_is_named(tmp_path):
    """Under torchrun rank 0 reads the other ranks' samples; a truncated shard is one line naming it."""
    out = tmp_path / "s.npz"
    np.savez(tmp_path / "s.npz.rank1.npz", b1=np.zeros((2, 8, 8, 1), np.uint8))
    assert list(cli_sample.merge_shards(out, 2)) == [1] and not (tmp_path / "s.npz.rank1.npz").exists()
    np.savez(tmp_path / "s.npz.rank1.npz", b1=np.zeros((2, 8, 8, 1), np.uint8))
    shard = tmp_path / "s.npz.rank1.npz"
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(ValueError, match=r"^the samples of rank 1 '.*s\.npz\.rank1\.npz' is not a readable \.npz"):
        cli_sample.merge_shards(out, 2)
