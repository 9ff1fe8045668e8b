"""The GPU check script runs end to end in its CPU dry run, and a CUDA build cannot silently come out CPU-only."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
STEPS = ("env", "install", "backends", "info_check", "tests", "bench_ops", "bench_train", "bench_sampling")


def test_gpu_check_dry_run(tmp_path):
    pytest.importorskip("triton")
    env = {**os.environ, "PYTHON": sys.executable, "PYTEST_ADDOPTS": ""}
    env.pop("PYTEST_XDIST_WORKER", None)
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", str(tmp_path)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    summary = (tmp_path / "summary.txt").read_text()
    assert proc.returncode == 0, summary + proc.stdout[-4000:] + proc.stderr[-2000:]
    for step in STEPS:
        assert f"=== {step} rc=0" in summary, summary
        assert (tmp_path / f"{step}.log").stat().st_size > 0
    assert "every op has backends ['cpu', 'triton'] on cpu" in (tmp_path / "backends.log").read_text()
    assert "self-check: all passed" in (tmp_path / "info_check.log").read_text()
    assert (tmp_path / "tdc_sampling.csv").exists()  # benchmark output stays in the output folder
    assert "all steps passed" in summary


@pytest.mark.skipif(torch.version.cuda is not None, reason="this torch has CUDA: the build would succeed")
def test_require_cuda_fails_loudly_without_cuda():
    env = {**os.environ, "DIFFCURR_REQUIRE_CUDA": "1"}
    proc = subprocess.run([sys.executable, "setup.py", "--name"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert "DIFFCURR_REQUIRE_CUDA=1 but the CUDA kernels cannot be built: torch has no CUDA" in proc.stderr


def test_gpu_check_stops_when_a_backend_is_missing(tmp_path):
    # a Triton that cannot be imported: the script must stop at the backend assertion, before any test runs
    shadow = tmp_path / "shadow" / "triton"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('triton deliberately broken')\n")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(shadow.parent), "PYTEST_ADDOPTS": ""}
    proc = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    summary = (out / "summary.txt").read_text()
    assert proc.returncode != 0
    assert "backends missing, stopping" in summary
    assert "triton deliberately broken" in (out / "backends.log").read_text()
    assert not (out / "tests.log").exists()
