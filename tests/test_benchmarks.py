"""Smoke runs of the benchmark scripts (correct output shape, no timing claims): the full loss path with its
compiled provider, and the compiled training step in both noise modes."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(args, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_bench_ops_full_loss_path(tmp_path):
    out = _run(
        [
            "benchmarks/bench_ops.py",
            "--quick",
            "--compile",
            "--ops",
            "full_loss_path",
            "--sizes",
            "3x2x5x7",
            "--threads",
            "1",
            "--out",
            str(tmp_path),
        ],
        tmp_path,
    )
    for provider in ("torch-eager", "compile(torch-eager)", "cpu"):
        assert f"full_loss_path  given fwd+bwd  {provider}" in out
    assert "providers disagree" not in out
    assert "host memory retained" in out
    assert (tmp_path / "ops.csv").exists() and (tmp_path / "ops.md").exists()


def test_bench_ops_modern_block_ops(tmp_path):
    """The modern block's ops beside their eager form and its torch.compile, every pass, the outputs agreeing."""
    args = ["benchmarks/bench_ops.py", "--quick", "--compile", "--ops", "rmsnorm_modulate", "qk_norm_rope", "swiglu"]
    out = _run([*args, "--head-dim", "24", "--threads", "1", "--out", str(tmp_path)], tmp_path)  # --quick: 4x64x96
    for op in ("rmsnorm_modulate", "qk_norm_rope", "swiglu"):
        for provider in ("torch-eager", "compile(torch-eager)", "cpu"):
            assert f"{op:15s} -     fwd+bwd  {provider}" in out, out[-3000:]
        assert f"target {op} 4x64x96 fwd+bwd cpu:" in out
    assert "providers disagree" not in out


def test_bench_train_compiled_step(tmp_path):
    out = _run(
        ["benchmarks/bench_train.py", "--compiled-step", "--quick", "--warmup", "0", "--reps", "2", "--batch", "8"],
        tmp_path,
    )
    for mode in ("given", "seed"):
        for label in ("plain-torch loss", "our ops"):
            assert f"compiled step, {label}, {mode} noise:" in out


def test_bench_train_variants_are_labelled_and_divided_by_the_plain_step(tmp_path):
    """``--variant``: each option's step beside the plain one, its row named by what differs, its ratio written."""
    out = _run(
        [
            "benchmarks/bench_train.py",
            "--batch",
            "4",
            "--warmup",
            "0",
            "--reps",
            "2",
            "--set",
            "engine.cpu_threads=1",
            "--variant",
            "",
            "--variant",
            "model.routing=sprint;model.routing_keep=0.5;model.routing_start=1;model.routing_end=3",
            "--variant",
            "model.norm=rmsnorm;terms.use=[dispersive]",
            "--variant",
            "optim.name=muon",
            "--variant",
            "optim.name=schedule_free;optim.schedule=constant",
            "--out",
            str(tmp_path / "train.csv"),
        ],
        tmp_path,
    )
    assert "custom-64x4/2 on 1x8x8 sprint keep 0.5 blocks [1,3): " in out
    assert "custom-64x4/2 on 1x8x8 rmsnorm +dispersive: " in out
    assert "custom-64x4/2 on 1x8x8 optim muon: " in out and "custom-64x4/2 on 1x8x8 optim schedule_free: " in out
    import csv

    rows = list(csv.DictReader(open(tmp_path / "step_options.csv")))
    assert [r["option"] for r in rows] == [
        "none (the plain step again)",
        "model.routing=sprint model.routing_keep=0.5 model.routing_start=1 model.routing_end=3",
        "model.norm=rmsnorm terms.use=[dispersive]",
        "optim.name=muon",
        "optim.name=schedule_free optim.schedule=constant",
    ]
    assert len({r["ms_plain"] for r in rows}) == 1 and all(float(r["x_plain"]) > 0 for r in rows)
    assert (tmp_path / "step_options.md").exists() and not (tmp_path / "train.csv").exists()


def test_bench_train_refuses_a_malformed_routing_in_one_line():
    proc = subprocess.run(
        [sys.executable, "benchmarks/bench_train.py", "--providers", "fused+routed", "--routing", "sprint,0.5,2"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode != 0
    assert "expected [tread|sprint,]KEEP,START,END" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr


def test_step_breakdown_counts_the_raw_kernels_as_fused_ops():
    """The C++ kernels (``diffcurr_fast_C::*``) are ops of the step, not unattributed Python time."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import step_breakdown as sb

    from diffcurr_fast.ops import _backend

    if _backend.unavailable_reason("cpu", "gated_residual_fwd", torch.device("cpu")) is not None:
        import pytest

        pytest.skip("the C++ extension is not built")
    x, gate = torch.randn(64, 256, 256), torch.randn(64, 256)
    kernel = torch.ops.diffcurr_fast_C.gated_residual_fwd
    assert sb._op_category("diffcurr_fast_C::gated_residual_fwd") == "fused ops"
    out = sb.breakdown(lambda: [kernel(x, gate, x) for _ in range(4)], steps=2)
    assert out["fused ops"] > 0.5 * out["total"], out  # the kernels' own time, not "unattributed"
