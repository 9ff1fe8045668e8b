"""A study launched through submitit (diffcurr_fast/study/launch.py): its LocalExecutor and a fake Slurm
(tests/study/fake_slurm/) run the same tiny study as the local launcher and give the same report; the Slurm path's
job ids, follow-up of queued jobs, status, cancel, and the resume of a preempted or cancelled job."""

import csv
import io
import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import yaml
from conftest import TINY_SETS, _main

from diffcurr_fast.study import launch
from diffcurr_fast.study.layout import read_status, run_dir_of
from diffcurr_fast.study.report import write_report
from diffcurr_fast.study.runner import run_study
from diffcurr_fast.study.spec import spec_from_dict

SPEC = {
    "name": "tiny",
    "set": [
        *TINY_SETS,
        "engine.max_steps=80",
        "checkpoint.every=4",
        "checkpoint.export_ema=false",
        "optim.warmup_steps=2",
        "optim.schedule=constant",
        "logging.log_every=4",
        "curriculum.patience=1",
        "curriculum.eval_every=2",
        "curriculum.pacing=none",
    ],
    "seeds": [0],
    "reference": "vanilla",
    "eval_every": 40,
    "eval": {"num_samples": 16, "steps": 3},
    "arms": [{"name": "vanilla"}, {"name": "cl", "set": ["curriculum.pacing=patience", "curriculum.method=snr"]}],
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """The digits classifier's cache, shared by the studies of this file (and their jobs, which inherit it)."""
    with pytest.MonkeyPatch.context() as m:
        m.setenv("DIFFCURR_FAST_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        yield


@pytest.fixture(scope="module")
def local_study(cache, tmp_path_factory):
    """The study run by the local launcher (one thread per run, as every study of this file), with its report."""
    out = tmp_path_factory.mktemp("local") / "study"
    assert run_study(spec_from_dict(SPEC), out, workers=2, threads=1, verbose=False)["failed"] == []
    write_report(out)
    return out


def _report(study_dir):
    """results.csv without its clock column and report.md without its wall-time column: what two launchers of the
    same runs must agree on."""
    rows = list(csv.DictReader(io.StringIO((study_dir / "results.csv").read_text())))
    lines = (study_dir / "report.md").read_text().splitlines()
    wall = ("| arm | seeds", "| vanilla | 1", "| cl | 1")  # the final-metrics table, whose last column is wall time
    table = [line.rsplit("|", 2)[0] if line.startswith(wall) else line for line in lines]
    return [{k: v for k, v in r.items() if k != "train_s"} for r in rows], table


def _weights(run_dir):
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint

    state = load_checkpoint(latest_checkpoint(run_dir), map_location="cpu")
    return state["model"], state["ema"]["module"], state["world_size"]


def _same_weights(a, b):
    return all(x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x) for x, y in zip(a[:2], b[:2]))


def test_study_help_lists_the_launcher_options_without_importing_submitit():
    code = (
        "import sys\nfrom diffcurr_fast.cli import main\ntry:\n    main(['study', '--help'])\nexcept SystemExit:\n"
        "    pass\nassert 'torch' not in sys.modules and 'submitit' not in sys.modules, 'imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    for option in ("--launcher {local,slurm}", "--nodes N", "--gpus-per-node G", "--cpus-per-gpu C", "--partition P"):
        assert option in text, option
    assert "--time-min M" in text and "--sbatch KEY=VALUE" in text and "'status' / 'cancel'" in text, text


@pytest.mark.slow
def test_submitit_local_executor_gives_the_local_launchers_report(local_study, tmp_path):
    """submitit's LocalExecutor (real processes, the same jobs as on Slurm) runs the study: the folder check, one job
    per run (its id kept in jobs/), the same weights and the same report as the local launcher."""
    out = tmp_path / "study"
    res = run_study(spec_from_dict(SPEC), out, workers=2, threads=1, verbose=False, launcher="slurm", cluster="local")
    assert sorted(res["ran"]) == [("cl", 0), ("vanilla", 0)] and res["failed"] == [] and res["kept"] == 0
    assert (out / "jobs" / "folder_seen").read_text().split("\n")[0] == (out / "jobs" / "folder_check").read_text()
    for arm in ("vanilla", "cl"):
        record = json.loads((out / "jobs" / f"{arm}-seed0.json").read_text())
        assert record["scheduler"] == "process" and (out / "slurm" / f"{record['job_id']}_0_log.out").is_file()
        assert _same_weights(_weights(run_dir_of(out, arm, 0)), _weights(run_dir_of(local_study, arm, 0)))
    write_report(out)
    assert _report(out) == _report(local_study)


@pytest.mark.slow
def test_a_job_of_two_gpus_runs_its_run_as_two_ranks(cache, tmp_path):
    """slurm.gpus_per_node 2: the job's two tasks are the two ranks of one data-parallel run (gloo here)."""
    data = {
        **SPEC,
        "arms": [SPEC["arms"][0]],
        "set": [*SPEC["set"], "engine.max_steps=8"],
        "slurm": {"gpus_per_node": 2},
    }
    out = tmp_path / "study"
    res = run_study(spec_from_dict(data), out, threads=1, verbose=False, launcher="slurm", cluster="local")
    assert res["failed"] == [], (out / "logs" / "vanilla-seed0.log").read_text()[-2000:]
    assert _weights(run_dir_of(out, "vanilla", 0))[2] == 2 and read_status(out, "vanilla", 0)["steps"] == 8


def _wait(condition, what, timeout=120):
    deadline = time.time() + timeout
    while not condition():
        assert time.time() < deadline, f"waited {timeout} s for {what}"
        time.sleep(0.05)


def _checkpointed(out, arm):
    ckpts = run_dir_of(out, arm, 0) / "checkpoints"
    return ckpts.is_dir() and any(p.suffix == ".pt" for p in ckpts.iterdir())


def _status(capsys, out):
    """The output of ``study status OUT``."""
    from diffcurr_fast import cli

    capsys.readouterr()
    assert cli.main(["study", "status", str(out)]) == 0
    return capsys.readouterr().out


def _squeue_calls(fake_slurm):
    log = fake_slurm / "squeue.log"
    return len(log.read_text().splitlines()) if log.is_file() else 0


def _job_id(out, arm):
    return json.loads((out / "jobs" / f"{arm}-seed0.json").read_text())["job_id"]


@pytest.mark.slow
def test_fake_slurm_submits_follows_cancels_and_resumes(local_study, fake_slurm, tmp_path, capsys, monkeypatch):
    """On a fake Slurm: a study submits a job per run (ids in jobs/); a job signalled mid-run as before its time
    limit (USR2) is checkpointed, requeued by submitit and resumes; an interrupted study leaves its jobs queued and a
    rerun follows them instead of submitting them again; status and cancel; the rerun after a cancel resubmits only
    the unfinished run, which resumes from its checkpoint. Every run ends with the local launcher's weights, and the
    report is its report."""
    spec_file, out = tmp_path / "spec.yaml", tmp_path / "study"
    spec_file.write_text(yaml.safe_dump(SPEC))
    (fake_slurm / "hold").write_text("cl-seed0\n")  # cl stays queued
    cmd = [sys.executable, "-m", "diffcurr_fast.cli", "study", str(spec_file), "--launcher", "slurm"]
    cmd += ["--out", str(out), "--threads", "1", "--no-report"]
    # SIGINT as in a terminal, also when the tests run in the background (which ignores it, and children inherit that)
    default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
    driver = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        _wait(lambda: _checkpointed(out, "vanilla"), "vanilla's first checkpoint")
        vanilla = _job_id(out, "vanilla")
        subprocess.run(["scancel", "--signal", "USR2", vanilla], check=True)  # what Slurm sends before the limit
        _wait(lambda: read_status(out, "vanilla", 0) is not None, "vanilla's end")
        driver.send_signal(signal.SIGINT)  # Ctrl-C: the study stops following its jobs; they go on
        stdout, stderr = driver.communicate(timeout=60)
    finally:
        driver.kill()
    assert driver.returncode == 130 and "the submitted jobs go on" in stderr.strip().splitlines()[-1], stderr
    assert "start vanilla seed 0 (job 102)" in stdout and "start cl seed 0 (job 103)" in stdout, stdout
    assert (fake_slurm / "last").read_text().strip() == "103"  # the folder check, vanilla, cl
    assert read_status(out, "vanilla", 0)["resumed"] is True  # requeued by submitit after its checkpoint
    _wait(lambda: (fake_slurm / "102.state").read_text() == "COMPLETED\n", "vanilla's job to end")
    text = _status(capsys, out)
    assert "2 runs: 1 finished, 0 running, 1 queued, 0 failed, 0 not started" in text, text
    assert "vanilla seed 0  finished (fd " in text and "cl seed 0       queued (job 103)" in text, text

    # the rerun follows cl's queued job; released, cl runs, and study cancel stops it mid-run
    asked = _squeue_calls(fake_slurm)

    def release_then_cancel():
        try:
            _wait(lambda: _squeue_calls(fake_slurm) > asked, "the rerun's look at the queue")
            (fake_slurm / "hold").unlink()
            _wait(lambda: _checkpointed(out, "cl"), "cl's first checkpoint")
            states.append(launch.run_states(out))
            cancelled.extend(launch.cancel_study(out))
        except BaseException as exc:  # the study in the main thread must end all the same
            errors.append(exc)
            (fake_slurm / "hold").unlink(missing_ok=True)
            launch.cancel_study(out)

    monkeypatch.setattr(launch, "SQUEUE_EVERY_S", 0.5)  # the cancelled job's end is seen sooner
    states, cancelled, errors = [], [], []
    helper = threading.Thread(target=release_then_cancel)
    helper.start()
    res = run_study(spec_from_dict({**SPEC, "launcher": "slurm"}), out, threads=1, verbose=False)
    helper.join()
    if errors:
        raise errors[0]
    assert res == {"ran": [], "failed": [("cl", 0)], "kept": 1} and cancelled == ["103"]
    assert (fake_slurm / "last").read_text().strip() == "103"  # nothing submitted again
    assert states[0][1][:2] == ("cl", 0) and states[0][1][2].startswith("running at step "), states
    text = _status(capsys, out)
    assert "cl seed 0       failed: job 103: study worker cl seed 0: SIGTERM received: stopped at step" in text
    assert "rerun the study to resume it" in text, text

    # the rerun submits cl again, alone; it resumes from the checkpoint written when it was cancelled
    rc, err = _main(capsys, "study", str(spec_file), "--launcher", "slurm", "--out", str(out), "--threads", "1")
    assert rc == 0, err
    assert (fake_slurm / "last").read_text().strip() == "104" and _job_id(out, "cl") == "104"
    assert _job_id(out, "vanilla") == vanilla and read_status(out, "cl", 0)["resumed"] is True
    for arm in ("vanilla", "cl"):
        assert _same_weights(_weights(run_dir_of(out, arm, 0)), _weights(run_dir_of(local_study, arm, 0))), arm
    assert _report(out) == _report(local_study)
