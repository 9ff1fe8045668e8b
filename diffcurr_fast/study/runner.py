"""Running a study: every (arm, seed) as an ordinary run directory, N at once, resumable after a crash or a kill.

Study folder::

    study.yaml                  the spec (a rerun must give the same spec: settings are fixed before results)
    runs/<arm>/seed<k>/         the run directory of (arm, seed): ``diffcurr-fast train`` / ``tdc`` output
    status/<arm>-seed<k>.json   written when the run finished: kind, steps, training FLOPs, final metrics and the
                                wall time of the attempt that finished it (a resumed run: since its resume)
    logs/<arm>-seed<k>.log      the worker's output
    jobs/<arm>-seed<k>.json     the run's latest worker process or Slurm job (``launch``; ``study status``)
    slurm/                      launcher slurm: submitit's job files and logs (``launch``)
    step_time.json              a speedrun: every arm's step time and, with ``peer_dit``, the official DiT step's,
                                measured side by side (a worker measures it first, beside the first runs; kept on
                                a rerun)
    results.csv, report.md, *.png   ``study report``

A run with a status file is finished and kept. Any other run is started again by a worker process
(``python -m diffcurr_fast.study.runner STUDY_DIR ARM SEED``): a train run with checkpoints resumes from the newest
(the trainer's ``--resume``, which repeats the uninterrupted run exactly), one without starts over; a tdc run
with its ``tdc.json`` resumes too (``tdc --resume``: stage 1, finished groups and search rounds are kept), one
without starts over. Launcher ``local`` (``LocalPool``): ``workers`` runs go at once, each with ``cpu_threads`` =
cores // workers (or ``--threads``) and, on a machine with GPUs, one GPU per worker slot (``CUDA_VISIBLE_DEVICES``).
Launcher ``slurm`` (``launch.SubmititPool``): each run is a Slurm job whose tasks run the worker as the ranks of one
data-parallel run. A worker launched under ``torchrun`` (or a job's tasks) trains its run data-parallel
(``engine.kind`` auto); rank 0 alone evaluates a tdc bundle and writes the status.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
import yaml
from tqdm.auto import tqdm

from diffcurr_fast._files import OutputLock, write_json
from diffcurr_fast.eval.features import digits_classifier, mnist5k_classifier
from diffcurr_fast.runs.checkpoint import latest_checkpoint
from diffcurr_fast.runs.recipes import apply_overrides
from diffcurr_fast.runs.sampling import build_model, build_schedule
from diffcurr_fast.runs.threads import check_threads
from diffcurr_fast.study.launch import SubmititPool, active_jobs, write_job
from diffcurr_fast.study.layout import STEPTIME, jobs, log_path, read_status, run_dir_of, status_path
from diffcurr_fast.study.peer_dit import check_checkout
from diffcurr_fast.study.spec import (
    LAUNCH_KEYS,
    LAUNCHERS,
    SPEC_FILE,
    Arm,
    StudySpec,
    arm_config,
    check_spec,
    load_study,
    spec_from_dict,
)
from diffcurr_fast.study.step_time import STEP_TIME_FILE
from diffcurr_fast.study.tuning import decide, picked, split_trial
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.pipeline import equal_sampling_steps, load_bundle_with_config, run_tdc
from diffcurr_fast.train.evaluation import Evaluator
from diffcurr_fast.train.interrupt import TrainingInterrupted
from diffcurr_fast.train.loop import train
from diffcurr_fast.train.report import read_metrics


def prepare_study(spec: StudySpec, study_dir: str | Path) -> Path:
    """Create ``study_dir`` with ``study.yaml``, or check that an existing one holds the same spec (its launch
    settings aside: a rerun may launch the runs elsewhere, and ``study.yaml`` then records the new ones). The spec is
    written whole or not at all (renamed into place), so a Ctrl-C leaves no half spec for a rerun to misread."""
    study_dir = Path(study_dir)
    path = study_dir / SPEC_FILE
    if path.is_file():
        saved = spec_from_dict(yaml.safe_load(path.read_text()), str(path)).to_dict()
        fixed = {k: v for k, v in spec.to_dict().items() if k not in LAUNCH_KEYS}
        if {k: v for k, v in saved.items() if k not in LAUNCH_KEYS} != fixed:
            raise ValueError(
                f"{str(path)!r} holds a different spec; a study's settings are fixed when it starts: use "
                "another --out or the same spec"
            )
        if saved == spec.to_dict():
            return study_dir
    study_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(yaml.safe_dump(spec.to_dict(), sort_keys=False))
    os.replace(tmp, path)
    return study_dir


def pending(spec: StudySpec, study_dir: Path) -> list[tuple[str, int]]:
    return [(a, s) for a, s in jobs(spec) if read_status(study_dir, a, s) is None]


def run_study(
    spec: StudySpec,
    study_dir: str | Path,
    workers: int | None = None,
    *,
    verbose: bool = True,
    peer_dit: str | Path | None = None,
    threads: int | None = None,
    launcher: str | None = None,
    cluster: str = "slurm",
) -> dict[str, Any]:
    """Run every unfinished (arm, seed) of ``spec`` in ``study_dir``; returns {"ran": [...], "failed": [...], "kept":
    n}. Failed runs are listed, not retried (a rerun resumes them). ``launcher`` (default: the spec's): ``local``,
    ``workers`` processes at once (default 1); ``slurm``, submitit jobs (``launch.SubmititPool``; ``cluster``: its
    executor), ``workers`` at once (default: all), runs still queued or running from an earlier sitting followed, not
    submitted again. ``peer_dit`` (a speedrun): a facebookresearch/DiT checkout whose step time is measured first
    (module doc). ``threads``: CPU threads per run (default: the cores split between the workers; on Slurm, the CPUs
    of a task). ``verbose``: a line per started and finished run on stdout, and a progress bar of the runs (done /
    all, with an ETA) on stderr. Interrupted (Ctrl-C), local workers are stopped (``LocalPool.stop``) and the
    ``KeyboardInterrupt`` propagates; a rerun resumes their runs. Slurm jobs go on."""
    launcher = launcher or spec.launcher
    if launcher not in LAUNCHERS:
        raise ValueError(f"--launcher {launcher!r}; valid launchers: {', '.join(LAUNCHERS)}")
    if workers is not None and workers < 1:
        raise ValueError(f"--workers must be >= 1, got {workers}")
    if threads is not None and threads < 1:
        raise ValueError(f"--threads must be >= 1, got {threads}")
    check_threads(threads or 0)
    if peer_dit is not None:
        if not spec.speedrun:
            raise ValueError(f"--peer-dit times the official arm of a speedrun; study {spec.name!r} has no speedrun")
        check_checkout(peer_dit)
    check_spec(spec)
    # held until the study ends (released in the finally below, or at exit): one study process per folder
    lock = OutputLock(study_dir, "study folder", "choose another study folder (--out)", directory=True).acquire()
    try:  # a launcher refused (its settings, no Slurm here) leaves no folder behind
        pool: Any = (
            LocalPool(study_dir, workers or 1, threads)
            if launcher == "local"
            else SubmititPool(spec, study_dir, workers, threads, cluster)
        )
    except BaseException:
        lock.release()
        raise
    study_dir = prepare_study(spec, study_dir)
    todo = pending(spec, study_dir)
    kept = len(jobs(spec)) - len(todo)
    measure = bool(spec.speedrun) and not (study_dir / STEP_TIME_FILE).is_file()

    def done_file(job: tuple[str, int]) -> Path:  # the file a job writes once it succeeded
        return study_dir / STEP_TIME_FILE if job == STEPTIME else status_path(study_dir, *job)

    running = _follow(pool, study_dir, [STEPTIME] * measure + todo, done_file)
    _prepare_features(spec)
    ran, failed = [], []
    if verbose:
        print(
            f"study {spec.name}: {len(todo)} runs to do, {kept} finished kept, {pool.describe()}; folder {study_dir}",
            flush=True,
        )
    queue = [job for job in [STEPTIME] * measure + todo if job not in {r for r, _ in running}]
    for (arm, seed), handle in running:
        if verbose:
            what = "step times" if seed < 0 else f"{arm} seed {seed}"
            print(f"  follow {what} ({pool.label(handle)}, queued or running)", flush=True)
    if queue:
        pool.prepare(verbose)
    bar = tqdm(
        total=kept + len(todo),
        initial=kept,
        desc=f"study {spec.name}",
        unit="run",
        file=sys.stderr,
        disable=not verbose,
        dynamic_ncols=True,
    )

    picks = decide(spec, study_dir, read_status) if spec.tuning else {}  # made again when a trial finishes

    def ready(job: tuple[str, int]) -> bool:
        """A run can start: a trial, the step-time job, an untuned arm's run, or a tuned arm's run once its pick is
        made (``tuning.decide``, when every trial of the arm has finished)."""
        arm = job[0]
        return job == STEPTIME or split_trial(arm)[1] is not None or not spec.arm(arm).tune or arm in picks

    def say(line: str) -> None:  # a line of the study's output on stdout, printed above the progress bar
        if verbose:
            bar.write(line, file=sys.stdout)
            sys.stdout.flush()

    try:
        while queue or running:
            while queue and (pool.workers is None or len(running) < pool.workers):
                job = next((j for j in queue if ready(j)), None)
                if job is None:  # every queued run waits for the pick of its arm's trials
                    if not running:  # ... of trials that failed: those runs cannot start
                        for arm, seed in queue:
                            failed.append((arm, seed))
                            say(f"  skip  {arm} seed {seed}: its tuning trials did not all finish (see logs/)")
                        queue.clear()
                    break
                queue.remove(job)
                arm, seed = job
                cmd = [sys.executable, "-m", "diffcurr_fast.study.runner", str(study_dir.absolute()), arm, str(seed)]
                if job == STEPTIME:
                    peer = "-" if peer_dit is None else str(peer_dit)
                    cmd = [sys.executable, "-m", "diffcurr_fast.study.step_time", str(study_dir.absolute()), peer]
                handle = pool.start(arm, seed, cmd, done_file(job))
                running.append((job, handle))
                label = f" ({pool.label(handle)})" if pool.label(handle) else ""
                say(f"  start step times{label}" if seed < 0 else f"  start {arm} seed {seed}{label}")
            time.sleep(pool.poll_s)
            for item in list(running):
                (arm, seed), handle = item
                if not pool.ended(handle):
                    continue
                running.remove(item)
                ok = done_file((arm, seed)).is_file()
                if (arm, seed) != STEPTIME or not ok:  # "ran" lists runs; a failed measurement fails
                    (ran if ok else failed).append((arm, seed))
                if (arm, seed) == STEPTIME:
                    say(f"  done  step times: {'step_time.json' if ok else 'FAILED (logs/step-time.log)'}")
                    continue
                st = read_status(study_dir, arm, seed)
                if st:
                    msg = f"{spec.metric} {st['final'].get(spec.metric, float('nan')):.4g}, {st['wall_s']:.0f} s"
                else:
                    msg = f"FAILED ({pool.label(handle)}; see logs/{arm}-seed{seed}.log)"
                say(f"  done  {arm} seed {seed}: {msg}")
                bar.update(1)
                if split_trial(arm)[1] is not None:  # a trial: its arm's pick may be made now
                    picks = decide(spec, study_dir, read_status)
                if failed:
                    bar.set_postfix(failed=len(failed))
    finally:
        bar.close()
        pool.stop([handle for _, handle in running])
        lock.release()
    return {"ran": ran, "failed": failed, "kept": kept}


def _follow(
    pool: Any, study_dir: Path, todo: list[tuple[str, int]], done_file: Any
) -> list[tuple[tuple[str, int], Any]]:
    """The jobs of ``todo`` whose job of an earlier sitting is still queued or running, each with the handle that
    ``pool`` follows it by (done once ``done_file(job)`` exists); ValueError when ``pool`` cannot follow it (a job of
    the other launcher, a worker of another study process)."""
    active = active_jobs(study_dir, todo, need_slurm=pool.scheduler == "slurm")
    out = []
    for run, rec in active.items():
        if rec["scheduler"] == "process":
            raise ValueError(
                f"run {run[0]} seed {run[1]} of {str(study_dir)!r} is running in another study process (pid "
                f"{rec['job_id']}): let it finish, or stop it (Ctrl-C there) before running the study again"
            )
        if pool.scheduler != "slurm":
            ids = ", ".join(r["job_id"] for r in active.values())
            raise ValueError(
                f"{len(active)} runs of {str(study_dir)!r} have Slurm jobs queued or running ({ids}): follow them "
                f"with --launcher slurm, or cancel them first (diffcurr-fast study cancel {study_dir})"
            )
        out.append((run, pool.follow(rec, done_file(run))))
    return out


class LocalPool:
    """The study's runs as worker processes of this machine: ``workers`` at once, each with ``threads`` CPU threads
    (default: the cores split between them) and, on a machine with GPUs, one GPU per worker slot
    (``CUDA_VISIBLE_DEVICES``); each worker's pid is kept in ``jobs/`` (``study status``)."""

    scheduler = "process"
    poll_s = 0.2

    def __init__(self, study_dir: str | Path, workers: int, threads: int | None):
        self.study_dir, self.workers = Path(study_dir), workers
        self.threads = threads or max(1, (os.cpu_count() or 1) // workers)
        self.gpus = _gpu_count()
        self._slots: set[int] = set()

    def describe(self) -> str:
        return f"{self.workers} workers x {self.threads} threads"

    def prepare(self, verbose: bool) -> None:
        pass

    def start(self, arm: str, seed: int, cmd: list[str], done: Path) -> tuple[subprocess.Popen, Any, int]:
        log = log_path(self.study_dir, arm, seed)
        log.parent.mkdir(parents=True, exist_ok=True)
        fh = open(log, "a")
        env = {**os.environ, "OMP_NUM_THREADS": str(self.threads), "MKL_NUM_THREADS": str(self.threads)}
        slot = min(set(range(self.workers)) - self._slots)
        if self.gpus:  # one run per GPU: worker slot i sees GPU i mod #GPUs only
            env["CUDA_VISIBLE_DEVICES"] = str(slot % self.gpus)
        proc = subprocess.Popen([*cmd, str(self.threads)], stdout=fh, stderr=subprocess.STDOUT, env=env)
        self._slots.add(slot)
        write_job(self.study_dir, arm, seed, self.scheduler, str(proc.pid))
        return proc, fh, slot

    def label(self, handle: tuple[subprocess.Popen, Any, int]) -> str:
        """'' while the worker runs (the start line names nothing), its exit status once it ended."""
        return "" if handle[0].returncode is None else f"rc {handle[0].returncode}"

    def ended(self, handle: tuple[subprocess.Popen, Any, int]) -> bool:
        proc, fh, slot = handle
        if proc.poll() is None:
            return False
        fh.close()
        self._slots.discard(slot)
        return True

    def stop(self, handles: list[tuple[subprocess.Popen, Any, int]]) -> None:
        """Stop the workers still running (the study was interrupted): SIGTERM to all of them first (a training run
        checkpoints on it, as on Ctrl-C), then wait for each; a second Ctrl-C while waiting kills them. A run's
        status file is written only once it finished, so every stopped run resumes on the next run of the study."""
        for proc, _, _ in handles:
            proc.terminate()
        try:
            for proc, fh, _ in handles:
                proc.wait()
                fh.close()
        except KeyboardInterrupt:
            for proc, fh, _ in handles:
                proc.kill()
                fh.close()
            raise


def _gpu_count() -> int:
    """Visible CUDA devices (0 without CUDA)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _prepare_features(spec: StudySpec) -> None:
    """Train and cache the digits / mnist5k classifier once, before workers would race to do it."""
    features = spec.eval.get("features", "digits")
    if features in ("digits", "mnist5k"):
        (digits_classifier if features == "digits" else mnist5k_classifier)()


# ---- one run (the worker process) ---------------------------------------------------------------------------
def _rank() -> int:
    """This process's rank under torchrun (0 otherwise)."""
    return int(os.environ.get("RANK", "0"))


def run_one(study_dir: str | Path, arm_name: str, seed: int, cpu_threads: int = 0) -> dict[str, Any]:
    """Run (or resume) (arm, seed) of the study in ``study_dir`` in this process and write its status file (rank
    0 under torchrun)."""
    study_dir = Path(study_dir)
    spec = load_study(study_dir)
    arm = spec.arm(arm_name)
    if arm.tune:  # a tuned arm's seed: its own overrides, then the picked point of its grid
        arm = Arm(arm.name, arm.kind, [*arm.set, *picked(study_dir, arm.name)], arm.reference)
    run_dir = run_dir_of(study_dir, arm.name, seed)
    cfg = arm_config(spec, arm, seed, run_dir, cpu_threads)
    t0 = time.perf_counter()
    out = _run_tdc(cfg, run_dir) if arm.kind == "tdc" else _run_train(cfg, run_dir)
    status = {
        "arm": arm.name,
        "seed": seed,
        "kind": arm.kind,
        "run_dir": str(run_dir.relative_to(study_dir)),
        "wall_s": time.perf_counter() - t0,
        **out,
    }
    if _rank() == 0:
        write_json(status, status_path(study_dir, arm.name, seed), indent=1)
    return status


def _run_train(cfg: Any, run_dir: Path) -> dict[str, Any]:
    resume = run_dir.is_dir() and latest_checkpoint(run_dir) is not None
    overwrite = run_dir.is_dir() and not resume  # killed before its first checkpoint: start over
    summary = train(cfg, resume=resume, overwrite=overwrite)
    flops = 3.0 * dit_flops(build_model(cfg)) * cfg.data.batch_size * summary["step"]
    evals = eval_records(run_dir / "metrics.jsonl")
    return {
        "steps": summary["step"],
        "train_flops": flops,
        "resumed": resume,
        "final": evals[-1] if evals else {},
        "evals": evals,  # the study reports from the status files alone when the run folders are gone
    }


def _run_tdc(cfg: Any, run_dir: Path) -> dict[str, Any]:
    resume = (run_dir / "tdc.json").is_file()
    overwrite = run_dir.is_dir() and not resume  # killed before tdc.json was written: start over
    out = run_tdc(cfg, None, run_dir, overwrite=overwrite, resume=resume, verbose=True)
    acc = out["accounting_data"]
    multi, bcfg = load_bundle_with_config(out["bundle"])
    steps = int(acc["training"]["total_steps"])
    final: dict[str, Any] = {}
    equal: dict[str, Any] = {}
    if _rank() == 0:
        schedule, e = build_schedule(bcfg), bcfg.eval
        final = Evaluator(bcfg, run_dir)(steps, multi, schedule)
        write_json(final, run_dir / "bundle_eval.json", indent=1)
        # the same evaluation at the base model's sampling FLOPs: the experts are smaller, so more steps
        n, flops = equal_sampling_steps(multi, schedule, bcfg, acc["base_flops_per_forward"], e.sampler, e.steps)
        equal = Evaluator(apply_overrides(bcfg, [f"eval.steps={n}"]), run_dir)(steps, multi, schedule)
        equal |= {"sampling_steps": n, "sampling": flops}
        write_json(equal, run_dir / "bundle_eval_equal_sampling.json", indent=1)
    sampling = {k: v["multi_expert_flops_per_image"] for k, v in acc["sampling"].items()}
    return {
        "steps": steps,
        "train_flops": acc["training"]["tdc_flops"],
        "resumed": resume,
        "train_flops_with_search": acc["training"]["tdc_flops_with_search"],
        "single_model_flops": acc["training"]["single_model_flops"],
        "sampling_flops_per_image": sampling,
        "base_sampling_flops_per_image": {k: v["base_flops_per_image"] for k, v in acc["sampling"].items()},
        "final": final,
        "equal_sampling": equal,  # the bundle at the base model's sampling FLOPs (eval.steps of the base)
    }


def eval_records(path: Path) -> list[dict[str, Any]]:
    """The evaluation records of a metrics.jsonl, one per step (a resumed run's repeated steps: the last), by step."""
    if not Path(path).is_file():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for rec in read_metrics(path):
        if rec.get("eval"):
            by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]


def main(argv: list[str] | None = None) -> int:
    """The worker: ``python -m diffcurr_fast.study.runner STUDY_DIR ARM SEED [CPU_THREADS]``."""
    argv = sys.argv[1:] if argv is None else argv
    study_dir, arm, seed = argv[0], argv[1], int(argv[2])
    threads = int(argv[3]) if len(argv) > 3 else 0
    try:
        status = run_one(study_dir, arm, seed, threads)
    except TrainingInterrupted as stop:  # Ctrl-C or SIGTERM: checkpointed; the study's rerun resumes the run
        print(f"study worker {arm} seed {seed}: {stop}; rerun the study to resume it", flush=True)
        return stop.exit_code
    except KeyboardInterrupt:
        print(f"study worker {arm} seed {seed}: interrupted (Ctrl-C); rerun the study to resume it", flush=True)
        return 130
    if _rank() == 0:
        print(json.dumps({k: v for k, v in status.items() if k != "final"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
