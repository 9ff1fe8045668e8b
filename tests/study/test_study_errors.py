"""Bad inputs of studies (diffcurr_fast/study/): duplicate study spec keys and an arm's set given as a string
(spec.py), the cluster plot of a cluster no seed trained and the grids of runs that drew none (report.py), a study
folder that cannot be written, Ctrl-C during a study and its progress bar (runner.py). docs/errors.md lists what
each input gets."""

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import yaml
from conftest import _main


def test_duplicate_study_spec_keys_are_refused(tmp_path):
    from diffcurr_fast.study.spec import load_spec

    (tmp_path / "s.yaml").write_text("name: a\nseeds: [0, 1]\nname: b\n")
    with pytest.raises(ValueError, match=r"study spec .* sets a key more than once .*'name' at lines 1, 3"):
        load_spec(tmp_path / "s.yaml")


def test_study_cluster_plot_of_an_untrained_cluster_warns_nothing(tmp_path):
    import warnings

    from diffcurr_fast.study.report import plot_cluster_loss
    from diffcurr_fast.study.runner import run_dir_of
    from diffcurr_fast.study.spec import spec_from_dict

    spec = spec_from_dict(
        {"name": "s", "seeds": [0, 1], "metric": "fd", "reference": "a", "eval_every": 1, "arms": [{"name": "a"}]}
    )
    for seed, losses in ((0, [0.5, None, 0.25]), (1, [0.7, None, 0.35])):  # cluster 1 never unlocked
        rd = run_dir_of(tmp_path, "a", seed)
        rd.mkdir(parents=True)
        (rd / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.4, "cluster_loss": losses}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" was one
        plot_cluster_loss(spec, tmp_path, tmp_path / "c.png")
    assert (tmp_path / "c.png").is_file()


SPEC = {"name": "tiny", "seeds": [0], "eval_every": 1, "arms": [{"name": "a"}, {"name": "b"}]}


def _spec_file(tmp_path, data=SPEC):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(data))
    return str(tmp_path / "spec.yaml")


class _Worker:
    """A study worker that finishes at once: it writes its run's status file, as a finished run does."""

    def __init__(self, cmd, **kwargs):
        from diffcurr_fast._files import write_json
        from diffcurr_fast.study.runner import status_path

        study_dir, arm, seed = cmd[3], cmd[4], int(cmd[5])
        status = {"arm": arm, "seed": seed, "kind": "train", "steps": 1, "train_flops": 1.0, "wall_s": 0.0}
        evals = [{"step": 1, "eval": True, "fd": 1.0}]
        write_json({**status, "final": evals[0], "evals": evals}, status_path(study_dir, arm, seed))
        self.returncode, self.pid = 0, -1  # no process: its job record names none that lives

    def poll(self):
        return 0

    def terminate(self):
        pass

    def wait(self):
        return 0


@pytest.fixture
def no_features(monkeypatch):
    from diffcurr_fast.study import runner

    monkeypatch.setattr(runner, "_prepare_features", lambda spec: None)  # the digits classifier is not needed


@pytest.mark.parametrize("where", ["arm", "spec"])
def test_study_set_given_as_a_string_names_the_arm(tmp_path, capsys, where):
    from diffcurr_fast.study.spec import spec_from_dict

    arms = [{"name": "fast", "set": "optim.lr=1e-3"}] if where == "arm" else [{"name": "fast"}]
    data = {**SPEC, "arms": arms, **({"set": "optim.lr=1e-3"} if where == "spec" else {})}
    rc, err = _main(capsys, "study", _spec_file(tmp_path, data), "--out", str(tmp_path / "s"))
    named = "arm 'fast': set" if where == "arm" else "spec.yaml: set"
    assert rc == 2 and f"{named} must be a list of section.field=value overrides" in err, err
    assert "e.g. set: [optim.lr=1e-3], got 'optim.lr=1e-3'" in err and len(err.strip().splitlines()) == 1, err
    with pytest.raises(ValueError, match=r"^spec: arm 'fast': set must be a list .* got \{'optim.lr': 0.001\}$"):
        spec_from_dict({**SPEC, "arms": [{"name": "fast", "set": {"optim.lr": 1e-3}}]})
    assert not (tmp_path / "s").exists()


