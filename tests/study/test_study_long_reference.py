"""The field's reading of a speed-up (study/speedrun.py ``both_readings``) on a hand-made curve where the long
reference reaches each arm's final FD at a known step, its bound where it never does, both readings with the tuning
included; the long reference's spec (study/long_reference.py) derived from the study and its pick, reused from a
folder of the same settings; and a tiny speedrun that trains its long reference and reports both readings."""

import json
import math

import pytest
import yaml
from conftest import TINY_SETS, _main

from diffcurr_fast._files import write_json
from diffcurr_fast.study import speedrun_report as srr
from diffcurr_fast.study.long_reference import long_spec, prepare
from diffcurr_fast.study.runner import prepare_study
from diffcurr_fast.study.spec import arm_config, spec_from_dict
from diffcurr_fast.study.speedrun import both_readings


def _rows(arm, seed, fds, every=100):
    return [
        {"arm": arm, "seed": seed, "step": every * (i + 1), "fd": f, "train_s": 1.0, "train_flops": 2.0}
        for i, f in enumerate(fds)
    ]


def _hand_spec():
    return spec_from_dict(
        {
            "name": "s",
            "seeds": [0, 1],
            "eval_every": 100,
            "reference": "tuned",
            "arms": [{"name": "tuned"}, {"name": "fast"}, {"name": "best"}],
            "speedrun": {"official_arm": "tuned", "smooth": 1},
        }
    )


# 400 steps each; the long reference (its arm named as the official arm) runs 8 x 400 = 3,200 steps, evaluated every
# 400 steps, at the official arm's step time (1 s); fast's and best's steps take 0.5 s.
ROWS = (
    _rows("tuned", 0, [9, 7, 6, 5])  # finals 5 and 6: the existing threshold is 6
    + _rows("tuned", 1, [9, 8, 6, 6])
    + _rows("fast", 0, [6, 4, 3, 2])  # its worst final: 2, reached at step 400 (seed 0) and 300 (seed 1)
    + _rows("fast", 1, [5, 4, 2, 2])
    + _rows("best", 0, [4, 2, 1, 1])  # its worst final: 1, reached at step 300 and 400
    + _rows("best", 1, [4, 3, 2, 1])
)
LONG = _rows("tuned", 0, [8, 6, 4, 3, 2.5, 2, 1.8, 1.7], 400) + _rows("tuned", 1, [8, 6, 5, 4, 3, 2.5, 1.5, 1.4], 400)
STEP_TIME = {"arms": {"tuned": 1.0, "fast": 0.5, "best": 0.5}, "steps_each": 60, "threads": 1}


