"""CMakeLists.txt configures against the installed libtorch, builds the kernels library and its C++ test, and
``ctest`` passes."""

import os
import shutil
import subprocess

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CMAKE = shutil.which("cmake")
CTEST = shutil.which("ctest")

pytestmark = [pytest.mark.slow, pytest.mark.skipif(CMAKE is None or CTEST is None, reason="cmake is not installed")]


def _run(cmd, timeout):
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-6000:]}"
    return proc.stdout


def test_cmake_build_and_ctest(tmp_path):
    build = str(tmp_path / "build")
    _run(
        [
            CMAKE,
            "-S",
            ROOT,
            "-B",
            build,
            f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}",
            "-DCMAKE_BUILD_TYPE=Release",
        ],
        timeout=120,
    )
    _run([CMAKE, "--build", build, "-j", str(max(2, os.cpu_count() or 2))], timeout=170)
    out = _run([CTEST, "--test-dir", build, "--output-on-failure"], timeout=60)
    assert "100% tests passed" in out
