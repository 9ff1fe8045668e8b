"""Typed, strict training configuration: the sections, composed from the options of their components.

A configuration is a ``TrainConfig`` of twelve sections (model, diffusion, curriculum, timesteps, terms, data, optim,
engine, logging, checkpoint, eval, tdc). A section holds its own fields (declared beside what they configure,
``_CORES``, with ``options.option``: a default, a one-line doc, its choices or range) and the fields of the components
registered for it (``COMPONENTS``): each formulation, timestep strategy, training term, model option and optimizer
declares its options beside its code
(``options.Options``), and the section takes them as its keys (a term's ``weight`` is ``terms.<name>_weight``). The
config names no component: it asks each one whether the run uses it, for its rules (``validate``) and for what it
refuses.

Unknown keys, wrong types and invalid values raise ``ValueError`` naming the key and what is valid; so does an option
of a component the run does not use when the user set it (``check_unused``). ``config_from_dict`` builds one from a
nested dict; recipes, ``--set`` overrides and the YAML written to a run directory are ``runs.recipes``.

Importing this module imports no torch (a command's ``--help`` imports it): the components are imported when the
first section is built.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from diffcurr_fast.options import (
    DEFAULT_SOURCE,
    Options,
    check_value,
    coerce,
    filled,
    hints,
    is_record,
    load,
    new_source,
    source_of,
    sources,
)
from diffcurr_fast.runs.sections import EVAL_SHAPES, with_article

# ---- components ---------------------------------------------------------------------------------------------------
# The sections whose keys include their components' options: section -> (the field that selects among them, or None
# where each is turned on by its own field; the registry module; its table of name -> ``module:Class``). A table's
# entry is the component's class (whose ``Options`` are its options) or its ``Options`` class itself.
COMPONENTS: dict[str, tuple[tuple[str | None, str, str], ...]] = {
    "model": ((None, "diffcurr_fast.models.registry", "OPTIONS"),),
    "diffusion": (("formulation", "diffcurr_fast.diffusion.registry", "FORMULATIONS"),),
    "timesteps": (("sampler", "diffcurr_fast.timesteps.registry", "STRATEGIES"),),
    "terms": (("use", "diffcurr_fast.terms.registry", "TERMS"), (None, "diffcurr_fast.terms.registry", "SWITCHES")),
    "optim": (("name", "diffcurr_fast.optim.registry", "OPTIMIZERS"),),
}
# Each section's own fields, declared beside what they configure: section -> ``module:Class``.
_CORES: dict[str, str] = {
    "model": "diffcurr_fast.models.registry:DiTOptions",
    "diffusion": "diffcurr_fast.runs.sections:DiffusionOptions",
    "curriculum": "diffcurr_fast.curriculum.pacing:CurriculumOptions",
    "timesteps": "diffcurr_fast.timesteps.registry:TimestepsOptions",
    "terms": "diffcurr_fast.terms.registry:TermsOptions",
    "data": "diffcurr_fast.data.section:DataOptions",
    "optim": "diffcurr_fast.optim.registry:OptimOptions",
    "engine": "diffcurr_fast.runs.sections:EngineConfig",
    "logging": "diffcurr_fast.runs.sections:LoggingConfig",
    "checkpoint": "diffcurr_fast.runs.sections:CheckpointConfig",
    "eval": "diffcurr_fast.runs.sections:EvalConfig",
    "tdc": "diffcurr_fast.runs.sections:TDCConfig",
}
SECTION_NAMES = tuple(_CORES)


@dataclass(frozen=True)
class Component:
    """One registered component of a section: its name, the field that selects it (None: its own ``SWITCH``) and
    its options class."""

    section: str
    name: str
    selector: str | None
    options: type[Options]

    def used(self, section: Any) -> bool:
        """Whether the run whose section is ``section`` uses it."""
        if self.selector is None:
            return self.options.of(section).active()
        chosen = getattr(section, self.selector)
        return self.name in chosen if isinstance(chosen, list) else self.name == chosen

    @property
    def label(self) -> str:
        """How errors name it: ``terms.use NAME`` (a list), ``timesteps.sampler 'NAME'`` (a choice), ``model.SWITCH``
        (its own field)."""
        if self.selector is None:
            return f"{self.section}.{self.options.SWITCH or self.name}"
        if self.selector == "use":
            return f"{self.section}.{self.selector} {self.name}"
        return f"{self.section}.{self.selector} {self.name!r}"

    def how_to_use(self, section: Any) -> str:
        """How a user turns it on, for the error naming one of its options that is set while it is off."""
        if self.selector is None:
            key = f"{self.section}.{self.options.SWITCH}"
            return f"it applies only when {key} turns it on ({key} is {getattr(section, self.options.SWITCH)!r})"
        key, chosen = f"{self.section}.{self.selector}", getattr(section, self.selector)
        if isinstance(chosen, list):
            return f"{key} {chosen!r} does not list {self.name!r}; add it to {key}"
        return f"{key} is {chosen!r}; set {key}={self.name}"


def components(section: str) -> list[Component]:
    """The components registered for ``section`` now (a test may register one), in registry order."""
    out = []
    for selector, module, table in COMPONENTS.get(section, ()):
        for name, target in getattr(importlib.import_module(module), table).items():
            obj = load(target)
            out.append(Component(section, name, selector, getattr(obj, "Options", obj)))
    return out


_TYPES: dict[tuple, type] = {}


def section_type(name: str) -> type:
    """The dataclass of section ``name``: its own fields, then each component's options under their keys (a
    component's field's metadata names it: ``component``); the section's own class where it has no components. Built
    on first use and again when a registry grew."""
    core, comps = load(_CORES[name]), components(name)
    if not comps:
        return core
    key = (name, tuple((c.name, c.options) for c in comps))
    if key not in _TYPES:
        extra, seen = [], {f.name for f in dataclasses.fields(core)}
        for c in comps:
            for f in dataclasses.fields(c.options):
                k = c.options.PREFIX + f.name
                if k in seen:
                    raise ValueError(f"{name}.{k}: the options of {c.name!r} repeat a key of the section")
                seen.add(k)
                new = field(
                    default=f.default,
                    default_factory=f.default_factory,
                    metadata={**f.metadata, "component": c.name},
                )
                extra.append((k, hints(c.options)[f.name], new))
        _TYPES[key] = dataclasses.make_dataclass(
            f"{name.capitalize()}Config",
            extra,
            bases=(core,),
            namespace={"__doc__": core.__doc__, "__module__": __name__},
        )
    return _TYPES[key]


def __getattr__(name: str) -> Any:
    """``ModelConfig``, ``DiffusionConfig``, ..., ``TDCConfig``: each section's type (``section_type``); ``SECTIONS``:
    every section's type."""
    named = {f"{sec.capitalize()}Config": sec for sec in SECTION_NAMES} | {"TDCConfig": "tdc"}
    if name in named:
        return section_type(named[name])
    if name == "SECTIONS":
        return {sec: section_type(sec) for sec in SECTION_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# The fields whose ``auto`` follows diffusion.formulation -> their key in the formulation's ``defaults`` (and in its
# ``limits``, where it limits their values).
FORMULATION_FIELDS = {
    ("diffusion", "prediction"): "prediction",
    ("diffusion", "learn_sigma"): "learn_sigma",
    ("diffusion", "weighting"): "weighting",
    ("logging", "sampler"): "sampler",
    ("eval", "sampler"): "sampler",
}


@dataclass
class TrainConfig:
    """The whole training configuration (module doc)."""

    model: Any = field(default_factory=lambda: section_type("model")())
    diffusion: Any = field(default_factory=lambda: section_type("diffusion")())
    curriculum: Any = field(default_factory=lambda: section_type("curriculum")())
    timesteps: Any = field(default_factory=lambda: section_type("timesteps")())
    terms: Any = field(default_factory=lambda: section_type("terms")())
    data: Any = field(default_factory=lambda: section_type("data")())
    optim: Any = field(default_factory=lambda: section_type("optim")())
    engine: Any = field(default_factory=lambda: section_type("engine")())
    logging: Any = field(default_factory=lambda: section_type("logging")())
    checkpoint: Any = field(default_factory=lambda: section_type("checkpoint")())
    eval: Any = field(default_factory=lambda: section_type("eval")())
    tdc: Any = field(default_factory=lambda: section_type("tdc")())

    def validate(self) -> TrainConfig:
        """Resolve ``auto`` (``resolve_auto``), check every field (types, choices, ranges), the sections' own rules,
        the rules of each component the run uses and the options of those it does not (``check_unused``), then the
        cross-section rules; returns self."""
        self.resolve_auto()
        for sec in SECTION_NAMES:
            section = getattr(self, sec)
            for f in dataclasses.fields(section):
                check_value(f"{sec}.{f.name}", f, getattr(section, f.name), hints(type(section))[f.name])
            if hasattr(section, "validate"):  # the section's own cross-field rules, where it has any
                section.validate()
        self._check_formulation_fields()
        for comp, opts, used in self.components():
            if used:
                opts.validate(self)
            else:
                self.check_unused(comp)
        if self.curriculum.num_clusters > self.diffusion.num_timesteps:
            raise ValueError(
                f"curriculum.num_clusters ({self.curriculum.num_clusters}) must be <= diffusion.num_timesteps "
                f"({self.diffusion.num_timesteps})"
            )
        if self.engine.cuda_graphs:
            if self.optim.impl == "apex":
                raise ValueError(
                    "engine.cuda_graphs does not work with optim.impl 'apex' (its FusedAdam cannot skip an update on "
                    "the device); set engine.cuda_graphs=false"
                )
            self.check_refusals("cuda_graphs")
        if self.tdc.num_groups > self.diffusion.num_timesteps:
            raise ValueError(
                f"tdc.num_groups ({self.tdc.num_groups}) must be <= diffusion.num_timesteps "
                f"({self.diffusion.num_timesteps})"
            )
        m = self.model
        if self.logging.eval_every and m.in_channels not in (1, 3):
            raise ValueError(
                f"logging.eval_every needs images (model.in_channels 1 or 3), got {m.in_channels} "
                "channels (latents would need the VAE decoder); set logging.eval_every=0"
            )
        shape = (m.in_channels, m.input_size, m.input_size)
        takes = EVAL_SHAPES.get(self.eval.features, shape)
        if self.logging.eval_every and takes != shape:
            fits = next((f for f, s in EVAL_SHAPES.items() if s == shape), None)
            fix = f"eval.features={fits} (its own classifier)" if fits else "eval.features=inception (FID)"
            raise ValueError(
                f"eval.features {self.eval.features!r} scores {'x'.join(map(str, takes))} images, but this model "
                f"makes {'x'.join(map(str, shape))} (data.dataset {self.data.dataset!r}); set {fix}"
            )
        if self.data.dataset == "images":
            size = self.data.image_size or m.input_size
            if (m.in_channels, m.input_size) != (3, size):
                raise ValueError(
                    f"data.dataset 'images' gives 3x{size}x{size} images but the model takes "
                    f"{m.in_channels}x{m.input_size}x{m.input_size}; set model.in_channels=3, model.input_size={size}"
                )
        return self

    def components(self) -> Iterator[tuple[Component, Options, bool]]:
        """(component, its options as this config holds them, whether the run uses it) of every section."""
        for sec in COMPONENTS:
            section = getattr(self, sec)
            for comp in components(sec):
                yield comp, comp.options.of(section), comp.used(section)

    def used(self) -> list[tuple[Component, Options]]:
        """(component, its options) of each component this run uses, in section and registry order."""
        return [(comp, opts) for comp, opts, used in self.components() if used]

    def check_refusals(self, use: str) -> None:
        """ValueError with the first refusal of ``use`` by a component the run uses (``Options.refusal``)."""
        for _, opts in self.used():
            reason = opts.refusal(self, use)
            if reason:
                raise ValueError(reason)

    def check_unused(self, comp: Component) -> None:
        """An option of ``comp``, which the run does not use, that the user set to another value than its default,
        in the same source as what turns the component off or a later one, is an error naming how to use it. Set in
        an earlier source (the recipe's, when a --set turns the component off) it yields; a record's (a saved
        config, which holds every key) is not a request."""
        section = getattr(self, comp.section)
        switch = comp.selector or comp.options.SWITCH
        off_rank = source_of(section, switch)[0]
        defaults = comp.options()
        for key, name in comp.options.keys().items():
            rank, label = source_of(section, key)
            if key == switch or getattr(section, key) == getattr(defaults, name):
                continue
            if rank == 0 or is_record(self, rank) or rank < off_rank:
                continue
            raise ValueError(
                f"{comp.section}.{key} ({label}) is an option of {comp.name!r}, which this run does not use: "
                f"{comp.how_to_use(section)}, or drop {comp.section}.{key}"
            )

    def _check_formulation_fields(self) -> None:
        """The fields of ``FORMULATION_FIELDS`` hold values the formulation allows (its ``limits``; the prediction is
        the diffusion section's own check, the evaluation sampler counts only when evaluations run)."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion.registry import formulation_class

        form = self.diffusion.formulation
        limits = formulation_class(form).limits
        for (sec, key), name in FORMULATION_FIELDS.items():
            valid, value = limits.get(name), getattr(getattr(self, sec), key)
            if valid is None or value in valid or name == "prediction":
                continue
            if name != "sampler":
                raise ValueError(
                    f"{sec}.{key}={value!r} is not supported with diffusion.formulation {form!r}; use {valid[0]!r}"
                )
            if sec == "logging" or self.logging.eval_every:
                raise ValueError(
                    f"{sec}.{key} {value!r} cannot sample {with_article(form)} model; valid choices: {', '.join(valid)}"
                )

    def resolve_auto(self) -> None:
        """The fields of ``FORMULATION_FIELDS`` that are ``auto`` take the formulation's own choice (its
        ``defaults``). One set by an earlier source than ``diffusion.formulation`` (the recipe when the formulation is
        an override) that does not apply to that formulation yields to it as well; set in the same source or a later
        one, it stays, and ``validate`` says why it cannot be used."""
        # imported here, not at the top: keeps --help free of torch
        from diffcurr_fast.diffusion.registry import formulation_class

        form = self.diffusion.formulation
        rank, where = source_of(self.diffusion, "formulation")
        cls = formulation_class(form)
        own, limits = cls.defaults, cls.limits
        for (sec, key), default_key in FORMULATION_FIELDS.items():
            section = getattr(self, sec)
            value, done = getattr(section, key), filled(section)
            fits = default_key not in limits or value in limits[default_key]
            yields = not fits and source_of(section, key)[0] < rank and value != "auto" and key not in done
            if value == "auto" or key in done or yields:
                note = f"; {value!r} ({source_of(section, key)[1]}) does not apply to {form}" if yields else ""
                setattr(section, key, own[default_key])
                done.add(key)
                sources(section)[key] = (rank, f"auto: diffusion.formulation {form!r} ({where}){note}")
        for comp, opts, used in self.components():  # a component a later choice rules out turns off
            overruled = opts.overruled(self) if used and comp.selector is None else None
            if overruled is not None:
                section = getattr(self, comp.section)
                setattr(section, comp.options.SWITCH, getattr(comp.options(), comp.options.SWITCH))
                filled(section).add(comp.options.SWITCH)
                sources(section)[comp.options.SWITCH] = overruled

    def sources(self) -> dict[str, str]:
        """``section.field`` -> the source that set it (a recipe, the demo, --set, a preset, auto), for the fields
        not left at their defaults."""
        return {
            f"{sec.name}.{k}": label
            for sec in dataclasses.fields(self)
            for k, (_, label) in sources(getattr(self, sec.name)).items()
        }

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Plain nested dict (YAML/JSON-serialisable): every key, but the options of the components the run does
        not use (they take their defaults when it is read back)."""
        out = dataclasses.asdict(self)
        for comp, _, used in self.components():
            if not used:
                switch = comp.selector or comp.options.SWITCH
                for key in comp.options.keys():
                    if key != switch:
                        out[comp.section].pop(key, None)
        return out


