"""Every Triton kernel compiles ahead of time for sm_80 and sm_90 with the real compiler (no GPU needed).

The launch tables live next to each launcher (``aot_launches`` in diffcurr_fast/kernels/*.py): every dtype the ops
accept, every autotune config and every tile a launcher can pick. Compiling needs the real Triton pipeline, so it runs
in a subprocess without ``TRITON_INTERPRET`` (which the other tests set). The default suite compiles fp32 and
bf16 with one config per kernel; the exhaustive run (all dtypes, configs and tiles plus the runtime's
specialisation of int arguments equal to 1: 802 compiles, about 6 minutes on 2 busy cores without the cache) is
marked slow.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")


def _compile(tmp_path, *flags):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "aot.json"
    proc = subprocess.run(
        [sys.executable, "-m", "diffcurr_fast.kernels.aot", "--json", str(out), *flags],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, json.loads(out.read_text()) if out.exists() else []


def _check(proc, results, min_compiles):
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert len(results) >= min_compiles
    assert {r["arch"] for r in results} == {80, 90}
    assert not [r for r in results if "error" in r]
    kernels = {r["kernel"] for r in results}
    assert kernels >= {
        "_philox_randn_fwd_kernel",
        "_q_sample_fwd_kernel",
        "_diffusion_loss_fwd_kernel",
        "_sample_timesteps_fwd_kernel",
        "_adaln_modulate_fwd_kernel",
        "_adaln_modulate_bwd_kernel",
        "_gated_residual_fwd_kernel",
        "_gated_residual_bwd_kernel",
        "_rmsnorm_modulate_fwd_kernel",
        "_rmsnorm_modulate_bwd_kernel",
        "_qk_norm_rope_fwd_kernel",
        "_qk_norm_rope_bwd_kernel",
        "_swiglu_fwd_kernel",
        "_swiglu_bwd_kernel",
    }
    for r in results:
        assert r["spill_stores"] == r["spill_loads"] == r["stack"] == 0, r
        assert r["regs"] <= 255 and r["cubin_bytes"] > 0


def test_every_kernel_compiles_fp32_bf16_sm80_sm90(tmp_path):
    proc, results = _compile(tmp_path, "--fast")
    _check(proc, results, 40)


@pytest.mark.slow
def test_every_kernel_dtype_and_config_compiles(tmp_path):
    proc, results = _compile(tmp_path)
    _check(proc, results, 300)
    assert {"fp16" in r["launch"] for r in results} == {True, False}


def test_launch_tables_cover_every_autotune_config():
    code = (
        "from diffcurr_fast.kernels import aot; t = aot.launches(); gaps = aot.untested_configs(t); "
        "assert len(t) > 100 and not gaps, gaps; print(len(t))"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_problems_flags_spills_and_scalar_streaming():
    from diffcurr_fast.kernels.aot import problems

    ok = {
        "launch": "k",
        "arch": 90,
        "spill_stores": 0,
        "spill_loads": 0,
        "stack": 0,
        "streaming": True,
        "ld_vec": 4,
        "ld_scalar": 2,
        "ld_vec_bytes": 64,
        "ld_scalar_bytes": 8,
    }
    assert problems([ok]) == []
    assert "spills" in problems([{**ok, "spill_stores": 4}])[0]
    assert "vectorised" in problems([{**ok, "ld_vec_bytes": 8, "ld_scalar_bytes": 64}])[0]
    assert "boom" in problems([{"launch": "k", "arch": 80, "error": "boom"}])[0]
