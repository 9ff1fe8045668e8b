"""The formulations by name (``diffusion.formulation``): name -> ``module:Class``, imported on first use.

Adding a formulation is one new file in this package (a ``Formulation`` subclass that declares its facts, its
``Options`` and ``from_options``; see ``flow.py``, ``edm.py``) and one line here.
"""

from __future__ import annotations

from diffcurr_fast.options import load

FORMULATIONS: dict[str, str] = {
    "ddpm": "diffcurr_fast.diffusion.ddpm:DDPMSchedule",
    "flow": "diffcurr_fast.diffusion.flow:FlowFormulation",
    "edm": "diffcurr_fast.diffusion.edm:EDMFormulation",
}
NAMES = tuple(FORMULATIONS)


def formulation_class(name: str) -> type:
    """The ``Formulation`` class registered as ``name``; ValueError naming the valid ones."""
    if name not in FORMULATIONS:
        raise ValueError(f"unknown diffusion.formulation {name!r}; valid choices: {', '.join(FORMULATIONS)}")
    return load(FORMULATIONS[name])
