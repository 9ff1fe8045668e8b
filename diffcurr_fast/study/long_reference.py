"""The long reference of a speedrun: its official arm trained ``factor`` x the study's budget, for the field's reading
of a speed-up (how REPA's 17.5x and TREAD's numbers are stated: the baseline's time to *the new recipe's* quality).

In the spec::

    long_reference: {folder: ../long_reference_digits, factor: 8, set: [optim.ema_decay=0.999875]}

- The long reference is the official arm (``speedrun.official_arm``) with its own overrides, the point its tuning
  trials picked (``tuning.json``), ``engine.max_steps`` = ``factor`` x its budget and the ``set`` of the mapping
  (e.g. the EMA decay scaled to the longer run by the study's rule); everything else, the evaluations included, is
  the study's. Its schedule runs over its own length (a decayed reference decays over the long run).
- It is a study of its own, in ``folder`` (relative to the study folder): one arm, the study's seeds, the ordinary
  run directories, status files and ``study posthoc``. ``diffcurr-fast study`` trains it after the study's runs
  (``run_long_reference``), so its seeds are trained once and resumed like any run.
- **Shared by the studies whose reference is the same run**: a study that names a folder holding a long reference
  reuses its runs when the two resolve to the same training config (seeds, threads and run folder aside) and the
  folder has the study's seeds; a folder of other settings is refused in one line that names what differs
  (``prepare``).

The reading itself is ``diffcurr_fast.study.speedrun.both_readings``; the report's section is
``diffcurr_fast.study.speedrun_report.readings_section``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from diffcurr_fast.study.runner import run_study
from diffcurr_fast.study.spec import SPEC_FILE, Arm, StudySpec, arm_config, load_study, spec_from_dict
from diffcurr_fast.study.tuning import TUNING_FILE, picked


def folder_of(spec: StudySpec, study_dir: str | Path) -> Path:
    """The long reference's study folder: ``long_reference.folder``, relative to ``study_dir`` (resolved by its
    words, so that ``../x`` names the same folder before the study folder exists)."""
    return Path(os.path.normpath(Path(study_dir) / spec.long_reference["folder"]))


def long_spec(spec: StudySpec, study_dir: str | Path) -> StudySpec | None:
    """The long reference's spec (module doc), or None while the official arm's tuning trials have not all finished
    (its pick is not known yet)."""
    lr = spec.long_reference
    ref = spec.arm(spec.speedrun["official_arm"])
    if ref.kind != "train":
        raise ValueError(f"study {spec.name!r}: long_reference trains a train arm; {ref.name!r} is a {ref.kind} arm")
    if ref.tune and not (Path(study_dir) / TUNING_FILE).is_file():
        return None
    try:
        pick = picked(Path(study_dir), ref.name) if ref.tune else []
    except ValueError:  # the trials of the reference have not all finished
        return None
    own = [*ref.set, *pick]
    steps = lr["factor"] * arm_config(spec, Arm(ref.name, ref.kind, own), spec.seeds[0], "budget").engine.max_steps
    data = {
        "name": f"{ref.name}_x{lr['factor']}",
        "recipe": spec.recipe,
        "set": spec.set,
        "seeds": spec.seeds,
        "metric": spec.metric,
        "reference": ref.name,
        "eval_every": spec.eval_every,
        "eval": spec.eval,
        "arms": [{"name": ref.name, "set": [*own, f"engine.max_steps={steps}", *lr["set"]]}],
        "notes": f"The official arm {ref.name} of study {spec.name} (its picked overrides {pick or 'none: not tuned'}) "
        f"trained {lr['factor']}x its budget, {steps} steps, with the study's evaluations: the long reference of the "
        "field's reading of a speed-up (diffcurr_fast.study.long_reference).",
    }
    return spec_from_dict(data, f"long reference of study {spec.name}")


def _config(spec: StudySpec) -> dict[str, dict[str, Any]]:
    """The resolved training config of a long reference's arm, seeds, threads and run folder aside."""
    return arm_config(spec, spec.arms[0], 0, "long-reference").to_dict()


def prepare(spec: StudySpec, study_dir: str | Path) -> StudySpec | None:
    """The spec the long reference's folder runs: the derived one (``long_spec``) for a new folder, the folder's own
    when it holds the same long reference; None while the pick is not known. ValueError in one line when its own
    overrides do not resolve on the official arm, when the folder holds a long reference of other settings, or when
    it lacks some of the study's seeds."""
    ref = spec.arm(spec.speedrun["official_arm"])
    try:  # checked before the pick is known: a typo fails before any run
        arm_config(spec, Arm(ref.name, ref.kind, [*ref.set, *spec.long_reference["set"]]), spec.seeds[0], "check")
    except ValueError as exc:
        raise ValueError(f"long_reference.set: {exc}") from None
    new = long_spec(spec, study_dir)
    folder = folder_of(spec, study_dir)
    if new is None or not (folder / SPEC_FILE).is_file():
        return new
    saved = load_study(folder)
    there, here = _config(saved), _config(new)
    diff = [
        f"{sec}.{key} {there[sec][key]!r} there, {here[sec][key]!r} here"
        for sec in here
        for key in here[sec]
        if there.get(sec, {}).get(key) != here[sec][key]
    ]
    if len(saved.arms) != 1 or diff:
        what = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "") or "other arms"
        raise ValueError(
            f"long reference folder {str(folder)!r} holds another reference ({what}); name another "
            "long_reference.folder in the spec"
        )
    missing = sorted(set(spec.seeds) - set(saved.seeds))
    if missing:
        raise ValueError(
            f"long reference folder {str(folder)!r} has seeds {saved.seeds}, not this study's {missing}; name another "
            "long_reference.folder in the spec"
        )
    return saved


def run_long_reference(
    spec: StudySpec, study_dir: str | Path, workers: int = 1, *, threads: int | None = None, verbose: bool = True
) -> dict[str, Any] | None:
    """Train (or resume) the long reference of ``spec`` in its folder (``prepare``), ``workers`` runs at once; None,
    with a line, while the official arm's pick is not known."""
    long = prepare(spec, study_dir)
    if long is None:
        if verbose:
            print(
                f"long reference: not trained yet: the tuning trials of {spec.speedrun['official_arm']} have not all "
                "finished (rerun the study)",
                flush=True,
            )
        return None
    return run_study(long, folder_of(spec, study_dir), workers, verbose=verbose, threads=threads)


__all__ = ["folder_of", "long_spec", "prepare", "run_long_reference"]
