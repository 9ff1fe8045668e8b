"""What is imported on first use: package exports (PEP 562), so that importing one light submodule (a command's
argument parser, the config) does not import torch and every other module of its package; and matplotlib."""

from __future__ import annotations

import importlib
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]):
    """A module ``__getattr__`` for ``package`` that imports ``exports[name]`` (a module path) on first access."""
    pkg = importlib.import_module(package)

    def __getattr__(name: str) -> Any:
        if name in exports:
            value = getattr(importlib.import_module(exports[name]), name)
            setattr(pkg, name, value)
            return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (files, no display), for the modules that write plots."""
    # imported here, not at the top: matplotlib's import costs a third of torch's, and only plotting needs it
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
