"""Evaluation during training (bit-identical training stream, resume) and the study runner and report."""

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
import yaml

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.study.presets import preset_spec
from diffcurr_fast.study.report import (
    collect,
    mean_std,
    paired_t,
    run_folder_plots,
    sample_line,
    summarize,
    write_report,
)
from diffcurr_fast.study.runner import read_status, run_dir_of, run_study, status_path
from diffcurr_fast.study.spec import load_spec, spec_from_dict
from diffcurr_fast.train.loop import Trainer, train


@pytest.fixture(autouse=True)
def _shared_cache(one_thread, tmp_path_factory, monkeypatch):
    # the digits classifier cache is shared by the tests of this file (trained once, in a few seconds)
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


TINY = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "diffusion.num_timesteps=60",
    "curriculum.num_clusters=4",
    "curriculum.patience=1",
    "curriculum.eval_every=2",
    "data.batch_size=16",
    "logging.log_every=4",
    "logging.progress=false",
    "logging.num_samples=0",
    "logging.plots=false",
    "checkpoint.export_ema=false",
    "optim.warmup_steps=2",
    "eval.num_samples=16",
    "eval.steps=3",
    "eval.cfg_scale=2.0",
    "engine.cpu_threads=1",
    "optim.schedule=constant",
]


def tiny(run_dir, *extra):
    return load_config(None, [*TINY, f"checkpoint.run_dir={run_dir}", *extra])


