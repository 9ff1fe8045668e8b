"""Time to quality: the decision rules of ``diffcurr_fast.study.speedrun`` pinned to numbers worked out by hand from
its module doc, at their boundaries (seeds on different step grids, a reference seed that never reaches the
threshold, shares that do not divide the count, a crossing exactly on an evaluation, the smoothing window at a
run's start, intervals that straddle x1, ties and unfinished arms in ``best_arms``). Each number below is written
out from the definitions, not read back from the code."""

import json
import math

import pytest
from scipy import stats

from diffcurr_fast.study import speedrun as sr
from diffcurr_fast.study.spec import spec_from_dict

AXES = ("step", "wall_s", "train_flops")


def _spec(arms, seeds=(0, 1), **speedrun):
    return spec_from_dict(
        {
            "name": "pinned",
            "seeds": list(seeds),
            "eval_every": 100,
            "reference": "official",
            "arms": [{"name": n} for n in arms],
            "speedrun": {"official_arm": "official", "smooth": 1, **speedrun},
        }
    )


def _rows(arm, seed, fds, every=100):
    """Evaluations at every, 2 every, ...; the run's clock 0.01 s and 2 FLOPs per step (no step_time.json: the
    wall axis is the recorded train_s)."""
    return [
        {"arm": arm, "seed": seed, "step": every * (i + 1), "fd": f, "train_s": 0.01 * every * (i + 1)}
        | {"train_flops": 2.0 * every * (i + 1)}
        for i, f in enumerate(fds)
    ]


def _at(step):
    """The three axes at a step (0.01 s and 2 FLOPs per step)."""
    return {"step": step, "wall_s": 0.01 * step, "train_flops": 2.0 * step}


def _welch(reference, arm):
    """The module doc's speed-up, written out: exp(d +- t_{0.975, nu} sqrt(s_o^2 / n_o + s_a^2 / n_a))."""
    lr, la = [math.log(x) for x in reference], [math.log(x) for x in arm]
    no, na = len(lr), len(la)
    mo, ma = sum(lr) / no, sum(la) / na
    vo = sum((x - mo) ** 2 for x in lr) / (no - 1) / no
    va = sum((x - ma) ** 2 for x in la) / (na - 1) / na
    nu = (vo + va) ** 2 / (vo**2 / (no - 1) + va**2 / (na - 1))
    half = float(stats.t.ppf(0.975, nu)) * math.sqrt(vo + va)
    d = mo - ma
    return math.exp(d), math.exp(d - half), math.exp(d + half)


# ---- the official mean curve over seeds that evaluate on different step grids -----------------------------------
def test_official_curve_on_different_step_grids_keeps_the_shared_steps_of_each_seeds_own_smoothing():
    """* smoothing: the trailing moving average of the last ``smooth`` evaluations of a run (fewer at its start);
    * plateau: on the official arm's mean smoothed FD curve over seeds, the last plateau_share of its evaluations."""
    spec = _spec(["official", "fast"], smooth=2, plateau_share=0.6, plateau_tol=0.05)
    # seed 0 every 100 steps, seed 1 every 200: they share steps 200, 400 and 600
    rows = _rows("official", 0, [10, 8, 6, 5, 4, 3.8]) + _rows("official", 1, [9, 6, 4.4], every=200)
    rows += _rows("fast", 0, [6, 5, 4]) + _rows("fast", 1, [5, 5], every=300)
    res = sr.analyse(spec, rows, None)
    # each run smoothed on its own grid (window 2, one value at its start):
    #   seed 0: 10, 9, 7, 5.5, 4.5, 3.9 at 100 .. 600; seed 1: 9, 7.5, 5.2 at 200, 400, 600
    # the mean curve at the steps both evaluated: 200 (9 + 9) / 2, 400 (5.5 + 7.5) / 2, 600 (3.9 + 5.2) / 2
    steps = [s for s, _ in res["official_curve"]]
    assert steps == [200, 400, 600]
    assert [f for _, f in res["official_curve"]] == pytest.approx([9.0, 6.5, 4.55])
    # plateau: 60% of 3 evaluations is 1.8 -> 2 (at least two): 400 -> 600 improves by 1.95 / 6.5 = 30%
    pl = res["plateau"]
    assert (pl["evaluations"], pl["from_step"], pl["to_step"]) == (2, 400, 600)
    assert pl["improvement"] == pytest.approx(0.3) and pl["plateaued"] is False
    # threshold: the worst final smoothed FD, seed 1's 5.2 (seed 0's is 3.9)
    assert res["threshold"] == pytest.approx(5.2)
    off = res["arms"]["official"]
    # seed 0: 5.5 at 400, 4.5 at 500: (5.5 - 5.2) / (5.5 - 4.5) = 0.3 -> step 430; seed 1 meets it exactly at 600
    assert off["per_seed"][0] == pytest.approx(_at(430.0))
    assert off["per_seed"][1] == pytest.approx(_at(600.0))
    # fast: seed 0 smoothed 6, 5.5, 4.5 -> 230; seed 1 smoothed 5, 5 on its 300-step grid -> its first evaluation
    fast = res["arms"]["fast"]
    assert fast["per_seed"][0] == pytest.approx(_at(230.0)) and fast["per_seed"][1] == pytest.approx(_at(300.0))
    assert fast["speedup"]["step"][0] == pytest.approx(math.sqrt(430 * 600) / math.sqrt(230 * 300))


