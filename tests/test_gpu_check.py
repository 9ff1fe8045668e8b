"""The GPU check script runs end to end in its CPU dry run, and a CUDA build cannot silently come out CPU-only."""

import dataclasses
import json
import os
import string
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check as gc  # noqa: E402

STEPS = [s.name for s in gc.STEPS]


def _env(**extra):
    env = {**os.environ, "PYTHON": sys.executable, "PYTEST_ADDOPTS": "", **extra}
    env.pop("PYTEST_XDIST_WORKER", None)
    return env


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path):
    pytest.importorskip("triton")
    cmd = ["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=1800)
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-4000:] + proc.stderr[-2000:]
    for step in STEPS:
        assert f"=== {step} rc=0" in summary, summary
        assert (tmp_path / f"{step}.log").stat().st_size > 0
    env_log = (tmp_path / "env.log").read_text()
    for line in ("nvcc:", "ninja:", "driver:", "triton:", "DALI:", "import torch: ok", "import pynvml: ok"):
        assert line in env_log, env_log
    assert "every op has backends ['cpu', 'triton'] on cpu" in (tmp_path / "backends.log").read_text()
    assert "self-check: all passed" in (tmp_path / "info_check.log").read_text()
    for csv in ("ops.csv", "train.csv", "tdc_sampling.csv"):  # benchmark output stays in the output folder
        assert (tmp_path / csv).exists(), csv
    assert "mfu_pct" in (tmp_path / "train.csv").read_text().splitlines()[0]
    assert "slowest" in (tmp_path / "tests.log").read_text()  # --durations
    assert "all steps passed" in summary


def test_both_profiles_fill_every_step():
    """Every placeholder has a GPU and a dry-run value, and the two argument lists of a step differ only where a
    placeholder stands: the dry run runs the GPU branch's command lines."""
    texts = [s.cmd for s in gc.STEPS] + [v for s in gc.STEPS for v in s.env.values()]
    used = {f for t in texts for _, f, _, _ in string.Formatter().parse(t) if f}
    assert used - {"py", "out"} == set(gc.PROFILES["gpu"]) == set(gc.PROFILES["dry"])
    for step in gc.STEPS:
        gpu, _ = gc.command(step, {**gc.PROFILES["gpu"], "py": "PY", "out": "OUT"})
        dry, _ = gc.command(step, {**gc.PROFILES["dry"], "py": "PY", "out": "OUT"})
        fixed = [w for w in gc.shlex.split(step.cmd) if "{" not in w]
        assert [w for w in gpu if w in fixed] == fixed == [w for w in dry if w in fixed], step.name
    gpu = {s.name: gc.command(s, {**gc.PROFILES["gpu"], "py": "PY", "out": "OUT"})[0] for s in gc.STEPS}
    assert "--maxfail=10" in gpu["tests"] and "--durations=15" in gpu["tests"] and "-x" not in gpu["tests"]
    assert gpu["train_b2"][-2:] == ["--set", "model.preset=DiT-B/2"]


ALL_STEPS = gc.STEPS


def _broken(name, extra, monkeypatch):
    step = next(s for s in ALL_STEPS if s.name == name)
    monkeypatch.setattr(gc, "STEPS", (dataclasses.replace(step, cmd=step.cmd + extra),))


def test_dry_run_fails_on_a_broken_gpu_command_line(tmp_path, monkeypatch):
    # the clash this check shipped with: a preset over a config that sets the depth explicitly
    _broken("train_b2", " --set model.depth=4", monkeypatch)
    assert gc.run("dry", tmp_path, budget_s=900) == 1
    assert "model.depth=4 contradicts model.preset 'DiT-S/2'" in (tmp_path / "train_b2.log").read_text()
    assert json.loads((tmp_path / "summary.json").read_text())["steps"] == {"train_b2": "rc=1"}
    _broken("ops_loss_fp32", " --no-such-flag", monkeypatch)  # a flag the script does not take
    assert gc.run("dry", tmp_path / "b", budget_s=900) == 1
    assert "unrecognized arguments: --no-such-flag" in (tmp_path / "b" / "ops_loss_fp32.log").read_text()


def test_rerun_failed_runs_only_what_failed(tmp_path, monkeypatch):
    marks = tmp_path / "ran"
    marks.mkdir()
    touch = '{py} -c "import pathlib, sys; pathlib.Path(sys.argv[1]).touch(); sys.exit(int(sys.argv[2]))" '
    steps = (
        gc.Step("setup", 30, touch + f"{marks}/setup 0", setup=True),
        gc.Step("good", 30, touch + f"{marks}/good 0"),
        gc.Step("bad", 30, touch + f"{marks}/bad 3"),
        gc.Step("late", 30, touch + f"{marks}/late 0"),
    )
    monkeypatch.setattr(gc, "STEPS", steps)
    assert gc.run("dry", tmp_path, budget_s=900) == 1
    assert sorted(p.name for p in marks.iterdir()) == ["bad", "good", "late", "setup"]
    assert gc.failed_steps(tmp_path) == {"bad"}
    for p in marks.iterdir():
        p.unlink()
    assert gc.run("dry", tmp_path, budget_s=900, only=gc.failed_steps(tmp_path)) == 1
    assert sorted(p.name for p in marks.iterdir()) == ["bad", "setup"]  # the setup step runs again, "good" not
    done = json.loads((tmp_path / "summary.json").read_text())["steps"]
    assert done == {"setup": "ok", "good": "ok", "bad": "rc=3", "late": "ok"}  # earlier results kept
    with pytest.raises(SystemExit, match="no .*summary.json"):
        gc.failed_steps(tmp_path / "nowhere")


def test_tested_something():
    assert gc.tested_something("3 passed, 1 skipped in 2.0s")
    assert not gc.tested_something("5 skipped in 1.0s")
    assert not gc.tested_something("3 passed, 1 failed in 2.0s")
    assert not gc.tested_something("3 passed, 2 errors in 2.0s")


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA: the build would succeed")
def test_require_cuda_fails_loudly_without_cuda():
    env = {**os.environ, "DIFFCURR_REQUIRE_CUDA": "1"}
    proc = subprocess.run(
        [sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0
    assert "DIFFCURR_REQUIRE_CUDA=1 but the CUDA kernels cannot be built: torch has no CUDA" in proc.stderr


def test_gpu_check_stops_when_a_backend_is_missing(tmp_path):
    # a Triton that cannot be imported: the script must stop at the backend assertion, before any test runs
    shadow = tmp_path / "shadow" / "triton"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('triton deliberately broken')\n")
    out = tmp_path / "out"
    env = _env(PYTHONPATH=os.pathsep.join([str(shadow.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--dry-run", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    summary = (out / "summary.txt").read_text()
    assert proc.returncode != 0
    assert "step backends failed, stopping" in summary
    assert "triton deliberately broken" in (out / "backends.log").read_text()
    assert not (out / "tests.log").exists()
