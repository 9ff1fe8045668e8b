"""The post-hoc EMA pass (study/posthoc.py) on hand-made study folders, with the run's reading of snapshots and its
evaluation replaced by cheap stand-ins: every length at the last snapshot, each arm's pick by the rule, the pick at
every snapshot step from the weights of the snapshots up to it, a rerun that evaluates nothing, the given grid
alone, the long reference's runs evaluated the same way, the progress count; and the records read back by
``read_records``, ``posthoc_picks``, ``posthoc_rows`` and ``posthoc_finals`` by hand."""

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from diffcurr_fast._files import write_json
from diffcurr_fast.study import posthoc
from diffcurr_fast.study.layout import run_dir_of, status_path
from diffcurr_fast.study.spec import SPEC_FILE, spec_from_dict

GRID = (0.05, 0.1, 0.2)
BEST = {"a": 0.1, "b": 0.2, "ref": 0.05}  # each arm's FD is lowest at this length


def true_fd(arm, seed, sigma_rel, step):
    """The stand-in evaluation's FD of run (arm, seed) at (step, sigma_rel): lowest at the arm's best length, lower
    at a later step."""
    return 100.0 / step + 1000.0 * (sigma_rel - BEST[arm]) ** 2 + 0.01 * seed


class World:
    """Snapshots, configs and evaluations of hand-made runs (run_dir -> (arm, seed, snapshot steps))."""

    def __init__(self):
        self.runs = {}
        self.evals = []  # (run_dir, step, sigma_rel) of every evaluation
        self.threads = []
        self.bars = []

    def add(self, study_dir, arm, seed, steps, finished=True):
        rd = run_dir_of(study_dir, arm, seed)
        self.runs[Path(rd)] = (arm, seed, list(steps))
        if finished:
            write_json({"steps": max(steps, default=0)}, status_path(study_dir, arm, seed))
        return rd


class Bar:
    """A progress bar that counts."""

    def __init__(self, world, total=None, **kwargs):
        self.total, self.kwargs, self.n, self.closed = total, kwargs, 0, False
        world.bars.append(self)

    def update(self, n=1):
        self.n += n

    def close(self):
        self.closed = True


@pytest.fixture
def world(monkeypatch):
    w = World()

    def load_run_config(path):
        return SimpleNamespace(run_dir=Path(path).parent)

    def list_snapshots(run_dir):  # two lengths a step, as a run keeps them
        steps = w.runs.get(Path(run_dir), (None, None, []))[2]
        return [SimpleNamespace(step=s, sigma_rel=r) for s in steps for r in (0.05, 0.1)]

    def reconstruct(run_dir, sigma_rel, step=None):
        steps = w.runs[Path(run_dir)][2]
        at = max(s for s in steps if step is None or s <= step)
        weights = {"weight": torch.tensor([[float(sigma_rel)]]), "bias": torch.tensor([float(at)])}
        return weights, SimpleNamespace(step=at)

    def build_model(cfg):
        assert isinstance(cfg.run_dir, Path)
        return torch.nn.Linear(1, 1)

    def build_schedule(cfg):
        return ("schedule", cfg.run_dir)

    class Evaluator:
        def __init__(self, cfg, run_dir):
            assert cfg.run_dir == Path(run_dir)
            self.run_dir = Path(run_dir)

        def __call__(self, step, model, schedule):
            assert schedule == ("schedule", self.run_dir)
            sigma_rel, at = float(model.weight.item()), int(model.bias.item())
            assert at == step  # the weights are those of the step evaluated
            arm, seed, _ = w.runs[self.run_dir]
            w.evals.append((self.run_dir, step, round(sigma_rel, 6)))
            return {"step": int(step), "eval": True, "fd": true_fd(arm, seed, round(sigma_rel, 6), step)}

    monkeypatch.setattr(posthoc, "load_run_config", load_run_config)
    monkeypatch.setattr(posthoc, "list_snapshots", list_snapshots)
    monkeypatch.setattr(posthoc, "reconstruct", reconstruct)
    monkeypatch.setattr(posthoc, "build_model", build_model)
    monkeypatch.setattr(posthoc, "build_schedule", build_schedule)
    monkeypatch.setattr(posthoc, "Evaluator", Evaluator)
    monkeypatch.setattr(posthoc, "set_cpu_threads", lambda threads: w.threads.append(threads))
    monkeypatch.setattr(posthoc, "tqdm", lambda **kw: Bar(w, **kw))
    return w


