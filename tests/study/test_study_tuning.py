"""The tuning protocol (study/tuning.py): the grid and its trials, the pick rules by hand, equal trials for every
tuned arm, and a tiny study whose 2-point grid is picked by its rule, its seeds run at the pick, and its report's
arithmetic checked by hand."""

import json
import math

import pytest
import yaml

from diffcurr_fast.study.report import write_report
from diffcurr_fast.study.runner import read_status, run_dir_of, run_study
from diffcurr_fast.study.spec import load_spec, spec_from_dict
from diffcurr_fast.study.tuning import decide, grid, pick_point, trial_score, worse_seed

TINY = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "diffusion.num_timesteps=60",
    "curriculum.num_clusters=4",
    "curriculum.pacing=none",
    "data.batch_size=16",
    "logging.progress=false",
    "logging.num_samples=0",
    "logging.plots=false",
    "checkpoint.export_ema=false",
    "optim.warmup_steps=0",
    "optim.schedule=constant",
    "engine.cpu_threads=1",
]


def _spec(**extra):
    base = {
        "name": "tuned",
        "set": [*TINY, "engine.max_steps=12", "checkpoint.every=6"],
        "seeds": [0],
        "metric": "fd",
        "reference": "plain",
        "eval_every": 4,
        "eval": {"num_samples": 16, "steps": 3},
        "tuning": {"budget": 8, "pick": "final"},
        "arms": [
            {"name": "plain", "tune": {"optim.lr": [1.0e-5, 3.0e-3]}},
            {"name": "minsnr", "set": ["diffusion.weighting=min_snr"], "tune": {"optim.lr": [1.0e-5, 3.0e-3]}},
        ],
    }
    return {**base, **extra}


def test_grid_trials_and_their_overrides():
    assert grid({"optim.lr": [1, 2], "optim.beta2": [0.9, 0.99]}) == [
        ["optim.lr=1", "optim.beta2=0.9"],
        ["optim.lr=1", "optim.beta2=0.99"],
        ["optim.lr=2", "optim.beta2=0.9"],
        ["optim.lr=2", "optim.beta2=0.99"],
    ]
    spec = spec_from_dict(_spec())
    assert spec.trials() == [("plain~t0", 0), ("plain~t1", 0), ("minsnr~t0", 0), ("minsnr~t1", 0)]
    assert spec.arm("minsnr~t1").set == ["diffusion.weighting=min_snr", "optim.lr=0.003", "engine.max_steps=8"]
    assert spec.arm("minsnr").set == ["diffusion.weighting=min_snr"]
    untuned = spec_from_dict({**_spec(), "tuning": None, "reference": "a", "arms": [{"name": "a"}]}).to_dict()
    assert "tuning" not in untuned and "tune" not in untuned["arms"][0]


@pytest.mark.parametrize(
    "change, match",
    [
        (
            {"arms": [{"name": "a", "tune": {"optim.lr": [1, 2]}}, {"name": "b", "tune": {"optim.lr": [1]}}]},
            r"every tuned arm gets the same number of trials, got \{'a': 2, 'b': 1\}",
        ),
        ({"tuning": None}, "an arm has a tune grid but the spec has no tuning section"),
        ({"tuning": {"budget": 0}}, "tuning.budget must be an int >= 1"),
        ({"tuning": {"budget": 5, "pick": "best"}}, "tuning.pick must be 'final' or a metric value > 0"),
        ({"tuning": {"budget": 5, "every": 2}}, r"unknown tuning keys \['every'\]"),
        ({"arms": [{"name": "a", "tune": {"optim.lr": 3}}]}, "tune must map config keys to non-empty lists"),
        ({"metric": "is"}, "the tuning protocol picks a lower-is-better metric"),
        ({"tuning": {"budget": 5, "seed": 1, "seeds": [1, 2]}}, "give tuning.seed .* or tuning.seeds .*, not both"),
        ({"tuning": {"budget": 5, "seeds": [3, 3]}}, r"tuning.seeds must be a non-empty list of distinct ints >= 0"),
        (
            {"tuning": {"budget": 5, "seeds": 10}},
            r"tuning.seeds must be a non-empty list of distinct ints >= 0, got 10",
        ),
    ],
)
def test_bad_tuning_is_refused_in_one_line(change, match):
    with pytest.raises(ValueError, match=match):
        spec_from_dict(_spec(**change))