@pytest.mark.parametrize(
    "arm, match",
    [
        (
            {"tune": [{"optim.lr": [1e-4, 2e-4]}]},
            r"tune must map config keys to lists of values, .* got \[\{'optim.lr'",
        ),
        ({"tune": "optim.lr"}, r"tune must map config keys to lists of values, e.g. tune: .* got 'optim.lr'$"),
    ],
    ids=["list", "key"],
)
def test_study_tune_grid_that_cannot_be_one_is_named(tmp_path, capsys, arm, match):
    """An arm's tune written as a list (a TypeError) or as a bare key ("dictionary update sequence element #0 has
    length 1"): one line naming the arm, before anything runs."""
    import re

    data = {**SPEC, "set": ["engine.max_steps=2"], "tuning": {"budget": 2}, "arms": [{"name": "fast", **arm}]}
    rc, err = _main(capsys, "study", _spec_file(tmp_path, data), "--out", str(tmp_path / "s"))
    assert rc == 2 and "spec.yaml: arm 'fast': " in err and re.search(match, err.strip()), err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "s").exists()


def test_study_arm_that_fixes_and_tunes_a_key_says_which_value_is_used(tmp_path):
    """A spec file whose arm fixes optim.lr in set and tunes it (the fixed value was never used, unsaid) gets a
    warning naming both (the shipped presets do it on purpose: the official recipe's overrides, its rate tuned)."""
    from diffcurr_fast.study.spec import load_spec

    arm = {"name": "fast", "set": ["optim.lr=1e-3"], "tune": {"optim.lr": [1e-4, 2e-4]}}
    path = _spec_file(tmp_path, {**SPEC, "tuning": {"budget": 2}, "arms": [arm]})
    with pytest.warns(UserWarning) as caught:
        load_spec(path)
    assert [str(w.message) for w in caught] == [
        f"study spec '{path}': arm 'fast': set fixes optim.lr=1e-3 but tune tries [0.0001, 0.0002]: each trial and "
        "the picked value replace the fixed one, which is not used"
    ]


def test_study_unwritable_folder_is_refused_before_any_run(tmp_path, capsys, monkeypatch):
    from diffcurr_fast import _files
    from diffcurr_fast.study import runner

    def no_run(*args, **kwargs):
        raise AssertionError("a run started before the study folder was checked")

    monkeypatch.setattr(runner, "_prepare_features", no_run)
    monkeypatch.setattr(runner.subprocess, "Popen", no_run)
    (tmp_path / "notes.txt").write_text("mine")
    spec = _spec_file(tmp_path)
    rc, err = _main(capsys, "study", spec, "--out", str(tmp_path / "notes.txt" / "s"))
    assert rc == 2 and f"study folder '{tmp_path / 'notes.txt' / 's'}' cannot be created" in err, err
    assert "is a file, not a directory; choose another study folder (--out)" in err, err

    def refuse(*args, **kwargs):  # a read-only folder (the tests run as root, which permissions do not stop)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_files.tempfile, "mkdtemp", refuse)
    rc, err = _main(capsys, "study", spec, "--out", str(tmp_path / "ro"))
    assert rc == 2 and "refuses new files (Permission denied); choose another study folder (--out)" in err, err
    assert not (tmp_path / "ro").exists()