def write_study(study_dir, data):
    spec = spec_from_dict(data)
    Path(study_dir).mkdir(parents=True, exist_ok=True)
    (Path(study_dir) / SPEC_FILE).write_text(yaml.safe_dump(spec.to_dict()))
    return spec


def two_arm_study(tmp_path, world):
    """Arms a and b of seeds 0 and 1 (b's seed 1 unfinished) and a tdc arm; snapshots every 4 or 6 steps."""
    out = tmp_path / "study"
    write_study(
        out,
        {
            "name": "h",
            "seeds": [0, 1],
            "eval_every": 4,
            "arms": [{"name": "a"}, {"name": "b"}, {"name": "t", "kind": "tdc"}],
        },
    )
    world.add(out, "a", 0, [4, 8, 12])
    world.add(out, "a", 1, [4, 8, 12])
    world.add(out, "b", 0, [6, 12])
    world.add(out, "b", 1, [6], finished=False)
    write_json({"steps": 12}, status_path(out, "t", 0))  # a finished tdc run: no post-hoc EMA
    return out


def by_hand_picks(runs, grid):
    """{arm: pick} by the documented rule: the lowest mean final FD over the seeds (ties: the shorter)."""
    picks = {}
    for arm in {a for a, _, _ in runs}:
        mean = {s: sum(true_fd(a, k, s, st[-1]) for a, k, st in runs if a == arm) for s in grid}
        picks[arm] = min(grid, key=lambda s: (mean[s], s))
    return picks


def test_the_pass_evaluates_every_length_at_the_last_snapshot_and_the_pick_at_every_snapshot(tmp_path, world):
    """Step 1 at each finished run's last snapshot for every length, step 3 at its arm's pick for every snapshot
    step (weights of that step), each once, in ``posthoc/<arm>-seed<k>.jsonl``; the unfinished run is left out."""
    out = two_arm_study(tmp_path, world)
    picks = posthoc.run_posthoc(out, GRID, threads=3)
    finished = [("a", 0, [4, 8, 12]), ("a", 1, [4, 8, 12]), ("b", 0, [6, 12])]
    want = by_hand_picks(finished, GRID)
    assert want == {"a": 0.1, "b": 0.2}
    assert {arm: p["pick"] for arm, p in picks.items()} == want
    assert picks["a"]["finals"] == {s: [true_fd("a", k, s, 12) for k in (0, 1)] for s in GRID}
    for arm, seed, steps in finished:
        recs = posthoc.read_records(tmp_path / "study" / "posthoc" / f"{arm}-seed{seed}.jsonl")
        keys = {(steps[-1], s) for s in GRID} | {(st, want[arm]) for st in steps}
        assert set(recs) == keys
        for (st, s), r in recs.items():
            assert r["step"] == st and r["sigma_rel"] == s and r["fd"] == true_fd(arm, seed, s, st)
    assert not posthoc.records_path(out, "b", 1).exists()
    assert len(world.evals) == len(set(world.evals)) == 3 * len(GRID) + (2 + 2 + 1)  # pick's last step reused
    assert world.threads == [3]
    (bar,) = world.bars
    assert bar.total == bar.n == 3 * len(GRID) + (3 + 3 + 2) and bar.closed
    assert bar.kwargs["disable"] is False  # the progress is shown unless asked not to


def test_the_progress_bar_is_off_when_asked(tmp_path, world):
    out = two_arm_study(tmp_path, world)
    posthoc.run_posthoc(out, GRID, progress=False)
    assert [b.kwargs["disable"] for b in world.bars] == [True]


def test_a_rerun_evaluates_nothing_and_reads_every_record_back(tmp_path, world):
    out = two_arm_study(tmp_path, world)
    picks = posthoc.run_posthoc(out, GRID, progress=False)
    n = len(world.evals)
    assert posthoc.run_posthoc(out, GRID, progress=False) == picks
    assert len(world.evals) == n
    # a run's evaluator returns a record it made without evaluating it again
    rd = run_dir_of(out, "a", 0)
    ev = posthoc.RunEvaluator(rd, posthoc.records_path(out, "a", 0))
    rec = ev.record(8, 0.2)
    assert rec["fd"] == true_fd("a", 0, 0.2, 8) and rec["sigma_rel"] == 0.2
    assert ev.record(8, 0.2) == rec and len(world.evals) == n + 1
    assert posthoc.read_records(posthoc.records_path(out, "a", 0))[(8, 0.2)] == rec


