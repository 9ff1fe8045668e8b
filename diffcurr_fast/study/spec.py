"""A study specification: a base recipe, arms (a name and ``--set`` overrides), seeds and the evaluation settings.

A spec is a YAML mapping::

    name: curriculum
    recipe: null                  # base training recipe (null: the embedded digits demo)
    set: [engine.max_steps=2000]  # overrides shared by every arm
    seeds: [0, 1, 2, 3, 4]
    metric: fd                    # the metric the report compares (lower is better; 'is' higher is better)
    reference: vanilla            # the arm every other arm is compared with (an arm may name its own)
    eval_every: 500               # logging.eval_every of every run
    eval: {num_samples: 500, steps: 50, cfg_scale: 2.0}   # the eval section of every run
    arms:
      - {name: vanilla, set: [curriculum.pacing=none]}
      - {name: e2h_snr, set: [curriculum.pacing=patience, curriculum.method=snr]}
      - {name: tdc, kind: tdc, set: [tdc.finetune_steps=200], reference: base}
    speedrun: {official_arm: official, threshold: reference, smooth: 3}   # optional: time to quality

``tuning`` (optional) with an arm's ``tune`` grid is the tuning protocol (``diffcurr_fast.study.tuning``): every
tuned arm gets the same number of trials, and a rule fixed in the spec picks the value its seeds run with.

``speedrun`` (optional) makes the report a time-to-quality benchmark (``diffcurr_fast.study.speedrun``): its keys
are ``SPEEDRUN_KEYS`` with the defaults of ``SPEEDRUN_DEFAULTS``; ``official_arm`` names the arm whose time axis is
the official DiT step's (measured with ``study --peer-dit PATH``).

``launcher`` (``local``, the default, or ``slurm``) and ``slurm`` (the jobs' resources, ``SLURM_DEFAULTS``) say where
the runs go (``diffcurr_fast.study.launch``); unlike every other setting, a rerun may change them.
``long_reference`` (optional, a speedrun): the official arm trained ``factor`` x the study's budget in another study
folder, for the field's reading of a speed-up (``diffcurr_fast.study.long_reference``).

``kind`` is ``train`` (an ordinary ``diffcurr-fast train`` run) or ``tdc`` (``diffcurr-fast tdc``: stage 1, experts,
bundle; its final metric is the bundle's). ``load_spec`` checks every arm's config before anything runs.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from diffcurr_fast.runs.recipes import duplicate_keys, load_config
from diffcurr_fast.study.tuning import check_tuning, grid, split_trial, trial_name, trial_seeds

SPEC_FILE = "study.yaml"  # a study folder's spec (``load_study``)
KINDS = ("train", "tdc")
METRICS = {"fd": "lower", "is": "higher", "precision": "higher", "recall": "higher"}
SPEC_KEYS = (
    "name",
    "recipe",
    "set",
    "seeds",
    "metric",
    "reference",
    "eval_every",
    "eval",
    "arms",
    "notes",
    "speedrun",
    "tuning",
    "launcher",
    "slurm",
    "long_reference",
)
# threshold: 'reference' (the worst final smoothed metric over the official arm's seeds) or a number; smooth: the
# trailing window (evaluations) of the moving average; plateau: the official arm's last plateau_share of evaluations
# improve its smoothed mean curve by less than plateau_tol (relative)
SPEEDRUN_DEFAULTS: dict[str, Any] = {
    "official_arm": "",
    "threshold": "reference",
    "smooth": 3,
    "plateau_share": 0.2,
    "plateau_tol": 0.03,
}
SPEEDRUN_KEYS = tuple(SPEEDRUN_DEFAULTS)
# folder: the long reference's study folder (relative to the study folder); factor: its budget over the study's; set:
# overrides of its own after the official arm's (the EMA scaled to its length)
LONG_REFERENCE_KEYS = ("folder", "factor", "set")
ARM_KEYS = ("name", "kind", "set", "reference", "tune")
# where the runs go (``diffcurr_fast.study.launch``): worker processes on this machine, or submitit jobs on Slurm, each
# of nodes x gpus_per_node tasks (one per GPU, cpus_per_gpu CPUs each) in a partition (null: the cluster's default)
# for at most time_min minutes; sbatch: more of submitit's Slurm parameters (account, qos, mem, constraint, setup, ...)
LAUNCHERS = ("local", "slurm")
SLURM_DEFAULTS: dict[str, Any] = {
    "nodes": 1,
    "gpus_per_node": 1,
    "cpus_per_gpu": 8,
    "partition": None,
    "time_min": 1440,
    "sbatch": {},
}
LAUNCH_KEYS = ("launcher", "slurm")  # how the runs are launched: a rerun may change them (nothing else)


@dataclass
class Arm:
    """One arm: a name, its kind and its overrides; ``reference`` the arm it is compared with ('' = the spec's);
    ``tune`` its grid of the tuning protocol (``study.tuning``; {} = not tuned)."""

    name: str
    kind: str = "train"
    set: list[str] = field(default_factory=list)
    reference: str = ""
    tune: dict[str, list[Any]] = field(default_factory=dict)


@dataclass
class StudySpec:
    """The whole study (module doc)."""

    name: str
    arms: list[Arm]
    seeds: list[int]
    recipe: str | None = None
    set: list[str] = field(default_factory=list)
    metric: str = "fd"
    reference: str = ""
    eval_every: int = 0
    eval: dict[str, Any] = field(default_factory=dict)
    notes: str = ""
    speedrun: dict[str, Any] = field(default_factory=dict)
    tuning: dict[str, Any] = field(default_factory=dict)
    launcher: str = "local"
    slurm: dict[str, Any] = field(default_factory=dict)
    long_reference: dict[str, Any] = field(default_factory=dict)

    def arm(self, name: str) -> Arm:
        """The arm called ``name``, or trial i of a tuned arm's grid (``<arm>~t<i>``, ``study.tuning``): the arm with
        the grid point's overrides and ``engine.max_steps`` = ``tuning.budget``."""
        base, trial = split_trial(name)
        for a in self.arms:
            if a.name == base and trial is None:
                return a
            if a.name == base and a.tune and trial < len(grid(a.tune)):
                point = [*grid(a.tune)[trial], f"engine.max_steps={self.tuning['budget']}"]
                return Arm(name, a.kind, [*a.set, *point], a.reference)
        raise ValueError(f"no arm {name!r} in study {self.name!r}; arms: {', '.join(a.name for a in self.arms)}")

    def trials(self) -> list[tuple[str, int]]:
        """Every (trial arm, seed) of the tuning protocol, arm by arm, each point at every trial seed."""
        seeds = trial_seeds(self.tuning) if self.tuning else []
        return [
            (trial_name(a.name, i), s) for a in self.arms if a.tune for i in range(len(grid(a.tune))) for s in seeds
        ]

    def reference_of(self, arm: Arm) -> str:
        return arm.reference or self.reference

    def overrides(self, arm: Arm, seed: int, run_dir: str | Path, cpu_threads: int = 0) -> list[str]:
        """The ``--set`` overrides of run (``arm``, ``seed``): shared ones, evaluation, the arm's, then the seed,
        run directory and thread count (which no arm may set)."""
        out = [*self.set, f"logging.eval_every={self.eval_every}", *(f"eval.{k}={v}" for k, v in self.eval.items())]
        out += [*arm.set, f"engine.seed={seed}", f"checkpoint.run_dir={run_dir}", "logging.progress=false"]
        if cpu_threads:
            out.append(f"engine.cpu_threads={cpu_threads}")
        return out

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        for a in out["arms"]:  # a spec without tuning is written as before it existed
            if not a["tune"]:
                del a["tune"]
        if not out["tuning"]:
            del out["tuning"]
        if out["launcher"] == "local" and not out["slurm"]:  # a spec without launch settings is written as before
            del out["launcher"], out["slurm"]
        if not out["long_reference"]:
            del out["long_reference"]
        return out


def spec_from_dict(data: dict[str, Any], source: str = "spec") -> StudySpec:
    """Parse and check a spec mapping (unknown keys, bad arms and duplicate names are errors)."""
    if not isinstance(data, dict):
        raise ValueError(f"{source}: a study spec must be a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SPEC_KEYS))
    if unknown:
        raise ValueError(f"{source}: unknown spec keys {unknown}; valid keys: {', '.join(SPEC_KEYS)}")
    arms = []
    for i, a in enumerate(data.get("arms") or []):
        if not isinstance(a, dict) or "name" not in a:
            raise ValueError(f"{source}: arm {i} must be a mapping with a name, got {a!r}")
        bad = sorted(set(a) - set(ARM_KEYS))
        if bad:
            raise ValueError(f"{source}: arm {a['name']!r} has unknown keys {bad}; valid keys: {', '.join(ARM_KEYS)}")
        arm = Arm(
            str(a["name"]),
            str(a.get("kind", "train")),
            _overrides(a.get("set"), f"{source}: arm {a['name']!r}"),
            str(a.get("reference") or ""),
            _tune(a.get("tune"), f"{source}: arm {a['name']!r}"),
        )
        if arm.kind not in KINDS:
            raise ValueError(f"{source}: arm {arm.name!r} has kind {arm.kind!r}; valid kinds: {', '.join(KINDS)}")
        if not arm.name.replace("_", "").replace("-", "").isalnum():
            raise ValueError(f"{source}: arm name {arm.name!r} must be letters, digits, '_' or '-'")
        arms.append(arm)
    if not arms:
        raise ValueError(f"{source}: a study needs at least one arm")
    names = [a.name for a in arms]
    if len(set(names)) != len(names):
        raise ValueError(f"{source}: arm names must be unique, got {names}")
    seeds = data.get("seeds", [0])
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) and s >= 0 for s in seeds):
        raise ValueError(f"{source}: seeds must be a non-empty list of ints >= 0, got {seeds!r}")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"{source}: seeds must be distinct, got {seeds}")
    spec = StudySpec(
        name=str(data.get("name") or "study"),
        arms=arms,
        seeds=list(seeds),
        recipe=data.get("recipe"),
        set=_overrides(data.get("set"), source),
        metric=str(data.get("metric", "fd")),
        reference=str(data.get("reference") or names[0]),
        eval_every=int(data.get("eval_every", 0)),
        eval=dict(data.get("eval") or {}),
        notes=str(data.get("notes") or ""),
        speedrun=_speedrun(data.get("speedrun"), names, source),
        tuning=check_tuning(data.get("tuning"), {a.name: a.tune for a in arms}, source),
        launcher=str(data.get("launcher") or "local"),
        slurm=_slurm(data.get("slurm"), source),
        long_reference=_long_reference(data.get("long_reference"), data.get("speedrun"), source),
    )
    if spec.launcher not in LAUNCHERS:
        raise ValueError(f"{source}: launcher {spec.launcher!r}; valid launchers: {', '.join(LAUNCHERS)}")
    if spec.metric not in METRICS:
        raise ValueError(f"{source}: metric {spec.metric!r}; valid metrics: {', '.join(METRICS)}")
    if spec.tuning and METRICS[spec.metric] != "lower":
        raise ValueError(f"{source}: the tuning protocol picks a lower-is-better metric (fd), got {spec.metric!r}")
    if spec.speedrun and METRICS[spec.metric] != "lower":
        raise ValueError(f"{source}: a speedrun needs a lower-is-better metric (fd), got {spec.metric!r}")
    for a in arms:
        spec.arm(spec.reference_of(a))  # every reference names an arm
    if spec.eval_every < 1:
        raise ValueError(f"{source}: eval_every must be >= 1 (the study compares evaluated metrics)")
    return spec


