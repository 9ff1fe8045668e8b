"""The bookkeeping of a speedrun's step times (study/step_time.py) without a facebookresearch/DiT checkout: our
arms and a stand-in official step timed on a hand-set clock, the medians and percentiles by hand, the peer's
arguments taken from the official arm's config, the checkout's name and commit, the documented default of 3 rounds
of 20 timed steps, and the worker's command line (``STUDY_DIR PEER|- [THREADS]``) and the JSON it writes."""

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import TINY_SETS, tiny

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.study import step_time
from diffcurr_fast.study.spec import SPEC_FILE, arm_config, load_study, spec_from_dict
from diffcurr_fast.study.step_time import OFFICIAL_CODE, STEP_TIME_FILE, measure_step_times

GIT_ID = ["-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]


def _git_repo(root: Path, commit: bool = True) -> Path:
    root.mkdir(parents=True)
    subprocess.run(["git", "init", "-q", str(root)], check=True)
    if commit:
        subprocess.run(["git", *GIT_ID, "-C", str(root), "commit", "-q", "--allow-empty", "-m", "x"], check=True)
    return root


def _head_commit(repo: Path) -> str:
    """The commit HEAD names, read from the repository's files (not through git rev-parse)."""
    ref = (repo / ".git" / "HEAD").read_text().split("ref:")[-1].strip()
    return (repo / ".git" / ref).read_text().strip()


class _Clock:
    """A hand-set ``time.perf_counter``: each stand-in step advances it by its next duration."""

    def __init__(self, durations: dict[str, list[float]]):
        self.now, self.left = 0.0, {n: iter(d) for n, d in durations.items()}
        self.calls: list[tuple[str, object]] = []

    def step(self, name: str):
        def run(x, y):
            self.calls.append((name, x))
            self.now += next(self.left[name])

        return run


def _stand_in_trainer(clock: _Clock, made: list):
    """A ``Trainer`` stand-in: its loader yields numbered batches named by its arm (its run folder's name), its
    ``train_step`` advances the clock."""

    class Trainer:
        def __init__(self, cfg):
            self.run_dir = Path(cfg.checkpoint.run_dir)
            name = self.run_dir.name
            self.loader = iter((f"{name}-x{k}", f"{name}-y{k}") for k in range(100))
            self.train_step = clock.step(name)
            made.append(self)

    return Trainer


# a: 1, 2, 3, 4, 5, 9 (median 3.5; 20th percentile at position 0.2 x 5 = 1: 2, 80th at 4: 5); b: 2, 2, 2, 6, 6, 7
# (median 4, percentiles 2 and 6); the official code: 6, 6, 7, 7, 8, 8 (median 7, percentiles 6 and 8). Warm-up
# calls take 100 s and must not count.
DURATIONS = {
    "a": [100, 1, 5, 2, 100, 4, 3, 9],
    "b": [100, 2, 2, 2, 100, 6, 6, 7],
    OFFICIAL_CODE: [100, 8, 6, 7, 100, 7, 8, 6],
}


def _peer_stand_in(monkeypatch, got: list):
    def official_step(path, **kw):
        got.append({"path": path, **kw})
        return step_stand_in[0], {"model": None, "timm_stubbed": True}

    step_stand_in = [None]
    monkeypatch.setattr(step_time, "official_step", official_step)
    return step_stand_in


def test_with_a_peer_every_step_is_timed_side_by_side_and_the_json_names_the_checkout(tmp_path, monkeypatch):
    """Two arms and the official step, two rounds of (one warm-up, three timed) calls on a hand-set clock: each
    arm's median, the official median apart, the official arm's median as ours_s, and the checkout's folder name,
    commit and timm flag."""
    clock, made, got = _Clock(DURATIONS), [], []
    peer = _git_repo(tmp_path / "DiT")
    _peer_stand_in(monkeypatch, got)[0] = clock.step(OFFICIAL_CODE)
    monkeypatch.setattr(step_time, "Trainer", _stand_in_trainer(clock, made))
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    cfgs = {
        "a": tiny(tmp_path / "ra", "engine.cpu_threads=1", "engine.seed=3", "optim.ema_decay=0.9"),
        "b": tiny(tmp_path / "rb", "engine.cpu_threads=1", "engine.seed=7", "optim.ema_decay=0.95"),
    }
    res = measure_step_times(cfgs, str(peer), "b", rounds=2, reps=3, warmup=1)
    assert res == {
        "arms": {"a": 3.5, "b": 4.0},
        "arms_p20_p80": {"a": [2.0, 5.0], "b": [2.0, 6.0], OFFICIAL_CODE: [6.0, 8.0]},
        "ours_s": 4.0,
        "official_s": 7.0,
        "steps_each": 6,
        "batch": 16,
        "threads": 1,
        "checkout": "DiT",
        "commit": _head_commit(peer),
        "timm_stubbed": True,
    }
    m = cfgs["b"].model  # the official step is built at the official arm's model, seed and EMA decay
    assert got == [
        {
            "path": str(peer),
            "preset": "custom",
            "input_size": m.input_size,
            "in_channels": m.in_channels,
            "num_classes": m.num_classes,
            "seed": 7,
            "dims": {
                "patch_size": m.patch_size,
                "hidden_size": 32,
                "depth": 1,
                "num_heads": 2,
                "mlp_ratio": m.mlp_ratio,
                "class_dropout_prob": m.class_dropout_prob,
            },
            "ema_decay": 0.95,
        }
    ]
    # every step trains on the same batches, the first arm's loader's; the blocks alternate a, b, official
    assert {x for _, x in clock.calls} <= {f"a-x{k}" for k in range(100)} and len(clock.calls) == 24
    assert [n for n, _ in clock.calls] == [n for n in ["a", "b", OFFICIAL_CODE] * 2 for _ in range(4)]


def test_a_named_preset_peer_gets_no_custom_dims(tmp_path, monkeypatch):
    """With ``model.preset`` a DiT preset the official step is built from the preset alone (dims None)."""
    clock, made, got = _Clock({n: [0.0] * 4 for n in ("off", OFFICIAL_CODE)}), [], []
    _peer_stand_in(monkeypatch, got)[0] = clock.step(OFFICIAL_CODE)
    monkeypatch.setattr(step_time, "Trainer", _stand_in_trainer(clock, made))
    cfg = load_config(None, [f"checkpoint.run_dir={tmp_path / 'r'}", "model.preset=DiT-S/2", "engine.cpu_threads=1"])
    res = measure_step_times({"off": cfg}, str(_git_repo(tmp_path / "peer")), "off", rounds=1, reps=2, warmup=1)
    assert [(g["preset"], g["dims"]) for g in got] == [("DiT-S/2", None)]
    assert res["checkout"] == "peer" and res["steps_each"] == 2 and res["batch"] == 64


def test_each_arm_trains_in_its_own_scratch_folder_removed_afterwards(tmp_path, monkeypatch):
    """The trainers run in folders named after their arms inside one temporary folder, gone once measured; the
    arms' own run folders are left alone."""
    clock, made = _Clock({n: [0.0] * 2 for n in "ab"}), []
    monkeypatch.setattr(step_time, "Trainer", _stand_in_trainer(clock, made))
    cfgs = {n: tiny(tmp_path / "runs" / n, "engine.cpu_threads=1") for n in "ab"}
    measure_step_times(cfgs, None, "a", rounds=1, reps=1, warmup=1)
    dirs = [t.run_dir for t in made]
    assert [d.name for d in dirs] == ["a", "b"] and dirs[0].parent == dirs[1].parent
    assert not dirs[0].parent.exists() and not (tmp_path / "runs").exists()


def test_the_default_is_three_rounds_of_twenty_timed_steps(tmp_path, monkeypatch):
    """docs/study.md: alternating blocks of 20 steps, 3 rounds; 60 timed steps per arm."""
    clock, made = _Clock({"a": [1.0] * 1000}), []
    monkeypatch.setattr(step_time, "Trainer", _stand_in_trainer(clock, made))
    monkeypatch.setattr(time, "perf_counter", lambda: clock.now)
    res = measure_step_times({"a": tiny(tmp_path / "a", "engine.cpu_threads=1")}, None, "a")
    assert res["steps_each"] == 60 and res["arms"] == {"a": 1.0}


# ---- the checkout's commit ---------------------------------------------------------------------------------------


def test_the_commit_is_the_checked_out_one_and_empty_when_there_is_none(tmp_path):
    repo = _git_repo(tmp_path / "repo")
    assert step_time._git_commit(repo) == _head_commit(repo)
    assert step_time._git_commit(str(repo)) == _head_commit(repo)
    assert step_time._git_commit(_git_repo(tmp_path / "unborn", commit=False)) == ""  # git prints 'HEAD', fails
    (tmp_path / "plain").mkdir()
    assert step_time._git_commit(tmp_path / "plain") == ""
    assert step_time._git_commit(tmp_path / "missing") == ""


def test_without_git_or_with_a_hung_git_the_commit_is_empty(tmp_path, monkeypatch):
    """No git on PATH, or git past its time limit: '' (the report then names the checkout by its folder alone)."""
    repo = _git_repo(tmp_path / "repo")
    monkeypatch.setenv("PATH", str(tmp_path / "nothing"))
    assert step_time._git_commit(repo) == ""
    monkeypatch.undo()

    def hung(cmd, **kw):
        if kw.get("timeout") is None:
            pytest.fail("git run without a time limit would wait forever on a hung checkout")
        raise subprocess.TimeoutExpired(cmd, kw["timeout"])

    monkeypatch.setattr(subprocess, "run", hung)
    assert step_time._git_commit(repo) == ""


# ---- the worker's command line -----------------------------------------------------------------------------------


@pytest.fixture
def study(tmp_path):
    """A study folder: two train arms and a tdc arm, seeds 3 and 5, official arm 'official'."""
    spec = spec_from_dict(
        {
            "name": "st",
            "set": TINY_SETS,
            "seeds": [3, 5],
            "eval_every": 6,
            "arms": [
                {"name": "official", "set": ["optim.lr=1e-4"]},
                {"name": "t", "kind": "tdc"},
                {"name": "fast", "set": ["optim.lr=3e-3"]},
            ],
            "speedrun": {"official_arm": "official"},
        }
    )
    (tmp_path / "study").mkdir()
    (tmp_path / "study" / SPEC_FILE).write_text(yaml.safe_dump(spec.to_dict()))
    return tmp_path / "study"


@pytest.fixture
def measured(monkeypatch):
    """``measure_step_times`` replaced by a recorder that returns a fixed result."""
    got = []

    def measure(cfgs, peer, official_arm):
        got.append((cfgs, peer, official_arm))
        return {"arms": {"official": 0.25, "fast": 0.125}, "ours_s": 0.25, "steps_each": 60, "threads": 3}

    monkeypatch.setattr(step_time, "measure_step_times", measure)
    return got


def test_the_worker_measures_the_train_arms_at_the_first_seed_without_a_peer_for_a_dash(study, measured, capsys):
    """``STUDY_DIR - 3``: no peer, every train arm (not the tdc arm) at the first seed, in its own
    ``steptime-run/ARM`` folder at 3 threads; step_time.json written as the committed ones (one-space indent),
    the same JSON printed, exit 0."""
    assert step_time.main([str(study), "-", "3"]) == 0
    [(cfgs, peer, official)] = measured
    assert peer is None and official == "official" and list(cfgs) == ["official", "fast"]
    for name, lr in (("official", 1e-4), ("fast", 3e-3)):
        cfg = cfgs[name]
        assert (cfg.engine.seed, cfg.engine.cpu_threads, cfg.optim.lr) == (3, 3, lr)
        assert Path(cfg.checkpoint.run_dir) == study / "steptime-run" / name
    text = (study / STEP_TIME_FILE).read_text()
    res = json.loads(text)
    assert res == {"arms": {"official": 0.25, "fast": 0.125}, "ours_s": 0.25, "steps_each": 60, "threads": 3}
    assert text == json.dumps(res, indent=1)
    assert capsys.readouterr().out == json.dumps(res) + "\n"


def test_the_worker_reads_sys_argv_and_passes_the_peer_path_and_keeps_the_recipe_threads(
    study, measured, monkeypatch, tmp_path
):
    """``python -m ... STUDY_DIR PEER``: the peer path as given; without THREADS the recipe's own thread count
    (the embedded demo's 2)."""
    monkeypatch.setattr(sys, "argv", ["step_time", str(study), str(tmp_path / "DiT")])
    assert step_time.main() == 0
    [(cfgs, peer, _)] = measured
    spec = load_study(study)
    own = arm_config(spec, spec.arms[0], 3, "r").engine.cpu_threads
    assert peer == str(tmp_path / "DiT") and own == 2
    assert [c.engine.cpu_threads for c in cfgs.values()] == [own, own]


def test_the_worker_with_a_peer_and_threads(study, measured, tmp_path):
    assert step_time.main([str(study), str(tmp_path / "DiT"), "1"]) == 0
    [(cfgs, peer, _)] = measured
    assert peer == str(tmp_path / "DiT") and [c.engine.cpu_threads for c in cfgs.values()] == [1, 1]