def test_study_ctrl_c_stops_the_workers_in_one_line_and_the_rerun_resumes(tmp_path, capsys, monkeypatch, no_features):
    from diffcurr_fast.study import runner
    from diffcurr_fast.study.spec import load_study

    started, popen = [], subprocess.Popen

    def sleeper(cmd, **kwargs):  # a worker that runs until it is stopped
        started.append(popen([sys.executable, "-c", "import time; time.sleep(60)"], **kwargs))
        return started[-1]

    def ctrl_c(seconds):  # Ctrl-C in the parent while both workers run
        raise KeyboardInterrupt

    out = tmp_path / "s"
    with monkeypatch.context() as m:
        m.setattr(runner.subprocess, "Popen", sleeper)
        m.setattr(runner, "time", types.SimpleNamespace(sleep=ctrl_c))
        rc, err = _main(capsys, "study", _spec_file(tmp_path), "--out", str(out), "--workers", "2", "--no-report")
    assert rc == 130 and len(started) == 2, err
    assert err.strip().splitlines()[-1] == (  # the lines above: the progress bar
        "diffcurr-fast study: interrupted (Ctrl-C); the runs under way were stopped (a training run checkpoints "
        "first): rerun the same command to resume them"
    )
    assert "Traceback" not in err
    assert [p.poll() for p in started] == [-15, -15]  # both workers stopped (SIGTERM), none left running
    assert not (out / "status").exists() or not list((out / "status").iterdir())  # no run counted as finished
    spec = load_study(out)
    monkeypatch.setattr(runner.subprocess, "Popen", _Worker)
    assert runner.run_study(spec, out, verbose=False) == {"ran": [("a", 0), ("b", 0)], "failed": [], "kept": 0}


