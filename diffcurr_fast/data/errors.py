"""Bad-data policy shared by the dataset scanners and loaders: ``on_bad="stop"`` raises, ``"skip"`` counts.

Every problem names the file it comes from. With ``"skip"`` the problems are collected in a ``BadDataReport``
whose ``summary()`` says how many files were skipped and why (first few listed).
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ON_BAD = ("skip", "stop")


class BadDataError(ValueError):
    """A data file is unusable (corrupt, truncated, wrong shape/dtype, missing its pair)."""


def check_on_bad(on_bad: str) -> str:
    """Validate an ``on_bad`` policy name."""
    if on_bad not in ON_BAD:
        raise ValueError(f"on_bad must be one of {ON_BAD}, got {on_bad!r}")
    return on_bad


@dataclass
class BadDataReport:
    """Files skipped under ``on_bad="skip"``: ``(path, reason)`` pairs, in the order they were found."""

    on_bad: str = "stop"
    problems: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        check_on_bad(self.on_bad)

    def __len__(self) -> int:
        return len(self.problems)

    def bad(self, path: object, reason: str) -> None:
        """Record a bad file: raise ``BadDataError`` under ``"stop"``, remember it under ``"skip"``."""
        if self.on_bad == "stop":
            raise BadDataError(f"{path}: {reason} (pass on_bad='skip' to skip bad files)")
        self.problems.append((str(path), reason))

    def summary(self, limit: int = 5) -> str:
        """One paragraph: how many files were skipped, grouped by reason, with the first ``limit`` listed."""
        if not self.problems:
            return "no bad files"
        kinds = Counter(reason.split(":")[0] for _, reason in self.problems)
        head = ", ".join(f"{n} {k}" for k, n in kinds.most_common())
        listed = "; ".join(f"{p}: {r}" for p, r in self.problems[:limit])
        more = f"; ... {len(self.problems) - limit} more" if len(self.problems) > limit else ""
        return f"skipped {len(self.problems)} bad file(s) ({head}): {listed}{more}"

    def warn(self) -> None:
        """Emit the summary as a ``UserWarning`` when anything was skipped."""
        if self.problems:
            warnings.warn(self.summary(), UserWarning, stacklevel=2)


def first_nonfinite(x: Any) -> int | None:
    """Index along the first axis of the first sample of ``x`` (numpy array or tensor) holding a NaN or inf, or None
    when every value is finite. Reads ``x`` in chunks of samples (memory-mapped arrays stay cheap)."""
    n = int(x.shape[0]) if getattr(x, "ndim", 0) else 1
    step = max(1, (1 << 22) // max(1, int(np.prod(x.shape[1:])) if getattr(x, "ndim", 0) > 1 else 1))
    for lo in range(0, n, step):
        chunk = np.asarray(x[lo : lo + step]) if not hasattr(x, "detach") else x[lo : lo + step].detach().cpu().numpy()
        if chunk.dtype.kind != "f" and chunk.dtype.kind != "c":
            return None
        ok = np.isfinite(chunk).reshape(len(chunk), -1).all(axis=1) if chunk.ndim else np.isfinite(chunk)
        if not ok.all():
            return lo + int(np.argmin(ok))
    return None


def check_finite(x: Any, where: str, offset: int = 0, indices: Any = None) -> None:
    """``BadDataError`` naming ``where`` and the sample (``indices[i]`` or ``offset + i``) when ``x`` holds a NaN or
    inf. Non-finite data is never skipped: it would train a NaN model."""
    i = first_nonfinite(x)
    if i is not None:
        sample = int(indices[i]) if indices is not None else offset + i
        raise BadDataError(f"{where}: sample {sample} holds NaN or inf values; clean the data (it is never skipped)")