def _overrides(value: Any, where: str) -> list[str]:
    """The ``set`` of a spec or an arm: a list of ``section.field=value`` strings (absent: none). A string or a
    mapping would be read character by character or key by key, so each is refused naming ``where`` it is."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise ValueError(
            f"{where}: set must be a list of section.field=value overrides, e.g. set: [optim.lr=1e-3], got {value!r}"
        )
    return list(value)


def _tune(value: Any, where: str) -> dict[str, list[Any]]:
    """An arm's ``tune`` grid: a mapping of config keys to lists of values (absent: none). A list or a bare key is
    refused naming ``where`` it is."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: tune must map config keys to lists of values, e.g. tune: {{optim.lr: [1e-4, 2e-4]}}, "
            f"got {value!r}"
        )
    return dict(value)


def fixed_and_tuned(spec: StudySpec) -> list[str]:
    """A line per key that an arm's ``set`` fixes and its ``tune`` tries: the tuned values replace the fixed one.
    ``load_spec`` warns with them (a preset that tunes the official recipe's learning rate does it on purpose)."""
    out = []
    for arm in spec.arms:
        for text in arm.set:
            key, _, raw = text.partition("=")
            if key.strip() in arm.tune:
                out.append(
                    f"arm {arm.name!r}: set fixes {key.strip()}={raw.strip()} but tune tries "
                    f"{arm.tune[key.strip()]!r}: each trial and the picked value replace the fixed one, which is not "
                    "used"
                )
    return out


