"""The CUDA sources compile (they cannot run without a GPU): each ``csrc/cuda/*.cu`` with
``nvcc -c -std=c++20 -arch=sm_90`` and the CUDA op registration ``csrc/ops_cuda.cpp`` with the host compiler,
all in parallel."""

import glob
import os
import shutil
import subprocess

import pytest
import torch.utils.cpp_extension as cpp_ext

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NVCC = shutil.which("nvcc")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")]


def _cuda_include():
    """The CUDA toolkit's include directory (nvcc may be a wrapper script outside the toolkit)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), cpp_ext.CUDA_HOME]
    homes += [os.path.dirname(os.path.dirname(os.path.realpath(NVCC))), "/usr/local/cuda"]
    for home in homes:
        if home and os.path.exists(os.path.join(home, "include", "cuda_runtime.h")):
            return os.path.join(home, "include")
    return None


def _commands(out_dir):
    includes = [f"-I{os.path.join(ROOT, 'csrc')}"] + [f"-I{p}" for p in cpp_ext.include_paths()]
    cmds = []
    for src in sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu"))):
        obj = os.path.join(out_dir, os.path.basename(src) + ".o")
        cmds.append([NVCC, "-c", "-std=c++20", "-arch=sm_90", "-O3", *includes, src, "-o", obj])
    cxx = shutil.which("c++") or shutil.which("g++")
    if cxx is not None and _cuda_include() is not None:
        # The CPU wheel lacks the generated c10/cuda/impl/cuda_cmake_macros.h; its macros are not needed here.
        cmds.append(
            [
                cxx,
                "-std=c++20",
                "-fsyntax-only",
                "-DDIFFCURR_WITH_CUDA=1",
                "-DC10_CUDA_NO_CMAKE_CONFIGURE_FILE",
                *includes,
                f"-I{_cuda_include()}",
                os.path.join(ROOT, "csrc", "ops_cuda.cpp"),
            ]
        )
    return cmds


def test_cuda_sources_compile(tmp_path):
    cmds = _commands(str(tmp_path))
    assert any(c[0] == NVCC for c in cmds), "no csrc/cuda/*.cu found"
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
    failures = []
    for cmd, proc in zip(cmds, procs):
        out, _ = proc.communicate(timeout=170)
        if proc.returncode != 0:
            failures.append(f"{' '.join(cmd[-3:])}\n{out[-4000:]}")
    assert not failures, "\n\n".join(failures)
    for cmd in cmds:
        if cmd[0] == NVCC:
            assert os.path.getsize(cmd[-1]) > 0
