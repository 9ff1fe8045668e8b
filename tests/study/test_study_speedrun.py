"""Time to quality: the threshold arithmetic by hand, the training clock of the evaluation records, a tiny
speedrun end to end (with a stand-in DiT checkout for the official step), and the presets."""

import json
import math
import shutil
import textwrap
import time
from pathlib import Path

import pytest
import yaml

from diffcurr_fast.study import speedrun as sr
from diffcurr_fast.study import speedrun_report as srr
from diffcurr_fast.study.presets import ema_decay_for, preset_spec, speedrun_arms
from diffcurr_fast.study.report import collect, write_report
from diffcurr_fast.study.runner import run_study
from diffcurr_fast.study.spec import check_spec, load_spec, spec_from_dict


@pytest.fixture(autouse=True)
def _shared_cache(one_thread, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


# ---- the arithmetic against a hand computation -------------------------------------------------------------------
def test_smoothing_and_the_first_crossing_by_hand():
    assert sr.smooth([10, 8, 6, 2], 3) == pytest.approx([10, 9, 8, 16 / 3])
    assert sr.smooth([10, 8, 6, 2], 1) == [10, 8, 6, 2]
    cols = ([10, 8, 6, 2], [100, 200, 300, 400], [1.0, 2.5, 3.0, 5.0], [10, 20, 30, 40])
    pts = [{"fd": f, "step": s, "wall_s": w, "train_flops": fl} for f, s, w, fl in zip(*cols)]
    # smoothed 10, 9, 8, 5.333: threshold 7 is first met at the 4th evaluation; between the 3rd (8) and the 4th
    # (16/3) the fraction is (8 - 7) / (8 - 16/3) = 0.375
    hit = sr.crossing(pts, 7.0, 3)
    assert hit == pytest.approx({"step": 337.5, "wall_s": 3.75, "train_flops": 33.75})
    assert sr.crossing(pts, 10.0, 3) == {"step": 100.0, "wall_s": 1.0, "train_flops": 10.0}  # met at once
    assert sr.crossing(pts, 8.0, 3) == pytest.approx({"step": 300.0, "wall_s": 3.0, "train_flops": 30.0})  # exact
    assert sr.crossing(pts, 5.0, 3) is None  # the raw FD reaches 2, the smoothed one never 5
    assert sr.crossing(pts, 5.0, 1) == pytest.approx({"step": 325.0, "wall_s": 3.5, "train_flops": 32.5})  # (6-5)/(6-2)


def test_interval_and_speedup_by_hand():
    half = 4.302652729749462 * 2.0 / math.sqrt(3)  # t_{0.975, 2} s / sqrt(n), s = 2
    assert sr.mean_ci([12.0, 14.0, 16.0]) == pytest.approx((14.0, 14.0 - half, 14.0 + half))
    # times cannot be negative: 4 - 4.97 is clipped at 0; a quantity with a negative value is not
    assert sr.mean_ci([2.0, 4.0, 6.0]) == pytest.approx((4.0, 0.0, 4.0 + half))
    assert sr.mean_ci([-2.0, 0.0, 2.0]) == pytest.approx((0.0, -half, half))
    assert sr.mean_ci([3.0])[0] == 3.0 and math.isnan(sr.mean_ci([3.0])[1])
    # geometric means sqrt(100 * 120) / sqrt(50 * 40) = sqrt(6); Welch on the logs: nu = 1.92357, t = 4.47072
    up, lo, hi = sr.speedup([100.0, 120.0], [50.0, 40.0])
    assert up == pytest.approx(math.sqrt(6))
    assert (lo, hi) == pytest.approx((1.2862701074, 4.6646501115), rel=1e-8)
    assert sr.speedup([10.0, 10.0], [5.0, 5.0]) == pytest.approx((2.0, 2.0, 2.0))  # no spread: a point


def test_plateau_rule_by_hand():
    curve = [(100, 10.0), (200, 8.0), (300, 7.0), (400, 6.9), (500, 6.85)]
    p = sr.plateau(curve, 0.2, 0.03)  # the last 20% of 5 evaluations, at least 2: 6.9 -> 6.85
    assert p["improvement"] == pytest.approx(0.05 / 6.9) and p["plateaued"] and p["from_step"] == 400
    assert sr.plateau(curve, 0.6, 0.03)["improvement"] == pytest.approx(0.15 / 7.0)
    p = sr.plateau(curve, 0.8, 0.03)  # 8 -> 6.85: still falling
    assert p["improvement"] == pytest.approx(1.15 / 8.0) and not p["plateaued"]


def _rows(arm, seed, fds, every=100, per_step_s=0.01, flops=2.0):
    return [
        {
            "arm": arm,
            "seed": seed,
            "step": every * (i + 1),
            "fd": f,
            "train_s": per_step_s * every * (i + 1),
            "train_flops": flops * every * (i + 1),
        }
        for i, f in enumerate(fds)
    ]


def test_analyse_threshold_time_axes_and_flag_by_hand():
    spec = spec_from_dict(
        {
            "name": "s",
            "seeds": [0, 1],
            "eval_every": 100,
            "reference": "official",
            "arms": [{"name": "official"}, {"name": "fast"}],
            "speedrun": {"official_arm": "official", "smooth": 1},
        }
    )
    rows = _rows("official", 0, [9, 7, 5, 4]) + _rows("official", 1, [9, 8, 6, 5])
    rows += _rows("fast", 0, [8, 5, 3, 2], per_step_s=0.02) + _rows("fast", 1, [7, 5, 4, 3], per_step_s=0.02)
    res = sr.analyse(spec, rows, None)
    assert res["threshold"] == 5  # the worst final FD of the official seeds (4 and 5)
    off, fast = res["arms"]["official"], res["arms"]["fast"]
    # official: seed 0 meets 5 at step 300, seed 1 at 400; fast: seed 0 at 200, seed 1 at 200
    assert off["per_seed"][0]["step"] == 300 and off["per_seed"][1]["step"] == 400
    assert fast["per_seed"][0]["step"] == 200 and fast["per_seed"][1]["step"] == 200
    assert fast["speedup"]["step"][0] == pytest.approx(math.sqrt(300 * 400) / 200)
    # wall: no step_time.json, so the official arm keeps its train_s (0.01 s per step), ours 0.02 s per step
    assert fast["speedup"]["wall_s"][0] == pytest.approx(math.sqrt(3 * 4) / 4)
    text = "\n".join(srr.markdown(spec, res))
    assert "was not measured" in text
    # with the official step measured at 0.005 s, its axis is steps x 0.005
    res = sr.analyse(spec, rows, {"official_s": 0.005, "ours_s": 0.01, "threads": 1})
    assert res["arms"]["official"]["per_seed"][1]["wall_s"] == pytest.approx(2.0)
    assert res["arms"]["fast"]["speedup"]["wall_s"][0] == pytest.approx(math.sqrt(1.5 * 2.0) / 4)
    assert "was not measured" not in "\n".join(srr.markdown(spec, res))
    # with every arm's step measured side by side, each arm's axis is steps x its own step time (fast: 0.03 s,
    # official: the official code's 0.005 s), whatever the runs recorded
    res = sr.analyse(
        spec,
        rows,
        {"official_s": 0.005, "ours_s": 0.01, "arms": {"official": 0.01, "fast": 0.03}, "steps_each": 60, "threads": 1},
    )
    assert res["arms"]["fast"]["per_seed"][0]["wall_s"] == pytest.approx(200 * 0.03)
    assert res["arms"]["fast"]["speedup"]["wall_s"][0] == pytest.approx(math.sqrt(1.5 * 2.0) / 6)
    assert "fast 30.00 ms" in "\n".join(srr.markdown(spec, res))
    # without the official code, the official arm takes our step at its recipe
    res = sr.analyse(spec, rows, {"ours_s": 0.01, "arms": {"official": 0.01, "fast": 0.03}, "steps_each": 60})
    assert res["arms"]["official"]["per_seed"][1]["wall_s"] == pytest.approx(400 * 0.01)
    # an arm with a seed that never gets there has no speed-up
    rows2 = rows + _rows("slow", 0, [9, 9, 9, 9]) + _rows("slow", 1, [9, 6, 5, 4])
    spec2 = spec_from_dict({**spec.to_dict(), "arms": [*spec.to_dict()["arms"], {"name": "slow"}]})
    slow = sr.analyse(spec2, rows2, None)["arms"]["slow"]
    assert slow["reached"] == [1] and slow["speedup"]["step"] is None


def test_an_arm_there_at_its_first_evaluation_is_a_bound_in_the_table_and_the_headline():
    spec = _three_arm_spec(arms=("official", "fast", "quick"))
    rows = _rows("official", 0, [9, 7, 5, 4]) + _rows("official", 1, [9, 8, 6, 5])  # threshold 5: steps 300, 400
    rows += _rows("fast", 0, [4, 3, 2, 2]) + _rows("fast", 1, [6, 5, 3, 2])  # step 100 (the first) and step 200
    rows += _rows("quick", 0, [6, 5, 4, 3]) + _rows("quick", 1, [7, 4, 3, 3])  # steps 200 and 150 (7 -> 4: 2/3)
    res = sr.analyse(spec, rows, None)
    fast, quick = res["arms"]["fast"], res["arms"]["quick"]
    assert fast["at_first"] == [0] and quick["at_first"] == [] and res["arms"]["official"]["at_first"] == []
    assert fast["per_seed"][0]["step"] == 100 and quick["per_seed"][1]["step"] == pytest.approx(200 - 100 / 3)
    assert fast["speedup"]["step"][0] == pytest.approx(math.sqrt(300 * 400 / (100 * 200)))  # its value is kept
    text = "\n".join(srr.table(res))
    assert "| fast | 2/2 (1 at the first evaluation) | " in text and f">= x{math.sqrt(6):.3g} [" in text
    assert "| quick | 2/2 | " in text and "| official | 2/2 | " in text and text.count(">= x") == 3  # fast's 3 axes
    assert "`fast` reached the threshold at the first evaluation" in text and "a lower bound" in text
    head = "\n".join(
        srr.references_section({"analyses": {"official": res}, "finals": {"official": 4.5}, "strongest": "official"})
    )
    assert f"in at most 1/{math.sqrt(6):.3g} of its wall time" in head and "1 of its seeds were there at" in head


def _three_arm_spec(seeds=(0, 1), arms=("official", "vanilla", "fast")):
    return spec_from_dict(
        {
            "name": "s",
            "seeds": list(seeds),
            "eval_every": 100,
            "reference": "official",
            "arms": [{"name": a} for a in arms],
            "speedrun": {"official_arm": "official", "smooth": 1},
        }
    )


def test_sample_efficiency_over_uniform_t_and_the_ratios_by_hand():
    spec = _three_arm_spec()
    rows = _rows("official", 0, [9, 8, 7, 6]) + _rows("official", 1, [9, 8, 7, 6])
    rows += _rows("vanilla", 0, [8, 6, 4, 3]) + _rows("vanilla", 1, [8, 6, 5, 3])
    rows += _rows("fast", 0, [6, 4, 3, 2]) + _rows("fast", 1, [5, 3, 3, 3])
    st = {
        "official_s": 0.04,
        "ours_s": 0.01,
        "arms": dict.fromkeys(("official", "vanilla", "fast"), 0.01),
        "steps_each": 9,
    }
    res = sr.analyse(spec, rows, st)
    assert res["threshold"] == 6 and res["reference"] == "official"
    eff = sr.efficiency(spec, rows, st, res["threshold"])
    # at FD 6: vanilla at step 200 (both seeds), fast at 100 (seed 0) and 150 (seed 1: 5 at step 100, so 100)
    assert eff[0]["threshold"] == 6 and eff[0]["reference"] == "vanilla"
    assert [eff[0]["arms"]["vanilla"]["per_seed"][s]["step"] for s in (0, 1)] == [200, 200]
    assert [eff[0]["arms"]["fast"]["per_seed"][s]["step"] for s in (0, 1)] == [100, 100]
    assert eff[0]["arms"]["fast"]["speedup"]["step"][0] == pytest.approx(2.0)
    assert eff[0]["arms"]["vanilla"]["speedup"]["step"] is None  # the reference itself
    # at vanilla's own worst final FD (3 and 3): vanilla at 400 both, fast at 300 (seed 0) and 200 (seed 1)
    assert eff[1]["threshold"] == 3 and "arm vanilla's worst final" in eff[1]["threshold_rule"]
    assert eff[1]["arms"]["fast"]["speedup"]["step"][0] == pytest.approx(400 / math.sqrt(300 * 200))
    text = "\n".join(srr.markdown(spec, res, eff))
    assert "### Sample efficiency: steps over uniform t" in text and "At FD 3 (arm vanilla's" in text
    assert "At FD 6 (the threshold above)" in text
    # x16 = the step (0.04 / 0.01 s) x the recipe (vanilla 200 steps vs official 400) x the strategy (fast 100 vs 200)
    assert (
        "Where `fast`'s x16 comes from (ratios of geometric means; they multiply to it): the time per step x4 "
        "(the official arm's over `fast`'s), the recipe x2 " in text
    )
    assert "the official arm sets nothing) and the timestep strategy x2 (`fast` over `vanilla`, in steps)" in text
    # the ratios the report states (whether they meet a goal is a reading in docs, not the report's): the best wall
    # speed-up over the official arm, official at 400 steps x 0.04 s, fast at 100 x 0.01 s: x16 with no spread (a
    # point interval); the steps over uniform t at FD 6 (both seeds agree: a point) and at FD 3 (fast's two seeds,
    # 300 and 200, leave an interval that reaches below x1)
    assert res["arms"]["fast"]["speedup"]["wall_s"] == pytest.approx((16.0, 16.0, 16.0))
    # fast is there at its first evaluation (step 100) on both seeds: its speed-ups are lower bounds (>=)
    first = "| fast | 2/2 (2 at the first evaluation) | 100 [100, 100] | "
    assert first + "1 [1, 1] | 200 [200, 200] | >= x4 [4, 4] | >= x16 [16, 16] | >= x4 [4, 4] |" in text
    assert first + ">= x2 [2, 2] |" in text
    assert "| fast | 2/2 | 250 [0, 885] | x1.63 [0.124, 21.5] |" in text
    assert "### Targets" not in text
    # an arm no faster than uniform t: a ratio of x1 at both thresholds
    slow = [r for r in rows if r["arm"] != "fast"] + _rows("fast", 0, [8, 6, 4, 3]) + _rows("fast", 1, [8, 6, 5, 3])
    eff = sr.efficiency(spec, slow, st, 6.0)
    assert [e["arms"]["fast"]["speedup"]["step"] for e in eff] == [pytest.approx((1.0, 1.0, 1.0))] * 2
    text = "\n".join(srr.efficiency_section(eff))
    assert (
        "| fast | 2/2 | 200 [200, 200] | x1 [1, 1] |" in text and "| fast | 2/2 | 400 [400, 400] | x1 [1, 1] |" in text
    )
    assert sr.efficiency(spec_from_dict({**spec.to_dict(), "arms": [{"name": "official"}]}), rows, st, 6.0) == []


def test_the_official_runs_of_a_longer_study_replace_the_studys_own():
    spec = _three_arm_spec((0, 1, 2))
    rows = _rows("official", 0, [9, 8]) + _rows("official", 1, [9, 8]) + _rows("official", 2, [9, 8])
    rows += _rows("fast", 0, [6, 5, 4, 4]) + _rows("fast", 1, [5, 4, 4, 4]) + _rows("fast", 2, [5, 4, 4, 3.5])
    longer = _rows("official", 0, [9, 8, 7, 6, 5, 4, 3.5, 3.4], every=200) + _rows(
        "official", 1, [9, 7, 5, 3], every=400
    )
    longer += _rows("vanilla", 0, [1, 1])  # not the official arm: ignored
    st = {"official_s": 0.02, "ours_s": 0.01, "arms": {"official": 0.01, "vanilla": 0.01, "fast": 0.01}}
    assert sr.analyse(spec, rows, st)["threshold"] == 8
    res = sr.with_official_runs(spec, rows, st, longer)
    assert res["threshold"] == 3.4  # the worst final FD of the longer runs (3.4 and 3); seed 2 has none there
    assert res["arms"]["official"]["seeds"] == [0, 1] and res["arms"]["official"]["reached"] == [0, 1]
    assert res["official_curve"][-1] == (1600, pytest.approx((3.4 + 3) / 2))  # the steps both longer runs share
    assert res["arms"]["fast"]["reached"] == []  # never at 3.4 in its 400 steps
    # official: seed 0 at step 1600, seed 1 between 1200 (5) and 1600 (3): 1200 + 400 * 1.6 / 2 = 1520
    assert [res["arms"]["official"]["per_seed"][s]["step"] for s in (0, 1)] == [1600, pytest.approx(1520)]
    assert res["arms"]["official"]["per_seed"][0]["wall_s"] == pytest.approx(1600 * 0.02)  # this study's step time
    text = "\n".join(srr.official_runs_section(spec, res, "elsewhere"))
    assert "## Against the official recipe run longer (`elsewhere`)" in text and "| fast | 0/3 |" in text
    assert "Where " not in text  # no arm reached it: no speed-up to split
    # the steps over uniform t at this threshold, with the longer official runs in its table
    rows += _rows("vanilla", 0, [6, 5, 4, 3.4]) + _rows("vanilla", 1, [6, 5, 4, 3])
    eff = sr.efficiency(spec, sr.merged_rows(spec, rows, longer), st, res["threshold"])
    text = "\n".join(srr.official_runs_section(spec, res, "elsewhere", eff[:1]))
    assert "Steps over uniform t at FD 3.4 (this threshold):" in text
    assert "| vanilla | 2/2 |" in text and "| official | 2/2 |" in text


def test_speedrun_spec_errors():
    base = {"name": "s", "eval_every": 10, "arms": [{"name": "official"}]}
    with pytest.raises(ValueError, match="unknown speedrun keys"):
        spec_from_dict({**base, "speedrun": {"official_arm": "official", "window": 3}})
    with pytest.raises(ValueError, match="must name an arm"):
        spec_from_dict({**base, "speedrun": {"official_arm": "nope"}})
    with pytest.raises(ValueError, match="threshold must be 'reference' or a number"):
        spec_from_dict({**base, "speedrun": {"official_arm": "official", "threshold": "final"}})
    with pytest.raises(ValueError, match="lower-is-better"):
        spec_from_dict({**base, "metric": "is", "speedrun": {"official_arm": "official"}})


# ---- the training clock -----------------------------------------------------------------------------------------
TINY = [
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "diffusion.num_timesteps=60",
    "curriculum.num_clusters=4",
    "curriculum.pacing=none",
    "data.batch_size=16",
    "logging.log_every=4",
    "logging.progress=false",
    "logging.num_samples=0",
    "logging.plots=false",
    "checkpoint.export_ema=false",
    "eval.num_samples=16",
    "eval.steps=3",
    "engine.cpu_threads=1",
]


def test_eval_records_carry_the_training_time_without_evaluations(tmp_path, monkeypatch):
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.evaluation import Evaluator
    from diffcurr_fast.train.loop import train

    call, clock, skip = Evaluator.__call__, time.perf_counter, [0.0]

    def slow(self, *a, **k):  # every evaluation takes 1000 s more on the clock (not in its own eval_s)
        skip[0] += 1000.0
        return call(self, *a, **k)

    monkeypatch.setattr(Evaluator, "__call__", slow)
    monkeypatch.setattr(time, "perf_counter", lambda: clock() + skip[0])
    run = tmp_path / "r"
    cfg = load_config(
        None, [*TINY, f"checkpoint.run_dir={run}", "engine.max_steps=24", "logging.eval_every=8", "checkpoint.every=16"]
    )
    t0 = clock()
    train(cfg)
    elapsed = clock() - t0  # the real time
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    evals = [r for r in recs if r.get("eval")]
    ts = [r["train_s"] for r in evals]
    assert [r["step"] for r in evals] == [8, 16, 24] and ts == sorted(ts) and ts[0] > 0
    assert ts[-1] < elapsed < 1000  # none of the evaluations' 3 x 1000 s is training time
    # a resumed run continues the clock from its checkpoint (the final one, step 24)
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint

    saved = load_checkpoint(latest_checkpoint(run), map_location="cpu")["train_s"]
    assert ts[2] <= saved < ts[2] + elapsed
    cfg2 = load_config(
        None, [*TINY, f"checkpoint.run_dir={run}", "engine.max_steps=32", "logging.eval_every=8", "checkpoint.every=16"]
    )
    train(cfg2, resume=True)
    last = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 32 and saved < last["train_s"] < 1000


# ---- a tiny speedrun end to end ---------------------------------------------------------------------------------
# A stand-in for a facebookresearch/DiT checkout (models.DiT, diffusion.create_diffusion): the real one is not
# available offline; tests/study/test_study_step_time.py times it when DIFFCURR_FAST_PEER_DIT names one.
FAKE_MODELS = """
import torch
from torch import nn


class DiT(nn.Module):
    def __init__(self, input_size=32, patch_size=2, in_channels=4, hidden_size=1152, depth=28, num_heads=16,
                 mlp_ratio=4.0, class_dropout_prob=0.1, num_classes=1000, learn_sigma=True):
        super().__init__()
        self.dims = dict(input_size=input_size, patch_size=patch_size, hidden_size=hidden_size, depth=depth)
        self.net = nn.Conv2d(in_channels, 2 * in_channels, 1)

    def forward(self, x, t, y):
        return self.net(x)


DiT_models = {}
"""
FAKE_DIFFUSION = """
import torch


class _Diffusion:
    num_timesteps = 1000

    def q_sample(self, x, t, noise=None):
        return x

    def training_losses(self, model, x, t, model_kwargs):
        out = model(x, t, **model_kwargs)
        return {"loss": ((out[:, : x.shape[1]] - x) ** 2).mean(dim=(1, 2, 3))}


def create_diffusion(timestep_respacing=""):
    return _Diffusion()
"""


def _fake_checkout(root):
    (root / "diffusion").mkdir(parents=True)
    (root / "models.py").write_text(textwrap.dedent(FAKE_MODELS))
    (root / "diffusion" / "__init__.py").write_text(textwrap.dedent(FAKE_DIFFUSION))
    return root


SPEEDRUN_SPEC = {
    "name": "tinyrun",
    "set": [*TINY, "engine.max_steps=24", "checkpoint.every=24", "optim.ema_warmup=false", "optim.ema_decay=0.9"],
    "seeds": [0],
    "metric": "fd",
    "reference": "official",
    "eval_every": 6,
    "eval": {"num_samples": 16, "steps": 3},
    "arms": [
        {"name": "official", "set": ["optim.lr=1e-4", "optim.warmup_steps=0", "optim.schedule=constant"]},
        {"name": "fast", "set": ["optim.lr=3e-3"]},
    ],
    "speedrun": {"official_arm": "official", "threshold": "reference", "smooth": 2},
}


def test_tiny_speedrun_end_to_end(tmp_path):
    peer = _fake_checkout(tmp_path / "DiT")
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(SPEEDRUN_SPEC))
    spec = load_spec(tmp_path / "spec.yaml")
    out = tmp_path / "study"
    res = run_study(spec, out, workers=2, verbose=False, peer_dit=peer)
    assert res == {"ran": [("official", 0), ("fast", 0)], "failed": [], "kept": 0}
    step_time = json.loads((out / "step_time.json").read_text())
    assert step_time["official_s"] > 0 and step_time["ours_s"] > 0 and step_time["checkout"] == "DiT"
    assert sorted(step_time["arms"]) == ["fast", "official"] and step_time["ours_s"] == step_time["arms"]["official"]
    files = write_report(out)
    for name in ("speedrun.json", "fd_vs_wall.png", "fd_vs_step.png"):
        assert (out / name).is_file(), name
    header = (out / "results.csv").read_text().splitlines()[0].split(",")
    assert header[-2:] == ["train_s", "train_flops"]
    # the report's threshold and the official arm's crossings, by hand from the runs' own records
    _, rows, status = collect(out)
    fd = [r["fd"] for r in sorted((r for r in rows if r["arm"] == "official"), key=lambda r: r["step"])]
    assert len(fd) == 4
    data = json.loads((out / "speedrun.json").read_text())
    assert data["threshold"] == pytest.approx((fd[-2] + fd[-1]) / 2)  # its final 2-evaluation mean
    assert data["arms"]["official"]["reached"] == [0]  # the official arm reaches its own final FD by its end
    flops = status[("official", 0)]["train_flops"] / 24
    r0 = [r for r in rows if r["arm"] == "official" and r["seed"] == 0 and r["step"] == 24][0]
    assert r0["train_flops"] == pytest.approx(flops * 24)
    text = files["report"].read_text()
    assert "## Time to quality" in text and f"{1e3 * step_time['official_s']:.2f} ms median" in text
    assert "| official | 1/1" in text  # "(1 at the first evaluation)" where a tiny run starts low
    # the time axes: steps x the side-by-side step times (the official arm: the official code's)
    hit = data["arms"]["fast"]["axes"]
    if data["arms"]["fast"]["reached"]:
        assert hit["wall_s"][0] == pytest.approx(hit["step"][0] * step_time["arms"]["fast"])
    off = data["arms"]["official"]["axes"]
    assert off["wall_s"][0] == pytest.approx(off["step"][0] * step_time["official_s"])
    assert run_study(spec, out, workers=2, verbose=False, peer_dit=peer)["kept"] == 2  # measured once: kept
    # its own official runs as "the longer study": the same numbers in the added section
    files = write_report(out, official_from=out)
    assert json.loads(files["speedrun_official"].read_text())["threshold"] == data["threshold"]
    assert "## Against the official recipe run longer" in files["report"].read_text()
    data = json.loads((out / "speedrun.json").read_text())
    # the status files alone carry the report: the run folders (checkpoints, never committed) can go
    shutil.rmtree(out / "runs")
    (out / "speedrun.json").unlink()
    with pytest.warns(UserWarning, match="kept as they were"):  # drawn from the run folders: kept
        write_report(out)
    assert json.loads((out / "speedrun.json").read_text()) == data


