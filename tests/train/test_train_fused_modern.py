"""The modern block's fused ops in training: a checkpoint trained on the eager path resumes on the fused ops, and
the reverse, and continues as the run that never switched (the same math, float32 rounding apart)."""

import shutil

import pytest
import torch
from conftest import tiny

from diffcurr_fast.runs.checkpoint import load_checkpoint
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.report import read_metrics

MODERN = ["model.norm=rmsnorm", "model.qk_norm=true", "model.mlp=swiglu", "model.pos=rope2d"]
STEPS = ["engine.max_steps=4", "checkpoint.every=2", "logging.log_every=1"]


def _losses(run):
    return {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}


@pytest.mark.parametrize("first, then", [("false", "true"), ("true", "false")], ids=["to-fused", "to-eager"])
def test_a_checkpoint_switches_between_the_eager_and_the_fused_path(tmp_path, first, then, one_thread):
    straight = tmp_path / "straight"
    Trainer(tiny(straight, *MODERN, *STEPS, f"model.fused_adaln={first}")).fit()
    switched = tmp_path / "switched"
    shutil.copytree(straight, switched)
    (switched / "checkpoints" / "ckpt_00000004.pt").unlink()  # back to the checkpoint of step 2
    tr = Trainer(tiny(switched, *MODERN, *STEPS, f"model.fused_adaln={then}"), resume=True)
    assert tr.step == 2 and tr.model.blocks[0].fused_adaln == (then == "true")
    tr.fit()
    a, b = _losses(straight), _losses(switched)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4]
    assert a[1] == b[1] and a[2] == b[2]  # the steps before the switch, as logged by the first run
    for step in (3, 4):  # after it: the other path's arithmetic, the same function
        torch.testing.assert_close(b[step], a[step], rtol=1e-4, atol=1e-6)
    ckpts = [load_checkpoint(run / "checkpoints" / "ckpt_00000004.pt") for run in (straight, switched)]
    assert list(ckpts[0]["model"]) == list(ckpts[1]["model"])  # one state dict on either path