# ---- building ------------------------------------------------------------------------------------------
def config_from_dict(
    data: dict[str, Any] | None, base: TrainConfig | None = None, source: str = "config", *, record: bool = False
) -> TrainConfig:
    """Build (and validate) a config from a nested dict over ``base`` (defaults); unknown keys are errors. The dict
    is one source, named ``source`` in the recorded provenance (``TrainConfig.sources``); ``record``: a saved config
    (a run's ``config.yaml``, a checkpoint's), which holds the options of the components it did not use too.
    ``base`` itself is not changed: the result is a new config."""
    cfg = copy.deepcopy(base) if base is not None else TrainConfig()
    src = new_source(cfg, source, record=record)
    data = data or {}
    if not isinstance(data, dict):
        raise ValueError(f"a config must be a mapping of sections, got {type(data).__name__}")
    for sec_name, values in data.items():
        if sec_name not in SECTION_NAMES:
            raise ValueError(f"unknown config section {sec_name!r}; valid sections: {', '.join(SECTION_NAMES)}")
        if values is None:
            continue
        if not isinstance(values, dict):
            raise ValueError(f"config section {sec_name!r} must be a mapping, got {values!r}")
        for key, value in values.items():
            set_key(cfg, f"{sec_name}.{key}", value, src)
    return cfg.validate()


