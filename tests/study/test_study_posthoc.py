"""The references and post-hoc EMA of a time-to-quality study: the speed-ups over each reference and the headline
over the strongest, by hand; the tuning time priced by the step times; the post-hoc pass (study/posthoc.py) on a
tiny study: its grid, each arm's pick by the rule, the curve at the pick equal to an evaluation of the reconstructed
weights, a rerun that evaluates nothing, and the report's section; and the speedrun_tuned preset's settings."""

import json
import math

import pytest
import torch

from diffcurr_fast._files import write_json
from diffcurr_fast.runs.checkpoint import load_weights
from diffcurr_fast.runs.posthoc_ema import reconstruct
from diffcurr_fast.runs.recipes import load_run_config
from diffcurr_fast.runs.sampling import build_model, build_schedule
from diffcurr_fast.study import posthoc
from diffcurr_fast.study import speedrun as sr
from diffcurr_fast.study import speedrun_report as srr
from diffcurr_fast.study.presets import LR_GRID, OFFICIAL, preset_spec
from diffcurr_fast.study.report import tuning_section, write_report
from diffcurr_fast.study.runner import read_status, run_dir_of, run_study, status_path
from diffcurr_fast.study.spec import spec_from_dict
from diffcurr_fast.train.evaluation import Evaluator


def _rows(arm, seed, fds, every=100):
    return [
        {
            "arm": arm,
            "seed": seed,
            "step": every * (i + 1),
            "fd": f,
            "train_s": 0.01 * every * (i + 1),
            "train_flops": 2.0 * every * (i + 1),
        }
        for i, f in enumerate(fds)
    ]


def _ref_spec():
    return spec_from_dict(
        {
            "name": "s",
            "seeds": [0, 1],
            "eval_every": 100,
            "reference": "tuned",
            "arms": [{"name": "tuned"}, {"name": "decay"}, {"name": "fast"}],
            "speedrun": {"official_arm": "tuned", "smooth": 1},
        }
    )


def test_speed_ups_over_each_reference_and_the_headline_over_the_strongest_by_hand():
    spec = _ref_spec()
    rows = _rows("tuned", 0, [9, 7, 6, 5]) + _rows("tuned", 1, [9, 8, 6, 6])  # finals 5, 6: mean 5.5
    rows += _rows("decay", 0, [9, 7, 5, 3]) + _rows("decay", 1, [9, 6, 4, 4])  # finals 3, 4: mean 3.5, stronger
    rows += _rows("fast", 0, [6, 4, 3, 2]) + _rows("fast", 1, [5, 4, 2, 2])
    refs = sr.against(spec, rows, None, ["decay"])
    assert refs["finals"] == {"tuned": 5.5, "decay": 3.5} and refs["strongest"] == "decay"
    dec = refs["analyses"]["decay"]
    assert dec["threshold"] == 4  # decay's worst final FD
    # decay reaches 4 at step 400 (seed 0: 5 -> 3, interpolated at 350) and 300 (seed 1); fast at 200 and 200
    assert dec["arms"]["decay"]["per_seed"][0]["step"] == pytest.approx(350)
    assert dec["arms"]["decay"]["per_seed"][1]["step"] == pytest.approx(300)
    assert dec["arms"]["fast"]["per_seed"][0]["step"] == pytest.approx(200)
    up = math.sqrt(350 * 300) / 200
    assert dec["arms"]["fast"]["speedup"]["wall_s"][0] == pytest.approx(up)
    text = "\n".join(srr.references_section(refs))
    assert "The strongest is `decay`" in text and f"in 1/{up:.3g} of its wall time" in text
    assert "Over `tuned`, at its threshold FD 6" in text and "Over `decay`, at its threshold FD 4" in text
    # a reference that is also an arm of the headline is never the headline's arm
    assert "**Headline:** `fast`" in text


