"""Checkpoints: atomic writes, retention, exact resume, interrupted writes, incompatible configs, EMA export."""

import shutil
import subprocess
import sys

import pytest
import torch
from conftest import assert_resumed_state

from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.loop import Trainer, train

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(run_dir, *extra):
    return load_config(
        None,
        [
            f"checkpoint.run_dir={run_dir}",
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            "diffusion.num_timesteps=60",
            "curriculum.num_clusters=4",
            "curriculum.patience=1",
            "curriculum.eval_every=2",
            "data.batch_size=17",
            "engine.max_steps=6",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
            "checkpoint.export_ema=false",
            "optim.warmup_steps=2",
            "checkpoint.keep_last=5",
            *extra,
        ],
    )


def test_atomic_save_and_keep_last(tmp_path):
    for step in (1, 2, 3, 4):
        ck.save_checkpoint(tmp_path, step, {"model": {"w": torch.full((3,), float(step))}, "config": {}}, keep_last=2)
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [3, 4]
    assert not list((tmp_path / ck.CKPT_DIR).glob("*.tmp"))
    state = ck.load_checkpoint(ck.latest_checkpoint(tmp_path))
    assert torch.equal(state["model"]["w"], torch.full((3,), 4.0))
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        ck.save_checkpoint(tmp_path, 5, {}, keep_last=0)


def test_load_is_weights_only(tmp_path):
    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    path = tmp_path / "x.pt"
    torch.save({"model": {}, "config": {}, "obj": Evil()}, path)
    with pytest.raises(ValueError, match="is corrupt or not a weights-only torch file"):
        ck.load_checkpoint(path)
    torch.save({"something": 1}, path)
    with pytest.raises(ValueError, match="not a diffcurr_fast training checkpoint"):
        ck.load_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        ck.load_checkpoint(tmp_path / "missing.pt")


def test_resume_continues_exactly(tmp_path):
    """2N steps in one go == N steps, a checkpoint, a fresh process state, N more steps (fp32, CPU)."""
    full = tmp_path / "full"
    extra = ("engine.max_steps=8", "checkpoint.every=4", "optim.schedule=cosine", "model.class_dropout_prob=0.5")
    train(tiny(full, *extra))
    half = tmp_path / "half"
    (half / ck.CKPT_DIR).mkdir(parents=True)
    shutil.copy(full / ck.CKPT_DIR / "ckpt_00000004.pt", half / ck.CKPT_DIR / "ckpt_00000004.pt")
    torch.manual_seed(12345)  # the resumed run must not depend on the state it starts in
    tr = Trainer(tiny(half, *extra), resume=True)
    assert tr.step == 4 and tr.resumed_from.name == "ckpt_00000004.pt"
    tr.fit()
    a = ck.load_checkpoint(ck.latest_checkpoint(full))
    b = ck.load_checkpoint(ck.latest_checkpoint(half))
    assert a["step"] == b["step"] == 8
    assert_resumed_state(a, b)


def test_interrupted_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    run = tmp_path / "run"
    cfg = tiny(run, "engine.max_steps=4", "checkpoint.every=2")
    tr = Trainer(cfg)
    for _ in range(2):
        tr.train_step(*next(tr.loader))
    good = tr.save()
    before = good.read_bytes()
    for _ in range(2):
        tr.train_step(*next(tr.loader))

    def crash(src, dst):
        raise KeyboardInterrupt("killed between write and rename")

    monkeypatch.setattr(ck, "_replace", crash)
    with pytest.raises(KeyboardInterrupt):
        tr.save()
    monkeypatch.undo()
    assert ck.latest_checkpoint(run) == good and good.read_bytes() == before
    assert not list((run / ck.CKPT_DIR).glob("*.tmp"))
    resumed = Trainer(cfg, resume=True)
    assert resumed.step == 2
    assert resumed.fit()["step"] == 4


def test_killed_process_leaves_resumable_run(tmp_path):
    """A process killed with SIGKILL while writing: a stray .tmp is ignored, the last complete checkpoint loads."""
    run = tmp_path / "run"
    train(tiny(run, "engine.max_steps=2", "checkpoint.every=2"))
    code = (
        "import os, torch, sys\n"
        "from diffcurr_fast.runs import checkpoint as ck\n"
        "orig = torch.save\n"
        "def slow(obj, fh):\n"
        "    fh.write(b'partial'); fh.flush(); os.kill(os.getpid(), 9)\n"
        "torch.save = slow\n"
        f"ck.save_checkpoint({str(run)!r}, 4, {{'model': {{}}, 'config': {{}}}})\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True)
    assert proc.returncode == -9
    assert [p.name for p in (run / ck.CKPT_DIR).glob("*.tmp")] == ["ckpt_00000004.pt.tmp"]
    assert ck.latest_checkpoint(run).name == "ckpt_00000002.pt"
    tr = Trainer(tiny(run, "engine.max_steps=3"), resume=True)
    assert tr.step == 2 and tr.fit()["step"] == 3
    assert not list((run / ck.CKPT_DIR).glob("*.tmp"))  # the next save cleared the stray file


def test_resume_with_incompatible_config_is_refused(tmp_path):
    run = tmp_path / "run"
    train(tiny(run, "engine.max_steps=2"))
    with pytest.raises(ValueError, match="cannot resume: .*model.hidden_size: checkpoint 32 vs now 64"):
        Trainer(tiny(run, "model.hidden_size=64"), resume=True)
    with pytest.raises(ValueError, match="cannot resume: .*diffusion.prediction: checkpoint 'eps' vs now 'v'"):
        Trainer(tiny(run, "diffusion.prediction=v"), resume=True)
    tr = Trainer(tiny(run, "engine.max_steps=9", "optim.lr=5e-4"), resume=True)  # unlocked keys may change
    assert tr.step == 2


def test_resume_without_a_checkpoint_is_refused_and_writes_nothing(tmp_path):
    with pytest.raises(FileNotFoundError, match="cannot resume: run directory .* does not exist"):
        Trainer(tiny(tmp_path / "new"), resume=True)
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no checkpoint under checkpoints/"):
        Trainer(tiny(tmp_path / "empty"), resume=True)
    assert not any((tmp_path / "empty").iterdir())


def test_safetensors_export_round_trip(tmp_path):
    from safetensors import safe_open

    sd = {"a": torch.randn(3, 5), "b": torch.arange(4)}
    ck.export_safetensors(sd, tmp_path / "e.safetensors", {"step": 7, "config": {"x": 1}})
    with safe_open(str(tmp_path / "e.safetensors"), "pt") as f:
        assert f.metadata() == {"step": "7", "config": '{"x": 1}'}
        assert torch.equal(f.get_tensor("a"), sd["a"]) and torch.equal(f.get_tensor("b"), sd["b"])
