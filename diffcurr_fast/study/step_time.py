"""The step times of a speedrun (``step_time.json``): every arm's median training step and, with a
facebookresearch/DiT checkout, the official code's, measured side by side in one process; they give each arm its
time axis (``diffcurr_fast.study.speedrun``).

``python -m diffcurr_fast.study.step_time STUDY_DIR PEER_DIT_PATH|- [THREADS]`` measures them (a study worker runs it
first, ``diffcurr_fast.study.runner``).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from diffcurr_fast._files import write_json
from diffcurr_fast.study.peer_dit import official_dims, official_step
from diffcurr_fast.study.spec import arm_config, load_study
from diffcurr_fast.train.loop import Trainer

STEP_TIME_FILE = "step_time.json"
OFFICIAL_CODE = "official code"  # step_time.json's name for the facebookresearch/DiT step


def time_side_by_side(steps: dict[str, Any], batches: list[Any], *, rounds: int, reps: int, warmup: int) -> dict:
    """{name: seconds of each timed call} of every step ``steps[name](x, y)``, measured side by side: ``rounds``
    rounds in which each step in turn makes ``warmup`` untimed calls, then ``reps`` timed ones; call i of the whole
    sequence trains on ``batches[i % len(batches)]``."""
    calls = 0
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            for i in range(warmup + reps):
                x, y = batches[calls % len(batches)]
                calls += 1
                t0 = time.perf_counter()
                step(x, y)
                if i >= warmup:
                    times[name].append(time.perf_counter() - t0)
    return times


def step_time_summary(times: dict[str, list[float]], official_arm: str) -> dict[str, Any]:
    """``step_time.json``'s times from ``time_side_by_side``'s: each arm's median step (``arms``; the official
    DiT step, ``OFFICIAL_CODE``, as ``official_s``), its 20th and 80th percentiles (numpy's linear interpolation)
    and ``official_arm``'s median as ``ours_s``."""
    med = {n: float(np.median(t)) for n, t in times.items()}
    res: dict[str, Any] = {
        "arms": {n: v for n, v in med.items() if n != OFFICIAL_CODE},
        "arms_p20_p80": {n: [float(np.percentile(t, q)) for q in (20, 80)] for n, t in times.items()},
        "ours_s": med[official_arm],
    }
    if OFFICIAL_CODE in med:
        res["official_s"] = med[OFFICIAL_CODE]
    return res


def measure_step_times(
    cfgs: dict[str, Any],
    peer_dit: str | Path | None,
    official_arm: str,
    *,
    rounds: int = 3,
    reps: int = 20,
    warmup: int = 5,
) -> dict[str, Any]:
    """Median step time of our trainer at every arm's config ``cfgs`` (arm name -> config) and, with ``peer_dit``,
    of the official DiT step (that checkout) at ``cfgs[official_arm]``'s model, batch and threads, on the training
    data, measured side by side in one process in alternating blocks of ``reps`` steps (after ``warmup`` steps per
    block; ``time_side_by_side``, ``step_time_summary``). Measured together, the arms' times compare whatever the
    load and the machine were when each run trained."""
    ref = cfgs[official_arm]
    if ref.engine.cpu_threads:
        torch.set_num_threads(ref.engine.cpu_threads)
    steps: dict[str, Any] = {}
    info: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        batches = None
        for name, cfg in cfgs.items():
            cfg.checkpoint.run_dir = str(Path(tmp) / name)
            tr = Trainer(cfg)
            batches = batches or [next(tr.loader) for _ in range(4)]
            steps[name] = tr.train_step
        if peer_dit is not None:
            m = ref.model
            steps[OFFICIAL_CODE], info = official_step(
                peer_dit,
                preset=m.preset,
                input_size=m.input_size,
                in_channels=m.in_channels,
                num_classes=m.num_classes,
                seed=ref.engine.seed,
                dims=official_dims(m) if m.preset == "custom" else None,
                ema_decay=ref.optim.ema_decay,
            )
        times = time_side_by_side(steps, batches, rounds=rounds, reps=reps, warmup=warmup)
    res = step_time_summary(times, official_arm)
    res |= {"steps_each": rounds * reps, "batch": ref.data.batch_size, "threads": torch.get_num_threads()}
    if peer_dit is not None:
        res |= {
            "checkout": Path(peer_dit).resolve().name,
            "commit": _git_commit(peer_dit),
            "timm_stubbed": bool(info["timm_stubbed"]),
        }
    return res


def _git_commit(path: str | Path) -> str:
    """The checked-out commit of a git checkout ('' when it is not one); the report names the peer by it."""
    try:
        out = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def main(argv: list[str] | None = None) -> int:
    """The worker: ``python -m diffcurr_fast.study.step_time STUDY_DIR PEER_DIT_PATH|- [THREADS]``."""
    argv = sys.argv[1:] if argv is None else argv
    study_dir, peer = Path(argv[0]), (None if argv[1] == "-" else argv[1])
    threads = int(argv[2]) if len(argv) > 2 else 0
    spec = load_study(study_dir)
    seed = spec.seeds[0]
    cfgs = {
        a.name: arm_config(spec, a, seed, study_dir / "steptime-run" / a.name, threads)
        for a in spec.arms
        if a.kind == "train"
    }
    res = measure_step_times(cfgs, peer, spec.speedrun["official_arm"])
    write_json(res, study_dir / STEP_TIME_FILE, indent=1)
    print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