def test_study_spec_interrupted_while_written_is_not_left_half_written(tmp_path, monkeypatch):
    from diffcurr_fast.study.runner import prepare_study
    from diffcurr_fast.study.spec import load_study, spec_from_dict

    spec, write_text = spec_from_dict(SPEC), Path.write_text

    def half_then_ctrl_c(self, text, *args, **kwargs):
        write_text(self, text[: len(text) // 2])
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(Path, "write_text", half_then_ctrl_c)
        with pytest.raises(KeyboardInterrupt):
            prepare_study(spec, tmp_path / "s")
    prepare_study(spec, tmp_path / "s")  # the rerun: no half spec that reads as another one
    assert load_study(tmp_path / "s").to_dict() == spec.to_dict()


def test_study_worker_interrupted_says_so_in_one_line(monkeypatch, capsys):
    from diffcurr_fast.study import runner
    from diffcurr_fast.train.interrupt import TrainingInterrupted

    def stopped(*args):
        raise TrainingInterrupted(2, 7, Path("runs/a/seed0/checkpoints/ckpt_00000007.pt"))

    monkeypatch.setattr(runner, "run_one", stopped)
    assert runner.main(["study", "a", "0"]) == 130
    out = capsys.readouterr().out
    assert out.strip() == (
        "study worker a seed 0: SIGINT received: stopped at step 7, checkpoint "
        "runs/a/seed0/checkpoints/ckpt_00000007.pt; rerun the study to resume it"
    )


@pytest.mark.parametrize(
    "given, line",
    [
        ({"slurm": {"gpus_per_node": 0}}, "spec.yaml: slurm.gpus_per_node must be an int >= 1 (each task of a job is"),
        (["--gpus-per-node", "0"], "the command line: slurm.gpus_per_node must be an int >= 1 (each task of a job"),
        (["--sbatch", "qos=high", "--sbatch", "nosuch=1"], "slurm.sbatch: submitit has no Slurm parameter 'nosuch';"),
        (["--sbatch", "time=60"], "slurm.sbatch.time: the study sets it; set slurm.time_min"),
        ({"slurm": {"sbatch": ["account=lab"]}}, "spec.yaml: slurm.sbatch must map submitit's Slurm parameters to"),
        ({"slurm": {"gpus": 8}}, "spec.yaml: unknown slurm keys ['gpus']; valid keys: nodes, gpus_per_node,"),
        ({"slurm": "gpu:8"}, "spec.yaml: slurm must be a mapping, e.g. slurm: {nodes: 1, gpus_per_node: 8}, got"),
        ({"slurm": {"partition": 3}}, "spec.yaml: slurm.partition must be a partition's name or null, got 3"),
        ({"launcher": "pbs"}, "spec.yaml: launcher 'pbs'; valid launchers: local, slurm"),
        (["--sbatch", "account"], "--sbatch 'account': give KEY=VALUE, e.g. --sbatch account=lab"),
        (["--sbatch", "additional_parameters=5"], "slurm settings refused by submitit: "),
    ],
)
def test_study_slurm_settings_are_refused_in_one_line_before_anything_is_submitted(
    tmp_path, capsys, fake_slurm, given, line
):
    data = {**SPEC, "launcher": "slurm", **(given if isinstance(given, dict) else {})}
    argv = [
        "study",
        _spec_file(tmp_path, data),
        "--out",
        str(tmp_path / "s"),
        *(given if isinstance(given, list) else []),
    ]
    rc, err = _main(capsys, *argv)
    assert rc == 2 and line in err and len(err.strip().splitlines()) == 1, err
    assert not (fake_slurm / "last").exists() and not (tmp_path / "s").exists()  # nothing submitted, nothing written


def test_study_on_slurm_without_slurm_or_submitit_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no srun
    rc, err = _main(capsys, "study", _spec_file(tmp_path), "--launcher", "slurm", "--out", str(tmp_path / "s"))
    assert (
        rc == 2
        and err.startswith('diffcurr-fast study: error: launcher slurm: Could not detect "srun"')
        and len(err.splitlines()) == 1
    ), err
    assert "run the study on a machine with Slurm's commands" in err and not (tmp_path / "s").exists()
    monkeypatch.setitem(sys.modules, "submitit", None)  # not installed
    rc, err = _main(capsys, "study", _spec_file(tmp_path), "--launcher", "slurm", "--out", str(tmp_path / "s"))
    assert rc == 2 and "launcher slurm needs the submitit package: pip install submitit" in err, err


def test_study_folder_the_compute_nodes_cannot_see_is_refused_before_any_run(tmp_path, capsys, fake_slurm, monkeypatch):
    """The fake's node sees the study folder empty (a disk of this machine only): the check job cannot read the check
    file, and the study stops in one line before any run is submitted."""
    from diffcurr_fast.study import launch

    if subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True).returncode:
        pytest.skip("unshare (user and mount namespaces) is not allowed here: the fake node cannot hide a folder")
    out = tmp_path / "s"
    monkeypatch.setenv("FAKE_SLURM_HIDE", str(out))
    monkeypatch.setattr(launch, "SQUEUE_EVERY_S", 0.2)  # the failed check job leaves no result: squeue sees it end
    rc, err = _main(capsys, "study", _spec_file(tmp_path), "--launcher", "slurm", "--out", str(out))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"the compute nodes do not see the study folder '{out}': check job 101 ended without reading" in err, err
    assert "put the study folder on a disk the nodes share (--out)" in err
    assert (fake_slurm / "last").read_text().strip() == "101" and (fake_slurm / "101.state").read_text() == "FAILED\n"
    assert sorted(p.name for p in (out / "jobs").iterdir()) == ["folder_check"]  # no run submitted


def test_study_refuses_runs_that_another_launcher_or_study_process_runs(tmp_path, fake_slurm, no_features, monkeypatch):
    """A rerun neither starts a run whose Slurm job is still queued or running (unless it follows it on Slurm) nor
    one that another study process of this host runs; a Slurm study that cannot ask squeue submits nothing."""
    from diffcurr_fast.study import launch, runner
    from diffcurr_fast.study.spec import spec_from_dict

    spec, out = spec_from_dict(SPEC), tmp_path / "s"
    runner.prepare_study(spec, out)
    (fake_slurm / "555.state").write_text("RUNNING\n")  # b's job, submitted by an earlier sitting
    launch.write_job(out, "b", 0, "slurm", "555")
    with pytest.raises(ValueError, match=r"^1 runs of '.*' have Slurm jobs queued or running \(555\): follow them "):
        runner.run_study(spec, out, verbose=False)
    (fake_slurm / "555.state").write_text("FAILED\n")
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(out.absolute())])
    try:  # a worker of another study process of this host (its command line names the study folder)
        launch.write_job(out, "a", 0, "process", str(other.pid))
        with pytest.raises(ValueError, match=r"^run a seed 0 of '.*' is running in another study process \(pid "):
            runner.run_study(spec, out, verbose=False)
    finally:
        other.kill()
        other.wait()
    launch.write_job(out, "a", 0, "slurm", "556")

    def busy():
        raise RuntimeError("squeue failed: slurm_load_jobs error: Socket timed out on send/recv operation")

    monkeypatch.setattr(launch, "squeue_states", busy)
    with pytest.raises(ValueError, match=r"^squeue failed: .*: cannot tell which of the study's jobs are queued"):
        runner.run_study(spec, out, verbose=False, launcher="slurm")
    assert (fake_slurm / "last").exists() is False  # nothing submitted


