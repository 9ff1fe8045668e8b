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
    ("", "_C", "_files", "_lazy", "kernels", "options", "recipes"),  # the face, the C++ extension, JSON files, lazy
    # exports, Triton kernels, the options schema, YAML recipes
    ("diffusion", "data", "curriculum"),  # schedules and formulations; datasets and loaders; clustering and pacing
    ("ops", "terms", "optim"),  # fused ops and their backend dispatch; the training terms; the optimizers
    ("models", "timesteps"),  # the DiT and its options; timestep strategies
    ("objective",),  # the training objective
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
    """module path -> file, for the package under ``root``: the import path is the file path."""
    files: dict[str, Path] = {}
    for path in sorted((root / "diffcurr_fast").rglob("*.py")):
        parts = [p for p in path.relative_to(root).with_suffix("").parts if p != "__init__"]
        files[".".join(parts)] = path
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
    for d in ("diffcurr_fast/diffusion", "diffcurr_fast/train", "diffcurr_fast/kernels"):
        (tmp_path / d).mkdir(parents=True)
        (tmp_path / d / "__init__.py").write_text("")
    (tmp_path / "diffcurr_fast/__init__.py").write_text("")
    (tmp_path / "diffcurr_fast/train/loop.py").write_text("from diffcurr_fast.diffusion import axis\n")
    assert violations(tmp_path) == []
    (tmp_path / file).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / file).write_text(text)
    assert len(violations(tmp_path)) == 1, violations(tmp_path)


def test_kernels_index_names_every_kernel_source():
    """The top-level kernels/README.md names every module of diffcurr_fast/kernels, and every path it names exists."""
    text = (ROOT / "kernels" / "README.md").read_text()
    modules = {p.name for p in (ROOT / "diffcurr_fast" / "kernels").glob("*.py")} - {"__init__.py"}
    assert {m for m in modules if f"diffcurr_fast/kernels/{m}" not in text} == set()
    named = set(re.findall(r"`((?:diffcurr_fast|csrc|benchmarks)/[\w/.]+\.(?:py|h|cpp|cu))`", text))
    assert named and {p for p in named if not (ROOT / p).is_file()} == set()


def function_imports_without_reason(root: Path) -> list[str]:
    """Imports inside functions whose block has no comment saying why (docs/architecture.md: every import is at
    the top of its module, except those that keep ``--help`` free of torch and optional dependencies, each with a
    one-line comment). A block is a run of consecutive import statements; its comment may be on any of its lines,
    on the line above it, or on the ``try:`` that guards it."""
    out: list[str] = []
    for path in sorted((root / "diffcurr_fast").rglob("*.py")):
        lines = path.read_text().splitlines()
        tree = ast.parse("\n".join(lines))
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for parent in ast.walk(func):
                for field in ("body", "orelse", "finalbody"):
                    body = getattr(parent, field, None)
                    if not isinstance(body, list):
                        continue
                    i = 0
                    while i < len(body):
                        if not isinstance(body[i], ast.Import | ast.ImportFrom):
                            i += 1
                            continue
                        j = i
                        while j + 1 < len(body) and isinstance(body[j + 1], ast.Import | ast.ImportFrom):
                            j += 1
                        first, last = body[i].lineno, body[j].end_lineno
                        span = lines[first - 2 : last]  # the line above the block, and the block
                        if i == 0 and isinstance(parent, ast.Try) and field == "body":
                            span.append(lines[parent.lineno - 1])
                        if not any("#" in line for line in span):
                            out.append(f"{path.relative_to(root)}:{first}: {lines[first - 1].strip()}")
                        i = j + 1
    return out


def test_imports_inside_functions_say_why():
    found = function_imports_without_reason(ROOT)
    assert not found, "imports inside a function without a comment saying why:\n" + "\n".join(found)


def test_the_import_checks_can_fail(tmp_path):
    pkg = tmp_path / "diffcurr_fast"
    pkg.mkdir()
    (pkg / "a.py").write_text("def f():\n    import os\n\n    return os\n")
    (pkg / "b.py").write_text("def f():\n    import os  # here: a reason\n\n    return os\n")
    (pkg / "c.py").write_text(
        "def f():\n    try:  # optional\n        import x\n    except ImportError:\n        x = None\n"
    )
    assert [line.split(":")[0] for line in function_imports_without_reason(tmp_path)] == ["diffcurr_fast/a.py"]


def test_matplotlib_and_json_files_have_one_writer():
    """docs/architecture.md: matplotlib is imported only by ``_lazy.pyplot()``; JSON files are written by
    ``_files.write_json`` (``kernels/aot.py``, in the same layer, writes its own the same way)."""
    plots, dumps = [], []
    for path in sorted((ROOT / "diffcurr_fast").rglob("*.py")):
        rel, text = str(path.relative_to(ROOT)), path.read_text()
        if re.search(r"^\s*(import|from) matplotlib", text, re.M) and rel != "diffcurr_fast/_lazy.py":
            plots.append(rel)
        if "json.dump(" in text and rel not in ("diffcurr_fast/_files.py", "diffcurr_fast/kernels/aot.py"):
            dumps.append(rel)
    assert plots == [] and dumps == []


def test_package_faces_have_no_export_tables():
    """docs/architecture.md: an ``__init__.py`` imports its public names directly (no ``__getattr__`` table), and
    a package that holds a command (``cli_*.py``) has only its docstring (the face: and ``__version__``), so that the
    command's --help stays light."""
    found = []
    for init in sorted((ROOT / "diffcurr_fast").rglob("__init__.py")):
        tree = ast.parse(init.read_text())
        names = {getattr(t, "id", None) for n in tree.body if isinstance(n, ast.Assign) for t in n.targets}
        funcs = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
        if "__getattr__" in names | funcs:
            found.append(f"{init.relative_to(ROOT)}: an export table")
        light = [n for n in tree.body[1:] if not (isinstance(n, ast.Assign) and names == {"__version__"})]
        if list(init.parent.glob("cli_*.py")) and light:
            found.append(f"{init.relative_to(ROOT)}: holds a command, so only its docstring")
    assert not found, found


def test_tests_mirror_the_package():
    """tests/<unit>/ for the units of the package (and csrc/ for the C++ sources); basenames unique (no __init__)."""
    dirs = {p.name for p in (ROOT / "tests").iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert dirs <= set(RANK) | {"csrc"}, sorted(dirs - set(RANK) - {"csrc"})
    names = [p.name for p in (ROOT / "tests").rglob("test_*.py")]
    assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)


def test_architecture_names_only_files_that_exist():
    """Every file docs/architecture.md names exists (a path from the root or the package, or a unique file name),
    and so does every test it names (``file.py::test``); ``<name>`` templates and the registry the first training
    term creates are not files yet."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    names = {n for n in re.findall(r"`([\w./-]+\.(?:py|md|yaml))(?:::(\w+))?`", text)}
    skip = {".venv", "mutants"}  # the environment and `make mutation`'s copy of the tree
    files = [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md", ".yaml") and not skip & set(p.parts)]
    missing = []
    for path, test in sorted(names):
        if path == "terms/registry.py":
            continue
        found = [p for p in (ROOT / path, ROOT / "diffcurr_fast" / path) if p.is_file()]
        found = found or [p for p in files if p.name == path]
        if len(found) != 1 or (test and f"def {test}(" not in found[0].read_text()):
            missing.append(f"{path}::{test}" if test else path)
    assert len(names) > 20 and not missing, missing