# ---- a reference seed that never reaches the threshold ----------------------------------------------------------
def test_a_reference_seed_that_never_reaches_a_stated_threshold_leaves_every_speedup_na():
    """reached: a run that never gets there has not reached it; per arm: mean and interval over the seeds that
    reached it; speed-up: only when every seed of both arms reached the threshold; otherwise n/a."""
    spec = _spec(["official", "fast"], seeds=(0, 1, 2))
    rows = _rows("official", 0, [9, 7, 5, 4]) + _rows("official", 1, [9, 8, 7, 6])  # seed 1 never reaches 5
    rows += _rows("official", 2, [9, 6, 4, 4])
    rows += _rows("fast", 0, [8, 5, 4, 3]) + _rows("fast", 1, [7, 6, 4, 3]) + _rows("fast", 2, [5, 4, 3, 3])
    res = sr.analyse(spec, rows, None, threshold=5.0)
    assert res["threshold"] == 5.0 and res["threshold_rule"] == "stated"
    off, fast = res["arms"]["official"], res["arms"]["fast"]
    assert off["seeds"] == [0, 1, 2] and off["reached"] == [0, 2] and 1 not in off["per_seed"]
    # official: seed 0 at 300 (exactly 5), seed 2 between 200 (6) and 300 (4): 250
    assert off["per_seed"][0] == pytest.approx(_at(300.0)) and off["per_seed"][2] == pytest.approx(_at(250.0))
    half = 12.706204736174698 * math.sqrt(1250.0) / math.sqrt(2)  # t_{0.975, 1} s / sqrt(2) over 300 and 250
    assert off["axes"]["step"] == pytest.approx((275.0, 0.0, 275.0 + half))  # 275 - 318 clipped: no negative steps
    # fast reaches it with every seed: 200, 250 (between 6 and 4) and 100 (5 at once)
    assert fast["reached"] == [0, 1, 2]
    assert [fast["per_seed"][s]["step"] for s in (0, 1, 2)] == pytest.approx([200.0, 250.0, 100.0])
    # ... but the official seed 1 did not: no speed-up on any axis (not one over its two other seeds)
    assert fast["speedup"] == dict.fromkeys(AXES)
    assert off["speedup"] == dict.fromkeys(AXES)  # the reference itself
    # the same rule on the sample-efficiency table: uniform t (the reference there) with a seed that never gets to
    # the threshold above leaves fast without a ratio, though fast reaches it with both seeds
    spec3 = _spec(["official", "vanilla", "fast"])
    rows3 = _rows("official", 0, [9, 7, 5]) + _rows("official", 1, [9, 6, 5])
    rows3 += _rows("vanilla", 0, [8, 6, 4]) + _rows("vanilla", 1, [8, 7, 6])
    rows3 += _rows("fast", 0, [6, 4, 3]) + _rows("fast", 1, [7, 5, 4])
    eff = sr.efficiency(spec3, rows3, None, 5.0)
    assert eff[0]["arms"]["vanilla"]["reached"] == [0] and eff[0]["arms"]["fast"]["reached"] == [0, 1]
    assert eff[0]["arms"]["fast"]["speedup"] == dict.fromkeys(AXES)