# ---- the presets ------------------------------------------------------------------------------------------------
def test_speedrun_preset_settings():
    spec = preset_spec("speedrun")
    assert len(spec.seeds) == 5 and spec.speedrun["official_arm"] == "official"
    names = [a.name for a in spec.arms]
    assert {"official", "vanilla", "vanilla_plain", "minsnr", "cl", "cl_minsnr", "anti_cl", "adaptive_pacing"} <= set(
        names
    )
    official = set(spec.arm("official").set)
    assert {
        "diffusion.beta_schedule=linear",
        "diffusion.weighting=none",
        "curriculum.pacing=none",
        "optim.lr=1e-4",
        "optim.schedule=constant",
        "optim.weight_decay=0",
    } <= official
    assert "diffusion.learn_sigma=true" in spec.set and "optim.ema_warmup=false" in spec.set
    # the EMA rule: the half-life is the official recipe's share of the run, ln 0.5 / ln 0.9999 of 400k steps
    steps = 12_000
    d = ema_decay_for(steps)
    assert math.log(0.5) / math.log(d) == pytest.approx(steps * (math.log(0.5) / math.log(0.9999)) / 400_000, rel=1e-3)
    assert f"optim.ema_decay={d}" in spec.set
    assert all(spec.reference_of(a) == "official" for a in spec.arms)


