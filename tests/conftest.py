import contextlib
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
# Every test starts at this count. A trainer sets its engine.cpu_threads process-wide, also inside a module-scoped
# fixture, which runs before a test's own fixtures: restoring the count found at a test's start would keep it.
BASE_THREADS = torch.get_num_threads()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    torch.set_num_threads(BASE_THREADS)
    yield
    torch.set_num_threads(BASE_THREADS)


def _cpu_isas() -> list:
    """The instruction sets of the C++ CPU kernels that this build and CPU run ([None] without the extension)."""
    from diffcurr_fast.ops import _backend

    return _backend.cpu_isas() or [None]


CPU_ISAS = _cpu_isas()


def op_backends(*names: str) -> list:
    """``parametrize`` values for an op test's ``backend``: the names as given, except that ``cpu`` becomes one
    value per instruction set of the C++ kernels that this machine runs (ids ``cpu-generic``, ``cpu-avx2``,
    ``cpu-avx512``), so that each variant a user's CPU may pick is checked against the reference here, not only
    the one this machine picks."""
    out = []
    for name in names:
        if name != "cpu" or CPU_ISAS == [None]:
            out.append(name)
            continue
        out += [pytest.param(name, id=f"cpu-{isa}", marks=pytest.mark.cpu_isa(isa)) for isa in CPU_ISAS]
    return out


@pytest.fixture(params=[pytest.param(isa, id=f"isa={isa}", marks=pytest.mark.cpu_isa(isa)) for isa in CPU_ISAS])
def each_cpu_isa(request):
    """Run the test once per instruction set of the C++ CPU kernels (``op_backends``), for tests without a
    ``backend`` parameter whose fused paths run on the CPU kernels (a fused model, the objective, the trainer's
    step). The value is the set in use (None: no extension; the test's own skip applies)."""
    return request.param


@pytest.fixture(autouse=True)
def _cpu_isa_marker(request):
    """A test marked ``cpu_isa(name)`` runs the C++ CPU kernels of that instruction set."""
    marker = request.node.get_closest_marker("cpu_isa")
    if marker is None or marker.args[0] is None:
        yield
        return
    from diffcurr_fast.ops import _backend

    with _backend.use_cpu_isa(marker.args[0]):
        yield


def assert_near_reference(actual: torch.Tensor, ref: torch.Tensor, rel: float, what: str = "") -> None:
    """Closeness to a (float64) reference, scaled to the tensor: ||actual - ref|| / ||ref|| <= rel, and no element
    off by more than 10 rel of the largest reference value. Two float32 paths differ by rounding whose size
    follows the tensor's scale, so an absolute tolerance that holds for one tensor, CPU or instruction set can
    fail on another (a gradient of a few hundred against atol 1e-4); a fixed relative one is as strict for all."""
    a, r = actual.detach().double(), ref.detach().double()
    assert a.shape == r.shape, f"{what}: shape {tuple(a.shape)} against {tuple(r.shape)}"
    assert bool(torch.isfinite(a).all()), f"{what}: non-finite values"
    err = float((a - r).norm() / r.norm().clamp_min(1e-300))
    worst = float((a - r).abs().max() / r.abs().max().clamp_min(1e-300))
    assert err <= rel and worst <= 10 * rel, (
        f"{what}: relative error {err:.2e}, worst element {worst:.2e} of the largest (limit {rel})"
    )


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


# ---- the bad-input tests (tests/<unit>/test_<unit>_errors.py): a tiny run's config, the command line, trained runs


def tiny(run_dir, *extra):
    """The config of a tiny digits run (TINY_SETS) in ``run_dir``, with the ``extra`` overrides."""
    from diffcurr_fast.runs.recipes import load_config

    return load_config(None, [f"checkpoint.run_dir={run_dir}", *TINY_SETS, *extra])


def _main(capsys, *argv):
    """(exit status, stderr) of ``diffcurr-fast ARGV``."""
    from diffcurr_fast import cli

    capsys.readouterr()
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err


def _sample_args(*argv):
    """The parsed arguments of ``diffcurr-fast sample ARGV``."""
    import argparse

    from diffcurr_fast import cli_sample

    p = argparse.ArgumentParser()
    cli_sample.add_arguments(p)
    return p.parse_args(list(argv))


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """A tiny run trained for 2 steps, a checkpoint at each (read only: tests copy it before changing it)."""
    from diffcurr_fast.train.loop import Trainer

    run = tmp_path_factory.mktemp("bad") / "run"
    Trainer(tiny(run, "engine.max_steps=2", "checkpoint.every=1")).fit()
    return run


@pytest.fixture(scope="session")
def no_dropout_run(tmp_path_factory):
    """A tiny run of 1 step trained without label dropout (model.class_dropout_prob=0): no null label to guide."""
    from diffcurr_fast.train.loop import Trainer

    run = tmp_path_factory.mktemp("nodrop") / "run"
    Trainer(tiny(run, "engine.max_steps=1", "model.class_dropout_prob=0")).fit()
    return run


def random_weights(model: torch.nn.Module, std: float = 0.05, seed: int = 0) -> torch.nn.Module:
    """Every trainable weight drawn at random (the zero-initialised adaLN and output layers would hide a mix-up), the
    model in eval mode."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model.eval()


def tiny_dit_overrides(run, *extra) -> list:
    """``--set`` overrides of a tiny DiT run (6x6 input, patch 3, width 48, depth 2, 7 classes, 60 timesteps) in
    ``run``, then ``extra``."""
    return [
        f"checkpoint.run_dir={run}",
        "model.input_size=6",
        "model.patch_size=3",
        "model.hidden_size=48",
        "model.depth=2",
        "model.num_heads=3",
        "model.num_classes=7",
        "diffusion.num_timesteps=60",
        "curriculum.num_clusters=4",
        "engine.max_steps=1",
        *extra,
    ]


class RecordingClassifier(torch.nn.Module):
    """A linear classifier on flattened 2x2 images that records every batch it sees, with the mode it was in."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)
        self.seen: list[tuple[bool, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.append((self.training, x.detach().clone()))
        return self.lin(x.flatten(1))


# A process that holds the lock of the folder or file argv[1] (argv[2]: "dir" or "file") until it is killed.
HOLDER = """
import sys, time
from diffcurr_fast._files import OutputLock
OutputLock(sys.argv[1], "run directory", "choose another", directory=sys.argv[2] == "dir").acquire()
print("held", flush=True)
time.sleep(120)
"""


@contextlib.contextmanager
def locked_by_another(path, kind="dir"):
    """A process holding the ``OutputLock`` of ``path`` (a folder, or a file with ``kind="file"``) while the block
    runs; killed at its end (its lock file stays, as a killed command's does). Yields the process."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), kind], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "held", proc.stderr.read()
        yield proc
    finally:
        proc.kill()
        proc.communicate()