# ---- the reference threshold, the crossing on an evaluation and the smoothing window at a run's start -----------
def test_reference_threshold_is_the_worst_final_smoothed_fd_reached_exactly_at_the_end():
    """threshold: reference = the largest final smoothed FD over the official arm's seeds (so every one of its
    seeds reaches it, at its end at the latest); reached: at the first evaluation whose smoothed FD is <= it."""
    spec = _spec(["official", "fast"], smooth=3)
    # official seed 0: raw 9, 6, 3, 6 -> smoothed 9, 7.5, 6, 5 (its raw final 6, its raw best 3 at step 300)
    # official seed 1: raw 9, 5, 4, 3 -> smoothed 9, 7, 6, 4
    rows = _rows("official", 0, [9, 6, 3, 6]) + _rows("official", 1, [9, 5, 4, 3])
    # fast seed 0: raw 6, 3, 3 -> smoothed 6, 4.5 (two values at its start), 4; seed 1: raw 4, 9, 9 -> 4 at once
    rows += _rows("fast", 0, [6, 3, 3]) + _rows("fast", 1, [4, 9, 9])
    res = sr.analyse(spec, rows, None)
    assert res["threshold"] == 5.0  # max(5, 4): the smoothed finals, not the raw ones (6, 3)
    off, fast = res["arms"]["official"], res["arms"]["fast"]
    assert off["reached"] == [0, 1]
    # seed 0 meets 5 only at its last evaluation, on the point: (6 - 5) / (6 - 5) = 1 -> step 400
    assert off["per_seed"][0] == _at(400.0)
    # seed 1: 6 at 300, 4 at 400: (6 - 5) / (6 - 4) = 0.5 -> 350
    assert off["per_seed"][1] == pytest.approx(_at(350.0))
    # fast seed 0 at its second evaluation, whose window holds two: (6 - 5) / (6 - 4.5) = 2/3 -> 166.67
    assert fast["per_seed"][0] == pytest.approx(_at(100.0 + 100.0 * 2 / 3))
    # fast seed 1 at its first evaluation (the smoothed value is the raw one): step 100, nothing to interpolate
    assert fast["per_seed"][1] == _at(100.0)
    assert fast["speedup"]["step"][0] == pytest.approx(math.sqrt(400 * 350) / math.sqrt(100 * 500 / 3))
    # the official curve: 400 -> the mean of both finals, (5 + 4) / 2; its start: 9 and 9
    assert res["official_curve"] == [(100, 9.0), (200, 7.25), (300, 6.0), (400, 4.5)]


# ---- the speed-up interval with unequal seed counts, straddling x1 ----------------------------------------------
def test_speedup_interval_with_unequal_seed_counts_straddles_one():
    """speed-up: the ratio of geometric means T_official / T_arm, with the 95% Welch interval of the difference of
    mean logs, exp(d +- t_{0.975, nu} sqrt(s_o^2 / n_o + s_a^2 / n_a)) (nu: Welch-Satterthwaite)."""
    # the official runs of a longer study with 2 seeds, this study's fast arm with 3 (the doc's own use of
    # with_official_runs): n_o = 2, n_a = 3
    spec = _spec(["official", "fast"], seeds=(0, 1, 2), threshold=5)
    own = _rows("official", 0, [9, 9]) + _rows("official", 1, [9, 9]) + _rows("official", 2, [9, 9])
    longer = _rows("official", 0, [9, 8, 5]) + _rows("official", 1, [9, 8, 7, 6, 5])  # 300 and 500
    rows = own + _rows("fast", 0, [8, 5]) + _rows("fast", 1, [9, 6, 4]) + _rows("fast", 2, [9, 8, 7, 6, 4])
    res = sr.with_official_runs(spec, rows, None, longer)
    assert res["threshold"] == 5.0 and res["arms"]["official"]["seeds"] == [0, 1]
    fast = res["arms"]["fast"]
    assert [fast["per_seed"][s]["step"] for s in (0, 1, 2)] == pytest.approx([200.0, 250.0, 450.0])
    up = fast["speedup"]["step"]
    # sqrt(300 * 500) / (200 * 250 * 450)^(1/3) = 387.298 / 282.311
    assert up[0] == pytest.approx(math.sqrt(300 * 500) / (200 * 250 * 450) ** (1 / 3))
    assert up == pytest.approx(_welch([300.0, 500.0], [200.0, 250.0, 450.0]), rel=1e-9)
    assert up[1] < 1.0 < up[2]  # faster on average, not beyond chance
    # n_o = 3 against n_a = 2 by hand: logs of 300, 400, 500 and 200, 450; nu = 1.2724, t = 7.7816
    got = sr.speedup([300.0, 400.0, 500.0], [200.0, 450.0])
    assert got == pytest.approx((1.3049558803896195, 0.04540150001546753, 37.507788270944665), rel=1e-9)
    assert got == pytest.approx(_welch([300.0, 400.0, 500.0], [200.0, 450.0]), rel=1e-9)


