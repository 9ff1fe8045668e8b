"""``diffcurr-fast info``: the report lists every op, backend and reason; ``--check`` passes here and fails
when a kernel is wrong."""

import argparse

import pytest
import torch

from diffcurr_fast import info
from diffcurr_fast.cli import main
from diffcurr_fast.ops import _backend


def test_report_lists_every_op_backend_and_reason(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    for name in ("torch", "triton", "nvidia-dali", "deepspeed", "NVIDIA apex", "flash-attn", "torch CUDA"):
        assert f"  {name}: " in out
    rows = info.backend_table()
    assert {(op, b) for _, op, b, _ in rows} == {(op, b) for op in info.OPS for b in _backend.BACKENDS}
    cpu = {(op, b): s for d, op, b, s in rows if d == "cpu"}
    assert all(cpu[(op, "reference")] == "available" for op in info.OPS)
    assert all(cpu[(op, "cuda")].startswith("no: backend 'cuda' needs CUDA tensors") for op in info.OPS)


def test_cpu_line_names_the_kernels_instruction_set(each_cpu_isa):
    line = info.describe_device(torch.device("cpu"))
    if each_cpu_isa is None:
        assert "C++ kernels" not in line
    else:
        assert line.endswith(f", C++ kernels {each_cpu_isa} (supported here: {', '.join(_backend.cpu_isas())})")


def test_check_passes_on_every_cpu_backend():
    rows, ok = info.check("cpu")
    assert ok, [r for r in rows if not r[-1].startswith(("ok", "skipped"))]
    tested = {(op, b, dt) for _, op, b, dt, _, _, status in rows if status.startswith("ok")}
    for op in info.OPS:
        for b in ("cpu", "triton"):
            if _backend.unavailable_reason(b, info.OPS[op], torch.device("cpu")) is None:
                assert (op, b, "fp32") in tested
    if _backend.unavailable_reason("cpu", "q_sample", torch.device("cpu")) is None:
        assert ("adaln_modulate", "cpu", "bf16") in tested


def test_check_fails_on_a_wrong_kernel(monkeypatch, capsys):
    if _backend.unavailable_reason("triton", "gated_residual_fwd", torch.device("cpu")) is not None:
        pytest.skip("needs the Triton interpreter")
    kern = _backend.kernels("adaln")
    right = kern.gated_residual_fwd
    monkeypatch.setattr(kern, "gated_residual_fwd", lambda x, g, y: right(x, g, y) + 1e-3)
    assert info.run(argparse.Namespace(check=True, device="cpu")) == 1
    out = capsys.readouterr().out
    assert "MISMATCH" in out and "self-check: FAILED" in out
    bad = [r for r in info.check("cpu")[0] if r[-1].startswith("MISMATCH")]
    assert [(r[1], r[2]) for r in bad] == [("gated_residual", "triton")]
