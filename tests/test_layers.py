"""The import rules of docs/architecture.md: a package imports only its own modules and those of lower layers.

Every import is read from the source (module level, inside functions, under ``TYPE_CHECKING``), and so is every
string that names a module of the package (``importlib.import_module`` targets, lazy export tables, the config's
choice owners): a dynamic import is an import.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Bottom-up. A unit (a subpackage, or a top-level module) may import its own modules and units of lower layers only.
LAYERS: list[tuple[str, ...]] = [
    ("", "_C", "_files", "_lazy", "kernels", "recipes"),  # the face, the C++ extension, JSON files, lazy exports,
    # Triton kernels, YAML recipes
    ("diffusion", "data", "curriculum"),  # schedules and formulations; datasets and loaders; clustering and pacing
    ("ops", "terms"),  # fused ops and their backend dispatch; the training-term interface
    ("models", "objective", "timesteps"),  # the DiT; the training objective; timestep strategies
    ("runs",),  # the run config, model building and sampling, checkpoints
    ("eval",),  # metrics and feature extractors, samples from a checkpoint
    ("train",),  # engines, the loop, EMA, evaluation during training, run directories
    ("tdc", "analysis"),  # TDC training; the offline difficulty analysis
    ("study", "cli_sample", "cli_export", "info"),  # ablation studies; the sample, export and info commands
    ("cli",),  # the command line: it names every command
]
RANK = {unit: i for i, units in enumerate(LAYERS) for unit in units}
_MODULE = re.compile(r"diffcurr_fast(\.\w+)+")
_FILE_SUFFIXES = {"json", "yaml", "yml", "txt", "pt", "safetensors", "npz", "png"}


def unit_of(module: str) -> str:
    """The layer unit of a module path: ``diffcurr_fast.train.loop`` -> ``train``, ``diffcurr_fast`` -> ``''``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def source_files(root: Path) -> dict[str, Path]:
    """module path -> file, for the package under ``root`` (``kernels/`` is installed as ``diffcurr_fast.kernels``)."""
    files: dict[str, Path] = {}
    for base, package in ((root / "diffcurr_fast", "diffcurr_fast"), (root / "kernels", "diffcurr_fast.kernels")):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            if parts and parts[0] in ("kernels", "recipes") and package == "diffcurr_fast":
                continue  # links to the top-level folders, scanned as themselves
            files[".".join([package, *parts])] = path
    return files


def imported_modules(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, module) of every import of the package in ``path`` (relative imports resolved), and of every string
    constant that is a module path of the package."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for a in node.names:  # ``from diffcurr_fast import ops`` imports the unit ops; ``__version__`` is the face
                sub = target == "diffcurr_fast" and not a.name.startswith("__")
                found.append((node.lineno, f"{target}.{a.name}" if sub else target))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and _MODULE.fullmatch(node.value):
            if node.value.rpartition(".")[2] not in _FILE_SUFFIXES:  # "diffcurr_fast.json" names a file
                found.append((node.lineno, node.value))
    return sorted({(line, m) for line, m in found if m == "diffcurr_fast" or m.startswith("diffcurr_fast.")})


def violations(root: Path) -> list[str]:
    """One line per import that runs up (or sideways into another unit of the same layer), or per unknown unit."""
    out: list[str] = []
    for module, path in source_files(root).items():
        unit = unit_of(module)
        if unit not in RANK:
            out.append(f"{path.relative_to(root)}: unit {unit!r} is in no layer (add it to LAYERS and the doc)")
            continue
        for line, target in imported_modules(path, module):
            dep = unit_of(target)
            if dep == unit:
                continue
            if dep not in RANK:
                out.append(f"{path.relative_to(root)}:{line}: imports {target}, a unit in no layer")
            elif RANK[dep] >= RANK[unit]:
                out.append(
                    f"{path.relative_to(root)}:{line}: {unit or 'diffcurr_fast'} (layer {RANK[unit]}) imports "
                    f"{target} (layer {RANK[dep]})"
                )
    return out


def test_no_import_runs_up():
    found = violations(ROOT)
    assert not found, "imports against the layers of docs/architecture.md:\n" + "\n".join(found)


def test_every_unit_is_placed():
    units = {unit_of(m) for m in source_files(ROOT)}
    assert units <= set(RANK), sorted(units - set(RANK))


@pytest.mark.parametrize(
    "file, text",
    [
        ("diffcurr_fast/diffusion/bad.py", "from diffcurr_fast.train.loop import Trainer\n"),
        ("diffcurr_fast/eval/bad.py", "def f():\n    from diffcurr_fast.train import evaluation\n"),
        ("diffcurr_fast/runs/bad.py", "import importlib\nimportlib.import_module('diffcurr_fast.train.engine')\n"),
        ("diffcurr_fast/ops/bad.py", "from diffcurr_fast import models\n"),
        ("diffcurr_fast/models/bad.py", "from diffcurr_fast.objective import Objective\n"),  # same layer
        ("diffcurr_fast/newpkg/__init__.py", "x = 1\n"),  # a package placed in no layer
    ],
)
def test_checker_sees_an_upward_import(tmp_path, file, text):
    for d in ("diffcurr_fast/diffusion", "diffcurr_fast/train", "kernels"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "diffcurr_fast/__init__.py").write_text("")
    (tmp_path / "diffcurr_fast/train/loop.py").write_text("from diffcurr_fast.diffusion import axis\n")
    assert violations(tmp_path) == []
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text(text)
    assert len(violations(tmp_path)) == 1, violations(tmp_path)