# ---- the plateau share that does not divide the count, and its tolerance ----------------------------------------
def test_speedup_with_one_seed_on_a_side_is_the_ratio_without_an_interval():
    """One seed on either side: the ratio of geometric means, no interval (a variance needs two); none on a side:
    nothing."""
    ratio, lo, hi = sr.speedup([4.0], [2.0, 1.0])
    assert ratio == pytest.approx(4.0 / math.sqrt(2.0), rel=1e-12) and math.isnan(lo) and math.isnan(hi)
    ratio, lo, hi = sr.speedup([8.0, 2.0], [2.0])
    assert ratio == pytest.approx(2.0, rel=1e-12) and math.isnan(lo) and math.isnan(hi)
    assert all(math.isnan(v) for v in sr.speedup([], [2.0]) + sr.speedup([2.0], []))


def test_plateau_share_of_seven_evaluations_and_the_strict_tolerance():
    """plateau: the last plateau_share of its evaluations (at least two) improve it by (f_first - f_last) /
    f_first; it has stopped falling when that is below plateau_tol. The last share of 7 evaluations is read as
    the share's evaluations rounded up (the code's ceil: it covers at least that share)."""
    curve = [(100, 10.0), (200, 9.0), (300, 8.0), (400, 7.5), (500, 7.2), (600, 7.1), (700, 7.0)]
    p = sr.plateau(curve, 0.3, 0.05)  # 2.1 of 7 -> 3 evaluations: 500 -> 700
    assert (p["evaluations"], p["from_step"], p["to_step"]) == (3, 500, 700)
    assert p["improvement"] == pytest.approx(0.2 / 7.2) and p["plateaued"] is True
    p = sr.plateau(curve, 0.5, 0.05)  # 3.5 -> 4 evaluations: 400 -> 700
    assert (p["evaluations"], p["from_step"]) == (4, 400) and p["improvement"] == pytest.approx(0.5 / 7.5)
    assert p["plateaued"] is False
    p = sr.plateau(curve, 0.1, 0.05)  # 0.7 -> 1, at least two: 600 -> 700
    assert (p["evaluations"], p["from_step"]) == (2, 600) and p["improvement"] == pytest.approx(0.1 / 7.1)
    p = sr.plateau(curve, 0.9, 0.05)  # 6.3 -> 7: the whole curve
    assert (p["evaluations"], p["from_step"]) == (7, 100) and p["improvement"] == pytest.approx(0.3)
    # below the tolerance, strictly: 8 -> 7 improves by exactly 1/8
    two = [(100, 8.0), (200, 7.0)]
    assert sr.plateau(two, 0.5, 0.125)["improvement"] == 0.125
    assert sr.plateau(two, 0.5, 0.125)["plateaued"] is False
    assert sr.plateau(two, 0.5, 0.1250001)["plateaued"] is True
    one = sr.plateau([(100, 8.0)], 0.5, 0.5)  # fewer than two evaluations: no rule
    assert math.isnan(one["improvement"]) and one["plateaued"] is False and one["from_step"] is None


# ---- best_arms: the ranking, its ties, intervals, incomplete and unfinished arms ---------------------------------
def _arm(up, wall):
    return {
        "seeds": [0, 1],
        "reached": [0, 1],
        "axes": {"wall_s": [wall, wall, wall]},
        "speedup": {"wall_s": up, "step": up, "train_flops": up},
    }


