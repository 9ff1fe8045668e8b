"""Package exports imported on first use (PEP 562), so that importing one light submodule (a command's argument
parser, the config) does not import torch and every other module of its package."""

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
