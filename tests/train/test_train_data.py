"""Data path: built-in digits, npz files and directories, resumable loader positions, rank slicing, recipes."""

from pathlib import Path

import numpy as np
import pytest
import torch

from diffcurr_fast.data.builtin import load_builtin, load_digits_tensors
from diffcurr_fast.data.loader import ArrayDataset, EpochBatchSampler, ResumableLoader, load_npz
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.loop import train

RECIPES = Path(__file__).resolve().parents[2] / "diffcurr_fast" / "recipes"


def test_digits():
    x, y = load_digits_tensors()
    assert x.shape == (1797, 1, 8, 8) and y.shape == (1797,) and x.dtype == torch.float32
    assert float(x.min()) == -1.0 and float(x.max()) == 1.0 and set(y.tolist()) == set(range(10))
    with pytest.raises(ValueError, match="unknown built-in dataset 'mnist'; choose one of \\('digits', 'mnist5k'\\)"):
        load_builtin("mnist")


def _batches(loader, n):
    return [next(loader) for _ in range(n)]


@pytest.mark.parametrize("n, batch", [(17, 5), (23, 4), (10, 10)])
def test_loader_resume_and_epochs(n, batch):
    ds = ArrayDataset(torch.randn(n, 1, 2, 2), torch.arange(n))
    ref = _batches(ResumableLoader(ds, batch, seed=3), 9)
    per_epoch = n // batch
    seen = torch.cat([y for _, y in ref[:per_epoch]])
    assert len(set(seen.tolist())) == per_epoch * batch  # no repeats within an epoch
    for cut in (0, 1, per_epoch, 5):
        a = ResumableLoader(ds, batch, seed=3)
        _batches(a, cut)
        b = ResumableLoader(ds, batch, seed=3)
        b.load_state_dict(a.state_dict())
        for (x1, y1), (x2, y2) in zip(_batches(b, 9 - cut), ref[cut:]):
            assert torch.equal(x1, x2) and torch.equal(y1, y2)
    with pytest.raises(ValueError, match="saved with seed 3 and global batch"):
        ResumableLoader(ds, batch, seed=4).load_state_dict(ResumableLoader(ds, batch, seed=3).state_dict())


def test_ranks_partition_the_global_batch():
    full = list(EpochBatchSampler(30, 6, 0, 1, seed=1, epoch=2))
    parts = [list(EpochBatchSampler(30, 6, r, 3, seed=1, epoch=2)) for r in range(3)]
    for k, idx in enumerate(full):
        assert sum((p[k] for p in parts), []) == idx
    with pytest.raises(ValueError, match="global batch size 6 is not divisible by the world size 4"):
        EpochBatchSampler(30, 6, 0, 4, seed=1, epoch=0)
    with pytest.raises(ValueError, match="has 5 samples, fewer than one global batch of 6"):
        EpochBatchSampler(5, 6, 0, 1, seed=1, epoch=0)


class _Plain(torch.utils.data.Dataset):
    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


@pytest.mark.parametrize("workers", [0, 1])
def test_dataloader_path_matches_fast_path(workers):
    ds = ArrayDataset(torch.randn(13, 2, 3, 3), torch.arange(13), scale=0.5)
    fast = _batches(ResumableLoader(ds, 3, seed=0), 6)
    slow = _batches(ResumableLoader(_Plain(ds), 3, seed=0, num_workers=workers), 6)
    for (x1, y1), (x2, y2) in zip(fast, slow):
        assert torch.equal(x1, x2) and torch.equal(y1, y2)
    assert torch.equal(fast[0][0], ds.x[fast[0][1]] * 0.5)