# Keys that configs saved by earlier versions hold (a checkpoint's, a TDC run's tdc.json, a bundle's
# train_config.json): removed (None) or renamed. ``upgrade_saved`` reads them; a recipe or --set that names one is an
# error (saying what a renamed key became).
LEGACY_KEYS = {("diffusion", "fused_ops"): None, ("tdc", "k"): "budget_floor"}


def upgrade_saved(data: dict[str, Any]) -> dict[str, Any]:
    """A saved config (``TrainConfig.to_dict`` of this or an earlier version) in today's keys: its ``LEGACY_KEYS``
    dropped or renamed. A new dict; ``data`` is not changed. (A key an earlier version did not have takes its
    default.)"""
    out = {sec: dict(values) if isinstance(values, dict) else values for sec, values in data.items()}
    for (sec, old), new in LEGACY_KEYS.items():
        if isinstance(out.get(sec), dict) and old in out[sec]:
            value = out[sec].pop(old)
            if new is not None:
                out[sec].setdefault(new, value)
    return out


def key_type(dotted: str) -> Any:
    """The type of the config key ``section.field``; None for an unknown key."""
    sec, _, name = dotted.partition(".")
    return hints(section_type(sec)).get(name) if sec in SECTION_NAMES else None


def set_key(cfg: TrainConfig, dotted: str, value: Any, source: tuple[int, str] = DEFAULT_SOURCE) -> None:
    """Set ``section.field`` of ``cfg`` to ``value`` (checked: ``options.check_value``) as set by ``source``
    (``options.new_source``); ValueError naming the key for an unknown one (and what a renamed key became)."""
    parts = dotted.split(".")
    if len(parts) != 2 or not all(parts):
        raise ValueError(f"config keys look like section.field, got {dotted!r}; sections: {', '.join(SECTION_NAMES)}")
    sec_name, key = parts
    if sec_name not in SECTION_NAMES:
        raise ValueError(
            f"unknown config section {sec_name!r} in {dotted!r}; valid sections: {', '.join(SECTION_NAMES)}"
        )
    section = getattr(cfg, sec_name)
    fields = {f.name: f for f in dataclasses.fields(section)}
    if key not in fields:
        renamed = f" (renamed {sec_name}.{LEGACY_KEYS[sec_name, key]})" if LEGACY_KEYS.get((sec_name, key)) else ""
        raise ValueError(f"unknown config key {dotted!r}{renamed}; valid keys of {sec_name}: {', '.join(fields)}")
    tp = hints(type(section))[key]
    value = check_value(dotted, fields[key], coerce(dotted, value, tp), tp)
    setattr(section, key, value)
    filled(section).discard(key)  # set by the user now, not filled from a preset or auto
    if value is None or value == "auto":  # back to what validate fills in
        sources(section).pop(key, None)
    else:
        sources(section)[key] = source