def _speedrun(data: Any, arms: list[str], source: str) -> dict[str, Any]:
    """The checked ``speedrun`` mapping with its defaults filled ({} when absent)."""
    if not data:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: speedrun must be a mapping, got {data!r}")
    bad = sorted(set(data) - set(SPEEDRUN_KEYS))
    if bad:
        raise ValueError(f"{source}: unknown speedrun keys {bad}; valid keys: {', '.join(SPEEDRUN_KEYS)}")
    out = {**SPEEDRUN_DEFAULTS, **data}
    if out["official_arm"] not in arms:
        raise ValueError(f"{source}: speedrun.official_arm {out['official_arm']!r} must name an arm: {arms}")
    thr = out["threshold"]
    if thr != "reference" and (isinstance(thr, bool) or not isinstance(thr, (int, float)) or not thr > 0):
        raise ValueError(f"{source}: speedrun.threshold must be 'reference' or a number > 0, got {thr!r}")
    if isinstance(out["smooth"], bool) or not isinstance(out["smooth"], int) or out["smooth"] < 1:
        raise ValueError(f"{source}: speedrun.smooth must be an int >= 1 (evaluations averaged), got {out['smooth']!r}")
    for key in ("plateau_share", "plateau_tol"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
            raise ValueError(f"{source}: speedrun.{key} must lie in (0, 1), got {v!r}")
    return out


def _slurm(data: Any, source: str) -> dict[str, Any]:
    """The checked ``slurm`` mapping with its defaults filled ({} when absent). The names under ``sbatch`` are
    checked against submitit's when the study is launched (``launch.check_sbatch``)."""
    if data is None or data == {}:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: slurm must be a mapping, e.g. slurm: {{nodes: 1, gpus_per_node: 8}}, got {data!r}")
    bad = sorted(set(data) - set(SLURM_DEFAULTS))
    if bad:
        raise ValueError(f"{source}: unknown slurm keys {bad}; valid keys: {', '.join(SLURM_DEFAULTS)}")
    out = {**SLURM_DEFAULTS, **data}
    for key in ("nodes", "gpus_per_node", "cpus_per_gpu", "time_min"):
        v = out[key]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            what = " (each task of a job is one GPU's rank)" if key == "gpus_per_node" else ""
            raise ValueError(f"{source}: slurm.{key} must be an int >= 1{what}, got {v!r}")
    if out["partition"] is not None and (not isinstance(out["partition"], str) or not out["partition"]):
        raise ValueError(f"{source}: slurm.partition must be a partition's name or null, got {out['partition']!r}")
    if not isinstance(out["sbatch"], dict) or not all(isinstance(k, str) for k in out["sbatch"]):
        raise ValueError(
            f"{source}: slurm.sbatch must map submitit's Slurm parameters to values (e.g. {{account: lab, "
            f"qos: high}}), got {out['sbatch']!r}"
        )
    return out


def _long_reference(data: Any, speedrun: Any, source: str) -> dict[str, Any]:
    """The checked ``long_reference`` mapping ({} when absent): a folder, a factor >= 2 and a list of overrides."""
    if not data:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{source}: long_reference must be a mapping (folder, factor, set), got {data!r}")
    bad = sorted(set(data) - set(LONG_REFERENCE_KEYS))
    if bad:
        raise ValueError(f"{source}: unknown long_reference keys {bad}; valid keys: {', '.join(LONG_REFERENCE_KEYS)}")
    if not speedrun:
        raise ValueError(f"{source}: long_reference trains the official arm of a speedrun; the spec has no speedrun")
    if not isinstance(data.get("folder"), str) or not data["folder"]:
        raise ValueError(f"{source}: long_reference.folder must name a study folder, got {data.get('folder')!r}")
    factor = data.get("factor", 8)
    if isinstance(factor, bool) or not isinstance(factor, int) or factor < 2:
        raise ValueError(f"{source}: long_reference.factor must be an int >= 2 (x the study's budget), got {factor!r}")
    return {"folder": data["folder"], "factor": factor, "set": _overrides(data.get("set"), f"{source}: long_reference")}


def load_spec(path: str | Path) -> StudySpec:
    """The spec in the YAML file ``path``, checked (``check_spec``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"study spec {str(p)!r} does not exist")
    text = p.read_text()
    dups = duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader))
    if dups:
        listed = "; ".join(f"{key!r} at lines {', '.join(map(str, lines))}" for key, lines in dups)
        raise ValueError(f"study spec {str(p)!r} sets a key more than once (only one would count): {listed}; keep one")
    spec = check_spec(spec_from_dict(yaml.safe_load(text) or {}, str(p)))
    for line in fixed_and_tuned(spec):
        warnings.warn(f"study spec {str(p)!r}: {line}", UserWarning, stacklevel=2)
    return spec


def load_study(study_dir: str | Path) -> StudySpec:
    """The spec of the study folder ``study_dir`` (its ``SPEC_FILE``, written when the study started)."""
    path = Path(study_dir) / SPEC_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{str(study_dir)!r} is not a study folder (no {SPEC_FILE})")
    return spec_from_dict(yaml.safe_load(path.read_text()), str(path))


def arm_config(spec: StudySpec, arm: Arm, seed: int, run_dir: str | Path, cpu_threads: int = 0):
    """The validated ``TrainConfig`` of run (``arm``, ``seed``): the recipe (None: the embedded digits demo) with
    ``spec.overrides`` (a tdc arm's options are its tdc section)."""
    try:
        return load_config(spec.recipe, spec.overrides(arm, seed, run_dir, cpu_threads))
    except ValueError as exc:
        raise ValueError(f"study {spec.name!r}, arm {arm.name!r}: {exc}") from None


def check_spec(spec: StudySpec) -> StudySpec:
    """Resolve every arm's config once, and every trial's of a tuned arm (a typo fails before any run starts);
    returns ``spec``."""
    for arm in [*spec.arms, *(spec.arm(name) for name, _ in spec.trials())]:
        cfg = arm_config(spec, arm, spec.seeds[0], "study-check")
        if arm.kind == "tdc":
            # imported here, not at the top: keeps --help free of torch
            from diffcurr_fast.tdc.pipeline import resolve_config

            resolve_config(cfg, None)
    return spec


__all__ = [
    "ARM_KEYS",
    "Arm",
    "KINDS",
    "LAUNCHERS",
    "LAUNCH_KEYS",
    "LONG_REFERENCE_KEYS",
    "METRICS",
    "SPEC_KEYS",
    "SLURM_DEFAULTS",
    "SPEEDRUN_KEYS",
    "StudySpec",
    "arm_config",
    "check_spec",
    "fixed_and_tuned",
    "load_spec",
    "spec_from_dict",
]
