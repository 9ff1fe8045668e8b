import contextlib
import json
import os
import signal
import subprocess
import sys
import weakref
from pathlib import Path

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
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

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
    "optim.name=adamw",  # the field's default (the demo ships Muon); the optimizers' own tests choose theirs
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


aten = torch.ops.aten  # SyncCounter's ops
_COPIES = {aten._to_copy.default, aten.copy_.default, aten.to.dtype_layout, aten.to.device}


class SyncCounter(TorchDispatchMode):
    """Records host reads of step-computed values (``syncs``: op name and shape) while active: every
    ``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor), ``.tolist()``,
    ``.numpy()`` and copy from a device to the CPU, except of values drawn from a CPU generator (or made from such
    alone). On a CUDA device each is a sync; on the CPU the counter shows the reads a GPU would stall on."""

    def __init__(self):
        super().__init__()
        self.syncs: list[tuple[str, tuple[int, ...]]] = []
        self._host: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # id -> tensor from a CPU generator

    def __enter__(self):
        # .tolist() and .numpy() read a tensor without dispatching (on CUDA they copy to the CPU first, seen below)
        self._saved = (torch.Tensor.tolist, torch.Tensor.numpy)
        for name, fn in zip(("tolist", "numpy"), self._saved):
            setattr(torch.Tensor, name, self._reader(name, fn))
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.numpy = self._saved
        return super().__exit__(*exc)

    def _reader(self, name, fn):
        def read(t, *args, **kwargs):
            if not self._is_host(t):
                self.syncs.append((name, tuple(t.shape)))
            return fn(t, *args, **kwargs)

        return read

    def _is_host(self, t: torch.Tensor) -> bool:
        return self._host.get(id(t)) is t

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat, _ = tree_flatten((args, kwargs))
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        out = func(*args, **kwargs)
        if func is aten._local_scalar_dense.default:
            if not self._is_host(args[0]):
                self.syncs.append((str(func), tuple(args[0].shape)))
        elif func in _COPIES:
            src = args[0]
            dst = out if func is not aten.copy_.default else args[0]
            if func is aten.copy_.default:
                src = args[1]
            if src.device.type != "cpu" and dst.device.type == "cpu":
                self.syncs.append((str(func), tuple(src.shape)))
        host_gen = any(isinstance(a, torch.Generator) and a.device.type == "cpu" for a in flat)
        if host_gen or (tensors and all(self._is_host(t) for t in tensors)):  # drawn on the host, or made from such
            for o in tree_flatten(out)[0]:
                if isinstance(o, torch.Tensor):
                    self._host[id(o)] = o
        return out


def assert_same_state(a, b, where: str = "state", skip: tuple = ()) -> None:
    """``a`` and ``b`` (a checkpoint, or any nesting of dicts, lists, tensors and scalars) hold the same values field
    by field: the same keys, tensors of one dtype and shape equal bit for bit (NaN where NaN), scalars equal. The
    keys named in ``skip`` (at any depth) are not compared. A new field of a checkpoint is compared without a
    change here: a resume test that uses this checks every piece of state, not a list of them."""
    if isinstance(a, dict):
        assert isinstance(b, dict), f"{where}: a dict against {type(b).__name__}"
        assert a.keys() == b.keys(), f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))} in one only"
        for key in a:
            if key not in skip:
                assert_same_state(a[key], b[key], f"{where}[{key!r}]", skip)
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a!r} against {b!r}"
        for i, (u, v) in enumerate(zip(a, b)):
            assert_same_state(u, v, f"{where}[{i}]", skip)
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{where}: a tensor against {type(b).__name__}"
        kind = (a.dtype, tuple(a.shape))
        assert kind == (b.dtype, tuple(b.shape)), f"{where}: {kind} against {(b.dtype, tuple(b.shape))}"
        same = torch.equal(a, b) or (a.is_floating_point() and bool(((a == b) | (a.isnan() & b.isnan())).all()))
        assert same, f"{where}: tensors differ"
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{where}: NaN against {b!r}"
    else:
        assert type(a) is type(b) and a == b, f"{where}: {a!r} against {b!r}"


def assert_resumed_state(whole, resumed) -> None:
    """A resumed run holds the uninterrupted run's state field by field (``assert_same_state`` of their
    ``Trainer.state_dict()``, everything a checkpoint keeps, or of two checkpoints), but for the two things a resume
    changes: the training clock (``train_s``, tested on its own) and the run directory in the config."""
    a, b = (t if isinstance(t, dict) else t.state_dict() for t in (whole, resumed))
    assert_same_state(a, b, skip=("train_s", "run_dir"))


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


def set_args(*overrides: str) -> list[str]:
    """The command line's ``--set`` arguments of ``overrides``, a key given again taking the later value (a test's
    base settings, then what it changes; the command line itself refuses a key given twice)."""
    last = {o.partition("=")[0].strip(): o for o in overrides}
    return [a for s in last.values() for a in ("--set", s)]


def tiny(run_dir, *extra):
    """The config of a tiny digits run (TINY_SETS) in ``run_dir``, with the ``extra`` overrides."""
    from diffcurr_fast.runs.recipes import load_config

    return load_config(None, [f"checkpoint.run_dir={run_dir}", *TINY_SETS, *extra])


@pytest.fixture
def fake_slurm(tmp_path, monkeypatch):
    """The fake Slurm of tests/study/fake_slurm/ first on PATH, over the state folder it returns; every job it started
    is killed at the end."""
    state = tmp_path / "fake_slurm"
    state.mkdir()
    monkeypatch.setenv("FAKE_SLURM", str(state))
    monkeypatch.setenv("PATH", f"{Path(__file__).parent / 'study' / 'fake_slurm'}{os.pathsep}{os.environ['PATH']}")
    yield state
    for pgid in state.glob("*.pgid"):
        try:
            os.killpg(int(pgid.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


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


def resume_in_copy(full, half, step: int, cfg):
    """A Trainer of ``cfg`` (run dir ``half``) resumed from the checkpoint of ``step`` of the run in ``full``, copied
    alone into ``half``; the global RNG reseeded first, as a new process would have it."""
    import shutil

    from diffcurr_fast.runs import checkpoint as ck
    from diffcurr_fast.train.loop import Trainer

    (half / ck.CKPT_DIR).mkdir(parents=True)
    name = ck.ckpt_name(step)
    shutil.copy(full / ck.CKPT_DIR / name, half / ck.CKPT_DIR / name)
    torch.manual_seed(999)
    tr = Trainer(cfg, resume=True)
    assert tr.step == step
    return tr


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