def test_the_field_reading_on_a_hand_made_curve():
    res = both_readings(_hand_spec(), ROWS, LONG, STEP_TIME, {"tuned": 100.0, "fast": 50.0, "best": 50.0})
    assert res["long_seeds"] == [0, 1] and res["long_steps"] == 3200 and res["threshold"] == 6
    fast = res["arms"]["fast"]
    assert fast["threshold"] == 2 and fast["long_reached"] == [0, 1]
    # the long reference reaches FD 2 at step 2,400 on seed 0 (2.5 -> 2) and 2,600 on seed 1 (2.5 -> 1.5, halfway)
    assert fast["long_axes"]["step"][0] == pytest.approx(2500)
    f = fast["field"]
    assert not f["step"]["bound"] and f["step"]["value"] == pytest.approx(math.sqrt(2400 * 2600 / (400 * 300)))
    assert f["wall_s"]["value"] == pytest.approx(math.sqrt(2400 * 2600 / (200 * 150)))  # 1 s against 0.5 s steps
    assert f["wall_tuned"]["value"] == pytest.approx(math.sqrt(2500 * 2700 / (250 * 200)))
    assert f["step"]["lo"] < f["step"]["value"] < f["step"]["hi"]
    # the existing reading: tuned reaches its FD 6 at step 300 on both seeds, fast at its first evaluation (100):
    # there at or before step 100, so its x3 is a lower bound, without an interval
    e = fast["existing"]
    assert e["step"]["value"] == pytest.approx(3) and e["wall_s"]["value"] == pytest.approx(6)
    assert e["wall_tuned"]["value"] == pytest.approx(400 / 100)
    assert e["step"]["bound"] and e["wall_s"]["bound"] and "lo" not in e["wall_s"]
    # best ends at FD 1, which the long reference never reaches: its end (3,200 steps) counts, a lower bound
    b = res["arms"]["best"]
    assert b["long_reached"] == [] and b["field"]["step"]["bound"]
    assert b["field"]["step"]["value"] == pytest.approx(3200 / math.sqrt(300 * 400))
    # the reference itself: its final FD 6 at step 300 (both seeds); the long run gets there at 800
    t = res["arms"]["tuned"]
    assert t["field"]["step"]["value"] == pytest.approx(800 / 300) and t["existing"] is None
    text = "\n".join(srr.readings_section(res, "../long", 8, "Both readings"))
    assert "| best | 1 | 350 [" in text and f"> x{3200 / math.sqrt(300 * 400):.3g} |" in text
    assert "| fast | 2 | 350 [" in text and f"(2/2) | x{f['step']['value']:.3g} [" in text
    assert "| > x6 | > x4 |" in text and "| tuned | 6 |" in text and "| - | - |" in text
    assert "reached the FD at its first evaluation" in text
    assert "trained 8x longer" in text and "`../long` (seeds [0, 1], 3200 steps" in text


def test_an_arm_there_at_its_first_evaluation_gives_a_bound_in_the_field_reading():
    # best at FD 1 from its first evaluation on both seeds: its time to its own final FD is at most 100 steps, so
    # the field's reading is a lower bound even where the long reference reaches that FD (seed 1 at 2,800 steps)
    rows = [r for r in ROWS if r["arm"] != "best"] + _rows("best", 0, [1, 1, 1, 1]) + _rows("best", 1, [1, 1, 1, 1])
    long = [r for r in LONG if r["seed"] == 0] + _rows("tuned", 1, [8, 6, 5, 4, 3, 2.5, 1.0, 0.9], 400)
    b = both_readings(_hand_spec(), rows, long, STEP_TIME)["arms"]["best"]
    assert b["axes"]["step"][0] == 100 and b["long_reached"] == [1]
    assert b["field"]["step"] == {"value": pytest.approx(math.sqrt(3200 * 2800) / 100), "bound": True}
    assert b["existing"]["step"]["bound"]  # the reference's FD 6 too, at its first evaluation
    # fast, there at its second evaluation on both seeds: an interval, as before
    assert not both_readings(_hand_spec(), rows, long, STEP_TIME)["arms"]["fast"]["field"]["step"]["bound"]


def test_an_arm_that_misses_the_reference_has_no_existing_reading():
    rows = [r for r in ROWS if r["arm"] != "fast"] + _rows("fast", 0, [9, 8, 7, 7]) + _rows("fast", 1, [9, 8, 7, 6])
    res = both_readings(_hand_spec(), rows, LONG, STEP_TIME)
    fast = res["arms"]["fast"]
    assert fast["existing"] is None and fast["existing_reached"] == (1, 2)
    assert fast["field"]["wall_tuned"]["value"] == pytest.approx(fast["field"]["wall_s"]["value"])  # no tuning
    text = "\n".join(srr.readings_section(res, "../long", 8, "Both readings"))
    assert "| 1/2 seeds reach it | 1/2 seeds reach it |" in text


TINY = [
    *TINY_SETS,
    "curriculum.pacing=none",
    "checkpoint.export_ema=false",
    "optim.warmup_steps=0",
    "engine.cpu_threads=1",
]