def test_the_pick_is_from_the_given_grid_even_when_records_hold_other_lengths(tmp_path, world):
    """b's best length is 0.2; a later pass over (0.05, 0.1) picks from those two alone, and evaluates b's curve
    at that pick."""
    out = two_arm_study(tmp_path, world)
    assert posthoc.run_posthoc(out, GRID, progress=False)["b"]["pick"] == 0.2
    picks = posthoc.run_posthoc(out, (0.05, 0.1), progress=False)
    assert {arm: p["pick"] for arm, p in picks.items()} == by_hand_picks(
        [("a", 0, [12]), ("a", 1, [12]), ("b", 0, [12])], (0.05, 0.1)
    )
    assert picks["b"]["pick"] == 0.1 and set(picks["b"]["finals"]) == {0.05, 0.1}
    assert (6, 0.1) in posthoc.read_records(posthoc.records_path(out, "b", 0))


def test_a_study_without_a_finished_run_is_refused_by_name(tmp_path, world):
    out = tmp_path / "empty"
    write_study(out, {"name": "e", "seeds": [0], "eval_every": 4, "arms": [{"name": "a"}]})
    world.add(out, "a", 0, [4], finished=False)
    with pytest.raises(ValueError, match="has no finished training runs to evaluate") as e:
        posthoc.run_posthoc(out, GRID, progress=False)
    assert repr(str(out)) in str(e.value)


def test_a_run_without_snapshots_is_refused_by_name(tmp_path, world):
    rd = tmp_path / "runs" / "a" / "seed0"
    with pytest.raises(ValueError, match="kept no post-hoc EMA snapshots") as e:
        posthoc.RunEvaluator(rd, tmp_path / "r.jsonl")
    assert repr(str(rd)) in str(e.value)


def _write_study_with_long_reference(out):
    """Study ``out``: one arm ``a``, seed 0, its long reference in the sibling folder ``long`` (factor 2)."""
    write_study(
        out,
        {
            "name": "s",
            "seeds": [0],
            "eval_every": 4,
            "reference": "a",
            "arms": [{"name": "a"}],
            "speedrun": {"official_arm": "a", "smooth": 1},
            "long_reference": {"folder": "../long", "factor": 2},
        },
    )


@pytest.mark.parametrize("progress", [True, False])
def test_the_long_reference_runs_are_evaluated_the_same_way(tmp_path, world, progress):
    """A study with a long reference: ``run_posthoc`` evaluates the long reference's finished runs in its own folder
    at the same grid, threads and progress."""
    out = tmp_path / "study"
    _write_study_with_long_reference(out)
    world.add(out, "a", 0, [4, 8])
    long = tmp_path / "long"
    write_study(long, {"name": "l", "seeds": [0], "eval_every": 4, "arms": [{"name": "ref"}]})
    world.add(long, "ref", 0, [8, 16])
    grid = (0.05, 0.1)
    picks = posthoc.run_posthoc(out, grid, threads=2, progress=progress)
    assert picks["a"]["pick"] == 0.1
    recs = posthoc.read_records(posthoc.records_path(long, "ref", 0))
    assert set(recs) == {(16, 0.05), (16, 0.1), (8, 0.05)}  # ref's best is 0.05
    assert world.threads == [2, 2]
    assert [b.kwargs["disable"] for b in world.bars] == [not progress] * 2


def test_a_long_reference_without_finished_runs_is_not_evaluated(tmp_path, world):
    out = tmp_path / "study"
    _write_study_with_long_reference(out)
    world.add(out, "a", 0, [4, 8])
    posthoc.run_posthoc(out, GRID, progress=False)  # no long folder yet: nothing to evaluate there
    assert not (tmp_path / "long").exists() and len(world.bars) == 1


def test_read_records_skips_a_torn_line_and_reads_the_lines_after_it(tmp_path):
    """A stop tears the last line; a rerun appends after it, so the torn line is then in the middle."""
    path = tmp_path / "r.jsonl"
    first = {"step": 4, "sigma_rel": 0.1, "fd": 3.0}
    later = {"step": 8, "sigma_rel": 0.1, "fd": 2.0}
    path.write_text(json.dumps(first) + "\n" + '{"step": 8, "sig\n' + json.dumps(later) + "\n")
    assert posthoc.read_records(path) == {(4, 0.1): first, (8, 0.1): later}


def _write_records(study_dir, arm, seed, recs, finished=True):
    path = posthoc.records_path(study_dir, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"step": st, "sigma_rel": s, **r}) + "\n" for (st, s), r in recs.items()))
    if finished:
        write_json({"steps": 8}, status_path(study_dir, arm, seed))


