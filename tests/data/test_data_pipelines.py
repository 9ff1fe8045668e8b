import numpy as np
import pytest
import torch
from PIL import Image

from diffcurr_fast.data.dali import dali_available
from diffcurr_fast.data.errors import BadDataError
from diffcurr_fast.data.images import ImageDataset, ImageFolder, adm_crop_geometry, center_crop_arr
from diffcurr_fast.data.latents import FastDiTLatentWriter, ShardedLatentWriter, open_latents
from diffcurr_fast.data.pipeline import ShardedLoader

needs_dali = pytest.mark.skipif(not dali_available(), reason="NVIDIA DALI is not installed (nvidia-dali-cuda130)")
BACKENDS = ["torch", pytest.param("dali", marks=needs_dali)]


def _collect(loader):
    xs, ys = zip(*list(loader))
    return torch.cat(xs), torch.cat(ys)


@pytest.fixture(scope="module")
def latent_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("latents")
    rng = np.random.default_rng(0)
    lat = rng.standard_normal((17, 4, 3, 5)).astype(np.float32)
    lab = rng.integers(0, 10, 17)
    FastDiTLatentWriter(root / "fastdit").write(lat, lab)
    w = ShardedLatentWriter(root / "sharded", (4, 3, 5), shard_size=6)
    w.write(lat, lab)
    w.close()
    return root, lat, lab


def _smooth(h, w, rng):
    yy, xx = np.mgrid[0:h, 0:w]
    base = np.stack([np.sin(xx / 5 + c) + np.cos(yy / 7 - c) for c in range(3)], -1)
    return np.clip(127.5 + 60 * base + rng.normal(0, 2, (h, w, 3)), 0, 255).astype(np.uint8)


@pytest.fixture(scope="module")
def image_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(1)
    # exact: short side already the target size (no resampling, so every backend agrees bit for bit)
    for c in range(3):
        (root / "exact" / f"class{c}").mkdir(parents=True)
        for j, (h, w) in enumerate([(16, 16), (16, 23), (21, 16), (16, 17)]):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(
                root / "exact" / f"class{c}" / f"{j}.png"
            )
    # resized: needs box halvings and a bicubic resize
    (root / "resized" / "a").mkdir(parents=True)
    for j, (h, w) in enumerate([(40, 52), (33, 70), (90, 64)]):
        Image.fromarray(_smooth(h, w, rng)).save(root / "resized" / "a" / f"{j}.png")
    return root


