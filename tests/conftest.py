import json
import os
import subprocess
import sys

# The Triton kernels run on CPU tensors through the interpreter; the variable must be set before anything
# imports them. On a CUDA machine the real compiler is used.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

# ``torchrun --standalone --nproc_per_node 2``: two ranks on CPU (gloo), for the multi-process tests
TORCHRUN2 = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
# The overrides of a tiny digits run (a one-block DiT of width 32, T = 40) that tests extend with their own
TINY_SETS = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "diffusion.num_timesteps=40",
    "curriculum.num_clusters=4",
    "data.batch_size=16",
    "logging.progress=false",
    "logging.num_samples=0",
    "logging.plots=false",
]

# Under pytest-xdist each worker gets one thread: with as many workers as cores, more threads only fight.
if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)  # a trainer sets engine.cpu_threads process-wide; the next test gets it back


@pytest.fixture
def one_thread():
    """One intra-op thread for the test (thousands of small ops: more threads only contend on a 2-core runner)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none is available on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def save_tiny_vae(path, levels: int, sample_size: int):
    """A random diffusers ``AutoencoderKL`` (RGB, 4 latent channels, ``levels`` levels of width 8, so latents are
    2^(levels - 1) times smaller) written to ``path`` with ``save_pretrained``; returns ``path``."""
    # imported here, not at the top: diffusers is optional, and only the tests that build a VAE need it
    import diffusers

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(
        in_channels=3,
        out_channels=3,
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(8,) * levels,
        layers_per_block=1,
        latent_channels=4,
        norm_num_groups=4,
        sample_size=sample_size,
    )
    vae.save_pretrained(path)
    return path


def run_torchrun2(tmp_path, script_text: str, *args, timeout: int = 300) -> list:
    """``script_text`` under ``torchrun --nproc_per_node 2`` (CPU, gloo), asserting a zero exit; the script gets
    ``*args`` and an output prefix last, and each rank writes ``<prefix>.<rank>.json``, returned in rank order."""
    script, prefix = tmp_path / "torchrun_script.py", tmp_path / "torchrun_out"
    script.write_text(script_text)
    cmd = [
        *TORCHRUN2,
        str(script),
        *map(str, args),
        str(prefix),
    ]
    proc = subprocess.run(
        cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads((tmp_path / f"torchrun_out.{r}.json").read_text()) for r in (0, 1)]
