#!/usr/bin/env bash
# The one prepared GPU check: build the CUDA extension, run the GPU tests, then the benchmarks on the device.
# Sized for a few minutes on one H100/H200. Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
# Writes logs and CSV/markdown results into OUT_DIR (default benchmarks/results/gpu).
set -uo pipefail
out=${1:-${OUT:-benchmarks/results/gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME TIMEOUT_S CMD...: run one step, log it, keep going on failure
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))"
  timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "=== $name rc=$rc"
  [ "$rc" -eq 0 ] || status=1
}
step env 60 bash -c "nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; $py -c 'import torch, triton; print(torch.__version__, torch.version.cuda, triton.__version__, torch.cuda.get_device_name())'"
# The package from this tree, with the CUDA kernels compiled for Hopper (sm_90) only, to keep the build short.
step build 300 env TORCH_CUDA_ARCH_LIST=9.0 MAX_JOBS=16 $py setup.py -q build_ext --inplace
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
step tests_gpu 300 $py -m pytest -q -x -m gpu tests -p no:cacheprovider
step tests_ops 300 $py -m pytest -q -n 8 tests/test_ops_q_sample.py tests/test_ops_diffusion_loss.py \
  tests/test_ops_sample_timesteps.py tests/test_ops_adaln.py tests/test_ops_philox.py tests/test_csrc.py -p no:cacheprovider
step bench_ops 300 $py benchmarks/bench_ops.py --device cuda --out "$out"
step bench_sampling 420 $py benchmarks/bench_sampling.py --device cuda --preset DiT-B/2 --input-size 32 --batch 64 \
  --steps 50 --num-classes 1000 --attn-backend auto --formulations ddpm,flow,edm --csv "$out/tdc_sampling.csv"
step bench_train 240 $py benchmarks/bench_train.py --device cuda --precision bf16 --batch 256 \
  --set model.preset=DiT-B/2 --out "$out/train.csv"
echo "gpu_check: $([ $status -eq 0 ] && echo all steps passed || echo some steps FAILED) (logs in $out)"
exit $status