def _long_spec_dict(**extra):
    return {
        "name": "tl",
        "set": [*TINY, "engine.max_steps=8", "checkpoint.every=8", "optim.phema_every=4"],
        "seeds": [0],
        "metric": "fd",
        "reference": "ref",
        "eval_every": 4,
        "eval": {"num_samples": 16, "steps": 3},
        "arms": [{"name": "ref", "set": ["optim.schedule=cosine"]}, {"name": "fast", "set": ["optim.lr=3e-3"]}],
        "speedrun": {"official_arm": "ref", "smooth": 1},
        "long_reference": {"folder": "../long", "factor": 2, "set": ["optim.ema_decay=0.95"]},
        **extra,
    }


def test_the_long_reference_is_the_official_arm_at_its_pick_trained_longer_and_shared(tmp_path):
    tuned = _long_spec_dict(
        tuning={"budget": 4, "pick": "final", "seeds": [5, 6]},
        arms=[{"name": "ref", "set": ["optim.schedule=cosine"], "tune": {"optim.lr": [1.0e-3, 2.0e-3]}}],
    )
    spec = spec_from_dict(tuned)
    study = tmp_path / "a"
    assert long_spec(spec, study) is None  # the pick is not known yet
    write_json({"ref": {"pick": ["optim.lr=0.002"]}}, study / "tuning.json")
    long = long_spec(spec, study)
    assert long.name == "ref_x2" and long.seeds == [0] and long.eval == spec.eval and not long.tuning
    assert long.arms[0].set == [
        "optim.schedule=cosine",
        "optim.lr=0.002",
        "engine.max_steps=16",
        "optim.ema_decay=0.95",
    ]
    cfg = arm_config(long, long.arms[0], 0, "r")
    assert (cfg.engine.max_steps, cfg.optim.lr, cfg.optim.ema_decay, cfg.optim.schedule) == (16, 2e-3, 0.95, "cosine")
    assert cfg.logging.eval_every == 4 and cfg.eval.num_samples == 16  # the study's evaluations
    # a second study whose reference resolves to the same run reuses the folder (its spec kept as it was written)
    prepare_study(long, tmp_path / "long")
    other = spec_from_dict(
        {**tuned, "name": "tl2", "arms": [*tuned["arms"], {"name": "more", "tune": {"optim.lr": [1, 2]}}]}
    )
    write_json({"ref": {"pick": ["optim.lr=0.002"]}}, tmp_path / "b" / "tuning.json")
    assert prepare(other, tmp_path / "b").to_dict() == long.to_dict()


def test_a_tiny_speedrun_trains_its_long_reference_and_reports_both_readings(tmp_path, capsys):
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(_long_spec_dict()))
    out = tmp_path / "study"
    rc, err = _main(capsys, "study", str(tmp_path / "spec.yaml"), "--out", str(out), "--threads", "1")
    assert rc == 0, err
    st = json.loads((tmp_path / "long" / "status" / "ref-seed0.json").read_text())
    assert st["steps"] == 16 and [e["step"] for e in st["evals"]] == [4, 8, 12, 16]
    text = (out / "report.md").read_text()
    assert "## Both readings of the speed-up" in text and "trained 2x longer" in text
    assert "| fast |" in text.split("## Both readings of the speed-up")[1]
    from diffcurr_fast import cli

    assert cli.main(["study", str(tmp_path / "spec.yaml"), "--out", str(out), "--threads", "1"]) == 0
    assert "study ref_x2: 0 runs to do, 1 finished kept" in capsys.readouterr().out  # the long runs are kept
    # post hoc: the long reference's runs are evaluated too, each side read at its own best length
    assert _main(capsys, "study", "posthoc", str(out))[0] == 0
    assert sorted(p.name for p in (tmp_path / "long" / "posthoc").iterdir()) == ["ref-seed0.jsonl"]
    assert _main(capsys, "study", "report", str(out))[0] == 0
    text = (out / "report.md").read_text().split("## Both readings of the speed-up with post-hoc EMA")[1]
    assert "| fast |" in text and "(seeds [0], 16 steps;" in text
