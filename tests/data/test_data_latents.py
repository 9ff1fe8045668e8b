import json

import numpy as np
import pytest

from diffcurr_fast.data.errors import BadDataError
from diffcurr_fast.data.latents import (
    FastDiTLatents,
    FastDiTLatentWriter,
    ShardedLatents,
    ShardedLatentWriter,
    detect_latent_format,
    open_latents,
)


def _latents(n=17, shape=(4, 3, 5), seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, *shape)).astype(np.float32), rng.integers(0, 10, n)


@pytest.mark.parametrize("n", [1, 3, 17])
def test_fastdit_roundtrip(tmp_path, n):
    lat, lab = _latents(n)
    w = FastDiTLatentWriter(tmp_path)
    w.write(lat[:2], lab[:2])
    w = FastDiTLatentWriter(tmp_path)  # resumes after what is on disk
    assert w.num_written == min(2, n)
    w.write(lat[w.num_written :], lab[w.num_written :])
    assert np.load(tmp_path / "features" / "0.npy").shape == (1, 4, 3, 5)  # fast-DiT's (1, C, H, W)
    ds = open_latents(tmp_path)
    assert isinstance(ds, FastDiTLatents) and detect_latent_format(tmp_path) == "fastdit"
    assert len(ds) == n and ds.latent_shape == (4, 3, 5)
    for i in range(n):
        x, y = ds[i]
        np.testing.assert_array_equal(x.numpy(), lat[i])
        assert int(y) == lab[i]


def test_fastdit_named_dirs_and_numeric_order(tmp_path):
    lat, lab = _latents(12)
    (tmp_path / "imagenet256_features").mkdir()
    (tmp_path / "imagenet256_labels").mkdir()
    for i in range(12):
        np.save(tmp_path / "imagenet256_features" / f"{i}.npy", lat[i][None])
        np.save(tmp_path / "imagenet256_labels" / f"{i}.npy", lab[i : i + 1])
    ds = FastDiTLatents(tmp_path)
    np.testing.assert_array_equal(ds.read(10)[0], lat[10])  # numeric, not lexicographic, order


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_sharded_roundtrip_and_resume(tmp_path, dtype):
    lat, lab = _latents(17)
    w = ShardedLatentWriter(tmp_path, (4, 3, 5), shard_size=5, dtype=dtype, scale=0.18215)
    w.write(lat[:12], lab[:12])  # two full shards flushed, two samples buffered (lost if the run stops here)
    assert w.num_written == 10
    w = ShardedLatentWriter(tmp_path, (4, 3, 5), shard_size=5, dtype=dtype)
    assert w.num_written == 10
    w.write(lat[10:], lab[10:])
    w.close()
    ds = open_latents(tmp_path)
    assert isinstance(ds, ShardedLatents) and len(ds) == 17 and ds.scale == pytest.approx(0.18215)
    assert [s["count"] for s in json.loads((tmp_path / "index.json").read_text())["shards"]] == [5, 5, 5, 2]
    tol = 0 if dtype == "float32" else 2e-3
    for i in (0, 4, 5, 16):
        x, y = ds[i]
        np.testing.assert_allclose(x.numpy(), lat[i], atol=tol * 4, rtol=tol)
        assert int(y) == lab[i]
    with pytest.raises(ValueError, match="cannot resume"):
        ShardedLatentWriter(tmp_path, (4, 3, 6), dtype=dtype)


def _fastdit(tmp_path, n=5):
    lat, lab = _latents(n)
    FastDiTLatentWriter(tmp_path).write(lat, lab)
    return tmp_path / "features", tmp_path / "labels"


@pytest.mark.parametrize(
    "case,match",
    [
        ("truncated", "truncated"),
        ("not_npy", "not a readable .npy"),
        ("wrong_shape", "wrong shape"),
        ("wrong_dtype", "wrong dtype"),
        ("label_dtype", "wrong label"),
        ("missing_label", "unpaired"),
        ("extra_label", "unpaired"),
        ("other_shape", "other latents"),
    ],
)
def test_fastdit_bad_files(tmp_path, case, match):
    feats, labels = _fastdit(tmp_path)
    bad = feats / "2.npy"
    if case == "truncated":
        data = bad.read_bytes()
        bad.write_bytes(data[: len(data) - 7])
    elif case == "not_npy":
        bad.write_bytes(b"garbage")
    elif case == "wrong_shape":
        np.save(bad, np.zeros((2, 2), np.float32))
    elif case == "wrong_dtype":
        np.save(bad, np.zeros((1, 4, 3, 5), np.int32))
    elif case == "label_dtype":
        bad = labels / "2.npy"
        np.save(bad, np.zeros(1, np.float32))
    elif case == "missing_label":
        (labels / "2.npy").unlink()
    elif case == "extra_label":
        bad = labels / "9.npy"
        np.save(bad, np.zeros(1, np.int64))
    elif case == "other_shape":
        np.save(bad, np.zeros((1, 4, 3, 6), np.float32))
    with pytest.raises(BadDataError, match=match) as info:
        FastDiTLatents(tmp_path)
    assert str(bad) in str(info.value)
    with pytest.warns(UserWarning, match="skipped 1 bad file"):
        ds = FastDiTLatents(tmp_path, on_bad="skip")
    assert len(ds.report) == 1 and ds.report.problems[0][0] == str(bad)
    assert len(ds) == (5 if case == "extra_label" else 4)


def test_empty_and_missing_dirs(tmp_path):
    (tmp_path / "features").mkdir()
    (tmp_path / "labels").mkdir()
    with pytest.raises(ValueError, match="empty latent directory"):
        FastDiTLatents(tmp_path)
    with pytest.raises(FileNotFoundError, match="no fast-DiT layout"):
        open_latents(tmp_path / "features")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        open_latents(tmp_path / "nope")
    with pytest.raises(ValueError, match="on_bad must be one of"):
        FastDiTLatents(tmp_path, on_bad="ignore")


def test_sharded_bad_files(tmp_path):
    lat, lab = _latents(10)
    w = ShardedLatentWriter(tmp_path, (4, 3, 5), shard_size=4)
    w.write(lat, lab)
    w.close()
    np.save(tmp_path / "shard-00001.labels.npy", lab[:3])  # labels not matching the latents
    with pytest.raises(BadDataError, match="labels not matching latents") as info:
        ShardedLatents(tmp_path)
    assert "shard-00001.labels.npy" in str(info.value)
    with pytest.warns(UserWarning, match="skipped 1"):
        ds = ShardedLatents(tmp_path, on_bad="skip")
    assert len(ds) == 6
    np.testing.assert_array_equal(ds.read(4)[0], lat[8])  # shard 2 follows shard 0
    np.save(tmp_path / "shard-00001.labels.npy", lab[4:8])
    np.save(tmp_path / "shard-00002.latents.npy", lat[:2, :2])
    with pytest.raises(BadDataError, match="wrong shape"):
        ShardedLatents(tmp_path)
    (tmp_path / "index.json").write_text("{")
    with pytest.raises(ValueError, match="invalid JSON"):
        ShardedLatents(tmp_path)