def test_speedrun_plateau_preset_is_the_official_arm_run_longer():
    spec, main = preset_spec("speedrun_plateau"), preset_spec("speedrun")
    assert [a.name for a in spec.arms] == ["official"] and spec.arm("official").set == main.arm("official").set
    assert f"optim.ema_decay={ema_decay_for(48_000)}" in spec.set and "engine.max_steps=48000" in spec.set
    assert not [s for s in spec.set if s.startswith(("engine.max_steps", "optim.ema_decay"))][2:]
    same = [s for s in main.set if not s.startswith(("engine.max_steps", "optim.ema_decay"))]
    assert [s for s in spec.set if not s.startswith(("engine.max_steps", "optim.ema_decay"))] == same
    assert spec.eval == main.eval and spec.speedrun == main.speedrun and spec.eval_every == 1600


def test_speedrun_tdc_preset_spends_the_vanilla_budget(tmp_path):
    from diffcurr_fast.study.presets import tdc_finetune_steps
    from diffcurr_fast.study.spec import arm_config

    # experts of 3 groups at k = 0.5 cost 2/3, 5/6 and 1 of the base model: 2.5 base steps per fine-tuning step
    assert tdc_finetune_steps(12_000, 9_600, 3, 0.5) == 960 and tdc_finetune_steps(100, 40, 2, 0.5) == 34
    spec, main = preset_spec("speedrun_tdc"), preset_spec("speedrun")
    assert [(a.name, a.kind) for a in spec.arms] == [("vanilla", "train"), ("tdc", "tdc")]
    tdc = spec.arm("tdc")
    assert {"engine.max_steps=9600", "tdc.finetune_steps=960", "tdc.budget_floor=0.5"} <= set(tdc.set)
    # the vanilla arm is the screening's, run for run
    ours = arm_config(spec, spec.arm("vanilla"), 1, tmp_path / "r", 1).to_dict()
    theirs = arm_config(main, main.arm("vanilla"), 1, tmp_path / "r", 1).to_dict()
    assert ours == theirs
    cfg = arm_config(spec, tdc, 0, tmp_path / "t", 1)
    assert cfg.engine.max_steps == 9600 and cfg.tdc.num_groups == 3 and cfg.tdc.finetune_lr == 1e-4