def test_an_arm_missing_a_length_of_the_grid_has_no_pick_and_the_next_arm_still_has(tmp_path):
    spec = spec_from_dict({"name": "h", "seeds": [0], "eval_every": 4, "arms": [{"name": "a"}, {"name": "b"}]})
    _write_records(tmp_path, "a", 0, {(8, 0.05): {"fd": 1.0}, (8, 0.1): {"fd": 2.0}})  # no 0.2
    _write_records(tmp_path, "b", 0, {(8, 0.05): {"fd": 3.0}, (8, 0.1): {"fd": 2.0}, (8, 0.2): {"fd": 4.0}})
    picks = posthoc.posthoc_picks(spec, tmp_path, GRID)
    assert picks == {"b": {"finals": {0.05: [3.0], 0.1: [2.0], 0.2: [4.0]}, "pick": 0.1}}


def test_an_arm_with_an_unevaluated_finished_run_is_left_out_of_the_default_grid(tmp_path):
    """a's seed 1 finished but has no records: a has no pick, and b picks from its own lengths."""
    spec = spec_from_dict({"name": "h", "seeds": [0, 1], "eval_every": 4, "arms": [{"name": "a"}, {"name": "b"}]})
    _write_records(tmp_path, "a", 0, {(8, 0.05): {"fd": 1.0}, (8, 0.1): {"fd": 2.0}})
    write_json({"steps": 8}, status_path(tmp_path, "a", 1))
    for seed, fds in ((0, (3.0, 2.0)), (1, (3.0, 2.5))):
        _write_records(tmp_path, "b", seed, {(8, 0.05): {"fd": fds[0]}, (8, 0.1): {"fd": fds[1]}})
    assert posthoc.posthoc_picks(spec, tmp_path) == {"b": {"finals": {0.05: [3.0, 3.0], 0.1: [2.0, 2.5]}, "pick": 0.1}}
    # an arm none of whose runs finished has no pick either
    spec3 = spec_from_dict(
        {"name": "h", "seeds": [0, 1], "eval_every": 4, "arms": [{"name": "b"}, {"name": "c"}, {"name": "a"}]}
    )
    assert set(posthoc.posthoc_picks(spec3, tmp_path)) == {"b"}


def test_the_curve_rows_take_every_metric_from_the_post_hoc_records(tmp_path):
    spec = spec_from_dict({"name": "h", "seeds": [0], "eval_every": 4, "arms": [{"name": "a"}]})
    metrics = {"fd": 2.0, "is": 9.0, "precision": 0.7, "recall": 0.6, "cond_acc": 0.9}
    _write_records(tmp_path, "a", 0, {(8, 0.1): metrics, (8, 0.2): {k: 0.0 for k in metrics}})
    base = {"arm": "a", "seed": 0, "step": 8, "train_s": 1.5, "fd": 5.0, "is": 1.0}
    base |= {"precision": 0.1, "recall": 0.2, "cond_acc": 0.3}
    out = posthoc.posthoc_rows(spec, tmp_path, [base], {"a": {"pick": 0.1}})
    assert out == [{"arm": "a", "seed": 0, "step": 8, "train_s": 1.5, **metrics}]


def test_the_finals_are_the_last_record_at_the_pick_of_each_seed_that_has_the_key(tmp_path):
    """Seed 0: its last record at the pick (step 12). Seed 1: its last record at the pick has no cond_acc (an
    earlier one has): left out. Seed 2: no record at the pick: left out."""
    spec = spec_from_dict({"name": "h", "seeds": [0, 1, 2], "eval_every": 4, "arms": [{"name": "a"}]})
    _write_records(
        tmp_path,
        "a",
        0,
        {
            (4, 0.1): {"cond_acc": 0.5, "fd": 9.0},
            (8, 0.1): {"cond_acc": 0.6, "fd": 8.0},
            (12, 0.1): {"cond_acc": 0.7, "fd": 7.0},
            (12, 0.2): {"cond_acc": 0.99, "fd": 6.0},
        },
    )
    _write_records(
        tmp_path, "a", 1, {(4, 0.1): {"cond_acc": 0.4}, (8, 0.1): {"cond_acc": 0.45}, (12, 0.1): {"fd": 7.5}}
    )
    _write_records(tmp_path, "a", 2, {(12, 0.2): {"cond_acc": 0.8}})
    picks = {"a": {"pick": 0.1}}
    assert posthoc.posthoc_finals(spec, tmp_path, picks) == {"a": {0: 0.7}}
    assert posthoc.posthoc_finals(spec, tmp_path, picks, "fd") == {"a": {0: 7.0, 1: 7.5}}