def test_study_cancel_that_scancel_refuses_says_so_in_one_line(tmp_path, capsys, fake_slurm, monkeypatch):
    from diffcurr_fast.study import launch, runner
    from diffcurr_fast.study.spec import spec_from_dict

    out, bin_dir = tmp_path / "s", tmp_path / "bin"
    runner.prepare_study(spec_from_dict(SPEC), out)
    (fake_slurm / "555.state").write_text("RUNNING\n")
    launch.write_job(out, "a", 0, "slurm", "555")
    bin_dir.mkdir()
    (bin_dir / "scancel").write_text("#!/bin/sh\necho 'scancel: error: Access/permission denied' >&2\nexit 1\n")
    (bin_dir / "scancel").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    rc, err = _main(capsys, "study", "cancel", str(out))
    line = "scancel 555 failed (exit status 1); no job was cancelled: run study cancel again"
    assert rc == 2 and err == f"diffcurr-fast study: error: {line}\n", err


def test_a_job_on_a_node_that_sees_another_study_folder_stops_in_one_line(tmp_path):
    from diffcurr_fast.study.launch import read_check

    check = tmp_path / "jobs" / "folder_check"
    with pytest.raises(
        ValueError, match=r"does not see the study folder's check file .* as it was written when the job"
    ):
        read_check(str(check), "/shared/s 1234")  # no such file on this node
    check.parent.mkdir()
    check.write_text("/shared/s 9999")  # another copy of the folder at the same path
    with pytest.raises(ValueError, match=r"the study folder is not shared with this node; put it on a disk the nodes"):
        read_check(str(check), "/shared/s 1234")
    read_check(str(check), "/shared/s 9999")


def test_study_shows_its_progress_with_an_eta(tmp_path, capsys, monkeypatch, no_features):
    from diffcurr_fast.study import runner
    from diffcurr_fast.study.spec import spec_from_dict

    spec = spec_from_dict(SPEC)
    runner.prepare_study(spec, tmp_path)
    _Worker(["python", "-m", "runner", str(tmp_path), "a", "0"])  # one run finished before: kept
    monkeypatch.setattr(runner.subprocess, "Popen", _Worker)
    assert runner.run_study(spec, tmp_path)["ran"] == [("b", 0)]
    captured = capsys.readouterr()
    assert "  start b seed 0" in captured.out and "  done  b seed 0: fd 1, 0 s" in captured.out  # as before
    bar = captured.err.replace("\r", "\n")
    assert "study tiny:  50%" in bar and "1/2 [" in bar and "study tiny: 100%" in bar and "2/2 [" in bar, bar
    assert "<" in bar and ("run/s" in bar or "s/run" in bar), bar  # elapsed<remaining (the ETA), the rate


