"""The training terms by name (``terms.use``) and the switches of the ``terms`` section: name -> ``module:Class``,
imported on first use.

Adding a term is one new file in this package (a ``TrainingTerm`` subclass with ``Options``, whose ``weight`` the
objective multiplies it by, and ``from_config``) and one line in ``TERMS``. A method that changes the step's draw
and adds no loss is a switch: its ``Options`` (a bool field that turns it on, and ``pairing``, what the objective
does to the draw) and one line in ``SWITCHES``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from diffcurr_fast.options import load, option

TERMS: dict[str, str] = {
    "contrastive": "diffcurr_fast.terms.contrastive:Contrastive",
    "dispersive": "diffcurr_fast.terms.dispersive:Dispersive",
    "sra": "diffcurr_fast.terms.sra:SRA",
    "repa": "diffcurr_fast.terms.repa:REPA",
}
SWITCHES: dict[str, str] = {
    "immiscible": "diffcurr_fast.terms.immiscible:ImmiscibleOptions",
}


def names() -> tuple[str, ...]:
    """The names ``terms.use`` takes (the registry now: a test may register a term)."""
    return tuple(TERMS)


def term_class(name: str) -> type:
    """The ``TrainingTerm`` class registered as ``name``; ValueError naming the valid ones."""
    if name not in TERMS:
        raise ValueError(f"unknown training term {name!r} in terms.use; valid choices: {', '.join(TERMS)}")
    return load(TERMS[name])


def build_terms(cfg: Any) -> list[tuple[float, Any]]:
    """(weight, term) of each term of ``terms.use``, in its order: the term's ``Options.weight`` and
    ``from_config(cfg)``."""
    out = []
    for name in cfg.terms.use:
        cls = term_class(name)
        out.append((cls.Options.of(cfg.terms).weight, cls.from_config(cfg)))
    return out


def noise_pairing(cfg: Any) -> Callable | None:
    """What the switches that are on do to the step's draw (``pairing``): x0, noise -> the image of each noise
    stream; None when none is on. At most one may pair (the config refuses two)."""
    pairings = [opts.pairing() for opts in (load(t).of(cfg.terms) for t in SWITCHES.values()) if opts.active()]
    return pairings[0] if pairings else None


@dataclass
class TermsOptions:
    """Training terms beyond the regression loss (``diffcurr_fast.terms``), each added with its weight."""

    use: list[str] = option([], "the terms the step adds, in order (terms/registry.py)")

    def validate(self) -> None:
        valid = names()
        switch = next((u for u in self.use if u in SWITCHES), None)
        if switch is not None:
            key = load(SWITCHES[switch]).SWITCH
            raise ValueError(
                f"terms.use lists {switch!r}, which adds no loss and is not a term: it is the switch "
                f"terms.{key}=true; drop it from terms.use"
            )
        if any(u not in valid for u in self.use) or len(set(self.use)) != len(self.use):
            raise ValueError(f"terms.use {self.use!r}: each term once, from {', '.join(valid)}")