def test_npz_file_and_directory(tmp_path):
    x = np.random.default_rng(0).standard_normal((7, 4, 2, 2)).astype(np.float16)
    y = np.arange(7) % 3
    np.savez(tmp_path / "d.npz", x=x, y=y)
    (tmp_path / "dir").mkdir()
    np.save(tmp_path / "dir" / "x.npy", x)
    np.save(tmp_path / "dir" / "y.npy", y)
    a, b = load_npz(tmp_path / "d.npz", scale=2.0), load_npz(tmp_path / "dir", scale=2.0)
    xa, ya = a.batch([6, 0, 3])
    xb, yb = b.batch([6, 0, 3])
    assert xa.dtype == torch.float32 and torch.equal(xa, xb) and torch.equal(ya, yb)
    torch.testing.assert_close(xa, torch.from_numpy(x[[6, 0, 3]]).float() * 2.0)
    np.savez(tmp_path / "bad.npz", images=x)
    with pytest.raises(ValueError, match="lacks array\\(s\\) \\['x', 'y'\\]"):
        load_npz(tmp_path / "bad.npz")
    with pytest.raises(FileNotFoundError, match="must contain x.npy and y.npy"):
        load_npz(tmp_path)


def test_recipe_runs_on_user_data(tmp_path):
    """A latent recipe trains on a user directory of x.npy / y.npy (a tiny custom DiT and batch stand in)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    data = tmp_path / "latents"
    data.mkdir()
    rng = np.random.default_rng(0)
    np.save(data / "x.npy", rng.standard_normal((12, 4, 8, 8)).astype(np.float32) / 0.18215)
    np.save(data / "y.npy", rng.integers(0, 1000, 12))
    cfg = load_config(
        RECIPES / "dit_b2_curriculum_minsnr.yaml",
        [
            f"data.path={data}",
            "data.num_workers=0",
            "data.batch_size=6",
            "model.preset=custom",
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            "model.input_size=8",
            "engine.max_steps=2",
            "engine.precision=fp32",
            "engine.device=cpu",
            f"checkpoint.run_dir={tmp_path / 'run'}",
            "logging.progress=false",
            "checkpoint.export_ema=false",
            "logging.plots=false",
        ],
    )
    assert cfg.diffusion.weighting == "min_snr" and cfg.curriculum.pacing == "patience"
    try:
        summary = train(cfg)
    finally:
        torch.set_num_threads(threads)
    assert summary["step"] == 2 and np.isfinite(summary["loss"])
    assert (tmp_path / "run" / "checkpoints" / "ckpt_00000002.pt").is_file()


def test_dali_on_a_gpu_decodes_there_and_spawns_its_workers(monkeypatch):
    from diffcurr_fast.data import dali, pipeline
    from diffcurr_fast.train.data import dali_placement

    monkeypatch.setattr(pipeline, "resolve_backend", lambda b, on_gpu=False: "dali" if b in ("auto", "dali") else b)
    assert dali_placement("dali", torch.device("cuda", 1), "images") == (1, "mixed")
    assert dali_placement("auto", torch.device("cuda", 0), "latents") == (0, "cpu")
    assert dali_placement("dali", torch.device("cpu"), "images") == (None, "cpu")
    assert dali_placement("torch", torch.device("cuda", 0), "images") == (None, "cpu")
    assert dali_placement("dali", None, "images") == (None, "cpu")
    # fork is refused once CUDA is initialised: GPU pipelines (and CUDA processes) spawn their workers
    assert dali.py_start_method(0) == "spawn"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    assert dali.py_start_method(None) == "fork"
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    assert dali.py_start_method(None) == "spawn"


def test_num_workers_above_the_cpus_is_lowered_once(monkeypatch):
    """A recipe's data.num_workers 4 on a 2-core machine: one warning naming both numbers, 2 workers used (not
    PyTorch's two warnings and four processes competing for two cores)."""
    import warnings

    from diffcurr_fast.train import data

    monkeypatch.setattr(data.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert data.usable_workers(4) == 2 and data.usable_workers(2) == 2 and data.usable_workers(0) == 0
    assert [str(x.message) for x in w] == ["data.num_workers 4 is more than the 2 CPU(s) this process may use; using 2"]
