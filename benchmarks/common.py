"""Shared helpers for the benchmark scripts: timing with percentiles, copy bandwidth, machine info, CSV + markdown.

Benchmarks are scripts, not tests: each appends rows to ``benchmarks/results/<name>.csv`` (one row per
measurement, with machine, date, torch version and git revision) and regenerates a markdown table from it.
"""

from __future__ import annotations

import csv
import datetime as _dt
import os
import platform
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def synchronize(device: torch.device | str) -> None:
    """Wait for queued work on ``device`` (a no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def measure(
    run: Callable[[object], object],
    setup: Callable[[], object] | None = None,
    *,
    device: torch.device | str = "cpu",
    warmup: int = 3,
    reps: int = 10,
    budget_s: float | None = None,
    min_reps: int = 3,
) -> list[float]:
    """Seconds per call of ``run(state)`` over ``reps`` timed calls after ``warmup``; ``setup()`` is untimed.

    With ``budget_s``, slow calls get fewer repeats (at least ``min_reps``) so one measurement takes about
    ``budget_s`` seconds.
    """
    if budget_s is not None:
        state = setup() if setup is not None else None
        synchronize(device)
        t0 = time.perf_counter()
        run(state)  # first call: compilation, autotuning, allocator warmup
        synchronize(device)
        first = time.perf_counter() - t0
        if first * (warmup + reps) > budget_s:
            warmup = 1
            reps = max(min_reps, min(reps, int(budget_s / max(first, 1e-9))))
    times = []
    for i in range(warmup + reps):
        state = setup() if setup is not None else None
        synchronize(device)
        t0 = time.perf_counter()
        run(state)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def percentiles(times: Sequence[float]) -> tuple[float, float, float]:
    """(median, p20, p80) of ``times``."""
    t = torch.tensor(list(times), dtype=torch.float64)
    q = torch.quantile(t, torch.tensor([0.5, 0.2, 0.8], dtype=torch.float64))
    return float(q[0]), float(q[1]), float(q[2])


def copy_bandwidth(device: torch.device | str = "cpu", nbytes: int = 256 * 2**20, reps: int = 10) -> float:
    """Copy bandwidth in GB/s (bytes read + written per second) of ``dst.copy_(src)`` on a large buffer."""
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    times = measure(lambda _: dst.copy_(src), device=device, warmup=3, reps=reps)
    return 2 * n * 4 / percentiles(times)[0] / 1e9


def machine_name(device: torch.device | str = "cpu") -> str:
    """A short description of the machine: GPU name on CUDA, else CPU model and core count."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{model} ({os.cpu_count()} cores, {torch.get_num_threads()} threads)"


def git_rev() -> str:
    """Short git revision of the source tree ('unknown' outside a checkout), '+dirty' when modified."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=root, capture_output=True, text=True).stdout
        return rev + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def run_info(device: torch.device | str = "cpu") -> dict[str, str]:
    """Columns identifying a run: machine, UTC date, torch version, git revision."""
    return {
        "machine": machine_name(device),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "torch": torch.__version__,
        "git_rev": git_rev(),
    }


def append_csv(path: Path, rows: list[dict[str, object]]) -> None:
    """Append ``rows`` to the CSV at ``path``; when their columns differ from the file's, the file is rewritten
    with the union of both (earlier rows keep their values, new columns stay empty for them)."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(rows[0].keys())
    old = read_csv(path)
    old_fields = list(old[0].keys()) if old else []
    if old and old_fields != fields:
        union = old_fields + [f for f in fields if f not in old_fields]
        tmp = path.with_suffix(path.suffix + ".tmp")
        with open(tmp, "w", newline="", encoding="utf-8") as f:
            writer = csv.DictWriter(f, fieldnames=union)
            writer.writeheader()
            writer.writerows(old + rows)
        os.replace(tmp, path)
        return
    with open(path, "a", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        if not old_fields:
            writer.writeheader()
        writer.writerows(rows)


def read_csv(path: Path) -> list[dict[str, str]]:
    """All rows of the CSV at ``path`` (empty when it does not exist)."""
    if not path.exists():
        return []
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f))


def markdown_table(rows: list[dict[str, object]], columns: Sequence[str]) -> str:
    """A GitHub markdown table of ``columns`` for ``rows``."""
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join("---" for _ in columns) + "|"]
    for row in rows:
        lines.append("| " + " | ".join(str(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)
