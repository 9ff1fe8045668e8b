"""Bad inputs get one clear line, never a silent wrong result: non-finite weights, data path vs dataset, float
labels, NaN data, corrupt files, backends asked for by name, tensorboard, recipes, TDC groups, batched and
multi-rank sampling, lazy imports. docs/errors.md lists what each input gets."""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY_SETS, TORCHRUN2

from diffcurr_fast import cli_sample as sample_cli
from diffcurr_fast.data.errors import BadDataError
from diffcurr_fast.data.latents import FastDiTLatents, FastDiTLatentWriter, ShardedLatents, ShardedLatentWriter
from diffcurr_fast.data.loader import ArrayDataset, load_npz
from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.recipes import list_recipes, load_config, recipes_dir
from diffcurr_fast.train import cli_train
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.preflight import check_run

ROOT = Path(__file__).resolve().parents[1]
SETS = [*TINY_SETS, "checkpoint.keep_last=5"]


def tiny(run_dir, *extra):
    return load_config(None, [f"checkpoint.run_dir={run_dir}", *SETS, *extra])


def _npz(path, x, y):
    np.savez(path, x=x, y=y)
    return path


def _sample_args(*argv):
    p = argparse.ArgumentParser()
    sample_cli.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    run = tmp_path_factory.mktemp("bad") / "run"
    Trainer(tiny(run, "engine.max_steps=2", "checkpoint.every=1")).fit()
    return run


# ---- item 2: a model with non-finite weights is never saved, exported or sampled -----------------------------
def test_nonfinite_weights_are_not_saved(tmp_path):
    run = tmp_path / "run"
    tr = Trainer(tiny(run, "engine.max_steps=2", "checkpoint.every=1", "checkpoint.export_ema=true"))
    tr.fit()
    with torch.no_grad():
        next(tr.model.parameters()).fill_(float("nan"))  # what optim.lr=inf does at step 1
    with pytest.raises(ck.NonFiniteWeightsError, match=r"refusing to save the checkpoint of step 2 \(model\): weight"):
        tr.save()
    assert ck.latest_checkpoint(run).name == "ckpt_00000002.pt"  # the intact one stays the newest
    assert torch.isfinite(
        ck.load_checkpoint(ck.latest_checkpoint(run))["model"][next(iter(tr.model.state_dict()))]
    ).all()
    with pytest.raises(ck.NonFiniteWeightsError, match="refusing to export"):
        ck.export_safetensors(tr.model.state_dict(), tmp_path / "e.safetensors", {})
    assert not (tmp_path / "e.safetensors").exists()


def test_nonfinite_checkpoint_is_not_sampled(trained, tmp_path):
    state = ck.load_checkpoint(ck.latest_checkpoint(trained))
    key = next(iter(state["ema"]["module"]))
    state["ema"]["module"][key] = torch.full_like(state["ema"]["module"][key], float("inf"))
    torch.save(state, tmp_path / "nan.pt")  # written around save_checkpoint, as an old version could have
    with pytest.raises(ck.NonFiniteWeightsError, match=f"weight '{key}' has .* non-finite"):
        sample_cli.run(_sample_args("--ckpt", str(tmp_path / "nan.pt"), "--out", str(tmp_path / "s.npz")))
    assert not (tmp_path / "s.npz").exists()
    from diffcurr_fast.eval.evaluate import samples_from_checkpoint

    with pytest.raises(ck.NonFiniteWeightsError):
        samples_from_checkpoint(tmp_path / "nan.pt", 4, steps=2)


# ---- item 3: data.path with the built-in dataset --------------------------------------------------------------
def test_data_path_with_digits_is_refused(tmp_path):
    with pytest.raises(ValueError, match="data.path '/does/not/exist' is set but data.dataset is 'digits'"):
        load_config(None, ["data.path=/does/not/exist"])


# ---- items 4 and 5: labels must be integers, data must be finite; the error names the file and the sample -----
def test_float_and_negative_labels_are_refused(tmp_path):
    x = np.zeros((4, 1, 8, 8), np.float32)
    with pytest.raises(BadDataError, match=r"f\.npz'?: labels y must be integers, got dtype float64"):
        load_npz(_npz(tmp_path / "f.npz", x, np.array([1.0, 8.5, 2.0, 3.0])))
    with pytest.raises(BadDataError, match="labels must be >= 0, got -1"):
        load_npz(_npz(tmp_path / "n.npz", x, np.array([1, -1, 2, 3])))
    with pytest.raises(BadDataError, match="labels y must be integers"):
        ArrayDataset(torch.zeros(2, 1, 2, 2), torch.tensor([0.5, 1.0]))