@pytest.mark.parametrize("layout", ["fastdit", "sharded"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_latent_loader_reads_the_shared_order(latent_dirs, layout, backend, batch):
    root, lat, lab = latent_dirs
    ds = open_latents(root / layout)
    for shard in range(2):
        loader = ShardedLoader(ds, batch, seed=7, shard_id=shard, num_shards=2, backend=backend)
        x, y = _collect(loader)
        idx = loader.keys(0)[0]
        assert x.dtype == torch.float32 and y.dtype == torch.int64 and x.shape == (len(idx), 4, 3, 5)
        np.testing.assert_array_equal(x.numpy(), lat[idx])
        np.testing.assert_array_equal(y.numpy(), lab[idx])


@needs_dali
def test_dali_equals_torch_across_epochs_and_shards(latent_dirs):
    root, _, _ = latent_dirs
    ds = open_latents(root / "fastdit")
    seen = []
    for shard in range(3):
        out = {}
        for backend in ("torch", "dali"):
            loader = ShardedLoader(ds, 4, seed=3, shard_id=shard, num_shards=3, backend=backend)
            out[backend] = [_collect(loader) for _ in range(2)]  # two epochs
        for (xt, yt), (xd, yd) in zip(out["torch"], out["dali"]):
            assert torch.equal(xt, xd) and torch.equal(yt, yd)
        assert not torch.equal(out["torch"][0][1], out["torch"][1][1])  # reshuffled between epochs
        seen.append(out["torch"][0][0])
    # the three ranks together cover the 17 latents exactly once
    allx = torch.cat(seen).reshape(17, -1)
    assert torch.unique(allx, dim=0).shape[0] == 17


@pytest.mark.parametrize("backend", BACKENDS)
def test_resume_position(latent_dirs, backend):
    root, _, _ = latent_dirs
    ds = open_latents(root / "sharded")
    ref = ShardedLoader(ds, 3, seed=1, backend="torch")
    full = [b for b in ref] + [b for b in ref]  # epochs 0 and 1
    loader = ShardedLoader(ds, 3, seed=1, backend=backend)
    it = iter(loader)
    for _ in range(2):
        next(it)
    state = loader.state_dict()
    assert state["epoch"] == 0 and state["start"] == 6
    resumed = ShardedLoader(ds, 3, seed=1, backend=backend)
    resumed.load_state_dict(state)
    rest = [b for b in resumed] + [b for b in resumed]
    assert len(rest) == len(full) - 2
    for (xa, ya), (xb, yb) in zip(rest, full[2:]):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    with pytest.raises(ValueError, match="cannot resume"):
        ShardedLoader(ds, 3, seed=2).load_state_dict(state)


@pytest.mark.parametrize("backend", BACKENDS + [pytest.param("dali-parallel", marks=needs_dali)])
def test_image_loader_exact(image_dirs, backend):
    backend, py_workers = ("dali", 1) if backend == "dali-parallel" else (backend, 0)
    folder = ImageFolder(image_dirs / "exact")
    assert folder.classes == ["class0", "class1", "class2"] and len(folder) == 12
    ds = ImageDataset(folder, 16)
    for shard in range(2):
        loader = ShardedLoader(
            folder, 5, image_size=16, seed=4, shard_id=shard, num_shards=2, backend=backend, dali_py_workers=py_workers
        )
        x, y = _collect(loader)
        idx, flips = loader.keys(0)
        assert x.shape == (6, 3, 16, 16) and flips.any()
        for k, (i, f) in enumerate(zip(idx, flips)):
            img = np.array(Image.open(folder.files[i]).convert("RGB"))
            h, w = img.shape[:2]
            crop = img[(h - 16) // 2 : (h - 16) // 2 + 16, (w - 16) // 2 : (w - 16) // 2 + 16]
            ref = torch.from_numpy(np.ascontiguousarray(crop[:, ::-1] if f else crop)).permute(2, 0, 1) / 127.5 - 1
            torch.testing.assert_close(x[k], ref.float(), atol=1e-6, rtol=0)
            assert int(y[k]) == folder.labels[i]
            torch.testing.assert_close(ds[(int(i), bool(f))][0], x[k], atol=1e-6, rtol=0)


@needs_dali
def test_image_loader_dali_matches_torch_after_resize(image_dirs):
    folder = ImageFolder(image_dirs / "resized")
    xt, yt = _collect(ShardedLoader(folder, 2, image_size=16, seed=0, backend="torch"))
    xd, yd = _collect(ShardedLoader(folder, 2, image_size=16, seed=0, backend="dali"))
    assert torch.equal(yt, yd) and xt.shape == xd.shape == (3, 3, 16, 16)
    # same crop geometry, different resampling filters: close on smooth images
    assert (xt - xd).abs().mean() < 0.03


def test_center_crop_arr_geometry():
    img = Image.fromarray(np.zeros((90, 64, 3), np.uint8))
    assert center_crop_arr(img, 16).shape == (16, 16, 3)
    geo = adm_crop_geometry(64, 90, 16)  # halved twice (64 -> 32 -> 16 wide), then no resize needed
    assert geo.halved == (16, 22) and geo.resized == (16, 22) and geo.offset == (0, 3)
    with pytest.raises(ValueError, match="image_size"):
        adm_crop_geometry(10, 10, 0)


def test_bad_images(tmp_path):
    cls = tmp_path / "c0"
    cls.mkdir()
    for j in range(3):
        Image.fromarray(np.full((16, 16, 3), 40 * j, np.uint8)).save(cls / f"{j}.png")
    good = (cls / "1.png").read_bytes()
    (cls / "1.png").write_bytes(good[: len(good) // 2])  # truncated
    (cls / "2.png").write_bytes(b"not an image")  # corrupt
    with pytest.raises(BadDataError, match="1.png"):
        ImageFolder(tmp_path)
    with pytest.warns(UserWarning, match="skipped 2 bad file"):
        folder = ImageFolder(tmp_path, on_bad="skip", check="full")
    assert [p.name for p in folder.files] == ["0.png"] and "skipped 2" in folder.report.summary()
    # found only at read time (no check): stop names the file, skip drops and counts it
    unchecked = ImageFolder(tmp_path, on_bad="stop", check="none")
    with pytest.raises(ValueError, match="1.png"):
        _collect(ShardedLoader(unchecked, 3, image_size=16, backend="torch", shuffle=False))
    lenient = ImageFolder(tmp_path, on_bad="skip", check="none")
    loader = ShardedLoader(lenient, 3, image_size=16, backend="torch", shuffle=False)
    x, _ = _collect(loader)
    assert x.shape[0] == 1 and loader.skipped == 2
    # a batch whose every sample is skipped still advances the resume position
    (cls / "0.png").rename(cls / "3.png")  # order: 1.png (bad), 2.png (bad), 3.png
    one_by_one = ShardedLoader(
        ImageFolder(tmp_path, on_bad="skip", check="none"), 1, image_size=16, backend="torch", shuffle=False
    )
    it = iter(one_by_one)
    next(it)  # 3.png, after two skipped batches
    assert one_by_one.state_dict()["start"] == 3 and one_by_one.skipped == 2
    empty = tmp_path / "empty"
    (empty / "c").mkdir(parents=True)
    with pytest.raises(ValueError, match="empty folder"):
        ImageFolder(empty)
    with pytest.raises(ValueError, match="no class subdirectories"):
        ImageFolder(empty / "c")


@needs_dali
def test_dali_bad_image_names_file(tmp_path):
    cls = tmp_path / "c0"
    cls.mkdir()
    Image.fromarray(np.zeros((16, 16, 3), np.uint8)).save(cls / "0.png")
    (cls / "1.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 40)
    folder = ImageFolder(tmp_path, check="none")
    with pytest.raises(ValueError, match="1.png"):
        _collect(ShardedLoader(folder, 2, image_size=16, backend="dali"))


def test_loader_argument_errors(latent_dirs, image_dirs):
    root, _, _ = latent_dirs
    with pytest.raises(ValueError, match="backend must be one of"):
        ShardedLoader(root / "fastdit", 2, backend="jax")
    with pytest.raises(ValueError, match="image folders only"):
        ShardedLoader(open_latents(root / "fastdit"), 2, image_size=16)
    with pytest.raises(ValueError, match="batch_size"):
        ShardedLoader(root / "fastdit", 0)
    with pytest.raises(ValueError, match="need image_size"):
        ShardedLoader(ImageFolder(image_dirs / "exact"), 2)


@needs_dali
@pytest.mark.parametrize("kind", ["fastdit", "sharded", "images", "images-parallel"])
def test_dali_pipeline_is_built_once_across_epochs(latent_dirs, image_dirs, kind, monkeypatch):
    from nvidia.dali import Pipeline

    built = []  # every pipeline that was built (run() calls build() again, a no-op once built)
    build = Pipeline.build
    monkeypatch.setattr(Pipeline, "build", lambda self: (built.append(self), build(self))[1])
    builds = lambda: len({id(p) for p in built})  # noqa: E731
    if kind.startswith("images"):
        source, kw = ImageFolder(image_dirs / "exact"), {"image_size": 16, "dali_py_workers": int(kind != "images")}
    else:
        source, kw = open_latents(latent_dirs[0] / kind), {}
    b = 4 if kind.startswith("images") else 3  # 6 images -> batches of 4 and 2; 8 latents -> 3, 3 and 2
    args = dict(seed=5, shard_id=1, num_shards=2, **kw)
    dali_loader = ShardedLoader(source, b, backend="dali", **args)
    torch_loader = ShardedLoader(source, b, backend="torch", **args)
    for epoch in range(4):  # every epoch in turn: the loader's own position, then epoch_batches
        got = list(dali_loader) if epoch < 2 else list(dali_loader.epoch_batches(epoch))
        want = list(torch_loader.epoch_batches(epoch))
        assert len(got) == len(want) == len(dali_loader)
        for (xd, yd), (xt, yt) in zip(got, want):
            torch.testing.assert_close(xd, xt, atol=1e-6, rtol=0)
            assert torch.equal(yd, yt)
    assert builds() == 1 and dali_loader.dali_builds == 1
    # an interrupted epoch continues on the same pipeline; a jump to another position builds a new one
    it = dali_loader.epoch_batches(4)
    first = next(it)
    del it
    rest = list(dali_loader.epoch_batches(4, start=b))
    assert builds() == 1
    for (xd, yd), (xt, yt) in zip([first, *rest], torch_loader.epoch_batches(4)):
        torch.testing.assert_close(xd, xt, atol=1e-6, rtol=0)
        assert torch.equal(yd, yt)
    xj, yj = _collect(dali_loader.epoch_batches(2, start=3))
    xt, yt = _collect(torch_loader.epoch_batches(2, start=3))
    assert builds() == 2 and torch.equal(yj, yt)
    torch.testing.assert_close(xj, xt, atol=1e-6, rtol=0)