def _weights(run_dir):
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint

    state = load_checkpoint(latest_checkpoint(run_dir), map_location="cpu")
    return state["model"], state["ema"]["module"]


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_during_training_keeps_the_training_stream(tmp_path):
    """A run with evaluation on trains exactly the weights of one without; a resumed evaluated run too."""
    train(tiny(tmp_path / "plain", "engine.max_steps=12", "checkpoint.every=6"))
    train(tiny(tmp_path / "eval", "engine.max_steps=12", "checkpoint.every=6", "logging.eval_every=5"))
    train(tiny(tmp_path / "cut", "engine.max_steps=6", "checkpoint.every=6", "logging.eval_every=5"))
    train(tiny(tmp_path / "cut", "engine.max_steps=12", "checkpoint.every=6", "logging.eval_every=5"), resume=True)
    plain = _weights(tmp_path / "plain")
    for name in ("eval", "cut"):
        got = _weights(tmp_path / name)
        assert _same(plain[0], got[0]) and _same(plain[1], got[1]), name
    recs = [json.loads(line) for line in (tmp_path / "eval" / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r.get("eval")]
    assert [r["step"] for r in evals] == [5, 10, 12]  # every 5 steps and at the end
    assert all(math.isfinite(r["fd"]) and r["fd"] > 0 and r["extractor"] == "digits" for r in evals)
    assert all(0 <= r["precision"] <= 1 and 0 <= r["recall"] <= 1 and r["is"] >= 1 for r in evals)
    assert (tmp_path / "eval" / "eval_reference.npz").is_file()  # the reference is cached in the run dir
    cut = [
        r["step"]
        for r in map(json.loads, (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines())
        if r.get("eval")
    ]
    assert cut == [5, 6, 10, 12]  # the first part's final evaluation at 6, then the resumed run's


def test_evaluator_samples_are_fixed_and_leave_the_global_rng(tmp_path):
    from diffcurr_fast.train.evaluation import Evaluator

    cfg = tiny(tmp_path / "r", "logging.eval_every=1")
    tr = Trainer(cfg)
    ev = Evaluator(cfg, tr.run_dir, tr.dataset, tr.device)
    state = torch.get_rng_state()
    a = ev.sample(tr.ema.module, tr.formulation)
    assert torch.equal(state, torch.get_rng_state())
    assert torch.equal(a, ev.sample(tr.ema.module, tr.formulation))  # the same noise at every evaluation
    assert a.shape == (16, 1, 8, 8) and float(a.abs().max()) <= 1.0


def test_eval_config_errors():
    with pytest.raises(ValueError, match="eval.features 'inception' needs eval.inception_weights"):
        load_config(None, ["eval.features=inception"])
    with pytest.raises(ValueError, match="valid choices: digits, mnist5k, inception"):
        load_config(None, ["eval.features=clip"])
    with pytest.raises(ValueError, match="eval.sampler 'ddim' cannot sample a flow model"):
        load_config(
            None,
            [
                "diffusion.formulation=flow",
                "diffusion.prediction=velocity",
                "diffusion.learn_sigma=false",
                "diffusion.weighting=none",
                "logging.sampler=euler",
                "logging.eval_every=5",
                "eval.sampler=ddim",
            ],
        )
    flow = load_config(None, ["diffusion.formulation=flow", "logging.eval_every=5"])  # auto: the formulation's own
    assert flow.eval.sampler == "heun"


# ---- statistics -----------------------------------------------------------------------------------------------
def test_paired_t_against_a_hand_computation():
    # diffs 1, 2, 3, 4: mean 2.5; s = sqrt(((1.5^2 + 0.5^2) * 2) / 3) = sqrt(5/3) = 1.290994;
    # t_{0.975, 3} = 3.182446; half width = 3.182446 * 1.290994 / 2 = 2.054260
    p = paired_t([1.0, 2.0, 3.0, 4.0], lower_is_better=True)
    assert p.n == 4 and p.mean == pytest.approx(2.5) and p.std == pytest.approx(1.290994, abs=1e-6)
    assert p.ci_lo == pytest.approx(2.5 - 2.054260, abs=1e-5) and p.ci_hi == pytest.approx(2.5 + 2.054260, abs=1e-5)
    assert p.improved == 0
    q = paired_t([-1.0, -3.0, 2.0], lower_is_better=True)  # two of three seeds lower
    assert q.improved == 2 and paired_t([-1.0, -3.0, 2.0], lower_is_better=False).improved == 1
    # mean -2/3; s = sqrt(((1/3)^2 + (7/3)^2 + (8/3)^2) / 2) = sqrt(19/3) = 2.516611; t_{0.975, 2} = 4.302653
    assert q.mean == pytest.approx(-2 / 3) and q.std == pytest.approx(2.516611, abs=1e-6)
    assert q.ci_hi - q.mean == pytest.approx(4.302653 * 2.516611 / math.sqrt(3), abs=1e-5)
    assert mean_std([3.0]) == (3.0, 0.0) and math.isnan(paired_t([]).mean)


# ---- the study ------------------------------------------------------------------------------------------------
SPEC = {
    "name": "tiny",
    "set": [*TINY, "engine.max_steps=24", "checkpoint.every=8", "curriculum.pacing=none"],
    "seeds": [0, 1],
    "metric": "fd",
    "reference": "vanilla",
    "eval_every": 8,
    "eval": {"num_samples": 16, "steps": 3},
    "arms": [{"name": "vanilla"}, {"name": "cl", "set": ["curriculum.pacing=patience", "curriculum.method=snr"]}],
}


def _write_spec(tmp_path, data=SPEC):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_study_runs_reports_and_matches_a_hand_computation(tmp_path):
    spec = load_spec(_write_spec(tmp_path))
    out = tmp_path / "study"
    res = run_study(spec, out, workers=2, verbose=False)
    assert res["failed"] == [] and len(res["ran"]) == 4
    files = write_report(out)
    for name in ("results.csv", "report.md", "metric_vs_step.png", "curriculum_timelines.png", "cluster_loss.png"):
        assert (out / name).is_file(), name
    assert (run_dir_of(out, "cl", 1) / "checkpoints").is_dir()  # an ordinary run directory
    rows = [line.split(",") for line in (out / "results.csv").read_text().splitlines()]
    assert rows[0][:4] == ["arm", "seed", "step", "fd"]
    assert sorted({(r[0], r[1], r[2]) for r in rows[1:]}) == sorted(
        (a, str(s), str(st)) for a in ("cl", "vanilla") for s in (0, 1) for st in (8, 16, 24)
    )
    # the report's numbers from the runs' own final evaluations, by hand
    fd = {(a, s): read_status(out, a, s)["final"]["fd"] for a in ("vanilla", "cl") for s in (0, 1)}
    assert (
        fd[("vanilla", 0)]
        == json.loads((run_dir_of(out, "vanilla", 0) / "metrics.jsonl").read_text().splitlines()[-1])["fd"]
    )
    d = [fd[("cl", s)] - fd[("vanilla", s)] for s in (0, 1)]
    mean, sd = (d[0] + d[1]) / 2, abs(d[0] - d[1]) / math.sqrt(2)
    half = 12.706205 * sd / math.sqrt(2)  # t_{0.975, 1}
    arms = summarize(*collect(out)[::2])
    p = arms["cl"]["paired"]
    assert p.mean == pytest.approx(mean) and p.ci_hi == pytest.approx(mean + half) and p.n == 2
    assert p.improved == sum(x < 0 for x in d)
    v = [fd[("vanilla", 0)], fd[("vanilla", 1)]]
    assert arms["vanilla"]["stats"]["fd"] == pytest.approx((np.mean(v), np.std(v, ddof=1)))
    text = files["report"].read_text()
    assert f"| cl | vanilla | 2 | {mean:.4g} | [{mean - half:.4g}, {mean + half:.4g}] | {p.improved}/2 | x1 |" in text
    assert f"| vanilla | 2 | 24 | {np.mean(v):.4g} +- {np.std(v, ddof=1):.2g}" in text


def test_plots_from_run_folders_are_kept_when_some_folders_are_gone(tmp_path):
    """The timelines and the per-cluster losses come from the run folders: with only part of them here, the plots
    drawn when they were all here stay as they are (with a warning), instead of being redrawn from a subset."""
    spec = spec_from_dict(SPEC)
    names = ("curriculum_timelines.png", "cluster_loss.png")
    assert set(run_folder_plots(spec, tmp_path)) == {"timelines", "cluster_loss"}  # no finished run: drawn
    assert all((tmp_path / n).stat().st_size > 1000 for n in names)
    for arm in ("vanilla", "cl"):
        for seed in (0, 1):
            status_path(tmp_path, arm, seed).parent.mkdir(parents=True, exist_ok=True)
            status_path(tmp_path, arm, seed).write_text("{}")
    run_dir_of(tmp_path, "cl", 1).mkdir(parents=True)  # 1 of the 4 finished runs' folders is here
    for n in names:
        (tmp_path / n).write_bytes(b"drawn before")
    with pytest.warns(UserWarning, match=r"curriculum_timelines.png and cluster_loss.png kept .* 3 of the 4 finished"):
        run_folder_plots(spec, tmp_path)
    assert all((tmp_path / n).read_bytes() == b"drawn before" for n in names)
    for arm, seed in (("vanilla", 0), ("vanilla", 1), ("cl", 0)):  # every folder here again: drawn anew
        run_dir_of(tmp_path, arm, seed).mkdir(parents=True)
    run_folder_plots(spec, tmp_path)
    assert all((tmp_path / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_study_resumes_after_a_killed_worker(tmp_path):
    """A worker killed mid-run: the rerun keeps finished runs and resumes the killed one from its checkpoint,
    ending with the weights of an uninterrupted run."""
    data = {
        **SPEC,
        "seeds": [0],
        "arms": [SPEC["arms"][0]],
        "set": [*SPEC["set"], "engine.max_steps=40", "checkpoint.every=4"],
    }
    spec = spec_from_dict(data)
    from diffcurr_fast.study.runner import prepare_study, run_one

    ref, out = tmp_path / "ref", tmp_path / "killed"
    threads = str(max(1, os.cpu_count() or 1))  # as run_study's one worker: the same float reductions
    prepare_study(spec, ref)
    run_one(ref, "vanilla", 0, int(threads))  # the uninterrupted run, in this process
    prepare_study(spec, out)
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    proc = subprocess.Popen(
        [sys.executable, "-m", "diffcurr_fast.study.runner", str(out), "vanilla", "0", threads],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    ckpts = run_dir_of(out, "vanilla", 0) / "checkpoints"
    deadline = time.time() + 120
    while time.time() < deadline and not (ckpts.is_dir() and any(p.suffix == ".pt" for p in ckpts.iterdir())):
        time.sleep(0.05)
    proc.kill()
    proc.wait()
    assert read_status(out, "vanilla", 0) is None  # killed before it finished
    res = run_study(spec, out, verbose=False)
    assert res["ran"] == [("vanilla", 0)] and read_status(out, "vanilla", 0)["resumed"] is True
    a, b = _weights(run_dir_of(ref, "vanilla", 0)), _weights(run_dir_of(out, "vanilla", 0))
    assert _same(a[0], b[0]) and _same(a[1], b[1])
    assert run_study(spec, out, verbose=False) == {"ran": [], "failed": [], "kept": 1}  # finished: kept


def test_spec_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown spec keys"):
        spec_from_dict({**SPEC, "steps": 3})
    with pytest.raises(ValueError, match="arm names must be unique"):
        spec_from_dict({**SPEC, "arms": [{"name": "a"}, {"name": "a"}]})
    with pytest.raises(ValueError, match="no arm 'nope'"):
        spec_from_dict({**SPEC, "reference": "nope"})
    with pytest.raises(ValueError, match="arm 'cl'.*unknown config key"):
        load_spec(
            _write_spec(tmp_path, {**SPEC, "reference": "cl", "arms": [{"name": "cl", "set": ["curriculum.nope=1"]}]})
        )
    spec = load_spec(_write_spec(tmp_path))
    run_dir = tmp_path / "s"
    from diffcurr_fast.study.runner import prepare_study

    prepare_study(spec, run_dir)
    other = spec_from_dict({**SPEC, "seeds": [0, 1, 2]})
    with pytest.raises(ValueError, match="holds a different spec"):
        prepare_study(other, run_dir)


@pytest.mark.parametrize("name", ["curriculum", "tdc"])
def test_presets_resolve(name):
    spec = preset_spec(name)
    assert len(spec.seeds) >= (5 if name == "curriculum" else 3)
    if name == "curriculum":
        names = {a.name for a in spec.arms}
        assert {
            "vanilla",
            "cl_uniform",
            "cl_snr",
            "naive_cl",
            "anti_cl",
            "minsnr",
            "minsnr_cl",
            "dtr",
            "dtr_cl",
            "demo_vanilla",
            "demo_cl",
            "vanilla_short",
            "cl_snr_short",
        } <= names
        assert spec.reference_of(spec.arm("dtr_cl")) == "dtr"
    else:
        assert [a.kind for a in spec.arms] == ["train", "tdc"]


def test_eval_records_skip_a_cut_line_and_keep_the_last_per_step(tmp_path):
    from diffcurr_fast.study.runner import eval_records

    path = tmp_path / "metrics.jsonl"
    lines = [{"step": 5, "eval": True, "fd": 3.0}, {"step": 5, "loss": 1.0}, {"step": 10, "eval": True, "fd": 2.0}]
    text = "\n".join(json.dumps(r) for r in lines) + '\n{"step": 15, "ev'  # killed mid-write
    path.write_text(text + "\n" + json.dumps({"step": 10, "eval": True, "fd": 1.5}) + "\n")  # the resumed run
    assert [(r["step"], r["fd"]) for r in eval_records(path)] == [(5, 3.0), (10, 1.5)]


def test_tdc_arm_resumes_a_started_run_and_restarts_one_killed_before_it_began(tmp_path, monkeypatch):
    # a worker killed mid-TDC leaves tdc.json (the run's config): the rerun resumes it; a directory without it
    # (killed before the run began) is started over, never refused or resumed from nothing.
    from diffcurr_fast.study import runner

    seen = []

    def fake_run_tdc(cfg, options, run_dir, *, overwrite=False, resume=False, verbose=False):
        seen.append((overwrite, resume))
        raise RuntimeError("stop here")

    monkeypatch.setattr(runner, "run_tdc", fake_run_tdc)
    fresh, started, killed = tmp_path / "fresh", tmp_path / "started", tmp_path / "killed"
    started.mkdir()
    (started / "tdc.json").write_text("{}")
    killed.mkdir()
    (killed / "stage1").mkdir()
    for run_dir in (fresh, started, killed):
        with pytest.raises(RuntimeError, match="stop here"):
            runner._run_tdc(None, run_dir)
    assert seen == [(False, False), (False, True), (True, False)]


def test_report_links_only_the_sample_grids_that_exist(tmp_path):
    (tmp_path / "a.png").write_bytes(b"png")
    line = sample_line({"a": {}, "b": {}}, tmp_path)
    assert "[a](samples/a.png)" in line and "samples/b.png" not in line
    assert "No grid for b" in line
    assert "none" in sample_line({"b": {}}, tmp_path / "absent")
    assert "No grid" not in sample_line({"a": {}}, tmp_path)


def test_copy_samples_keeps_an_earlier_seeds_grid_once_its_run_directory_is_gone(tmp_path):
    from diffcurr_fast.study.report import copy_samples
    from diffcurr_fast.study.runner import status_path

    spec = spec_from_dict({"name": "s", "seeds": [0, 1], "eval_every": 1, "arms": [{"name": "a"}]})

    def finished(seed: int, grid: bytes) -> None:
        run_dir_of(tmp_path, "a", seed).mkdir(parents=True)
        (run_dir_of(tmp_path, "a", seed) / "samples.png").write_bytes(grid)
        status_path(tmp_path, "a", seed).parent.mkdir(exist_ok=True)
        status_path(tmp_path, "a", seed).write_text("{}")

    finished(0, b"seed0")
    finished(1, b"seed1")
    out = copy_samples(spec, tmp_path) / "a.png"
    assert out.read_bytes() == b"seed0"
    (run_dir_of(tmp_path, "a", 0) / "samples.png").unlink()  # seed 0's run directory lost, its grid kept
    assert copy_samples(spec, tmp_path) / "a.png" == out and out.read_bytes() == b"seed0"
    out.unlink()  # no grid kept: the first seed that has one
    assert copy_samples(spec, tmp_path) / "a.png" == out and out.read_bytes() == b"seed1"
