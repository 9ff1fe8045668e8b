"""The step times that price a speedrun's wall time (study/step_time.py): the side-by-side order, the batches and
the warm-up left out, on stand-in steps with a hand-set clock; the medians and percentiles by hand; our trainer's
arms measured without a peer; and, with a facebookresearch/DiT checkout, the official step beside ours."""

import os
import time

import pytest
import torch
from conftest import tiny

from diffcurr_fast.study.step_time import OFFICIAL_CODE, measure_step_times, step_time_summary, time_side_by_side


def test_steps_run_side_by_side_in_blocks_on_the_shared_batches_and_the_warm_up_is_not_timed(monkeypatch):
    """Two rounds of (one warm-up, three timed calls) per step; each call advances a hand-set clock by its own
    duration (warm-up calls 100 s), so every time read back is one call's duration."""
    clock, calls = [0.0], []
    durations = {"a": iter([100, 1, 5, 2, 100, 4, 3, 9]), "b": iter([100, 2, 2, 2, 100, 6, 6, 6])}

    def stand_in(name):
        def step(x, y):
            calls.append((name, x))
            clock[0] += next(durations[name])

        return step

    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    batches = [(i, -i) for i in range(3)]
    times = time_side_by_side({"a": stand_in("a"), "b": stand_in("b")}, batches, rounds=2, reps=3, warmup=1)
    assert times == {"a": [1, 5, 2, 4, 3, 9], "b": [2, 2, 2, 6, 6, 6]}
    assert calls == [(n, i % 3) for i, n in enumerate("aaaabbbbaaaabbbb")]  # blocks alternate; batches cycle


def test_the_summary_is_the_median_and_the_20th_and_80th_percentiles_by_hand():
    """a: 1, 2, 3, 4, 5, 9 sorted: median (3 + 4) / 2; the 20th percentile at position 0.2 x 5 = 1 (2), the 80th at
    4 (5). b: 2, 2, 2, 6, 6, 7: median 4. The official DiT step is kept apart from the arms."""
    times = {"a": [1.0, 5.0, 2.0, 4.0, 3.0, 9.0], "b": [2.0, 2.0, 2.0, 6.0, 6.0, 7.0], OFFICIAL_CODE: [8.0, 6.0, 7.0]}
    res = step_time_summary(times, "b")
    assert res == {
        "arms": {"a": 3.5, "b": 4.0},
        "arms_p20_p80": {"a": [2.0, 5.0], "b": [2.0, 6.0], OFFICIAL_CODE: [6.4, 7.6]},
        "ours_s": 4.0,  # the official arm's recipe on our step
        "official_s": 7.0,
    }
    assert "official_s" not in step_time_summary({"a": [1.0]}, "a")


def test_our_arms_are_measured_without_a_peer(tmp_path, one_thread, monkeypatch):
    from diffcurr_fast.train import loop

    ran, real = [], loop.Trainer.train_step

    def step(self, x0, y):
        ran.append(self.cfg.optim.lr)  # which arm's trainer stepped
        return real(self, x0, y)

    monkeypatch.setattr(loop.Trainer, "train_step", step)
    cfgs = {n: tiny(tmp_path / n, "engine.cpu_threads=1", f"optim.lr={lr}") for n, lr in (("a", 1e-3), ("b", 2e-3))}
    res = measure_step_times(cfgs, None, "b", rounds=2, reps=2, warmup=1)
    assert ran == [1e-3] * 3 + [2e-3] * 3 + [1e-3] * 3 + [2e-3] * 3
    assert sorted(res["arms"]) == ["a", "b"] and res["ours_s"] == res["arms"]["b"] > 0
    assert (res["steps_each"], res["batch"], res["threads"]) == (4, 16, 1)
    assert not {"official_s", "checkout", "commit"} & set(res)
    assert all(lo <= res["arms"][n] <= hi for n, (lo, hi) in res["arms_p20_p80"].items())


@pytest.mark.skipif(
    not os.environ.get("DIFFCURR_FAST_PEER_DIT"),
    reason="set DIFFCURR_FAST_PEER_DIT to a facebookresearch/DiT checkout to time its own step",
)
def test_official_step_time_with_a_real_checkout(tmp_path):
    cfg = tiny(tmp_path / "r", "diffusion.num_timesteps=1000", "engine.cpu_threads=1")
    res = measure_step_times(
        {"official": cfg}, os.environ["DIFFCURR_FAST_PEER_DIT"], "official", rounds=1, reps=5, warmup=2
    )
    assert res["official_s"] > 0 and res["ours_s"] > 0 and res["commit"]
    torch.testing.assert_close(res["ours_s"], res["arms"]["official"])