def test_pick_rules_by_hand():
    """final: the lowest smoothed metric at the last evaluation; a number: the fewest steps until the smoothed
    metric reaches it, then the final; ties keep the grid's order."""
    a = [{"step": 4, "fd": 10.0}, {"step": 8, "fd": 6.0}, {"step": 12, "fd": 5.0}]
    b = [{"step": 4, "fd": 7.0}, {"step": 8, "fd": 6.5}, {"step": 12, "fd": 5.2}]
    # window 2: a -> 10, 8, 5.5; b -> 7, 6.75, 5.85
    assert trial_score(a, "fd", 2, "final") == (0.0, 5.5) and trial_score(b, "fd", 2, "final") == (0.0, 5.85)
    assert pick_point([trial_score(x, "fd", 2, "final") for x in (a, b)]) == 0
    # reach 7: b at step 4 (7 <= 7), a at step 12 (5.5)
    assert trial_score(a, "fd", 2, 7.0) == (12.0, 5.5) and trial_score(b, "fd", 2, 7.0) == (4.0, 5.85)
    assert pick_point([trial_score(x, "fd", 2, 7.0) for x in (a, b)]) == 1
    never = trial_score(a, "fd", 2, 1.0)
    assert never[0] == math.inf and pick_point([never, trial_score(b, "fd", 2, 1.0)]) == 0  # both never: the final
    assert pick_point([(0.0, 3.0), (0.0, 3.0)]) == 0
    assert trial_score([], "fd", 2, "final") == (math.inf, math.inf)


def test_a_tiny_study_picks_by_its_rule_runs_its_seeds_at_the_pick_and_reports_it(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(_spec()))
    spec = load_spec(path)
    out = tmp_path / "study"
    res = run_study(spec, out, verbose=False)
    assert res["failed"] == [] and len(res["ran"]) == 6  # 2 arms x 2 trials + 2 arms x 1 seed
    tuning = json.loads((out / "tuning.json").read_text())
    for arm in ("plain", "minsnr"):
        finals = []
        for i in range(2):
            st = read_status(out, f"{arm}~t{i}", 0)
            assert st["steps"] == 8 and [e["step"] for e in st["evals"]] == [4, 8]
            finals.append(st["evals"][-1]["fd"])  # no speedrun: a window of one evaluation
        want = 0 if finals[0] <= finals[1] else 1
        assert tuning[arm]["pick"] == grid({"optim.lr": [1.0e-5, 3.0e-3]})[want], (arm, finals)
        assert [t["final"] for t in tuning[arm]["trials"]] == pytest.approx(finals)
        cfg = yaml.safe_load((run_dir_of(out, arm, 0) / "config.yaml").read_text())
        assert cfg["optim"]["lr"] == [1.0e-5, 3.0e-3][want] and cfg["engine"]["max_steps"] == 12
        walls = [read_status(out, f"{arm}~t{i}", 0)["wall_s"] for i in range(2)]
        assert tuning[arm]["tuning_wall_s"] == pytest.approx(sum(walls))
    write_report(out)
    text = (out / "report.md").read_text()
    assert "## Tuning" in text and "| plain | 0 | optim.lr=1e-05 |" in text
    assert run_study(spec, out, verbose=False) == {"ran": [], "failed": [], "kept": 6}  # a rerun keeps every run


def test_speed_up_with_tuning_included_by_hand(tmp_path):
    """(reference wall + its tuning wall) / (arm wall + its tuning wall), beside the ratio without tuning; an
    untuned arm adds nothing."""
    from diffcurr_fast._files import write_json
    from diffcurr_fast.study.report import tuning_section
    from diffcurr_fast.study.runner import status_path

    data = _spec(
        speedrun={"official_arm": "plain", "smooth": 1},
        arms=[
            {"name": "plain", "tune": {"optim.lr": [1.0e-5, 3.0e-3]}},
            {"name": "minsnr", "tune": {"optim.lr": [1.0e-5, 3.0e-3]}},
            {"name": "fixed"},
        ],
    )
    spec = spec_from_dict(data)
    evals = {0: [{"step": 4, "fd": 9.0}, {"step": 8, "fd": 7.0}], 1: [{"step": 4, "fd": 8.0}, {"step": 8, "fd": 7.5}]}
    for arm, walls in (("plain", (30.0, 50.0)), ("minsnr", (10.0, 20.0))):
        for i in (0, 1):
            write_json({"wall_s": walls[i], "evals": evals[i]}, status_path(tmp_path, f"{arm}~t{i}", 0))
    arms = {n: {"axes": {"wall_s": [w, w, w]}} for n, w in (("plain", 400.0), ("minsnr", 100.0), ("fixed", 200.0))}
    write_json({"reference": "plain", "arms": arms}, tmp_path / "speedrun.json")
    text = "\n".join(tuning_section(spec, tmp_path))
    # plain: tuning 80 s; minsnr: 30 s; fixed: none. Excluded: 400/100 = 4, 400/200 = 2; included: 480/130, 480/200
    assert "| minsnr | 100 | 30 | x4 | x3.69 |" in text and "| fixed | 200 | 0 | x2 | x2.4 |" in text
    assert "| plain | 400 | 80 | x1 | x1 |" in text and "Not tuned (no grid; no tuning time): fixed." in text
    assert "| plain | 0 | optim.lr=1e-05 | - | 7 | 30 | yes |" in text  # final 7 < 7.5


