"""Bad inputs of studies (diffcurr_fast/study/): duplicate study spec keys and an arm's set given as a string
(spec.py), the cluster plot of a cluster no seed trained and the grids of runs that drew none (report.py), a study
folder that cannot be written, Ctrl-C during a study and its progress bar (runner.py). docs/errors.md lists what
each input gets."""

import json
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
        self.returncode = 0

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