def test_tuning_time_is_priced_by_the_side_by_side_step_times(tmp_path):
    data = {
        "name": "t",
        "seeds": [0],
        "metric": "fd",
        "reference": "plain",
        "eval_every": 4,
        "tuning": {"budget": 8, "pick": "final"},
        "arms": [{"name": "plain", "tune": {"optim.lr": [1, 2]}}, {"name": "other", "tune": {"optim.lr": [1, 2]}}],
        "speedrun": {"official_arm": "plain", "smooth": 1},
    }
    spec = spec_from_dict(data)
    for arm in ("plain", "other"):
        for i in (0, 1):
            write_json(
                {"wall_s": 999.0, "evals": [{"step": 8, "fd": 5.0 + i}]}, status_path(tmp_path, f"{arm}~t{i}", 0)
            )
    arms = {n: {"axes": {"wall_s": [w, w, w]}} for n, w in (("plain", 40.0), ("other", 10.0))}
    write_json({"reference": "plain", "arms": arms}, tmp_path / "speedrun.json")
    write_json({"arms": {"plain": 0.5, "other": 0.25}, "steps_each": 60, "threads": 1}, tmp_path / "step_time.json")
    text = "\n".join(tuning_section(spec, tmp_path))
    # plain: 2 trials x 8 steps x 0.5 s = 8 s; other: 2 x 8 x 0.25 = 4 s; included: (40 + 8) / (10 + 4)
    assert "| other | 10 | 4 | x4 | x3.43 |" in text and "| plain | 40 | 8 | x1 | x1 |" in text
    assert "side-by-side step time" in text


def test_pick_length_by_hand():
    assert posthoc.pick_length({0.05: [3.0, 5.0], 0.1: [3.5, 4.0], 0.2: [4.0, 4.0]}) == 0.1  # means 4, 3.75, 4
    assert posthoc.pick_length({0.05: [4.0], 0.1: [4.0]}) == 0.05  # a tie: the shorter
    assert posthoc.pick_length({0.05: [float("nan")], 0.1: [9.0]}) == 0.1  # non-finite ranks last


def _write_records(study_dir, arm, seed, fds):
    """The post-hoc records of run (arm, seed): ``fds`` maps (step, sigma_rel) to the FD (IS 100 x it)."""
    path = posthoc.records_path(study_dir, arm, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"step": st, "sigma_rel": s, "fd": f, "is": 100.0 * f}) for (st, s), f in fds.items()]
    path.write_text("\n".join(lines) + "\n")
    write_json({"steps": 8}, status_path(study_dir, arm, seed))


def test_posthoc_picks_and_rows_by_hand(tmp_path):
    """Two arms of two seeds, records at steps 4 and 8 for lengths 0.05 and 0.1 (and 0.2 for one run only): the
    grid is the lengths every run has, the finals are the step-8 records, the pick the lower mean final, and the
    curve rows hold the picked length's metrics alone, on the collected rows' clocks."""
    spec = spec_from_dict({"name": "h", "seeds": [0, 1], "eval_every": 4, "arms": [{"name": "a"}, {"name": "b"}]})
    fds = {
        ("a", 0): {(4, 0.05): 9.0, (4, 0.1): 8.0, (8, 0.05): 5.0, (8, 0.1): 6.0, (8, 0.2): 1.0},
        ("a", 1): {(4, 0.05): 9.5, (4, 0.1): 8.5, (8, 0.05): 4.0, (8, 0.1): 4.5},  # means 4.5, 5.25: a picks 0.05
        ("b", 0): {(4, 0.05): 7.0, (4, 0.1): 6.0, (8, 0.05): 3.0, (8, 0.1): 2.0},
        ("b", 1): {(4, 0.05): 7.5, (4, 0.1): 6.5, (8, 0.05): 3.0, (8, 0.1): 3.0},  # means 3, 2.5: b picks 0.1
    }
    for (arm, seed), recs in fds.items():
        _write_records(tmp_path, arm, seed, recs)
    picks = posthoc.posthoc_picks(spec, tmp_path)
    assert picks == {
        "a": {"finals": {0.05: [5.0, 4.0], 0.1: [6.0, 4.5]}, "pick": 0.05},
        "b": {"finals": {0.05: [3.0, 3.0], 0.1: [2.0, 3.0]}, "pick": 0.1},
    }
    rows = [r for arm in "ab" for seed in (0, 1) for r in _rows(arm, seed, [99.0, 98.0], every=4)]
    out = posthoc.posthoc_rows(spec, tmp_path, rows, picks)
    got = sorted((r["arm"], r["seed"], r["step"], r["fd"], r["is"], r["train_s"]) for r in out)
    assert got == [
        ("a", 0, 4, 9.0, 900.0, 0.04),
        ("a", 0, 8, 5.0, 500.0, 0.08),
        ("a", 1, 4, 9.5, 950.0, 0.04),
        ("a", 1, 8, 4.0, 400.0, 0.08),
        ("b", 0, 4, 6.0, 600.0, 0.04),
        ("b", 0, 8, 2.0, 200.0, 0.08),
        ("b", 1, 4, 6.5, 650.0, 0.04),
        ("b", 1, 8, 3.0, 300.0, 0.08),
    ]
    # an arm without a pick has no rows; a collected row missing for a step leaves that step out
    only_b = posthoc.posthoc_rows(spec, tmp_path, [r for r in rows if r["step"] == 8], {"b": picks["b"]})
    assert sorted((r["arm"], r["seed"], r["step"], r["fd"]) for r in only_b) == [("b", 0, 8, 2.0), ("b", 1, 8, 3.0)]


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
    "engine.max_steps=8",
    "checkpoint.every=8",
    "optim.phema_every=4",
]


