"""Bad inputs of the top-level commands (diffcurr_fast/cli.py, cli_sample.py, info.py): --help and argument errors
do not import torch, the light parsers name the real choices, sample's --out under a file and --num-samples 0,
sampling in batches and over ranks, info shows the backend a run uses. docs/errors.md lists what each input gets."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import TORCHRUN2, _main, _sample_args

from diffcurr_fast import cli_sample as sample_cli

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


def test_info_shows_the_backend_a_run_uses(monkeypatch):
    from diffcurr_fast import info

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "reference")
    src, rows = info.selected_backends()
    assert src == "DIFFCURR_OPS_BACKEND=reference"
    assert {r[2] for r in rows if r[0] == "cpu"} == {"reference"}
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "triton")
    _, rows = info.selected_backends()
    if not torch.cuda.is_available():
        assert all(r[2].startswith("none: backend 'triton' runs on CPU tensors only") for r in rows if r[0] == "cpu")
    assert "backends a run uses" in info.report()


def test_sample_out_under_a_file_is_one_line(no_dropout_run, tmp_path, capsys):
    (tmp_path / "x.npz").write_bytes(b"mine")
    rc, err = _main(capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "x.npz" / "y.npz"))
    assert rc == 2 and "x.npz' is a file, not a directory; choose another --out" in err, err
    assert (tmp_path / "x.npz").read_bytes() == b"mine"
    rc, err = _main(
        capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "s.npz"), "--num-samples", "0"
    )
    assert rc == 2 and "--num-samples must be >= 1, got 0" in err, err


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
