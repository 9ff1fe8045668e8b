"""The training terms by name (``terms.use``): name -> ``module:Class``, imported on first use.

Adding a term is one new file in this package (a ``TrainingTerm`` subclass with ``from_config``) and one line here;
the config lists the names from ``NAMES`` and checks the term's fields in its ``terms`` section
(``terms.<name>_weight``, ...).
"""

from __future__ import annotations

import importlib

TERMS: dict[str, str] = {
    "contrastive": "diffcurr_fast.terms.contrastive:Contrastive",
    "dispersive": "diffcurr_fast.terms.dispersive:Dispersive",
    "sra": "diffcurr_fast.terms.sra:SRA",
    "repa": "diffcurr_fast.terms.repa:REPA",
}
NAMES = tuple(TERMS)


def term_class(name: str) -> type:
    """The ``TrainingTerm`` class registered as ``name``; ValueError naming the valid ones."""
    if name not in TERMS:
        raise ValueError(f"unknown training term {name!r} in terms.use; valid choices: {', '.join(NAMES)}")
    module, cls = TERMS[name].split(":")
    return getattr(importlib.import_module(module), cls)
