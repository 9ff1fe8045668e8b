"""Small files written whole: JSON records of a run (status, accounting, indexes, bundles, results); and the one
reader of safetensors files a user hands over, which names the file when it cannot be read."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def read_safetensors(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """The tensors of the safetensors file ``path``; ValueError naming it when it is truncated, empty or of another
    format (safetensors' own error names neither the file nor the likely cause)."""
    from safetensors.torch import load_file  # here, not at the top: importing this module stays free of torch

    try:
        return load_file(str(path), device=device)
    except FileNotFoundError:
        raise
    except Exception as exc:  # safetensors raises its own error type, or OSError / ValueError on a short read
        raise ValueError(
            f"{str(path)!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); it may be truncated or "
            "of another format"
        ) from None


def write_json(data: Any, path: str | Path, *, indent: int = 2) -> Path:
    """Write ``data`` as JSON to ``path`` atomically: serialised first, written to ``<name>.tmp`` in the same
    directory (parents created) and renamed over ``path``, so a failure or a kill leaves the previous file whole."""
    path = Path(path)
    text = json.dumps(data, indent=indent)  # a value JSON cannot hold fails here, before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path
