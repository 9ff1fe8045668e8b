"""Small files written whole: JSON records of a run (status, accounting, indexes, bundles, results)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


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