def test_posthoc_pass_on_a_tiny_study(tmp_path, monkeypatch):
    spec = spec_from_dict(
        {
            "name": "p",
            "set": TINY,
            "seeds": [0, 1],
            "metric": "fd",
            "reference": "a",
            "eval_every": 4,
            "eval": {"num_samples": 16, "steps": 3},
            "arms": [{"name": "a"}, {"name": "b", "set": ["optim.lr=3e-3"]}],
            "speedrun": {"official_arm": "a", "smooth": 1},
        }
    )
    out = tmp_path / "study"
    assert run_study(spec, out, verbose=False)["failed"] == []
    grid = (0.05, 0.1, 0.2)
    picks = posthoc.run_posthoc(out, grid, progress=False)
    for arm in ("a", "b"):
        finals = {s: [] for s in grid}
        for seed in (0, 1):
            recs = posthoc.read_records(posthoc.records_path(out, arm, seed))
            assert {k for k in recs if k[0] == 8} == {(8, s) for s in grid}
            for s in grid:
                finals[s].append(recs[(8, s)]["fd"])
            assert {k for k in recs if k[1] == picks[arm]["pick"]} == {(4, picks[arm]["pick"]), (8, picks[arm]["pick"])}
        mean = {s: sum(v) / 2 for s, v in finals.items()}
        assert picks[arm]["pick"] == min(grid, key=lambda s: (mean[s], s))
    # a record is the run's own evaluation of the reconstructed weights at that step (snapshots up to it only)
    rd = run_dir_of(out, "b", 1)
    cfg = load_run_config(rd / "config.yaml")
    model = load_weights(build_model(cfg), reconstruct(rd, 0.1, step=4)[0], "test")
    want = Evaluator(cfg, rd)(4, model, build_schedule(cfg))["fd"]
    s = picks["b"]["pick"]
    path = posthoc.records_path(out, "b", 1)
    got = posthoc.RunEvaluator(rd, path).record(4, 0.1) if s != 0.1 else posthoc.read_records(path)[(4, 0.1)]
    assert got["fd"] == pytest.approx(want, rel=1e-6)
    # a rerun evaluates nothing: every record is read back
    monkeypatch.setattr(posthoc, "Evaluator", lambda *a, **k: pytest.fail("evaluated again"))
    assert posthoc.run_posthoc(out, grid, progress=False) == picks
    # the report's section: the grid, the picks and the time to quality on the picked curves, also from a study
    # folder carried without its run folders (the records are the study's, beside status/)
    import shutil

    shutil.rmtree(out / "runs")
    write_report(out)
    text = (out / "report.md").read_text()
    assert "## Post-hoc EMA: every arm at its best EMA length" in text
    assert "| b | " in text and f" | {picks['b']['pick']:g} |" in text
    assert "## Time to quality with post-hoc EMA" in text
    rows = posthoc.posthoc_rows(spec, out, [r for r in _collected(out)], picks)
    assert {(r["arm"], r["seed"], r["step"]) for r in rows} == {(a, s, t) for a in "ab" for s in (0, 1) for t in (4, 8)}


def _collected(out):
    from diffcurr_fast.study.report import collect

    return collect(out)[1]


def test_posthoc_needs_snapshots(tmp_path):
    spec = spec_from_dict(
        {
            "name": "p",
            "set": [s for s in TINY if not s.startswith("optim.phema_every")],
            "seeds": [0],
            "metric": "fd",
            "reference": "a",
            "eval_every": 8,
            "eval": {"num_samples": 16, "steps": 3},
            "arms": [{"name": "a"}],
        }
    )
    out = tmp_path / "study"
    run_study(spec, out, verbose=False)
    assert read_status(out, "a", 0) is not None
    with pytest.raises(ValueError, match="kept no post-hoc EMA snapshots: its study needs optim.phema_every > 0"):
        posthoc.run_posthoc(out, progress=False)


