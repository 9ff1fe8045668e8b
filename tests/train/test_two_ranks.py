"""Two CPU ranks over gloo against one process, for the commands that run under torchrun: ``train`` (the global
batch does not depend on the world size; a signal on one rank stops both with its exit status), ``eval`` (the
samples and metrics of one process) and a study worker (one status file, the steps and FLOPs of one process).
``sample`` and ``tdc`` are compared in tests/cli/test_cli_errors.py and tests/tdc/test_tdc_ddp.py."""

import json
import os
import subprocess
import textwrap

import pytest
import torch
import yaml
from conftest import TORCHRUN2, run_torchrun2

BASE = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "diffusion.num_timesteps=60",
    "curriculum.num_clusters=4",
    "data.batch_size=8",
    "logging.progress=false",
    "logging.num_samples=0",
    "logging.plots=false",
    "checkpoint.export_ema=false",
    "checkpoint.every=100",
    "engine.device=cpu",
    "engine.cpu_threads=1",
]

TRAIN_SCRIPT = textwrap.dedent(
    """
    import json, os, signal, sys
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from diffcurr_fast.cli import main
    from diffcurr_fast.train import loop
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.engine import create_engine

    base, run_dir, out = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    dist.init_process_group("gloo")  # shared by both runs below (an engine closes only a group it started)
    rank, seen, signal_at = dist.get_rank(), [], [None]
    real = loop.Trainer.train_step

    def spy(self, x0, y):
        seen.append([x0.tolist(), y.tolist()])
        stats = real(self, x0, y)
        if rank == 1 and self.step == signal_at[0]:  # only rank 1 is signalled (no launcher forwards it)
            os.kill(os.getpid(), signal.SIGTERM)
        return stats

    loop.Trainer.train_step = spy
    cfg = load_config(None, base + [f"checkpoint.run_dir={run_dir}/order", "engine.max_steps=3", "engine.kind=ddp"])
    loop.Trainer(cfg, create_engine("ddp", "cpu")).fit()
    batches, seen[:] = list(seen), []
    signal_at[0] = 2
    sets = [a for s in base + ["engine.max_steps=50", "engine.kind=ddp"] for a in ("--set", s)]
    rc = main(["train", "--run-dir", f"{run_dir}/stop", *sets])
    with open(f"{out}.{rank}.json", "w") as fh:
        json.dump({"rank": rank, "batches": batches, "rc": rc, "stop_steps": len(seen)}, fh)
    dist.destroy_process_group()
    """
)


@pytest.mark.slow
def test_train_two_ranks_split_the_global_batch_and_stop_together(tmp_path, monkeypatch, one_thread):
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train import loop

    r0, r1 = run_torchrun2(tmp_path, TRAIN_SCRIPT, json.dumps(BASE), tmp_path / "ddp")
    seen = []
    real = loop.Trainer.train_step
    monkeypatch.setattr(loop.Trainer, "train_step", lambda self, x0, y: seen.append([x0, y]) or real(self, x0, y))
    loop.Trainer(load_config(None, BASE + [f"checkpoint.run_dir={tmp_path / 'one'}", "engine.max_steps=3"])).fit()
    # docs/training.md: rank r takes the r-th slice of every global batch (the data order ignores the world size)
    assert len(seen) == len(r0["batches"]) == len(r1["batches"]) == 3
    for (x, y), (x0, y0), (x1, y1) in zip(seen, r0["batches"], r1["batches"]):
        assert torch.equal(torch.cat([torch.tensor(x0), torch.tensor(x1)]), x)
        assert torch.equal(torch.tensor(y0 + y1), y)
    # SIGTERM on rank 1 only: both ranks checkpoint the same step and exit 143 (rank 0 by the vote's default)
    assert (r0["rc"], r1["rc"]) == (143, 143)
    assert r0["stop_steps"] == r1["stop_steps"] == 2
    ckpts = sorted(p.name for p in (tmp_path / "ddp" / "stop" / "checkpoints").glob("ckpt_*.pt"))
    assert ckpts == ["ckpt_00000002.pt"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.loop import train

    run = tmp_path_factory.mktemp("two_ranks") / "run"
    train(load_config(None, BASE + [f"checkpoint.run_dir={run}", "engine.max_steps=2", "optim.lr=3e-3"]))
    return run


def _eval_args(ckpt, out):
    return [
        "eval",
        "--ckpt",
        str(ckpt),
        "--num-samples",
        "7",
        "--batch-size",
        "2",
        "--steps",
        "2",
        "--ref",
        "digits",
        "--seed",
        "3",
        "--json",
        str(out),
    ]


@pytest.mark.slow
def test_eval_two_ranks_match_one_process(checkpoint, tmp_path, monkeypatch, one_thread):
    from diffcurr_fast.cli import main

    cache = str(tmp_path / "cache")  # the digits classifier is trained once, by the single-process run
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", cache)
    assert main(_eval_args(checkpoint, tmp_path / "one.json")) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DIFFCURR_FAST_CACHE": cache}
    cmd = [
        *TORCHRUN2,
        "-m",
        "diffcurr_fast.cli",
        *_eval_args(checkpoint, tmp_path / "two.json"),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("sampled 7 images") == 1 and "2 ranks" in r.stdout  # rank 0 alone reports
    assert "| 2/2 [" in r.stderr and "| 4/4 [" not in r.stderr  # rank 0 drew batches 0 and 2 of the 4
    one, two = (json.loads((tmp_path / n).read_text()) for n in ("one.json", "two.json"))
    assert one == two  # the same samples: every metric bitwise equal


STUDY_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    from diffcurr_fast.study import runner

    writes, real = [], runner.write_json
    runner.write_json = lambda data, path, **kw: writes.append(str(path)) or real(data, path, **kw)
    runner.main(sys.argv[1:-1])
    with open(f"{sys.argv[-1]}.{os.environ['RANK']}.json", "w") as fh:
        json.dump({"writes": writes}, fh)
    """
)

STUDY = {
    "name": "ranks",
    "metric": "fd",
    "seeds": [0],
    "set": [*BASE, "engine.max_steps=4"],
    "eval_every": 4,
    "eval": {"num_samples": 8, "steps": 2},
    "arms": [{"name": "plain"}],
}


@pytest.mark.slow
def test_study_worker_two_ranks_write_one_status_with_one_process_steps_and_flops(tmp_path, monkeypatch, one_thread):
    from diffcurr_fast.study.runner import prepare_study, read_status, run_one
    from diffcurr_fast.study.spec import spec_from_dict

    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path / "cache"))
    spec = spec_from_dict(yaml.safe_load(yaml.safe_dump(STUDY)), "test")
    one, two = prepare_study(spec, tmp_path / "one"), prepare_study(spec, tmp_path / "two")
    a = run_one(one, "plain", 0)
    w0, w1 = run_torchrun2(tmp_path, STUDY_SCRIPT, two, "plain", 0, 1)
    b = read_status(two, "plain", 0)
    assert w0["writes"] == [str(two / "status" / "plain-seed0.json")] and w1["writes"] == []  # rank 0 alone writes
    # docs/study.md: the global batch is the same, so the steps and training FLOPs are those of one process
    assert (b["steps"], b["train_flops"], b["final"]["step"]) == (a["steps"], a["train_flops"], a["final"]["step"])
    assert b["final"]["fd"] > 0 and b["final"]["fd"] != a["final"]["fd"]  # DDP ranks draw their own noise