def test_nonfinite_data_names_file_and_sample(tmp_path):
    x = np.zeros((20, 1, 8, 8), np.float32)
    x[13, 0, 2, 2] = np.nan
    with pytest.raises(BadDataError, match=r"bad\.npz'?: sample 13 holds NaN or inf"):
        load_npz(_npz(tmp_path / "bad.npz", x, np.arange(20) % 10))
    d = tmp_path / "dir"  # memory-mapped: checked batch by batch, as read
    d.mkdir()
    x[13] = 0
    x[7, 0, 0, 0] = np.inf
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", np.arange(20) % 10)
    ds = load_npz(d)
    with pytest.raises(BadDataError, match=r"x\.npy'?: sample 7 holds NaN or inf"):
        ds.batch(list(range(20)))
    cfg = tiny(tmp_path / "run", "data.dataset=npz", f"data.path={d}", "engine.max_steps=3")
    with pytest.raises(BadDataError, match="sample 7"):  # the trainer stops at the batch, naming the sample
        Trainer(cfg).fit()


def test_nonfinite_latents_name_the_file(tmp_path):
    lat = np.zeros((4, 4, 2, 2), np.float32)
    lat[2, 1, 0, 0] = np.nan
    w = FastDiTLatentWriter(tmp_path / "fd")
    w.write(lat, np.arange(4))
    w.close()
    ds = FastDiTLatents(tmp_path / "fd")
    ds[1]
    with pytest.raises(BadDataError, match=r"2\.npy: sample 2 holds NaN or inf"):
        ds[2]
    sw = ShardedLatentWriter(tmp_path / "sh", (4, 2, 2), shard_size=3)
    sw.write(lat, np.arange(4))
    sw.close()
    sh = ShardedLatents(tmp_path / "sh")
    with pytest.raises(BadDataError, match=r"\.npy row 2: sample 2 holds NaN or inf"):
        sh[2]


# ---- item 6: eval refuses samples of another shape (convert only when asked) ----------------------------------
def test_eval_refuses_mismatched_shapes(tmp_path, capsys):
    from diffcurr_fast.eval import cli_eval
    from diffcurr_fast.eval.features import EXTRACTORS

    assert cli_eval.EXTRACTORS == EXTRACTORS
    np.savez(tmp_path / "rgb.npz", arr_0=np.zeros((6, 16, 16, 3), np.uint8))
    p = argparse.ArgumentParser()
    cli_eval.add_arguments(p)
    base = ["--samples", str(tmp_path / "rgb.npz"), "--ref", "digits", "--digits-cache", str(tmp_path / "d.pt")]
    with pytest.raises(ValueError, match="takes 1x8x8 images, got 3x16x16; pass --convert"):
        cli_eval.run(p.parse_args(base))
    assert cli_eval.run(p.parse_args([*base, "--convert", "--json", str(tmp_path / "out" / "r.json")])) == 0
    assert "FD: " in capsys.readouterr().out
    assert "fd" in json.loads((tmp_path / "out" / "r.json").read_text())