def test_two_seed_trials_score_a_point_by_its_worse_seed(tmp_path):
    """A hand-made trial table on seeds 10 and 11 (window 1): 1e-3 ends at 5 and 9 (worse: 9), 2e-3 at 6 and 7
    (worse: 7), 4e-3 at 4 on seed 10 but diverges on seed 11 (NaN: infinite). Seed 10 alone would pick 4e-3; the
    worse seed picks 2e-3. The wall time of a point is its seeds', summed; the report shows each seed's value and
    prices the tuning as 3 points x 2 seeds x 8 steps."""
    from diffcurr_fast._files import write_json
    from diffcurr_fast.study.report import tuning_section
    from diffcurr_fast.study.runner import status_path

    spec = spec_from_dict(
        _spec(
            tuning={"budget": 8, "pick": "final", "seeds": [10, 11]},
            arms=[{"name": "plain", "tune": {"optim.lr": [1.0e-3, 2.0e-3, 4.0e-3]}}],
            speedrun={"official_arm": "plain", "smooth": 1},
        )
    )
    assert spec.trials() == [(f"plain~t{i}", s) for i in range(3) for s in (10, 11)]
    finals = {0: (5.0, 9.0), 1: (6.0, 7.0), 2: (4.0, float("nan"))}
    for i, pair in finals.items():
        for seed, fd, wall in zip((10, 11), pair, (10.0, 20.0)):
            write_json(
                {"wall_s": wall + i, "evals": [{"step": 4, "fd": 50.0}, {"step": 8, "fd": fd}]},
                status_path(tmp_path, f"plain~t{i}", seed),
            )
    done = decide(spec, tmp_path, read_status)["plain"]
    assert done["pick"] == ["optim.lr=0.002"]
    assert [t["final"] for t in done["trials"]] == [9.0, 7.0, math.inf]
    assert [[x["final"] for x in t["per_seed"]] for t in done["trials"]] == [[5.0, 9.0], [6.0, 7.0], [4.0, math.inf]]
    assert [t["wall_s"] for t in done["trials"]] == [30.0, 32.0, 34.0] and done["tuning_wall_s"] == 96.0
    saved = json.loads((tmp_path / "tuning.json").read_text())["plain"]
    assert saved["trials"][2]["final"] is None and saved["trials"][2]["per_seed"][1]["final"] is None
    write_json({"arms": {"plain": 0.5}, "steps_each": 60, "threads": 1}, tmp_path / "step_time.json")
    write_json({"reference": "plain", "arms": {"plain": {"axes": {"wall_s": [40.0] * 3}}}}, tmp_path / "speedrun.json")
    text = "\n".join(tuning_section(spec, tmp_path))
    assert "seeds 10, 11, each point scored by its worse seed" in text
    assert "| plain | 1 | optim.lr=0.002 | - | 7 (6, 7) | 32 | yes |" in text
    assert "| plain | 2 | optim.lr=0.004 | - | n/a (4, n/a) | 34 |  |" in text
    assert "| plain | 40 | 24 | x1 | x1 |" in text  # 3 points x 2 seeds x 8 steps x 0.5 s


def test_worse_seed_by_hand():
    """More steps to the pick's value is worse, then a higher final; one seed is its own score."""
    assert worse_seed([(400.0, 9.0), (math.inf, 3.0)]) == (math.inf, 3.0)
    assert worse_seed([(400.0, 9.0), (400.0, 3.0)]) == (400.0, 9.0)
    assert worse_seed([(0.0, 5.5)]) == (0.0, 5.5)
    a = [{"step": 4, "fd": 10.0}, {"step": 8, "fd": 6.0}]
    b = [{"step": 4, "fd": 6.5}, {"step": 8, "fd": 8.0}]
    # pick 7 (window 1): seed a reaches it at step 8, seed b at step 4; the point's score is a's (8 steps)
    assert worse_seed([trial_score(x, "fd", 1, 7.0) for x in (a, b)]) == (8.0, 6.0)
