"""The run's resumable state (train/state.py): a run killed mid-way and resumed ends, field by field, in the state of
the run that was never stopped (the model, the EMA and post-hoc EMA averages, the optimizer, the curriculum, the
timestep sampler's history, the term's projector, the data position, every RNG stream, the skip counts, the log
window), writes the same snapshots and metrics, and continues the training clock of its checkpoint."""

import json
import shutil

import pytest
import torch
from conftest import assert_same_state, tiny
from safetensors.torch import load_file

from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.posthoc_ema import list_snapshots
from diffcurr_fast.train import loop
from diffcurr_fast.train.loop import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SETS = (
    "engine.max_steps=8",
    "checkpoint.every=3",
    "checkpoint.keep_last=5",
    "checkpoint.export_ema=false",
    "logging.log_every=4",
    "engine.cpu_threads=1",
    "optim.lr=1e-3",  # the rate at which the adaptive pacing unlocks a cluster at step 7 (the history pinned below)
    "optim.warmup_steps=2",
    "optim.schedule=cosine",
    "optim.grad_accum_steps=2",
    "optim.phema_every=2",
    "model.class_dropout_prob=0.5",
    "timesteps.sampler=importance",
    "timesteps.importance_history=2",
    "curriculum.pacing=adaptive",
    "curriculum.patience=1",
    "curriculum.eval_every=2",
    "terms.use=[sra]",
    "engine.max_nan_skips=4",
    "engine.max_skip_share=0.5",
)
# 0-based steps whose batch is NaN: a skip before the checkpoint of step 3, four in a row at 6; the log window of
# steps 1 to 4 has its two applied steps before the checkpoint
SKIPPED = (2, 3, 4, 5)


def _records(run):
    """metrics.jsonl without its timings."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("img_per_s", "train_s")} for r in recs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the run trained to the end, its copy killed after the checkpoint of step 3 and resumed there). The kill
    leaves the later files of the first attempt (checkpoints removed, snapshots and metrics lines kept) for the
    resume to clear."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    real = loop.Trainer.train_step

    def nan_batches(self, x0, y):
        return real(self, x0 * float("nan") if self.step in SKIPPED else x0, y)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(loop.Trainer, "train_step", nan_batches)
        base = tmp_path_factory.mktemp("state")
        whole = base / "run"
        Trainer(tiny(whole, *SETS)).fit()
        shutil.copytree(whole, base / "whole")
        for step, path in ck.list_checkpoints(whole):
            if step > 3:
                path.unlink()
        torch.manual_seed(12345)  # the resumed run must not depend on the state it starts in
        resumed = Trainer(tiny(whole, *SETS), resume=True)
        at_resume = resumed.train_s
        resumed.fit()
    torch.set_num_threads(n)
    return base / "whole", whole, at_resume


def test_the_checkpoint_carries_a_nontrivial_state(runs):
    """The state the resume must carry is there at step 3: the curriculum's monitor mid-stage, the sampler's history, a
    skipped step, the averages and the projector; the curriculum's unlock falls after the resume."""
    whole, _, _ = runs
    s = ck.load_checkpoint(whole / ck.CKPT_DIR / "ckpt_00000003.pt")
    assert s["nan_skips"] == 1 and s["nan_skip_run"] == [1, 3]
    assert s["phema"]["num_updates"] == s["ema"]["num_updates"] == 2
    assert s["curriculum"]["history"] == [] and s["curriculum"]["monitor"] is not None
    assert s["curriculum"]["steps_in_stage"] == 2 and s["curriculum"]["best"] == s["curriculum"]["monitor"]
    assert int(s["timesteps"]["importance"]["count"].sum()) == 2 * 16
    assert any(k.startswith("term_heads.sra.") for k in s["model"]) and s["train_s"] > 0


def test_a_resumed_run_ends_in_the_uninterrupted_runs_state_field_by_field(runs):
    whole, resumed, _ = runs
    assert [s for s, _ in ck.list_checkpoints(resumed)] == [s for s, _ in ck.list_checkpoints(whole)] == [3, 6, 8]
    for step in (6, 8):
        name = f"ckpt_{step:08d}.pt"
        a, b = (ck.load_checkpoint(r / ck.CKPT_DIR / name) for r in (whole, resumed))
        assert_same_state(a, b, skip=("train_s",))
    six = ck.load_checkpoint(resumed / ck.CKPT_DIR / "ckpt_00000006.pt")
    assert six["nan_skips"] == 4 and six["nan_skip_run"] == [4, 3]  # four in a row: one of them before the resume
    assert ck.load_checkpoint(resumed / ck.CKPT_DIR / "ckpt_00000008.pt")["curriculum"]["history"] == [7]


def test_a_resumed_run_writes_the_same_snapshots_and_metrics(runs):
    whole, resumed, _ = runs
    names = [(s.path.name, s.t) for s in list_snapshots(whole)]
    assert [(s.path.name, s.t) for s in list_snapshots(resumed)] == names and len(names) == 8
    for name, _ in names:
        assert_same_state(load_file(str(whole / "phema" / name)), load_file(str(resumed / "phema" / name)))
    recs = _records(whole)
    assert _records(resumed) == recs and [r["step"] for r in recs] == [4, 8] and recs[0]["loss"] > 0


def test_a_resumed_run_continues_the_training_clock_of_its_checkpoint(runs):
    whole, resumed, at_resume = runs
    saved = ck.load_checkpoint(whole / ck.CKPT_DIR / "ckpt_00000003.pt")["train_s"]
    assert at_resume == saved > 0
    later = [ck.load_checkpoint(resumed / ck.CKPT_DIR / f"ckpt_{s:08d}.pt")["train_s"] for s in (6, 8)]
    assert saved < later[0] < later[1]