# Sections whose values must match between a checkpoint and the run resuming from it (they define the model,
# the objective and the curriculum's state); the others (steps, LR, logging, ...) may change on resume.
RESUME_LOCKED = ("model", "diffusion", "curriculum", "timesteps", "terms")
# Keys of other sections that must match too: the batches (their size and order) and every RNG stream derive from
# them, and the optimizer's state is of the kind optim.name names, so a resume with another value could not continue
# the run it names.
RESUME_LOCKED_KEYS = (("data", "batch_size"), ("engine", "seed"), ("optim", "name"))
# Keys of the locked sections that may differ: the initial weights only matter for a fresh start; the fused ops
# compute the eager block's function with the same parameters, so a run may switch them on or off.
RESUME_FREE = {("model", "init_from"), ("model", "fused_adaln")}


def resume_mismatches(saved: dict[str, Any], cfg: TrainConfig) -> list[str]:
    """Keys of the locked sections whose values differ between ``saved`` (a ``to_dict``) and ``cfg``; a key the
    saved config predates counts as its default (a checkpoint written before a section or a key existed), and the
    options of a component ``cfg`` does not use are not compared (what turns it off is)."""
    now = cfg.to_dict()
    diffs = []
    for sec in RESUME_LOCKED:
        defaults = dataclasses.asdict(section_type(sec)())
        a, b = saved.get(sec, defaults), now[sec]
        for key in sorted(b):
            if (sec, key) in RESUME_FREE:
                continue
            was = a[key] if key in a else defaults.get(key)  # a key newer than the checkpoint
            if was != b.get(key):
                diffs.append(f"{sec}.{key}: checkpoint {was!r} vs now {b.get(key)!r}")
    for sec, key in RESUME_LOCKED_KEYS:  # a key newer than the checkpoint: its default
        a, b = saved.get(sec, {}).get(key, getattr(section_type(sec)(), key)), now[sec][key]
        if a != b:
            diffs.append(f"{sec}.{key}: checkpoint {a!r} vs now {b!r}")
    return diffs