# ---- item 12: clear errors ---------------------------------------------------------------------------------
def test_malformed_recipe_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  depth: 3\n   hidden_size: [\n")
    with pytest.raises(ValueError, match=r"bad\.yaml' is not valid YAML at line \d+, column \d+") as e:
        load_config(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "sets, match",
    [
        (["model.attn_backend=flash_attn"], "model.attn_backend 'flash_attn' cannot run here"),
        (["diffusion.ops_backend=cuda"], "diffusion.ops_backend 'cuda' cannot run on cpu"),
        (["diffusion.ops_backend=triton"], "diffusion.ops_backend 'triton' cannot run on cpu"),
        (["engine.device=cuda"], "engine.device is 'cuda' but no CUDA device is available"),
    ],
)
def test_backends_asked_for_are_checked_before_the_run(tmp_path, monkeypatch, sets, match):
    if torch.cuda.is_available():
        pytest.skip("the backends exist on this machine")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = tiny(tmp_path / "run", *sets)
    with pytest.raises(ValueError, match=match):
        check_run(cfg)
    with pytest.raises(ValueError, match=match):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_available_backends_pass_the_check(tmp_path):
    from diffcurr_fast.ops import _backend

    assert check_run(tiny(tmp_path / "a", "diffusion.ops_backend=reference")).mode == "fresh"
    if _backend.unavailable_reason("cpu", "q_sample", torch.device("cpu")) is None:  # the C++ extension is built
        assert check_run(tiny(tmp_path / "b", "diffusion.ops_backend=cpu", "engine.device=cpu")).mode == "fresh"


def test_corrupt_data_files_are_named(tmp_path):
    np.savez(tmp_path / "obj.npz", x=np.array([object()], dtype=object), y=np.arange(1))
    with pytest.raises(BadDataError, match=r"obj\.npz' holds object \(pickled\) arrays"):
        load_npz(tmp_path / "obj.npz")
    (tmp_path / "junk.npz").write_bytes(b"PK\x03\x04 not a zip")
    with pytest.raises(BadDataError, match=r"junk\.npz' is not a readable \.npz file"):
        load_npz(tmp_path / "junk.npz")
    d = tmp_path / "d"
    d.mkdir()
    np.save(d / "x.npy", np.zeros((10, 1, 8, 8), np.float32))
    np.save(d / "y.npy", np.arange(10))
    (d / "x.npy").write_bytes((d / "x.npy").read_bytes()[:300])  # truncated
    with pytest.raises(BadDataError, match=r"x\.npy' is not a readable \.npy file \(truncated or corrupt"):
        load_npz(d)


def test_empty_images_folder_is_named(tmp_path):
    (tmp_path / "imgs").mkdir()
    sets = ["data.dataset=images", f"data.path={tmp_path / 'imgs'}", "model.in_channels=3"]
    with pytest.raises(ValueError, match="has no class subdirectories"):
        check_run(tiny(tmp_path / "run", *sets))
    (tmp_path / "imgs" / "cat").mkdir()
    with pytest.raises(ValueError, match="holds no image files"):
        check_run(tiny(tmp_path / "run", *sets))


def test_corrupt_checkpoint_names_the_previous_intact_one(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    newest = ck.latest_checkpoint(run)
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated by a full disk
    with pytest.raises(ValueError) as e:
        Trainer(tiny(run, "engine.max_steps=4", "checkpoint.every=1"), resume=True)
    msg = str(e.value)
    assert f"checkpoint '{newest}' is corrupt" in msg and "weights_only=False" not in msg
    assert "the previous checkpoint ckpt_00000001.pt is intact" in msg and "--resume" in msg
    newest.rename(tmp_path / "aside.pt")  # the advice works
    assert Trainer(tiny(run, "engine.max_steps=4", "checkpoint.every=1"), resume=True).step == 1


# ---- item 14: tensorboard asked for but missing -------------------------------------------------------------
def test_tensorboard_missing_is_an_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec  # tensorboard hidden, whether it is installed or not
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="logging.tensorboard is true but tensorboard is not installed"):
        check_run(tiny(tmp_path / "run", "logging.tensorboard=true"))
    from diffcurr_fast.train.report import MetricsWriter

    with pytest.raises(ImportError, match="tensorboard is not installed"):
        MetricsWriter(tmp_path, tensorboard=True)


# ---- item 15: recipes ----------------------------------------------------------------------------------------
def test_recipe_paths_are_relative_to_the_recipe(tmp_path, monkeypatch):
    folder = tmp_path / "exp"
    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "z.json").write_text("{}")
    (folder / "w.pt").write_bytes(b"")
    (folder / "r.yaml").write_text(
        "engine:\n  kind: deepspeed\n  deepspeed_config: ds/z.json\n"
        "model:\n  init_from: w.pt\ncheckpoint:\n  run_dir: runs/x\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config("exp/r.yaml")
    assert cfg.engine.deepspeed_config == str(Path("exp") / "ds" / "z.json")
    assert cfg.model.init_from == str(Path("exp") / "w.pt")
    assert cfg.checkpoint.run_dir == "runs/x"  # outputs stay relative to the current directory
    cfg = load_config("exp/r.yaml", ["engine.deepspeed_config=other.json"])  # --set: relative to the cwd
    assert cfg.engine.deepspeed_config == "other.json"


def test_shipped_recipes_by_name(tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.find_spec("diffcurr_fast.recipes")  # package data of the installed package
    assert spec is not None and Path(list(spec.submodule_search_locations)[0]) == recipes_dir()
    assert (recipes_dir() / "ds" / "zero2.json").is_file()
    names = {p.stem for p in list_recipes()}
    assert {"dit_b2_curriculum", "dit_l2_zero2", "edm_cifar10"} <= names
    monkeypatch.chdir(tmp_path)  # away from the source tree
    cfg = load_config("dit_b2_curriculum")
    assert cfg.model.preset == "DiT-B/2" and cfg.curriculum.pacing == "patience"
    zero2 = load_config("dit_l2_zero2")
    assert Path(zero2.engine.deepspeed_config) == recipes_dir() / "ds" / "zero2.json"
    from diffcurr_fast.cli import main

    assert main(["recipes"]) == 0
    assert "dit_b2_curriculum" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no shipped recipe of that name"):
        load_config("dit_b2_curriculm")
    (tmp_path / "lat").mkdir()
    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    args = p.parse_args(
        ["dit_b2_curriculum", "--dry-run", "--set", "data.dataset=latents", "--set", f"data.path={tmp_path / 'lat'}"]
    )
    assert cli_train.run(args) == 0


# ---- TDC: groups checked before stage 1 -------------------------------------------------------------------------
def test_tdc_groups_checked_before_training(tmp_path):
    from diffcurr_fast.runs.config import TDCConfig
    from diffcurr_fast.tdc.preflight import check_groups, check_tdc_run

    cfg = tiny(tmp_path / "x", "curriculum.pacing=none")
    with pytest.raises(ValueError, match=r"tdc.num_groups must be an int in \[1, 40\]"):
        check_tdc_run(cfg, TDCConfig(num_groups=2000), tmp_path / "tdc")
    assert not (tmp_path / "tdc").exists()
    assert [hi - lo > 0 for lo, hi in check_groups(cfg, 3)] == [True] * 3
    (tmp_path / "tdc").mkdir()
    (tmp_path / "tdc" / "tdc.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not empty"):
        check_tdc_run(cfg, TDCConfig(num_groups=3), tmp_path / "tdc")
    assert check_tdc_run(cfg, TDCConfig(num_groups=3), tmp_path / "tdc", overwrite=True).mode == "overwrite"
    # guidance without a null label: refused before stage 1, as train refuses it
    nodrop = tiny(tmp_path / "y", "curriculum.pacing=none", "model.class_dropout_prob=0", "logging.num_samples=4")
    with pytest.raises(ValueError, match="classifier-free guidance needs the null label"):
        check_tdc_run(nodrop, TDCConfig(num_groups=3), tmp_path / "tdc2")
    assert not (tmp_path / "tdc2").exists()


# ---- sampling in batches, over ranks, in the ADM layout -----------------------------------------------------------
def test_sample_batches_match_and_bound_the_batch(trained, tmp_path, monkeypatch):
    from diffcurr_fast.runs import sampling

    sizes = []
    real = sampling.sample
    monkeypatch.setattr(sampling, "sample", lambda *a, **k: sizes.append(len(k["labels"])) or real(*a, **k))
    common = ["--ckpt", str(trained), "--steps", "3", "--num", "5", "--sampler", "ddpm"]
    assert sample_cli.run(_sample_args(*common, "--batch-size", "2", "--out", str(tmp_path / "a.npz"))) == 0
    assert sizes == [2, 2, 1]
    a = np.load(tmp_path / "a.npz")
    assert a["arr_0"].shape == (5, 8, 8, 1) and a["arr_0"].dtype == np.uint8 and a["arr_1"].tolist() == [0, 1, 2, 3, 4]
    assert len({a["arr_0"][i].tobytes() for i in range(5)}) == 5  # every batch has its own noise
    from diffcurr_fast.eval.evaluate import load_images

    assert load_images(tmp_path / "a.npz").shape == (5, 1, 8, 8)  # our eval reads the ADM layout


def test_sample_under_torchrun_matches_one_process(trained, tmp_path, one_thread):
    # bitwise equality needs the same thread count on both sides: one here, OMP_NUM_THREADS=1 under torchrun
    common = [
        "--ckpt",
        str(trained),
        "--steps",
        "2",
        "--num-samples",
        "5",
        "--batch-size",
        "2",
        "--sampler",
        "ddim",
        "--device",
        "cpu",
    ]
    assert sample_cli.run(_sample_args(*common, "--out", str(tmp_path / "one.npz"))) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        *TORCHRUN2,
        "-m",
        "diffcurr_fast.cli",
        "sample",
        *common,
        "--out",
        str(tmp_path / "two.npz"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 ranks" in r.stdout
    one, two = np.load(tmp_path / "one.npz"), np.load(tmp_path / "two.npz")
    np.testing.assert_array_equal(one["arr_0"], two["arr_0"])
    np.testing.assert_array_equal(one["arr_1"], two["arr_1"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.npz", "two.npz"]  # the rank shards are gone


# ---- lazy imports: --help and argument errors do not import torch ------------------------------------------------
ARGVS = [
    ["--help"],
    ["train", "--help"],
    ["sample", "--help"],
    ["eval", "--help"],
    ["analyze", "--help"],
    ["extract-latents", "--help"],
    ["train", "--bogus"],
    ["sample", "--ckpt", "x"],
    ["recipes"],
    ["tdc", "--help"],
    ["study", "--help"],
    ["export", "--help"],
]


@pytest.mark.parametrize("argv", ARGVS)
def test_cli_parsing_does_not_import_torch(argv):
    code = (
        f"import sys\nfrom diffcurr_fast.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


def test_light_parsers_name_the_real_choices():
    from diffcurr_fast.analysis import cli_analyze as analyze_cli
    from diffcurr_fast.curriculum.clustering import CLUSTER_METHODS
    from diffcurr_fast.data import cli_extract, extract, latents

    assert analyze_cli.CLUSTER_METHODS == CLUSTER_METHODS
    from diffcurr_fast import cli_sample as sample_cli
    from diffcurr_fast.runs import sampling

    assert sample_cli.SAMPLERS == sampling.SAMPLERS
    from diffcurr_fast.eval import cli_eval

    assert cli_eval.SAMPLERS == ("auto", *sampling.SAMPLERS)
    assert (cli_extract.LAYOUTS, cli_extract.SD_VAE_SCALE, cli_extract.LATENT_DTYPES) == (
        extract.LAYOUTS,
        extract.SD_VAE_SCALE,
        latents.LATENT_DTYPES,
    )


def test_bundle_weights_finite_and_readable(tmp_path):
    from diffcurr_fast.models import DiT
    from diffcurr_fast.tdc.experts import MultiExpertDenoiser, load_bundle, save_bundle

    experts = [
        DiT(
            input_size=8,
            in_channels=1,
            patch_size=4,
            hidden_size=16,
            depth=1,
            num_heads=2,
            num_classes=10,
            num_timesteps=40,
        )
        for _ in range(2)
    ]
    multi = MultiExpertDenoiser(experts, [(0, 20), (20, 40)])
    old = os.umask(0o022)
    try:
        save_bundle(multi, tmp_path / "b")
    finally:
        os.umask(old)
    assert (tmp_path / "b" / "weights.safetensors").stat().st_mode & 0o777 == 0o644
    load_bundle(tmp_path / "b")
    with torch.no_grad():
        next(experts[1].parameters()).fill_(float("nan"))
    with pytest.raises(ck.NonFiniteWeightsError, match="experts.1."):
        save_bundle(multi, tmp_path / "c")


@pytest.mark.parametrize("backend", ["torch", "dali"])
def test_nonfinite_latents_stop_training_under_either_loader(tmp_path, backend):
    if backend == "dali":
        pytest.importorskip("nvidia.dali")
    lat = np.zeros((16, 4, 4, 4), np.float32)
    lat[:, 0, 0, 0] = np.nan  # every latent: the first batch holds one, whatever the order
    w = FastDiTLatentWriter(tmp_path / "fd")
    w.write(lat, np.arange(16) % 10)
    w.close()
    cfg = tiny(
        tmp_path / "run",
        "data.dataset=latents",
        f"data.path={tmp_path / 'fd'}",
        f"data.backend={backend}",
        "data.batch_size=4",
        "model.in_channels=4",
        "model.input_size=4",
        "engine.max_steps=2",
    )
    match = r"\.npy: sample \d+ holds NaN" if backend == "torch" else "holds NaN or inf values; data.backend=torch"
    with pytest.raises(BadDataError, match=match):
        Trainer(cfg).fit()