def test_the_presets_reproduce_the_committed_studies():
    """A study's settings are fixed when it starts: the presets still give the committed study.yaml files (a
    preset edited after its study began would make the study refuse to resume)."""
    root = Path(__file__).resolve().parents[2] / "docs" / "results"
    checked = 0
    for name in (
        "speedrun",
        "speedrun_plateau",
        "speedrun_tdc",
        "speedrun_tuned",
        "speedrun_levers",
        "speedrun_edge",
        "speedrun_tuned_mnist5k",
        "speedrun_optim",
        "speedrun_optim_mnist5k",
    ):
        path = root / name / "study.yaml"
        if path.is_file():
            assert spec_from_dict(yaml.safe_load(path.read_text())).to_dict() == preset_spec(name).to_dict(), name
            checked += 1
    if not checked:
        pytest.skip("no committed speedrun study.yaml in this checkout")


def test_every_arm_of_the_speedrun_builds():
    spec = spec_from_dict({**preset_spec("speedrun").to_dict(), "arms": speedrun_arms()})
    check_spec(spec)
    assert {"lognormal", "importance", "speed", "anuts"} <= {a.name for a in spec.arms}


def test_mnist_stage_takes_the_best_arms_of_the_screening(tmp_path):
    with pytest.raises(ValueError, match="--screen DIR"):
        preset_spec("speedrun_mnist5k")
    arms = {
        "official": None,
        "vanilla": 1.1,
        "minsnr": 2.0,
        "cl": None,
        "cl_minsnr": 3.0,
        "anti_cl": 0.5,
        "adaptive_pacing": 1.5,
    }
    data = {
        "official_arm": "official",
        "arms": {
            n: {
                "seeds": [0],
                "reached": [0],
                "axes": {"wall_s": [10.0 if up is None else 5.0, 0, 0]},
                "speedup": {"wall_s": None if up is None else [up, up, up]},
            }
            for n, up in arms.items()
        },
    }
    (tmp_path / "speedrun.json").write_text(json.dumps(data))
    assert sr.best_arms(tmp_path, 4) == ["cl_minsnr", "minsnr", "adaptive_pacing", "vanilla"]
    spec = preset_spec("speedrun_mnist5k", screen=str(tmp_path))
    assert [a.name for a in spec.arms] == [
        "official",
        "cl_minsnr",
        "minsnr",
        "adaptive_pacing",
        "vanilla",
        "cl_minsnr_plain",
    ]
    assert "data.dataset=mnist5k" in spec.set and spec.eval["features"] == "mnist5k" and len(spec.seeds) == 3


def test_study_cli_options_are_checked(tmp_path):
    import argparse

    from diffcurr_fast.study import cli

    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    for extra in (["--official-from", str(tmp_path)], ["--against", "official"]):
        with pytest.raises(ValueError, match="--official-from and --against are options of 'study report DIR'"):
            cli.run(p.parse_args(["--preset", "speedrun", *extra]))
    with pytest.raises(ValueError, match="study posthoc needs the study folder: diffcurr-fast study posthoc DIR"):
        cli.run(p.parse_args(["posthoc"]))
    with pytest.raises(ValueError, match="--threads must be >= 1, got 0"):
        run_study(preset_spec("speedrun"), tmp_path / "s", threads=0, verbose=False)
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "study.yaml").write_text(
        yaml.safe_dump({"name": "p", "seeds": [0], "arms": [{"name": "a"}], "reference": "a", "eval_every": 10})
    )
    with pytest.raises(ValueError, match="--official-from applies to a speedrun study"):
        cli.run(p.parse_args(["report", str(tmp_path / "plain"), "--official-from", str(tmp_path)]))
    with pytest.raises(ValueError, match="--against applies to a speedrun study"):
        cli.run(p.parse_args(["report", str(tmp_path / "plain"), "--against", "a"]))
