"""Recipes and overrides: reading a YAML recipe (a file, or the name of a shipped one), ``--set a.b=value``, and
writing the resolved configuration back as YAML.

``load_config(path, overrides)`` builds a ``TrainConfig`` (``runs.config``) from a recipe, or from the demo recipe
(``diffcurr_fast/recipes/demo.yaml``) when ``path`` is None; ``config_to_yaml`` writes the resolved configuration
(the run directory keeps it as ``config.yaml``); ``describe_config`` lists every key for ``--help-config``.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import yaml

from diffcurr_fast.options import choices_of, filled, hints, new_source, source_of, sources, type_name
from diffcurr_fast.runs.config import (
    SECTION_NAMES,
    TrainConfig,
    components,
    config_from_dict,
    key_type,
    section_type,
    set_key,
    upgrade_saved,
)

# The run of ``diffcurr-fast train`` without a recipe (``make demo``); ``tdc`` without a recipe starts from it too.
DEMO_RECIPE = "demo.yaml"


def parse_override(text: str) -> tuple[str, Any]:
    """Split ``a.b=value`` and parse the value as YAML (so ``1e-4``, ``true``, ``null``, ``[1, 2]`` are typed)."""
    if "=" not in text:
        raise ValueError(f"an override looks like section.field=value, got {text!r}")
    key, raw = text.split("=", 1)
    key = key.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ValueError(f"cannot parse the value of override {text!r}: {exc}") from None
    if isinstance(value, str) and _looks_float(value):  # YAML 1.1 reads 1e-4 as a string
        value = float(value)
    return key, value


def _looks_float(s: str) -> bool:
    try:
        float(s)
    except ValueError:
        return False
    return any(c in s.lower() for c in "e.")


def _fix_floats(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _fix_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fix_floats(v) for v in obj]
    if isinstance(obj, str) and _looks_float(obj):
        return float(obj)
    return obj


# Config fields that name input files: inside a recipe, a relative value is relative to the recipe's folder (so a
# recipe and its DeepSpeed JSON travel together); on the command line (--set), relative to the current directory.
RECIPE_PATH_KEYS = (("data", "path"), ("engine", "deepspeed_config"), ("model", "init_from"), ("terms", "repa_encoder"))


def recipes_dir() -> Path:
    """The folder of the shipped recipes: the package ``diffcurr_fast.recipes`` (its YAML and DeepSpeed JSON are
    package data)."""
    return Path(__file__).resolve().parents[1] / "recipes"


def list_recipes() -> list[Path]:
    """The shipped recipes, sorted by name."""
    d = recipes_dir()
    return sorted(d.glob("*.yaml")) if d.is_dir() else []


def find_recipe(name: str | Path) -> Path:
    """A recipe file: ``name`` as a path, else a shipped recipe of that name (``dit_b2_curriculum`` or with .yaml)."""
    p = Path(name)
    if p.is_file():
        return p
    shipped = recipes_dir() / (p.name if p.suffix in (".yaml", ".yml") else f"{p.name}.yaml")
    if p.parent == Path(".") and shipped.is_file():
        return shipped
    names = ", ".join(r.stem for r in list_recipes())
    raise FileNotFoundError(
        f"recipe {str(name)!r} does not exist (no such file, and no shipped recipe of that name: {names})"
    )


def duplicate_keys(node: yaml.Node | None, prefix: str = "") -> list[tuple[str, list[int]]]:
    """(dotted key, 1-based lines) of every key set more than once in a mapping of the composed YAML ``node``, at
    any depth (PyYAML keeps the last one silently)."""
    out: list[tuple[str, list[int]]] = []
    if isinstance(node, yaml.MappingNode):
        lines: dict[str, list[int]] = {}
        for key, value in node.value:
            name = f"{prefix}{key.value}" if isinstance(key, yaml.ScalarNode) else f"{prefix}{key.start_mark}"
            lines.setdefault(name, []).append(key.start_mark.line + 1)
            out += duplicate_keys(value, name + ".")
        out = [(k, v) for k, v in lines.items() if len(v) > 1] + out
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            out += duplicate_keys(item, f"{prefix}{i}.")
    return out


def read_recipe(path: str | Path) -> dict[str, Any]:
    """The mapping in a YAML recipe, with the input paths of ``RECIPE_PATH_KEYS`` made relative to its folder;
    ValueError in one line (file, line, column) for malformed YAML."""
    p = find_recipe(path)
    text = p.read_text()
    try:
        dups = duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or type(exc).__name__
        raise ValueError(f"recipe {str(p)!r} is not valid YAML{where}: {problem}") from None
    if dups:
        listed = "; ".join(f"{key!r} at lines {', '.join(map(str, lines))}" for key, lines in dups)
        raise ValueError(f"recipe {str(p)!r} sets a key more than once (only one would count): {listed}; keep one")
    if not data:
        raise ValueError(
            f"recipe {str(p)!r} is empty; give its sections (see `diffcurr-fast train --help-config`), "
            "or run without a recipe for the embedded demo"
        )
    if not isinstance(data, dict):
        raise ValueError(f"recipe {str(p)!r} must be a mapping of sections, got {type(data).__name__}")
    data = _fix_floats(data)
    for sec, key in RECIPE_PATH_KEYS:
        section = data.get(sec)
        if isinstance(section, dict) and isinstance(section.get(key), str) and section[key]:
            v = Path(section[key]).expanduser()
            if not v.is_absolute():
                section[key] = str(p.parent / v)
    return data


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    """The YAML recipe at ``path`` (a file, or the name of a shipped recipe) over the paper defaults (the demo
    recipe, ``DEMO_RECIPE``, when ``path`` is None), then ``overrides`` (``a.b=value``); validated. Relative input
    paths in the recipe are relative to its folder (``read_recipe``)."""
    data = read_recipe(recipes_dir() / DEMO_RECIPE if path is None else path)
    label = "demo" if path is None else f"recipe {Path(path).name}"
    return take_export_dims(apply_overrides(config_from_dict(data, source=label), overrides))


def load_run_config(path: str | Path, overrides: list[str] | None = None) -> TrainConfig:
    """The config a run directory's ``config.yaml`` (at ``path``) records, with ``overrides`` on top: what
    ``train --resume`` starts from when no recipe is given. Its paths are taken as the run resolved them (not
    relative to the run's folder, as a recipe's are); keys of an earlier version are upgraded."""
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as exc:
        raise ValueError(f"{str(path)!r} is not valid YAML ({str(exc).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{str(path)!r} holds no config (a mapping of sections)")
    cfg = config_from_dict(_fix_floats(upgrade_saved(data)), source=f"{path.parent.name}/config.yaml", record=True)
    return take_export_dims(apply_overrides(cfg, overrides))


def take_export_dims(cfg: TrainConfig) -> TrainConfig:
    """With ``model.init_from`` a diffusers DiT folder, the model's dimensions come from its ``config.json``, as a
    preset's do: a dimension set by an earlier source than ``init_from`` (the recipe or the demo when ``init_from``
    is a --set), or filled by a preset or the custom defaults, takes the export's value; one set in the same or a
    later source that differs is an error. A plain weights file has no config: its shapes are checked at the
    start."""
    m = cfg.model
    # imported here, not at the top: keeps --help free of torch
    from diffcurr_fast.models.diffusers_dit import export_dims, is_diffusers_dir

    if not m.init_from or not is_diffusers_dir(m.init_from):
        return cfg
    rank, _ = source_of(m, "init_from")
    by = f"model.init_from {m.init_from!r} (its config.json)"
    for name, value in export_dims(m.init_from).items():
        have, (set_rank, where) = getattr(m, name), source_of(m, name)
        if have == value:
            continue
        if set_rank >= rank and name not in filled(m):
            raise ValueError(
                f"model.{name}={have!r} ({where}) contradicts model.init_from {m.init_from!r}, whose config.json "
                f"has {name} {value}; unset it (model.{name}=null) to take the export's value"
            )
        setattr(m, name, value)
        filled(m).discard(name)
        sources(m)[name] = (rank, by)
    return cfg.validate()


def apply_overrides(cfg: TrainConfig, overrides: list[str] | None) -> TrainConfig:
    """``cfg`` with the ``a.b=value`` overrides applied in order (one source, later than the recipe); validated.
    A text field (a path, a name) takes the value as written: ``checkpoint.run_dir=2024`` is the folder "2024",
    ``=on`` the folder "on", not an int or a bool (``null`` still clears an optional one). A key given again takes
    the later value (a caller's base settings, then its changes); the command line refuses that
    (``run_dir_overrides``)."""
    src = new_source(cfg, "--set")
    for text in overrides or []:
        key, value = parse_override(text)
        set_key(cfg, key, _as_written(key, text.split("=", 1)[1], value), src)
    return cfg.validate()


def _as_written(key: str, raw: str, value: Any) -> Any:
    """The override's text for a field typed ``str`` or ``str | None`` (YAML's reading for the other fields, a quoted
    text, and ``null`` / ``~`` of an optional field)."""
    tp = key_type(key)
    text = raw.strip()
    quoted = len(text) >= 2 and text[0] == text[-1] and text[0] in "'\""
    if tp not in (str, str | None) or quoted or (tp is not str and text in ("null", "~")):
        return value
    return text


def run_dir_overrides(overrides: list[str], run_dir: str | None) -> list[str]:
    """The command line's ``--set`` list, with ``--run-dir PATH`` as ``checkpoint.run_dir=PATH`` (the commands'
    shorthand). ValueError for a key given twice (only one would count, as in a recipe), for an empty ``--run-dir``
    (an unset shell variable would otherwise fall back to the recipe's folder) and for a ``--set checkpoint.run_dir``
    that names another folder."""
    seen: dict[str, str] = {}
    for text in overrides:
        key = text.partition("=")[0].strip()
        if key in seen:
            raise ValueError(f"--set {seen[key]!r} and --set {text!r} set {key} twice (only one would count); keep one")
        seen[key] = text
    if run_dir is None:
        return list(overrides)
    if not run_dir.strip():
        raise ValueError("--run-dir is empty (an unset shell variable?); give the run's directory")
    for text in overrides:
        key, _, raw = text.partition("=")
        if key.strip() == "checkpoint.run_dir" and raw.strip() != run_dir:
            raise ValueError(f"--run-dir {run_dir!r} and --set {text!r} name two folders; give one of them")
    return [*overrides, f"checkpoint.run_dir={run_dir}"]


def config_to_yaml(cfg: TrainConfig) -> str:
    """The resolved config as YAML (sections in their declared order); a field not left at its default carries a
    comment naming the source that set it (``TrainConfig.sources``)."""
    text = yaml.safe_dump(cfg.to_dict(), sort_keys=False, default_flow_style=False, width=math.inf)
    sources, lines, sec = cfg.sources(), [], ""
    for line in text.splitlines():
        if line and not line.startswith(" "):
            sec = line.rstrip(":")
        elif line.startswith("  ") and not line.startswith(("   ", "  - ")) and ":" in line:
            label = sources.get(f"{sec}.{line.strip().split(':', 1)[0]}")
            if label:
                line = f"{line}  # {label}"
        lines.append(line)
    return "\n".join(lines) + "\n"


def describe_config() -> str:
    """Every key with its type, default, choices and doc (for ``--help-config``): each section's own keys, then each
    component's options under a line naming it and what turns it on."""
    lines = []
    for sec_name in SECTION_NAMES:
        cls = section_type(sec_name)
        inst, owner = cls(), {f.name: f.metadata.get("component") for f in dataclasses.fields(cls)}
        comps = {c.name: c for c in components(sec_name)}
        lines.append(f"{sec_name}:  # {cls.__doc__}")
        shown = None
        for f in dataclasses.fields(inst):
            if owner[f.name] != shown and owner[f.name] is not None:
                shown, comp = owner[f.name], comps[owner[f.name]]
                lines.append(f"  # {comp.name}: {(comp.options.__doc__ or '').strip().splitlines()[0]}")
            choices = choices_of(f)
            extra = f" (one of {', '.join(map(str, choices))})" if choices else ""
            tp = type_name(hints(cls)[f.name])
            lines.append(f"  {f.name}: {getattr(inst, f.name)!r}  # {tp}; {f.metadata.get('doc', '')}{extra}")
    return "\n".join(lines)
