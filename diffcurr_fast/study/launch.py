"""Where a study's runs go, and what the study folder keeps of their jobs: ``launcher: local`` (worker processes of
this machine, ``runner.LocalPool``) or ``launcher: slurm`` (each run a submitit job on a Slurm cluster,
``SubmititPool``); ``study status DIR`` and ``study cancel DIR`` read what is kept.

A Slurm job of a run has ``slurm.nodes`` x ``slurm.gpus_per_node`` tasks, one per GPU, each with ``cpus_per_gpu``
CPUs. Each task runs the study's worker (``python -m diffcurr_fast.study.runner``) as a child process, with torchrun's
environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` = the first node, ``MASTER_PORT`` from the job
id): the trainer's DDP and DeepSpeed engines read it, so an arm runs under the engine it names (``engine.kind``;
``auto`` is DDP over several ranks). The step-time job of a speedrun is one task. ``partition``, ``time_min`` and
``sbatch`` (more of submitit's Slurm parameters: account, qos, mem, constraint, setup, additional_parameters, ...)
complete the request.

Study folder, beside ``runner``'s files::

    jobs/<arm>-seed<k>.json   the run's latest job: scheduler (``slurm``, or ``process``: a worker on ``host``) and id
    jobs/folder_check         the study folder's absolute path and a random token, written on the first submission
    jobs/folder_seen          the same text and a node's name, written by a check job that read folder_check there
    slurm/                    submitit's files of every job, and the tasks' own output (``<id>_<task>_log.out/.err``)

A rerun of the study submits only the runs that are unfinished (no status file) and whose job is not queued or
running (``squeue``); it follows those that are. When Slurm preempts a job or its time limit nears, submitit signals
it and calls ``RunJob.checkpoint`` on rank 0: the worker gets SIGTERM (the trainer checkpoints at its next step, every
rank agreeing), and submitit requeues the job, which resumes the run from that checkpoint (up to ``MAX_TIMEOUTS``
time limits per job; preemptions are not counted). Before the first run of a folder is submitted, a check job reads
``folder_check`` on a compute node and answers in ``folder_seen``: a study folder the nodes cannot see is refused in
one line. ``submitit`` is an optional dependency (the ``slurm`` extra), imported when a study is launched on Slurm.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import signal
import socket
import subprocess
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from diffcurr_fast._files import write_json
from diffcurr_fast.study.layout import job_path, jobs, log_path, read_status, run_dir_of, run_name
from diffcurr_fast.study.spec import SLURM_DEFAULTS, StudySpec, load_study

MAX_TIMEOUTS = 50  # time limits a job is requeued after (submitit's max_num_timeout); a resumed run goes on
SQUEUE_EVERY_S = 30.0  # a running study asks squeue this often which of its jobs are still queued or running
CHECK_TIME_MIN = 5  # the time limit of the folder check job
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD")
OVER = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")
OVER += ("REVOKED", "SPECIAL_EXIT", "TIMEOUT")
# submitit's Slurm parameters that the study's own settings give: where to set each instead
OWNED = {
    "nodes": "slurm.nodes",
    "gpus_per_node": "slurm.gpus_per_node",
    "num_gpus": "slurm.gpus_per_node",
    "gpus_per_task": "slurm.gpus_per_node (a job has one task per GPU)",
    "ntasks_per_node": "slurm.gpus_per_node (a job has one task per GPU)",
    "cpus_per_task": "slurm.cpus_per_gpu",
    "cpus_per_gpu": "slurm.cpus_per_gpu",
    "partition": "slurm.partition",
    "time": "slurm.time_min",
    "job_name": "nothing: the study names its jobs <study>-<arm>-seed<k>",
}


def _submitit() -> Any:
    try:
        import submitit  # optional dependency (the slurm extra), imported when used
    except ImportError:
        raise ImportError(
            "launcher slurm needs the submitit package: pip install submitit (or diffcurr_fast's 'slurm' extra)"
        ) from None
    return submitit


def check_sbatch(sbatch: dict[str, Any]) -> None:
    """ValueError, in one line, for a name under ``slurm.sbatch`` that submitit has no Slurm parameter for, or one
    that a study setting gives."""
    for key in sbatch:
        if key in OWNED:
            raise ValueError(f"slurm.sbatch.{key}: the study sets it; set {OWNED[key]}")
    valid = sorted(_submitit().SlurmExecutor._valid_parameters() - set(OWNED) - {"map_count"})
    bad = sorted(set(sbatch) - set(valid))
    if bad:
        raise ValueError(
            f"slurm.sbatch: submitit has no Slurm parameter {', '.join(map(repr, bad))}; its parameters: "
            f"{', '.join(valid)} (an sbatch option it does not name goes under additional_parameters, e.g. "
            "sbatch: {additional_parameters: {mail-user: me@lab.org}})"
        )


# ---- the job records (jobs/) -----------------------------------------------------------------------------------
def write_job(study_dir: Path, arm: str, seed: int, scheduler: str, job_id: str) -> None:
    record = {"scheduler": scheduler, "job_id": job_id, "host": socket.gethostname(), "submitted": time.time()}
    write_json(record, job_path(study_dir, arm, seed), indent=1)


def read_job(study_dir: Path, arm: str, seed: int) -> dict[str, Any] | None:
    p = job_path(study_dir, arm, seed)
    return json.loads(p.read_text()) if p.is_file() else None


def squeue_states() -> dict[str, str]:
    """{job id: state} of this user's jobs that Slurm still lists; RuntimeError when squeue fails or is missing."""
    cmd = ["squeue", "--noheader", "--format=%i|%T", f"--user={getpass.getuser()}"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RuntimeError(f"squeue failed: {exc}") from None
    if out.returncode:
        raise RuntimeError(f"squeue failed: {(out.stderr.strip().splitlines() or ['exit ' + str(out.returncode)])[-1]}")
    lines = (line.split("|") for line in out.stdout.splitlines() if "|" in line)
    return {job.strip(): state.strip().split()[0] for job, state in lines if state.strip()}


def process_alive(record: dict[str, Any], study_dir: Path) -> bool:
    """Whether the ``process`` record's worker still runs: on this host, its pid alive and running this study."""
    pid = int(record["job_id"])
    if record["host"] != socket.gethostname() or pid <= 0:
        return False
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return str(Path(study_dir).absolute()) in cmdline


def job_state(record: dict[str, Any], study_dir: Path, squeue: dict[str, str] | None) -> str | None:
    """'queued' or 'running' while the record's job is alive, None once it is over; ``squeue``: its listing (None:
    Slurm cannot be asked here, so a Slurm job counts as over)."""
    if record["scheduler"] == "process":
        return "running" if process_alive(record, study_dir) else None
    state = (squeue or {}).get(record["job_id"])
    if state is None or state in OVER:
        return None
    return "queued" if state in QUEUED else "running"


def active_jobs(
    study_dir: Path, runs: list[tuple[str, int]], need_slurm: bool
) -> dict[tuple[str, int], dict[str, Any]]:
    """The runs among ``runs`` whose latest job is still queued or running: {run: its record}. When squeue cannot
    answer, ``need_slurm`` (a study launched on Slurm) makes that a ValueError; otherwise the study folder was carried
    away from its cluster and its Slurm jobs count as over."""
    records = {run: rec for run in runs if (rec := read_job(study_dir, *run)) is not None}
    squeue = None
    if any(r["scheduler"] == "slurm" for r in records.values()):
        try:
            squeue = squeue_states()
        except RuntimeError as exc:
            if need_slurm:
                raise ValueError(f"{exc}: cannot tell which of the study's jobs are queued or running") from None
    return {run: rec for run, rec in records.items() if job_state(rec, study_dir, squeue)}


# ---- what a job runs ---------------------------------------------------------------------------------------------
def rank_env(env: Any) -> dict[str, str]:
    """torchrun's environment of the task that submitit's ``JobEnvironment`` ``env`` describes: its rank among the
    job's tasks, the first node as the rendezvous (this one's loopback for a job of one node), a port taken from the
    job id (two jobs on a node differ)."""
    digits = re.sub(r"\D", "", str(env.job_id)) or "0"
    return {
        "RANK": str(env.global_rank),
        "WORLD_SIZE": str(env.num_tasks),
        "LOCAL_RANK": str(env.local_rank),
        "LOCAL_WORLD_SIZE": str(env.num_tasks // env.num_nodes),
        "MASTER_ADDR": env.hostnames[0] if env.num_nodes > 1 else "127.0.0.1",
        "MASTER_PORT": str(20000 + int(digits) % 20000),
    }


def read_check(check: str, text: str) -> None:
    """ValueError unless the study folder's check file ``check`` holds ``text`` here (a node that sees the folder)."""
    p = Path(check)
    if not p.is_file() or p.read_text() != text:
        raise ValueError(
            f"{socket.gethostname()} does not see the study folder's check file {check} as it was written when the "
            "job was submitted: the study folder is not shared with this node; put it on a disk the nodes share"
        )


def confirm_folder(check: str, text: str, seen: str) -> str:
    """The check job: read the check file, and answer by writing ``seen`` (the same text, then this node's name)."""
    read_check(check, text)
    host = socket.gethostname()
    Path(seen).write_text(f"{text}\n{host}\n")
    return host


class RunJob:
    """What each task of a run's submitit job executes: the worker command ``cmd`` (with the CPU thread count last)
    as a child process, torchrun's environment when the job has several tasks, rank 0's output appended to ``log``
    (the other ranks': the task's own log under ``slurm/``). The child ignores submitit's signal (Slurm sends it to
    every process of the job), which ``checkpoint`` handles. ``threads`` 0: the CPUs Slurm gave the task. A job that
    starts again once its run has finished (``done`` exists: requeued as it ended) does nothing."""

    def __init__(self, cmd: list[str], log: str, check: str, text: str, threads: int, done: str):
        self.cmd, self.log, self.check, self.text, self.threads, self.done = cmd, log, check, text, threads, done
        self._proc: subprocess.Popen | None = None

    def __call__(self) -> int:
        env = _submitit().JobEnvironment()
        read_check(self.check, self.text)
        if Path(self.done).is_file():
            return 0
        threads = self.threads or max(1, len(os.sched_getaffinity(0)))
        child = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        if env.num_tasks > 1:
            child.update(rank_env(env))
        usr = getattr(signal, "SIG" + env.USR_SIG)
        out = open(self.log, "a") if env.global_rank == 0 else None
        try:
            self._proc = subprocess.Popen(
                [*self.cmd, str(threads)],
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                env=child,
                preexec_fn=lambda: signal.signal(usr, signal.SIG_IGN),
            )
            while (rc := self._proc.poll()) is None:  # polled, not waited: submitit's handler may run meanwhile
                time.sleep(1.0)
        finally:
            if out is not None:
                out.close()
        if rc:
            raise RuntimeError(f"the study worker exited with status {rc} (see {self.log})")
        return rc

    def checkpoint(self) -> Any:
        """submitit's hook, on rank 0 when the job is preempted or its time limit nears: SIGTERM to the worker (the
        trainer checkpoints at its next step and stops), wait for it, and give submitit the same job to requeue."""
        proc = self._proc
        if proc is not None and proc.returncode is None:
            try:
                os.kill(proc.pid, signal.SIGTERM)
                os.waitpid(proc.pid, 0)  # not proc.wait(): the interrupted poll may hold its lock
            except (ProcessLookupError, ChildProcessError):  # it had ended
                pass
        again = RunJob(self.cmd, self.log, self.check, self.text, self.threads, self.done)
        return _submitit().helpers.DelayedSubmission(again)


# ---- launching on Slurm --------------------------------------------------------------------------------------------
@dataclass
class Submitted:
    """A run's job as the study follows it: done when ``done`` (its status file) exists, or it ended otherwise."""

    job_id: str
    done: Path
    since: float  # when it was submitted or found queued
    job: Any = None  # submitit's Job (the local executor's jobs are asked directly)


class SubmititPool:
    """The study's runs as submitit jobs (module doc). ``cluster``: submitit's executor, ``slurm``, or ``local`` (its
    LocalExecutor: the same jobs as processes of this machine, one node). ``workers``: jobs at once (None: all)."""

    poll_s = 1.0  # the study looks for finished runs this often; it asks squeue every SQUEUE_EVERY_S

    def __init__(
        self, spec: StudySpec, study_dir: Path, workers: int | None, threads: int | None, cluster: str = "slurm"
    ):
        self.spec, self.study_dir, self.workers, self.threads = spec, Path(study_dir).absolute(), workers, threads or 0
        self.settings = {**SLURM_DEFAULTS, **spec.slurm}
        self.cluster = cluster
        self.scheduler = "slurm" if cluster == "slurm" else "process"
        check_sbatch(self.settings["sbatch"])
        submitit = _submitit()
        try:
            self.executor = submitit.AutoExecutor(
                folder=self.study_dir / "slurm", cluster=cluster, slurm_max_num_timeout=MAX_TIMEOUTS
            )
        except RuntimeError as exc:  # no srun on PATH
            raise ValueError(f"launcher slurm: {exc} (run the study on a machine with Slurm's commands)") from None
        self._params("check", self.settings["nodes"], self.settings["gpus_per_node"])  # refused now, not at submit
        self._listing: dict[str, str] = {}
        self._listed_at = self._asked_at = float("-inf")
        self._check = self.study_dir / "jobs" / "folder_check"

    def describe(self) -> str:
        s = self.settings
        where = f" in partition {s['partition']}" if s["partition"] else ""
        return f"Slurm jobs of {s['nodes']} node(s) x {s['gpus_per_node']} GPU(s){where}, {s['time_min']} min"

    def _params(self, name: str, nodes: int, tasks: int, time_min: int | None = None) -> None:
        s = self.settings
        params = {
            "name": name,
            "timeout_min": time_min or s["time_min"],
            "nodes": nodes,
            "tasks_per_node": tasks,
            "gpus_per_node": tasks,
            "cpus_per_task": s["cpus_per_gpu"],
            "slurm_partition": s["partition"],
            **{f"slurm_{k}": v for k, v in s["sbatch"].items()},
        }
        try:
            self.executor.update_parameters(**params)
        except (NameError, ValueError, TypeError, AssertionError) as exc:
            raise ValueError(f"slurm settings refused by submitit: {str(exc).strip().splitlines()[0]}") from None

    def _check_text(self) -> str:
        """The check file's text, written now unless it names this folder."""
        text = self._check.read_text() if self._check.is_file() else ""
        if not text.startswith(f"{self.study_dir} "):
            text = f"{self.study_dir} {uuid.uuid4().hex}"
            self._check.parent.mkdir(parents=True, exist_ok=True)
            self._check.write_text(text)
        return text

    def prepare(self, verbose: bool) -> None:
        """Before the first submission from this folder: a check job on a compute node reads the check file and
        answers; ValueError (one line) when it ended without answering (the nodes do not see the folder)."""
        text, seen = self._check_text(), self._check.with_name("folder_seen")
        if seen.is_file() and seen.read_text().split("\n")[0] == text:
            return  # checked from this folder before
        self._params(f"{self.spec.name}-folder-check", 1, 1, CHECK_TIME_MIN)
        job = self.executor.submit(confirm_folder, str(self._check), text, str(seen))
        if verbose:
            print(f"  check that the compute nodes see the study folder (job {job.job_id})", flush=True)
        handle = Submitted(job.job_id, seen, time.time(), job)
        while not self.ended(handle):
            time.sleep(self.poll_s)
        if not (seen.is_file() and seen.read_text().split("\n")[0] == text):
            raise ValueError(
                f"the compute nodes do not see the study folder {str(self.study_dir)!r}: check job {job.job_id} "
                f"ended without reading {self._check.name} there (a disk of this machine only, such as /tmp?); put the "
                "study folder on a disk the nodes share (--out)"
            )

    def start(self, arm: str, seed: int, cmd: list[str], done: Path) -> Submitted:
        nodes, tasks = (self.settings["nodes"], self.settings["gpus_per_node"]) if seed >= 0 else (1, 1)
        self._params(f"{self.spec.name}-{run_name(arm, seed)}", nodes, tasks)
        log = log_path(self.study_dir, arm, seed)
        log.parent.mkdir(parents=True, exist_ok=True)
        job = self.executor.submit(RunJob(cmd, str(log), str(self._check), self._check_text(), self.threads, str(done)))
        write_job(self.study_dir, arm, seed, self.scheduler, str(job.job_id))
        return Submitted(str(job.job_id), done, time.time(), job)

    def follow(self, record: dict[str, Any], done: Path) -> Submitted:
        """A job of an earlier sitting still queued or running (``active_jobs``)."""
        return Submitted(record["job_id"], done, time.time())

    def label(self, handle: Submitted) -> str:
        return f"job {handle.job_id}"

    def ended(self, handle: Submitted) -> bool:
        """The run finished (its status file), or its job is no longer queued or running: on Slurm, as squeue last
        listed it (a job that Slurm requeued after it stopped, e.g. preempted, is followed on)."""
        if handle.done.is_file():
            return True
        if self.cluster != "slurm":
            return handle.job.done()
        now = time.time()
        if now - self._asked_at > SQUEUE_EVERY_S:
            self._asked_at = now
            try:
                self._listing, self._listed_at = squeue_states(), now
            except RuntimeError:  # Slurm busy: asked again later; nothing counts as ended meanwhile
                pass
        state = self._listing.get(handle.job_id)
        return self._listed_at > handle.since and (state is None or state in OVER)

    def stop(self, handles: list[Submitted]) -> None:
        """The study stops following its jobs; Slurm's go on (the local executor's are cancelled with it)."""
        for h in handles:
            if h.job is not None and self.cluster != "slurm":
                h.job.cancel()


# ---- study status / study cancel -----------------------------------------------------------------------------------
def last_step(run_dir: Path) -> int | None:
    """The step of the newest training record of a run directory (a tdc run: its stage 1), None before the first."""
    for path in (run_dir / "metrics.jsonl", run_dir / "stage1" / "metrics.jsonl"):
        for line in reversed(_tail(path)):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue
    return None


def last_line(path: Path) -> str:
    """The last non-empty line of a text file ('' when there is none), at most 300 characters."""
    lines = [line.strip() for line in _tail(path) if line.strip()]
    return lines[-1][:300] if lines else ""


def _tail(path: Path) -> list[str]:
    """The lines of the last 64 KiB of a file ([] when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            return f.read().decode(errors="replace").splitlines()
    except OSError:
        return []


def run_states(study_dir: str | Path) -> list[tuple[str, int, str, str]]:
    """(arm, seed, state, details) of every run of the study in ``study_dir``: finished, queued, running, failed
    (its job ended without finishing it: details its log's last line) or not started."""
    study_dir = Path(study_dir)
    spec = load_study(study_dir)
    records = {run: rec for run in jobs(spec) if (rec := read_job(study_dir, *run)) is not None}
    squeue: dict[str, str] | None = None
    if any(r["scheduler"] == "slurm" for r in records.values()):
        try:
            squeue = squeue_states()
        except RuntimeError as exc:
            print(f"study status: {exc}; Slurm jobs are shown as ended", flush=True)
    out = []
    for arm, seed in jobs(spec):
        st, rec = read_status(study_dir, arm, seed), records.get((arm, seed))
        if st is not None:
            value = st.get("final", {}).get(spec.metric)
            metric = f"{spec.metric} {value:.4g}, " if isinstance(value, (int, float)) else ""
            out.append((arm, seed, "finished", f"{metric}{st['steps']} steps"))
            continue
        if rec is None:
            started = log_path(study_dir, arm, seed).is_file()
            out.append((arm, seed, "failed" if started else "not started", last_line(log_path(study_dir, arm, seed))))
            continue
        job = f"{'pid' if rec['scheduler'] == 'process' else 'job'} {rec['job_id']}"
        state = job_state(rec, study_dir, squeue)
        if state == "running":
            step = last_step(run_dir_of(study_dir, arm, seed))
            out.append((arm, seed, "running" + (f" at step {step}" if step is not None else ""), job))
        elif state == "queued":
            out.append((arm, seed, "queued", job))
        else:
            line = last_line(log_path(study_dir, arm, seed)) or _job_error(study_dir, rec)
            out.append((arm, seed, "failed", f"{job}: {line}"))
    return out


def _job_error(study_dir: Path, record: dict[str, Any]) -> str:
    """Why a job whose worker wrote nothing ended: the last line of a Slurm job's own error log, if any."""
    err = Path(study_dir) / "slurm" / f"{record['job_id']}_0_log.err"
    line = last_line(err) if record["scheduler"] == "slurm" else ""
    return (
        f"{line} (slurm/{err.name})"
        if line
        else "its worker wrote nothing (cancelled while queued, or the job failed before starting it)"
    )


def cancel_study(study_dir: str | Path) -> list[str]:
    """Cancel (scancel) the study's Slurm jobs that are queued or running; their ids. A cancelled run keeps its
    checkpoints (the trainer checkpoints on Slurm's SIGTERM): a rerun of the study resubmits it and it resumes."""
    study_dir = Path(study_dir)
    spec = load_study(study_dir)
    active = active_jobs(study_dir, [run for run in jobs(spec) if read_status(study_dir, *run) is None], True)
    ids = [rec["job_id"] for rec in active.values() if rec["scheduler"] == "slurm"]
    for i, job_id in enumerate(ids):
        try:
            _submitit().SlurmJob(folder=study_dir / "slurm", job_id=job_id).cancel(check=True)
        except subprocess.CalledProcessError as exc:
            done = f"jobs {', '.join(ids[:i])} were cancelled" if i else "no job was cancelled"
            raise ValueError(
                f"scancel {job_id} failed (exit status {exc.returncode}); {done}: run study cancel again"
            ) from None
    return ids