def test_study_report_says_why_finished_runs_have_no_grid(tmp_path):
    from diffcurr_fast.study.report import write_report
    from diffcurr_fast.study.runner import prepare_study, run_dir_of
    from diffcurr_fast.study.spec import spec_from_dict

    data = {
        **SPEC,
        "set": ["logging.num_samples=0"],
        "arms": [{"name": "nogrid"}, {"name": "lost", "set": ["logging.num_samples=8"]}, {"name": "gone"}],
        "reference": "nogrid",
    }
    prepare_study(spec_from_dict(data), tmp_path)
    for arm in ("nogrid", "lost", "gone"):
        _Worker(["python", "-m", "runner", str(tmp_path), arm, "0"])
        if arm != "gone":  # the run folder of 'gone' was not carried along
            run_dir_of(tmp_path, arm, 0).mkdir(parents=True)
    text = write_report(tmp_path)["report"].read_text()
    assert "No grid for nogrid: its runs finished without drawing one, since logging.num_samples is 0" in text
    assert "No grid for lost: its finished runs wrote no samples.png (see logs/lost-seed0.log)" in text
    assert "No grid for gone: no finished run directory of theirs was here" in text


LONG = {  # tiny runs, so that a refusal that failed would cost seconds
    "name": "l",
    "set": [
        "model.hidden_size=32",
        "model.depth=1",
        "model.num_heads=2",
        "engine.max_steps=4",
        "logging.progress=false",
    ],
    "seeds": [0],
    "eval_every": 4,
    "reference": "ref",
    "arms": [{"name": "ref"}, {"name": "fast"}],
    "speedrun": {"official_arm": "ref"},
    "long_reference": {"folder": "../long", "factor": 4},
}


@pytest.mark.parametrize(
    "change, match",
    [
        ({"speedrun": None}, "long_reference trains the official arm of a speedrun; the spec has no speedrun"),
        ({"long_reference": {"folder": "../l", "factor": 1}}, r"long_reference.factor must be an int >= 2 .*got 1"),
        ({"long_reference": {"folder": "../l", "steps": 9}}, r"unknown long_reference keys \['steps'\]"),
        ({"long_reference": {"factor": 8}}, "long_reference.folder must name a study folder, got None"),
        ({"long_reference": {"folder": "../l", "set": "optim.lr=1"}}, "long_reference: set must be a list of"),
        ({"long_reference": "../l"}, "long_reference must be a mapping"),
    ],
)
def test_bad_long_reference_is_refused_in_one_line(change, match):
    from diffcurr_fast.study.spec import spec_from_dict

    with pytest.raises(ValueError, match=match):
        spec_from_dict({**LONG, **change})


def test_long_reference_folder_of_other_settings_is_refused_before_any_run(tmp_path, capsys):
    """A study names a long reference folder that holds another reference's runs (other evaluations), or lacks some
    of its seeds: one line that names what differs, before any run starts."""
    from diffcurr_fast.study.long_reference import long_spec
    from diffcurr_fast.study.runner import prepare_study
    from diffcurr_fast.study.spec import spec_from_dict

    other = spec_from_dict({**LONG, "eval": {"num_samples": 16}})
    prepare_study(long_spec(other, tmp_path / "a"), tmp_path / "long")
    rc, err = _main(
        capsys, "study", _spec_file(tmp_path, {**LONG, "eval": {"num_samples": 32}}), "--out", str(tmp_path / "b")
    )
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "long reference folder" in err and "holds another reference (eval.num_samples 16 there, 32 here)" in err
    assert not (tmp_path / "b").exists()
    rc, err = _main(
        capsys,
        "study",
        _spec_file(tmp_path, {**LONG, "eval": {"num_samples": 16}, "seeds": [0, 1]}),
        "--out",
        str(tmp_path / "b"),
    )
    assert rc == 2 and "has seeds [0], not this study's [1]; name another long_reference.folder" in err, err


def test_long_reference_set_with_a_typo_is_refused_before_any_run(tmp_path, capsys):
    data = {**LONG, "long_reference": {"folder": "../long", "set": ["optim.ema_decy=0.9"]}}
    rc, err = _main(capsys, "study", _spec_file(tmp_path, data), "--out", str(tmp_path / "b"))
    assert rc == 2 and "long_reference.set: study 'l', arm 'ref': unknown config key 'optim.ema_decy'" in err, err
    assert not (tmp_path / "b").exists()
