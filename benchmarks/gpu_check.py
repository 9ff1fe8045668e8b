"""The one prepared GPU check: one table of steps drives the GPU run and its CPU dry run.

    python benchmarks/gpu_check.py [--dry-run] [--rerun-failed] [OUT_DIR]
    python benchmarks/gpu_check.py --print [--dry-run]   # the command lines, nothing run
    bash benchmarks/gpu_check.sh ...                     # the same

Each step of ``STEPS`` is one command line written once, with ``{placeholders}``. ``PROFILES["gpu"]`` fills them
for the device; ``PROFILES["dry"]`` fills the same placeholders with the CPU's device, small sizes and fp32 (the
Triton kernels run in the interpreter), so the dry run executes the GPU branch's own argument lists: a command line
that is wrong on the GPU (a bad flag, a config clash) is wrong in the dry run too, and the test suite runs the dry
run. The only other swaps are named in the dry profile: the install resolves the package without building it
(``pip install --dry-run``), the CPU does not compile with inductor (``--no-compile``), and the tests step runs a
CPU selection instead of the ``gpu``-marked tests (which would all skip).

Order (the GPU run fits one device lease): the environment and every runtime dependency first, the install, the
backend assertion, then the key figures (``info --check``, the fused loss path against ``torch.compile`` of plain
torch at one latent size in fp32 and bf16, the DiT-B/2 and DiT-XL/2 bf16 training step with its MFU, the modern
block's step against the plain one), each written
to its CSV as soon as it is measured, then the GPU tests and the rest of the benchmarks. Each step has its own time
limit; the run stops cleanly before ``BUDGET_S`` (default 450 s, under 8 minutes; the dry run's limits and budget
are ``LIMIT_SCALE`` times longer).

Writes one log per step and the benchmark CSVs into OUT_DIR (default ``benchmarks/results/gpu``, or
``$OUT/gpu_check`` when OUT is set), ``summary.txt`` (one line per step) and ``summary.json``. ``--rerun-failed``
reads ``summary.json`` of OUT_DIR and runs only the steps that failed, timed out or were skipped there (the
install and the backend assertion run again whenever anything does: a fresh machine has neither). Exits non-zero
when any step fails or when the tests step tested nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Step:
    """One command line of the check. ``cmd`` and ``env`` values are templates: ``{name}`` takes the profile's
    value; a word that is exactly ``{name}`` whose value is a list is replaced by the list's items (none when
    empty). ``setup``: rerun whenever anything reruns. ``stop``: a failure ends the run. ``pytest``: must pass at
    least one test."""

    name: str
    limit_s: int
    cmd: str
    env: dict[str, str] = field(default_factory=dict)
    setup: bool = False
    stop: bool = False
    pytest: bool = False


_LOSS = (
    "{py} benchmarks/bench_ops.py --device {dev} --ops full_loss_path --modes given seed {compile} --reps {reps} "
    "--copy-mib {copy_mib} "
)
_TRAIN = (
    "{py} benchmarks/bench_train.py --device {dev} --precision {dtype_lo} "
    "--warmup {warmup} --reps {reps} --set model.input_size={latent} --peak-tflops {peak_tflops} "
    "--out {out}/train.csv "
)
_BUILD = {"DIFFCURR_REQUIRE_CUDA": "{require_cuda}", "TORCH_CUDA_ARCH_LIST": "9.0", "MAX_JOBS": "16"}

STEPS: tuple[Step, ...] = (
    Step("env", 60, "{py} benchmarks/gpu_check.py --probe env"),  # a missing import is reported, not fatal
    Step(
        "install",
        240,
        "{py} -m pip install {pip_mode} --no-build-isolation --no-deps --no-index -e .",
        _BUILD,
        setup=True,
        stop=True,
    ),
    Step("backends", 60, "{py} benchmarks/gpu_check.py --probe backends {dev} {backends}", setup=True, stop=True),
    # ---- the key figures (the first minutes of the lease)
    Step("info_check", 90, "{py} -m diffcurr_fast.cli info --check --device {dev}"),
    Step("ops_loss_fp32", 60, _LOSS + "--warmup {warmup} --dtype fp32 --sizes {loss_size} --out {out}"),
    Step("ops_loss_bf16", 60, _LOSS + "--warmup {warmup} --dtype {dtype_lo} --sizes {loss_size} --out {out}"),
    # each with token routing beside it (TREAD, keep 0.5 over blocks [2, depth - 2)): its MFU on the full model's
    # FLOPs and on the FLOPs the routed step does, each labelled (bench_train.py)
    Step(
        "train_b2",
        90,
        _TRAIN + "--providers fused,fused+routed --routing 0.5,2,-2 --batch {train_batch} --recipe dit_b2_vanilla "
        "--set model.preset={preset_b2}",
    ),
    Step(
        "train_xl2",
        120,
        _TRAIN + "--providers fused,fused+routed --routing 0.5,2,-2 --batch {train_batch} --recipe dit_xl2 "
        "--set model.preset={preset_xl2}",
    ),
    # the modern block (RMSNorm, QK-norm, SwiGLU, 2-D RoPE) on the fused ops against the plain fused step, paired per
    # repetition in one process (bench_train.py --variant; rows in step_options.csv)
    Step(
        "train_modern",
        90,
        _TRAIN + "--batch {train_batch} --recipe dit_b2_vanilla --set model.preset={preset_b2} --set "
        "model.fused_adaln=true --variant '' --variant 'model.norm=rmsnorm;model.qk_norm=true;model.mlp=swiglu;"
        "model.pos=rope2d'",
    ),
    # ---- everything else
    Step(
        "tests",
        150,
        "{py} -m pytest -q --maxfail=10 --durations=15 -p no:cacheprovider -m {test_marker} {test_files}",
        pytest=True,
    ),
    Step(
        "ops_all",
        120,
        "{py} benchmarks/bench_ops.py --device {dev} --dtype {dtype_lo} {compile} --sizes "
        "{all_sizes} --block {block} --route {route} --reps {reps} --warmup {warmup} --out {out}",
    ),
    Step(
        "sampling",
        90,
        "{py} benchmarks/bench_sampling.py --device {dev} --preset {preset_b2} --input-size {latent} "
        "--batch {sample_batch} --steps {sample_steps} --num-classes 1000 --attn-backend auto --no-compile --reps "
        "{reps_few} --groups {groups} --formulations ddpm,flow,edm --csv {out}/tdc_sampling.csv",
    ),
    # a small DiT, where launches and host reads cost most: the model replayed as CUDA graphs against eager
    Step(
        "train_graphs",
        90,
        _TRAIN + "--providers fused,fused+graphs --batch {graphs_batch} --recipe dit_b2_vanilla "
        "--set model.preset={preset_s2}",
    ),
)

# placeholder: (GPU value, dry-run value). Besides the device, sizes and dtype, the dry run swaps only what the
# module doc names: the install's --dry-run, --no-compile, and the tests' selection.
VALUES: dict[str, tuple[str | list[str], str | list[str]]] = {
    "dev": ("cuda", "cpu"),
    "backends": (["cuda", "triton"], ["cpu", "triton"]),
    "dtype_lo": ("bf16", "fp32"),  # no bf16 arithmetic in the Triton interpreter
    "require_cuda": ("1", "0"),
    "pip_mode": ([], ["--dry-run"]),
    "compile": ([], ["--no-compile"]),
    "loss_size": ("256x4x32x32", "4x4x8x8"),
    "copy_mib": ("1024", "8"),  # the bandwidth yardstick: several times the L2 on the GPU
    "all_sizes": (["8x4x32x32", "64x4x32x32", "32x4x64x64"], ["2x4x8x8"]),
    "block": (["32", "256", "384"], ["2", "16", "32"]),
    "route": (["16x256x128x384", "256x256x128x1152"], ["2x16x8x32"]),  # token routing: DiT-S/2, DiT-XL/2 widths
    "reps": ("10", "2"),
    "reps_few": ("3", "1"),
    "warmup": ("3", "1"),
    "latent": ("32", "4"),
    "train_batch": ("256", "2"),
    "preset_b2": ("DiT-B/2", "DiT-S/2"),
    "preset_xl2": ("DiT-XL/2", "DiT-S/2"),
    "preset_s2": ("DiT-S/2", "DiT-S/2"),
    "graphs_batch": ("32", "2"),
    "peak_tflops": ("989", "1"),  # dense bf16 of an H100/H200 (datasheet)
    "sample_batch": ("64", "2"),
    "sample_steps": ("50", "2"),
    "groups": ("5", "2"),
    "test_marker": ("gpu", "not gpu"),
    "test_files": (
        [
            "tests/ops/test_ops_gpu.py",
            "tests/models/test_dit.py",
            "tests/models/test_attention.py",
            "tests/train/test_train.py",
        ],
        ["tests/ops/test_ops_adaln.py", "-k", "dit_block_path"],
    ),
}
LIMIT_SCALE = {"gpu": 1, "dry": 6}  # the dry run's limits: 2 shared CPU cores and the Triton interpreter
PROFILES = {name: {k: v[i] for k, v in VALUES.items()} for i, name in enumerate(("gpu", "dry"))}


def expand(template: str, values: dict[str, str | list[str]]) -> list[str]:
    """The argument list of ``template`` under one profile (a ``{name}`` word with a list value is spliced)."""
    out: list[str] = []
    for word in shlex.split(template):
        value = values.get(word[1:-1]) if word.startswith("{") and word.endswith("}") else None
        if isinstance(value, list):
            out += value
        else:
            out.append(word.format(**{k: v for k, v in values.items() if isinstance(v, str)}))
    return out


def command(step: Step, values: dict[str, str | list[str]]) -> tuple[list[str], dict[str, str]]:
    """(argv, extra environment) of ``step`` under one profile."""
    return expand(step.cmd, values), {k: v.format(**values) for k, v in step.env.items()}


def tested_something(log: str) -> bool:
    """A pytest log with at least one passed test and no failure or error."""
    import re

    return bool(re.search(r"\d+ passed", log)) and not re.search(r"\d+ (failed|errors?)\b", log)


def run(profile: str, out: Path, budget_s: float, only: set[str] | None = None, py: str = sys.executable) -> int:
    """Run the steps (``only``: their names, the earlier results kept for the others) under ``profile``; write the
    logs and summaries; the exit status."""
    out.mkdir(parents=True, exist_ok=True)
    earlier = json.loads((out / "summary.json").read_text())["steps"] if only is not None else {}
    values = {**PROFILES[profile], "py": py, "out": str(out)}
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if profile == "dry":
        env["TRITON_INTERPRET"] = "1"  # the Triton kernels run on CPU tensors through the interpreter
    start, results, status = time.monotonic(), dict(earlier), 0
    summary = out / "summary.txt"
    summary.write_text("")

    def note(line: str) -> None:
        print(line, flush=True)
        with summary.open("a") as f:
            f.write(line + "\n")

    for step in STEPS:
        if only is not None and step.name not in only and not step.setup:
            continue
        left = budget_s - (time.monotonic() - start)
        if left < 15:
            note(f"=== {step.name} skipped: time budget spent")
            results[step.name], status = "skipped", 1
            continue
        limit = min(step.limit_s * LIMIT_SCALE[profile], int(left))
        argv, extra = command(step, values)
        print(f"=== {step.name} (limit {limit}s, {time.strftime('%H:%M:%S')}): {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        log = out / f"{step.name}.log"
        with log.open("w") as f:
            try:
                proc = subprocess.run(
                    argv, cwd=ROOT, env={**env, **extra}, stdout=f, stderr=subprocess.STDOUT, timeout=limit
                )
                rc = proc.returncode
            except subprocess.TimeoutExpired:
                rc = 124
            except OSError as e:  # the program itself is missing
                f.write(f"gpu_check: cannot run {argv[0]}: {e}\n")
                rc = 127
        text = log.read_text(errors="replace")
        print("\n".join(text.splitlines()[-25:]), flush=True)
        if rc == 0 and step.pytest and not tested_something(text):
            note(f"=== {step.name}: nothing passed (all skipped?)")
            rc = 1
        msg = f"=== {step.name} rc={rc} {time.monotonic() - t0:.0f}s" + (" (timed out)" if rc == 124 else "")
        note(msg)
        results[step.name] = "ok" if rc == 0 else ("timed out" if rc == 124 else f"rc={rc}")
        if rc:
            status = 1
            if step.stop:
                note(f"gpu_check: step {step.name} failed, stopping (nothing below would test the device)")
                break
    (out / "summary.json").write_text(json.dumps({"profile": profile, "steps": results}, indent=1) + "\n")
    verdict = "all steps passed" if status == 0 else "some steps FAILED"
    note(f"gpu_check: {verdict} in {time.monotonic() - start:.0f} s (logs in {out})")
    return status


def failed_steps(out: Path) -> set[str]:
    """The steps that did not pass in the run whose summary is in ``out``, and those it never reached."""
    path = out / "summary.json"
    if not path.is_file():
        raise SystemExit(f"--rerun-failed: no {path} (run the check once first, into the same folder)")
    done = json.loads(path.read_text())["steps"]
    return {s.name for s in STEPS if done.get(s.name) != "ok"}


# ---- probes run as steps ----------------------------------------------------------------------------------------


def _runtime_requirements() -> list[str]:
    """The distribution names of setup.py's ``install_requires`` (read without running setup.py)."""
    import ast

    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "install_requires":
            reqs = ast.literal_eval(node.value)
            return [r.split(";")[0].split("[")[0].split("=")[0].split(">")[0].split("<")[0].strip() for r in reqs]
    raise SystemExit("gpu_check: setup.py has no install_requires list")


