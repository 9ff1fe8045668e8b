"""Options: the schema every config field is declared and checked by, and the base of a component's options.

A field is a dataclass field made by ``option(default, doc, choices, lo=, hi=)``: its default, a one-line doc
(``metadata["doc"]``) and its valid values, a tuple of choices (or a function returning them, read on first use) or
a range [lo, hi] with open ends as flagged. ``check_value`` is the one check of a value against its field: the type,
then the choices or the range, every float finite. The sections of the run config (``runs.config``) and the
options of each component are declared this way.

A component (a formulation, a timestep strategy, a training term, a model option, an optimizer) declares its options
beside its code as an ``Options`` subclass: its fields, their help, and the rules that are its own (``validate``),
what it refuses (``refusal``: TDC, export, CUDA graphs), whether a run uses it (``active``), and how a user turns it
on (``switch``). The config section it belongs to takes its fields as its own keys: ``PREFIX`` + the field's name
(``terms.sra_weight`` is the ``weight`` of SRA's options, whose prefix is ``sra_``).

Provenance: each section records, per field, (rank, label) of the source that set it: rank 0 the defaults, then one
rank per source in the order they were applied (the demo or a recipe, then the --set list), so that a later source
can win over an earlier one (a preset replaces the recipe's dimensions; an option of a component that a later source
turned off yields). Values filled in by validation (a preset's dimensions, ``auto``) are kept in ``filled`` so that
they are filled again when what they follow changes. A source may be a record (a run's saved ``config.yaml``, a
checkpoint's config): it holds every field, the options of components the run did not use included.

This module imports nothing of the package and no torch: a command's ``--help`` imports it.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

INF = math.inf
DEFAULT_SOURCE = (0, "default")


def option(
    default: Any,
    doc: str,
    choices: tuple | Callable[[], tuple] | None = None,
    *,
    lo: float | None = None,
    hi: float = INF,
    lo_open: bool = False,
    hi_open: bool = False,
) -> Any:
    """A field: its default, one-line doc, and its valid values (``choices``, or the range [lo, hi] with open ends as
    flagged). ``check_value`` is the one place these are checked."""
    meta: dict[str, Any] = {"doc": doc}
    if choices is not None:
        meta["choices"] = choices
    if lo is not None:
        meta["range"] = (lo, hi, lo_open, hi_open)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def positive(default: int, doc: str) -> Any:
    """An int field >= 1."""
    return option(default, doc, lo=1)


def nonneg(default: float, doc: str, **kw: Any) -> Any:
    """A field >= 0 (``hi`` etc. as in ``option``)."""
    return option(default, doc, lo=0, **kw)


def unit(default: float, doc: str, **kw: Any) -> Any:
    """A float field in [0, 1] (ends open as flagged)."""
    return option(default, doc, lo=0.0, hi=1.0, **kw)


# ---- types and checks --------------------------------------------------------------------------------------
_HINTS: dict[type, dict[str, Any]] = {}


def hints(cls: type) -> dict[str, Any]:
    """The resolved type of each field of the dataclass ``cls``."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, value: Any, tp: Any) -> Any:
    """``value`` as type ``tp`` (int -> float widening only); ValueError naming ``key`` otherwise."""
    if tp is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if tp is float and isinstance(value, str) and value.strip().lower() in ("inf", "+inf", "-inf", "nan"):
        return float(value)
    if typing.get_origin(tp) is list:  # a list field: each item as the item type
        (item,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ValueError(f"{key} must be a list of {type_name(item)} ([a, b, ...]), got {value!r}")
        return [coerce(key, v, item) for v in value]
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        for arg in typing.get_args(tp):
            if arg is type(None) and value is None:
                return None
            if arg is not type(None):
                try:
                    return coerce(key, value, arg)
                except ValueError:
                    pass
        raise ValueError(f"{key} must be {tp}, got {value!r}")
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif isinstance(tp, type) and isinstance(value, tp) and not isinstance(value, bool):
        return value
    raise ValueError(f"{key} must be of type {type_name(tp)}, got {value!r} ({type(value).__name__})")


def choices_of(f: dataclasses.Field) -> tuple | None:
    """The valid values of a choice field (resolved from their owner), or None."""
    choices = f.metadata.get("choices")
    return choices() if callable(choices) else choices


def check_value(key: str, f: dataclasses.Field, value: Any, tp: Any) -> Any:
    """The one check of a field's value: its type, then its choices or its range; every float must be finite.
    Returns the value as the field's type."""
    value = coerce(key, value, tp)
    choices = choices_of(f)
    if choices is not None and value not in choices:
        raise ValueError(f"invalid value {value!r} for {key}; valid choices: {', '.join(map(str, choices))}")
    for item in value if isinstance(value, list) else [value]:  # a list field: the range holds for each item
        if isinstance(item, float) and not math.isfinite(item):
            raise ValueError(f"{key} must be a finite number, got {item!r}")
        rng = f.metadata.get("range")
        if rng is not None and item is not None:
            lo, hi, lo_open, hi_open = rng
            if not ((item > lo if lo_open else item >= lo) and (item < hi if hi_open else item <= hi)):
                if hi == INF:
                    raise ValueError(f"{key} must be {'>' if lo_open else '>='} {lo}, got {item!r}")
                lb, rb = "(" if lo_open else "[", ")" if hi_open else "]"
                raise ValueError(f"{key} must lie in {lb}{lo}, {hi}{rb}, got {item!r}")
    return value


def check_fields(prefix: str, obj: Any) -> None:
    """``check_value`` on every field of the dataclass instance ``obj``, its keys named ``prefix.field``."""
    for f in dataclasses.fields(obj):
        check_value(f"{prefix}.{f.name}", f, getattr(obj, f.name), hints(type(obj))[f.name])


# ---- provenance -----------------------------------------------------------------------------------------------
def sources(section: Any) -> dict[str, tuple[int, str]]:
    """field -> (rank, label) of the source that set it (module doc); the defaults are not listed."""
    return section.__dict__.setdefault("_sources", {})


def filled(section: Any) -> set[str]:
    """The fields that validation filled in (a preset's dimensions, ``auto``)."""
    return section.__dict__.setdefault("_filled", set())


def source_of(section: Any, key: str) -> tuple[int, str]:
    return sources(section).get(key, DEFAULT_SOURCE)


def new_source(root: Any, label: str, *, record: bool = False) -> tuple[int, str]:
    """The next source applied to the config ``root``: (its rank, ``label``). A ``record`` (a saved config) holds
    every field and asks for nothing: its options of unused components are not refused (``is_record``)."""
    rank = root.__dict__.get("_rank", 0) + 1
    root.__dict__["_rank"] = rank
    if record:
        root.__dict__.setdefault("_records", set()).add(rank)
    return rank, label


def is_record(root: Any, rank: int) -> bool:
    """Whether source ``rank`` of ``root`` is a record (``new_source``)."""
    return rank in root.__dict__.get("_records", ())


# ---- the options of a component ----------------------------------------------------------------------------------
@dataclass
class Options:
    """A component's options (module doc). Subclasses declare fields with ``option`` and override what applies."""

    PREFIX: ClassVar[str] = ""
    # A component that its own field turns on (a model option, a switch of the terms section): that field's name.
    # While it is off, the other fields are options nobody uses: set by the user, they are refused.
    SWITCH: ClassVar[str | None] = None

    @classmethod
    def keys(cls) -> dict[str, str]:
        """The section's key of each field: PREFIX + name -> name."""
        return {cls.PREFIX + f.name: f.name for f in dataclasses.fields(cls)}

    @classmethod
    def of(cls, section: Any) -> Options:
        """The options as the config ``section`` holds them (its keys ``PREFIX`` + name)."""
        return cls(**{name: getattr(section, key) for key, name in cls.keys().items()})

    def active(self) -> bool:
        """Whether a run uses a component that its own field turns on (``SWITCH``); where the section's selection
        decides (``diffusion.formulation``, ``terms.use``, ...) the config does not ask."""
        return True

    def overruled(self, cfg: Any) -> tuple[int, str] | None:
        """For a component its own field turns on (``SWITCH``): (rank, label) of a choice made in a later source
        that rules it out (a recipe's Denoising Task Routing, then a --set of a continuous formulation), so that it
        turns off (yields, as ``auto`` fields do) instead of failing; None when nothing does."""
        return None

    def validate(self, cfg: Any) -> None:
        """The component's own rules over the whole config ``cfg`` (read-only), when the run uses it: ValueError in
        one line naming the key and what to set."""

    def refusal(self, cfg: Any, use: str) -> str | None:
        """The one-line error when the component cannot serve ``use`` (``tdc``: TDC's pruned experts;
        ``cuda_graphs``: a step that reads nothing back to the host), naming what to set instead; None where it
        can. Asked only when the run uses the component."""
        return None

    def check_inputs(self, cfg: Any, read: bool) -> None:
        """The component's input files exist and are what it takes (``read``: also open and read them as the
        start will), before anything is written; raises in one line naming the key."""

    def fused_ops(self, cfg: Any) -> list[str]:
        """The fused ops the component's code calls without a backend argument (a model option's, with
        ``model.fused_adaln``), whose backend ``DIFFCURR_OPS_BACKEND`` picks: the preflight checks they run here."""
        return []

    def min_micro_batch(self, cfg: Any) -> int:
        """The fewest samples per micro-batch the component needs (a term that compares samples: 2)."""
        return 1


def load(target: str) -> Any:
    """The object a registry names as ``module:attribute``, imported on first use."""
    import importlib  # here: the registries resolve their entries only when a config is built

    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)