def test_best_arms_ranks_by_the_wall_speedup_ratio_then_unfinished_arms_by_mean_wall_time(tmp_path):
    """best_arms: the arms with the largest wall-time speed-up over the official arm (arms without one rank last,
    by mean wall time to the threshold; the official arm is left out)."""
    nan = math.nan
    data = {
        "official_arm": "official",
        "arms": {
            "official": _arm(None, 40.0),
            "none": _arm(None, nan) | {"seeds": [], "reached": [], "axes": {"wall_s": [nan, nan, nan]}},
            "partial": _arm(None, 30.0) | {"reached": [0]},  # a seed never reached it: no speed-up
            "narrow": _arm([1.4, 1.2, 1.6], 28.0),
            "slowest": _arm([0.5, 0.3, 0.9], 80.0),  # a speed-up below x1 still ranks above none
            "wide": _arm([1.5, 0.8, 2.8], 26.0),  # the larger ratio, though its interval straddles x1
            "tie": _arm([1.4, 1.1, 1.7], 28.0),  # the same ratio as narrow, listed after it
            "partial_fast": _arm(None, 20.0) | {"reached": [1]},
        },
    }
    (tmp_path / "speedrun.json").write_text(json.dumps(data))
    assert sr.best_arms(tmp_path, 10) == ["wide", "narrow", "tie", "slowest", "partial_fast", "partial", "none"]
    assert sr.best_arms(tmp_path / "speedrun.json", 2) == ["wide", "narrow"]
    assert sr.best_arms(tmp_path, 3)[-1] == "tie"  # a tie keeps the screening's arm order (the sort is stable)


def test_best_arms_puts_an_arm_without_a_finished_run_last_through_the_analysis_file(tmp_path):
    """An arm with no finished run has no seeds and a NaN mean wall time in speedrun.json: it ranks after an arm
    that reached the threshold with only some seeds, whatever their order in the spec."""
    spec = _spec(["official", "ghost", "partial"])
    rows = _rows("official", 0, [9, 7, 5]) + _rows("official", 1, [9, 6, 5])
    rows += _rows("partial", 0, [8, 5, 4]) + _rows("partial", 1, [9, 8, 7])  # seed 1 never reaches 5
    res = sr.analyse(spec, rows, None)
    assert res["arms"]["ghost"]["seeds"] == [] and res["arms"]["partial"]["reached"] == [0]
    path = sr.write_analysis(res, tmp_path / "speedrun.json")
    saved = json.loads(path.read_text())["arms"]
    assert math.isnan(saved["ghost"]["axes"]["wall_s"][0]) and saved["partial"]["axes"]["wall_s"][0] == 2.0
    assert sr.best_arms(tmp_path, 1) == ["partial"]
    assert sr.best_arms(tmp_path, 5) == ["partial", "ghost"]


# ---- the time axis: steps x each arm's side-by-side step time -------------------------------------------------
def test_each_arms_time_axis_is_its_steps_times_its_own_step_time():
    """The official arm is priced by the official code's step when it was measured, by our step at its recipe
    otherwise; every other arm by its own; without step_time.json every run keeps its recorded train_s; an
    evaluation without FD or FLOPs is left out."""
    st = {"arms": {"official": 0.02, "fast": 0.03}, "official_s": 0.05}
    assert sr.arm_step_s(st, "official", "official") == 0.05 and sr.arm_step_s(st, "fast", "official") == 0.03
    assert sr.arm_step_s({"arms": {"official": 0.02}}, "official", "official") == 0.02
    assert sr.arm_step_s(st, "other", "official") is None and sr.arm_step_s(None, "fast", "official") is None
    rows = _rows("fast", 0, [9.0, 7.0, 5.0]) + _rows("fast", 1, [8.0]) + _rows("slow", 0, [6.0])
    rows[1] = {**rows[1], "fd": None}  # an evaluation without FD (step 200)
    priced = sr.run_points(rows[::-1], "fast", 0, sr.arm_step_s(st, "fast", "official"))
    assert priced == [
        {"fd": 9.0, "step": 100.0, "wall_s": 3.0, "train_flops": 200.0},
        {"fd": 5.0, "step": 300.0, "wall_s": 9.0, "train_flops": 600.0},
    ]
    recorded = sr.run_points(rows, "fast", 0, None)
    assert [(p["step"], p["wall_s"]) for p in recorded] == [(100.0, 1.0), (300.0, 3.0)]  # train_s: 0.01 s per step
    assert [p["wall_s"] for p in sr.run_points(rows, "fast", 0, 0.5)] == [50.0, 150.0]
