"""Bad data gets one line naming the file and the sample (diffcurr_fast/data/: loader.py, latents.py, errors.py):
float and negative labels, NaN or inf in images and latents (at load, when a batch is read, under either loader of
the trainer), corrupt .npz / .npy files. docs/errors.md lists what each input gets."""

import numpy as np
import pytest
import torch
from conftest import tiny

from diffcurr_fast.data.errors import BadDataError
from diffcurr_fast.data.latents import FastDiTLatents, FastDiTLatentWriter, ShardedLatents, ShardedLatentWriter
from diffcurr_fast.data.loader import ArrayDataset, load_npz
from diffcurr_fast.train.loop import Trainer


def _npz(path, x, y):
    np.savez(path, x=x, y=y)
    return path


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


class _StandInVAE(torch.nn.Module):
    """What extraction calls of a VAE (``encode(x).latent_dist.sample / mode``), 8x smaller; ``fail``: it refuses
    the first batch, as a VAE given images of a size it cannot take does."""

    def __init__(self, fail: bool = False):
        super().__init__()
        self.conv, self.fail = torch.nn.Conv2d(3, 4, 8, stride=8), fail

    def encode(self, x):
        from types import SimpleNamespace

        if self.fail:
            raise ValueError("the encoder cannot take these images")
        z = self.conv(x)  # (B, 4, S/8, S/8)
        return SimpleNamespace(latent_dist=SimpleNamespace(sample=lambda generator=None: z, mode=lambda: z))


@pytest.fixture
def images(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for c in range(2):
        (tmp_path / "imgs" / f"c{c}").mkdir(parents=True)
        for j in range(3):
            Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(tmp_path / "imgs" / f"c{c}/{j}.png")
    return tmp_path / "imgs"


def _vae_folder(path, weights: bytes):
    path.mkdir(parents=True)
    (path / "config.json").write_text('{"_class_name": "AutoencoderKL"}')
    (path / "diffusion_pytorch_model.safetensors").write_bytes(weights)
    return path


def test_extract_latents_refuses_a_vae_file_and_another_vae(tmp_path, images):
    """`--vae FILE` says to give the folder (it said "directory not found"); extract.json records the VAE (a digest of
    its config and weights, and its folder), so a rerun with another VAE (same config, other weights) is refused
    instead of keeping the old latents with exit 0; the same VAE moved elsewhere resumes."""
    import json
    import shutil

    from diffcurr_fast.data.extract import check_vae_dir, extract_latents

    a, b = _vae_folder(tmp_path / "a", b"weights of a"), _vae_folder(tmp_path / "b", b"weights of b")
    with pytest.raises(ValueError, match=r"^VAE '.*config.json' is a file; give the folder of a diffusers Autoenc"):
        check_vae_dir(a / "config.json")
    out, kw = tmp_path / "out", dict(image_size=16, batch_size=4, progress=False)
    assert extract_latents(_StandInVAE(), images, out, vae_dir=a, **kw) == 6
    record = json.loads((out / "extract.json").read_text())
    assert record["vae_path"] == str(a.resolve()) and len(record["vae"]) == 64
    with pytest.raises(ValueError, match=rf"other options: another VAE \(--vae '{b}'; the latents are of '{a}'\)"):
        extract_latents(_StandInVAE(), images, out, vae_dir=b, **kw)
    moved = shutil.copytree(a, tmp_path / "elsewhere" / "a")
    assert extract_latents(_StandInVAE(), images, out, vae_dir=moved, **kw) == 6


def test_a_refused_extraction_leaves_no_record_to_block_the_rerun(tmp_path, images):
    """A start refused on its first batch writes no extract.json (it was written first, and then refused the
    corrected rerun as an extraction of other options)."""
    from diffcurr_fast.data.extract import extract_latents

    out, kw = tmp_path / "out", dict(batch_size=4, progress=False)
    with pytest.raises(ValueError, match="the encoder cannot take these images"):
        extract_latents(_StandInVAE(fail=True), images, out, image_size=16, **kw)
    assert not (out / "extract.json").exists()
    assert extract_latents(_StandInVAE(), images, out, image_size=8, **kw) == 6  # the corrected rerun


def test_extract_latents_fits_its_workers_to_the_cpus_and_prints_no_warnings(tmp_path, images, capfd, monkeypatch):
    """extract-latents decodes with half the CPUs (at most 4) of DataLoader workers by default (4 on 2 cores made
    torch warn twice), loads the VAE without diffusers' accelerate notice, and refuses --num-workers below 0."""
    pytest.importorskip("diffusers", reason="diffusers is not installed (pip install diffusers)")
    from conftest import _main, save_tiny_vae

    from diffcurr_fast.data import cli_extract, extract

    vae = save_tiny_vae(tmp_path / "vae", levels=1, sample_size=8)
    argv = ["extract-latents", "--vae", str(vae), "--data", str(images), "--image-size", "8", "--no-progress"]
    capfd.readouterr()
    assert _main(capfd, *argv, "--out", str(tmp_path / "o"))[0] == 0
    err = capfd.readouterr().err
    assert err == "", err  # no accelerate notice, no DataLoader worker warning
    rc, err = _main(capfd, *argv, "--out", str(tmp_path / "n"), "--num-workers", "-1")
    assert rc == 2 and "--num-workers must be >= 0 (0: decode in this process), got -1" in err
    seen = []
    monkeypatch.setattr(extract, "extract_latents", lambda *a, **k: seen.append(k["num_workers"]) or 0)
    for cpus, workers in ((2, 1), (3, 1), (16, 4), (1, 0)):
        monkeypatch.setattr(cli_extract.os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        assert _main(capfd, *argv, "--out", str(tmp_path / f"w{cpus}"))[0] == 0
        assert seen[-1] == workers