def probe_env() -> int:
    """Print the toolchain and driver versions; import every runtime dependency (a missing one fails here, not as
    a collection error in the tests)."""
    import importlib
    import importlib.metadata as md
    import platform
    import shutil

    def tool(argv: list[str]) -> str:
        if shutil.which(argv[0]) is None:
            return "absent"
        try:
            res = subprocess.run(argv, capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired) as e:
            return f"failed ({e})"
        text = (res.stdout or res.stderr).strip().splitlines()
        return text[-1] if text else f"rc={res.returncode}"

    def version(module: str) -> str:
        try:
            return getattr(importlib.import_module(module), "__version__", "present")
        except Exception as e:  # an optional package that is broken says how
            return f"absent ({type(e).__name__}: {e})"

    import torch

    print(f"python {platform.python_version()}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    print(f"device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device'}")
    print(f"nvcc: {tool(['nvcc', '--version'])}")
    print(f"ninja: {tool(['ninja', '--version'])}")
    driver = tool(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"])
    print(f"driver: {driver}")
    print(f"triton: {version('triton')}")
    print(f"DALI: {version('nvidia.dali')}")
    modules = {"pyyaml": "yaml", "nvidia-ml-py": "pynvml"}  # where the import name is not the distribution's
    missing = []
    for req in _runtime_requirements():
        mod = modules.get(req.lower(), req.lower().replace("-", "_"))
        try:
            importlib.import_module(mod)
            print(f"import {mod}: ok ({req} {md.version(req)})")
        except Exception as e:
            missing.append(f"{req} (import {mod}): {type(e).__name__}: {e}")
    if missing:
        print("runtime dependencies missing:\n  " + "\n  ".join(missing))
        return 1
    return 0


def probe_backends(dev: str, wanted: list[str]) -> int:
    """Every op must have the device's backends, or every test below would skip."""
    import torch

    from diffcurr_fast.info import OPS
    from diffcurr_fast.ops import _backend

    device = torch.device(dev)
    reasons = {f"{op}/{b}": _backend.unavailable_reason(b, reg, device) for op, reg in OPS.items() for b in wanted}
    missing = [f"{name}: {why}" for name, why in reasons.items() if why is not None]
    print("\n".join(missing) or f"every op has backends {wanted} on {dev}")
    return 1 if missing else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?", default=None, help="output folder (default benchmarks/results/gpu)")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU with small sizes")
    p.add_argument("--rerun-failed", action="store_true", help="run only what failed in OUT's summary.json")
    p.add_argument("--probe", nargs="+", default=None, help=argparse.SUPPRESS)  # a step's own check
    p.add_argument("--print", dest="show", action="store_true", help="print each step's command line and exit")
    args = p.parse_args(argv)
    if args.probe:
        kind, rest = args.probe[0], args.probe[1:]
        return probe_env() if kind == "env" else probe_backends(rest[0], rest[1:])
    default = Path(os.environ["OUT"]) / "gpu_check" if os.environ.get("OUT") else Path("benchmarks/results/gpu")
    out = Path(args.out) if args.out else default
    if args.show:
        values = {**PROFILES["dry" if args.dry_run else "gpu"], "py": "python3", "out": str(out)}
        for step in STEPS:
            argv, extra = command(step, values)
            print(f"{step.name}:", *(f"{k}={v}" for k, v in extra.items()), shlex.join(argv))
        return 0
    only = failed_steps(out) if args.rerun_failed else None
    py = os.environ.get("PYTHON", sys.executable)
    profile = "dry" if args.dry_run else "gpu"
    budget = float(os.environ.get("BUDGET_S", 450 * LIMIT_SCALE[profile]))
    return run(profile, out.resolve(), budget, only, py)


if __name__ == "__main__":
    raise SystemExit(main())