def test_speedrun_tuned_preset_settings():
    spec = preset_spec("speedrun_tuned")
    names = [a.name for a in spec.arms]
    assert names == ["official", "official_tuned", "official_tuned_decay", "vanilla", "minsnr"]
    assert not spec.arm("official").tune  # as released, for the record
    for n in names[1:]:  # every tuned arm: the same grid
        assert spec.arm(n).tune == {"optim.lr": list(LR_GRID)}
    assert set(OFFICIAL) <= set(spec.arm("official_tuned").set)
    decay = spec.arm("official_tuned_decay").set
    assert decay[: len(OFFICIAL)] == OFFICIAL and decay[-1] == "optim.schedule=cosine" and "optim.min_lr=0" in decay
    assert spec.tuning == {"budget": 2000, "pick": "final", "seed": 10} and 10 not in spec.seeds
    assert spec.speedrun["official_arm"] == "official_tuned" and "optim.phema_every=400" in spec.set
    assert torch.tensor(LR_GRID).diff().gt(0).all()
    assert json.dumps(spec.to_dict())  # a spec that the study folder can record


def test_speedrun_levers_preset_is_minsnr_and_each_lever_on_it():
    from diffcurr_fast.study.presets import LEVERS, LEVERS_LR_GRID
    from diffcurr_fast.study.spec import arm_config

    spec, tuned = preset_spec("speedrun_levers"), preset_spec("speedrun_tuned")
    assert [a.name for a in spec.arms] == ["minsnr", *LEVERS]
    assert spec.arm("minsnr").set == tuned.arm("minsnr").set and spec.set == tuned.set
    assert LEVERS_LR_GRID == [2 * v for v in LR_GRID]  # one step up the same ladder
    assert spec.tuning == tuned.tuning and spec.seeds == tuned.seeds and spec.speedrun["official_arm"] == "minsnr"
    for name, sets in LEVERS.items():
        arm = spec.arm(name)
        assert arm.set == [*spec.arm("minsnr").set, *sets] and arm.tune == {"optim.lr": LEVERS_LR_GRID}
        arm_config(spec, arm, 0, "check")  # every lever's config validates at the study's sizes


def test_speedrun_edge_preset_is_the_reference_and_our_best_two_over_a_higher_grid():
    from diffcurr_fast.study.presets import EDGE_LR_GRID, LEVERS_LR_GRID

    spec, tuned, levers = preset_spec("speedrun_edge"), preset_spec("speedrun_tuned"), preset_spec("speedrun_levers")
    assert [a.name for a in spec.arms] == ["official_tuned_decay", "minsnr", "immiscible"]
    for name, source in (("official_tuned_decay", tuned), ("minsnr", tuned), ("immiscible", levers)):
        assert spec.arm(name).set == source.arm(name).set, name  # the same arm, only its grid differs
        assert spec.arm(name).tune == {"optim.lr": [4e-3, 8e-3, 1.6e-2, 3.2e-2]}
    assert EDGE_LR_GRID[:2] == [LR_GRID[-1], LEVERS_LR_GRID[-1]]  # from both earlier grids' top, two steps up
    assert spec.set == [*tuned.set, "engine.max_nan_skips=4000", "engine.max_skip_share=1.0"]
    assert spec.tuning == tuned.tuning and spec.seeds == tuned.seeds
    assert spec.speedrun["official_arm"] == "official_tuned_decay" and spec.reference == "official_tuned_decay"


def test_speedrun_tuned_mnist5k_preset_is_the_digits_arms_on_mnist5k_at_patch_2():
    from diffcurr_fast.study.presets import SR_TM_LR_GRID
    from diffcurr_fast.study.spec import arm_config

    spec, edge, tuned = (
        preset_spec("speedrun_tuned_mnist5k"),
        preset_spec("speedrun_edge"),
        preset_spec("speedrun_tuned"),
    )
    assert [a.name for a in spec.arms] == ["official_tuned_decay", "vanilla", "minsnr", "immiscible"]
    for name, source in (("official_tuned_decay", edge), ("vanilla", tuned), ("minsnr", edge), ("immiscible", edge)):
        assert spec.arm(name).set == source.arm(name).set, name  # the digits' arms, setting for setting
        assert spec.arm(name).tune == {"optim.lr": SR_TM_LR_GRID} == {"optim.lr": [4e-3, 8e-3, 1.6e-2]}
    cfg = arm_config(spec, spec.arm("immiscible"), 0, "check")
    m = cfg.model
    assert (cfg.data.dataset, cfg.data.batch_size, m.input_size, m.patch_size) == ("mnist5k", 32, 28, 2)
    assert (m.input_size // m.patch_size) ** 2 == 196 and cfg.engine.max_steps == 2400
    assert cfg.optim.phema_every == spec.eval_every == 400 and spec.tuning["budget"] == 1200
    assert spec.eval["features"] == "mnist5k" and spec.speedrun["official_arm"] == spec.reference
    assert cfg.engine.max_nan_skips == 4000  # a diverged trial is a result
