#!/usr/bin/env bash
# The one prepared GPU check: install the package as a user does, prove the GPU backends are there, self-check
# every op on the device, run the GPU tests, then the benchmarks. About 6 minutes on one H100/H200; every step
# has its own timeout and the whole run stops cleanly before BUDGET_S (default 450 s, under 8 minutes).
#
#   bash benchmarks/gpu_check.sh [--dry-run] [OUT_DIR]
#
# Writes one log per step (and the benchmark CSVs) into OUT_DIR (default benchmarks/results/gpu, or
# $OUT/gpu_check when OUT is set) and a summary.txt. --dry-run runs the same steps on the CPU with tiny CPU
# equivalents (the test suite runs it, so the script itself is tested). Exits non-zero when any step fails or
# when a step that must test something tested nothing.
set -uo pipefail
dry=0
if [ "${1:-}" = "--dry-run" ]; then dry=1; shift; fi
out=${1:-${OUT:+$OUT/gpu_check}}
out=${out:-benchmarks/results/gpu}
mkdir -p "$out"
py=${PYTHON:-python3}
budget=${BUDGET_S:-450}
export PYTHONUNBUFFERED=1
start=$(date +%s)
status=0
: >"$out/summary.txt"

step() {  # step NAME TIMEOUT_S CMD...: run one step within its timeout and the remaining budget, log it
  local name=$1 limit=$2; shift 2
  local left=$((budget - ($(date +%s) - start)))
  if [ "$left" -lt 15 ]; then
    echo "=== $name skipped: time budget spent" | tee -a "$out/summary.txt"
    status=1
    return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s, $(date +%T))"
  local t0=$(date +%s)
  timeout -k 5 "$limit" "$@" >"$out/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$out/$name.log"
  local msg="$name rc=$rc $(($(date +%s) - t0))s"
  [ "$rc" -eq 124 ] && msg="$msg (timed out)"
  echo "=== $msg" | tee -a "$out/summary.txt"
  [ "$rc" -eq 0 ] || status=1
  return "$rc"
}

tested_something() {  # tested_something LOG: a pytest log with at least one passed test and no failure
  grep -Eq "[0-9]+ passed" "$1" && ! grep -Eq "[0-9]+ (failed|error)" "$1"
}

if [ "$dry" -eq 1 ]; then
  dev=cpu
  export TRITON_INTERPRET=1  # the Triton kernels run on CPU tensors through the interpreter
  step env 60 "$py" -c "import sys, torch; print(sys.version.split()[0], torch.__version__)"
  # installability of this tree (metadata and dependency resolution only; the dev install is left as it is)
  step install 120 "$py" -m pip install --dry-run --no-build-isolation --no-deps --no-index -e .
  wanted="cpu triton"
else
  dev=cuda
  step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; \
    $py -c 'import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())'"
  # As a user installs it: editable, no dependency changes, offline; a CPU-only extension is an error here.
  step install 330 env DIFFCURR_REQUIRE_CUDA=1 TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}" MAX_JOBS=16 \
    "$py" -m pip install --no-build-isolation --no-deps --no-index -e . || {
    echo "gpu_check: the install failed; nothing below would test the CUDA kernels" | tee -a "$out/summary.txt"
    exit 1
  }
  wanted="cuda triton"
fi

# Before anything is tested: every op must have the device's backends, or every test below would skip.
step backends 60 "$py" - "$dev" $wanted <<'EOF' || { echo "gpu_check: backends missing, stopping" | tee -a "$out/summary.txt"; exit 1; }
import sys
import torch
from diffcurr_fast.info import OPS
from diffcurr_fast.ops import _backend
dev, wanted = torch.device(sys.argv[1]), sys.argv[2:]
missing = [f"{op}/{b}: {_backend.unavailable_reason(b, reg, dev)}" for op, reg in OPS.items() for b in wanted
           if _backend.unavailable_reason(b, reg, dev) is not None]
print("\n".join(missing) or f"every op has backends {wanted} on {dev}")
sys.exit(1 if missing else 0)
EOF

step info_check 120 "$py" -m diffcurr_fast.cli info --check --device "$dev"

if [ "$dry" -eq 1 ]; then
  step tests 120 "$py" -m pytest -q -x -p no:cacheprovider tests/test_ops_adaln.py -k "dit_block_path"
else
  step tests 240 "$py" -m pytest -q -x -m gpu -p no:cacheprovider tests/test_ops_gpu.py tests/test_dit.py \
    tests/test_attention.py tests/test_train.py
fi
tested_something "$out/tests.log" || { echo "=== tests: nothing passed (all skipped?)" | tee -a "$out/summary.txt"; status=1; }

if [ "$dry" -eq 1 ]; then
  step bench_ops 120 "$py" benchmarks/bench_ops.py --device cpu --quick --no-compile --ops gated_residual --out "$out"
  step bench_train 120 "$py" benchmarks/bench_train.py --device cpu --quick --out "$out/train.csv"
  step bench_sampling 120 "$py" benchmarks/bench_sampling.py --device cpu --no-compile --hidden 64 --depth 2 \
    --heads 2 --input-size 8 --steps 4 --batch 2 --reps 1 --groups 2 --threads 1 --formulations ddpm,flow,edm \
    --csv "$out/tdc_sampling.csv"
else
  # the loss path against torch.compile of plain torch at the four sizes, fp32 and bf16 (HBM copy in pct_copy)
  step bench_ops 200 bash -c "'$py' benchmarks/bench_ops.py --device cuda --ops full_loss_path diffusion_loss \
    --out '$out' && '$py' benchmarks/bench_ops.py --device cuda --dtype bf16 --ops full_loss_path --out '$out'"
  step bench_train 120 "$py" benchmarks/bench_train.py --device cuda --precision bf16 --batch 256 --warmup 3 \
    --reps 10 --set model.preset=DiT-B/2 --out "$out/train.csv"
  step bench_sampling 120 "$py" benchmarks/bench_sampling.py --device cuda --preset DiT-B/2 --input-size 32 \
    --batch 64 --steps 50 --num-classes 1000 --attn-backend auto --no-compile --reps 3 --formulations ddpm,flow,edm \
    --csv "$out/tdc_sampling.csv"
fi
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo some steps FAILED)" \
  "in $(($(date +%s) - start)) s (logs in $out)" | tee -a "$out/summary.txt"
exit $status
