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
