import io
import math

import pytest
import torch
from conftest import SyncCounter

from diffcurr_fast.curriculum.clustering import cluster_timesteps, uniform_clusters
from diffcurr_fast.curriculum.pacing import Curriculum
from diffcurr_fast.diffusion import DDPMSchedule

T = 23
CLUSTERS = [(0, 3), (3, 10), (10, 11), (11, 23)]  # odd, uneven sizes


def make(**kw):
    kw.setdefault("eval_every", 1)
    kw.setdefault("ema", 0.0)
    return Curriculum(CLUSTERS, T, **kw)


def feed(cur, losses, start=0):
    unlocks = []
    for i, loss in enumerate(losses):
        if cur.observe(start + i, loss):
            unlocks.append(start + i)
    return unlocks


def reference_patience(window_means, patience, ema, min_delta, num_clusters):
    """Independent statement of the patience rule: indices of the evaluations that unlock."""
    stage, monitor, best, bad, out = 0, None, math.inf, 0, []
    for i, m in enumerate(window_means):
        monitor = m if monitor is None else ema * monitor + (1 - ema) * m
        if monitor < (best - min_delta * abs(best) if best < math.inf else math.inf):
            best, bad = monitor, 0
        else:
            bad += 1
        if stage < num_clusters - 1 and bad >= patience:
            stage, monitor, best, bad = stage + 1, None, math.inf, 0
            out.append(i)
    return out


# ---- patience pacing on scripted losses -----------------------------------------------------------------------
def test_plateau_unlocks_exactly_after_patience():
    cur = make(patience=3)
    unlocks = feed(cur, [1.0] * 20)
    # eval 0 sets the best; evals 1, 2, 3 do not improve -> unlock at step 3; the stage resets, so 7, then 11.
    assert unlocks == [3, 7, 11]
    assert cur.history == [3, 7, 11]
    assert cur.finished and cur.stage == 3
    assert cur.unlocked_clusters == [3, 2, 1, 0]


def test_unlock_resets_best_so_a_higher_loss_scale_is_judged_on_its_own():
    cur = make(patience=2)
    assert feed(cur, [1.0, 1.0, 1.0]) == [2]
    # The enlarged union has a higher loss that keeps improving: no unlock, although it never beats 1.0.
    assert feed(cur, [2.0 - 0.05 * i for i in range(10)], start=3) == []
    assert cur.stage == 1 and cur.best_loss == pytest.approx(1.55)


def test_steadily_improving_never_unlocks():
    cur = make(patience=2)
    assert feed(cur, [1.0 / (s + 1) for s in range(50)]) == []
    assert cur.stage == 0 and not cur.finished and cur.bad_evals == 0


def test_noisy_plateau_min_delta():
    means = [1.0, 0.95, 1.05, 0.92, 1.0, 0.97, 1.01]
    # min_delta 0.1 (10 % of the best): the +-5 % wiggles are not improvements, so the second evaluation
    # without improvement unlocks.
    assert feed(make(patience=2, min_delta=0.1), means) == [2, 5]
    # min_delta 0: 0.95 and 0.92 count as improvements and delay the unlock.
    assert feed(make(patience=2, min_delta=0.0), means) == [5]


def test_noisy_plateau_with_ema_matches_reference():
    gen = torch.Generator().manual_seed(3)
    steps, eval_every = 600, 5
    trend = torch.cat([torch.linspace(2.0, 1.0, 150), torch.ones(450)])
    losses = (trend + 0.3 * torch.randn(steps, generator=gen)).tolist()
    cur = Curriculum(CLUSTERS, T, patience=4, ema=0.8, min_delta=0.01, eval_every=eval_every)
    unlocks = feed(cur, losses)
    means = [sum(losses[i : i + eval_every]) / eval_every for i in range(0, steps, eval_every)]
    expected = [eval_every * (i + 1) - 1 for i in reference_patience(means, 4, 0.8, 0.01, len(CLUSTERS))]
    assert unlocks == expected and len(expected) >= 1
    # An EMA on the noisy sequence must not unlock during the clear downward trend of the first 150 steps.
    assert all(u >= 100 for u in unlocks)


def test_tensor_losses_same_decisions_as_floats():
    losses = [1.0, 0.9, 0.9, 0.95, 0.9, 0.91, 0.92, 0.93, 0.5, 0.6, 0.7, 0.8] * 3
    a, b = make(patience=2, eval_every=3), make(patience=2, eval_every=3)
    assert feed(a, losses) == feed(b, [torch.tensor(v) for v in losses])
    assert a.history == b.history and a.monitored_loss == pytest.approx(b.monitored_loss)


def test_sync_only_once_per_window(monkeypatch):
    cur = make(patience=100, eval_every=7)
    calls = []
    original = cur._reduce_window
    monkeypatch.setattr(cur, "_reduce_window", lambda: calls.append(1) or original())
    feed(cur, [torch.tensor(1.0)] * 30)
    assert len(calls) == 30 // 7


def test_nan_loss_names_the_step():
    cur = make(patience=5)
    feed(cur, [1.0, 1.0])
    with pytest.raises(ValueError, match="at step 2"):
        cur.observe(2, float("nan"))
    cur = make(patience=5, eval_every=5)
    feed(cur, [torch.tensor(1.0)] * 3)
    cur.observe(3, torch.tensor(float("inf")))
    with pytest.raises(ValueError, match="non-finite training loss .* at step 3"):
        cur.observe(4, torch.tensor(1.0))
    with pytest.raises(ValueError, match="scalar"):
        make().observe(0, torch.ones(2))


# ---- other pacings ------------------------------------------------------------------------------------------------
def test_fixed_pacing_naive_cl():
    cur = make(pacing="fixed", stage_iters=4)
    assert feed(cur, [1.0 / (s + 1) for s in range(20)]) == [3, 7, 11]  # loss is ignored
    assert cur.finished


def test_hard_to_easy_order():
    cur = make(pacing="fixed", stage_iters=2, order="hard_to_easy")
    assert cur.unlocked_clusters == [0]
    w = cur.timestep_weights()
    assert w[:3].sum() == pytest.approx(1.0) and w[3:].sum() == 0
    feed(cur, [1.0] * 2)
    assert cur.unlocked_clusters == [0, 1]
    easy = make(pacing="fixed", stage_iters=2)
    assert easy.unlocked_clusters == [3]
    assert easy.timestep_weights()[11:].sum() == pytest.approx(1.0)


def test_none_is_vanilla():
    cur = make(pacing="none")
    assert cur.finished and cur.unlocked_clusters == [3, 2, 1, 0]
    torch.testing.assert_close(cur.timestep_weights(), torch.full((T,), 1.0 / T))
    assert feed(cur, [1.0] * 10) == []


@pytest.mark.parametrize("order", ["easy_to_hard", "hard_to_easy"])
def test_weights_never_touch_locked_clusters(order):
    cur = make(pacing="fixed", stage_iters=1, order=order)
    gen = torch.Generator().manual_seed(0)
    for step in range(len(CLUSTERS)):
        w = cur.timestep_weights()
        assert w.dtype == torch.float32 and w.shape == (T,)
        assert float(w.sum()) == pytest.approx(1.0, abs=1e-6)
        live = torch.zeros(T, dtype=torch.bool)
        for k in cur.unlocked_clusters:
            live[CLUSTERS[k][0] : CLUSTERS[k][1]] = True
        assert bool((w[~live] == 0).all())
        torch.testing.assert_close(w[live], torch.full((int(live.sum()),), 1.0 / int(live.sum())))
        t = torch.multinomial(w, 1000, replacement=True, generator=gen)
        assert bool(live[t].all())
        cur.observe(step, 1.0)


def test_weights_feed_fused_sampler():
    from diffcurr_fast import ops

    cur = make(pacing="fixed", stage_iters=1)
    cur.observe(0, 1.0)
    t = ops.sample_timesteps(257, cur.timestep_weights(), seed=5)
    assert bool(((t >= 10) & (t < T)).all())


# ---- checkpointing --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pacing", ["patience", "fixed", "adaptive"])
def test_state_dict_round_trip_mid_stage(pacing):
    gen = torch.Generator().manual_seed(1)
    steps = 300
    losses = (1.0 + 0.2 * torch.randn(steps, generator=gen)).abs()
    ts = torch.randint(0, T, (steps, 5), generator=gen)
    kw = dict(pacing=pacing, patience=3, ema=0.7, eval_every=7, stage_iters=40 if pacing == "fixed" else None)

    def run(cur, lo, hi):
        out = []
        for s in range(lo, hi):
            cur.observe_per_timestep(ts[s], losses[s].expand(5) * (1 + ts[s] / T))
            if cur.observe(s, losses[s]):
                out.append(s)
        return out

    full = Curriculum(CLUSTERS, T, **kw)
    full_unlocks = run(full, 0, steps)
    first = Curriculum(CLUSTERS, T, **kw)
    cut = 45  # mid-window (45 % 7 != 0) and mid-stage
    run(first, 0, cut)
    assert not first.finished
    buf = io.BytesIO()
    torch.save(first.state_dict(), buf)
    buf.seek(0)
    resumed = Curriculum(CLUSTERS, T, **kw)
    resumed.load_state_dict(torch.load(buf, weights_only=False))
    rest = run(resumed, cut, steps)
    assert resumed.history == full.history and [u for u in full_unlocks if u >= cut] == rest
    assert resumed.monitored_loss == full.monitored_loss
    torch.testing.assert_close(resumed.timestep_weights(), full.timestep_weights())
    torch.testing.assert_close(resumed.cluster_losses(), full.cluster_losses(), equal_nan=True)
    assert len(full.history) >= 1


def test_load_state_dict_rejects_other_config():
    a = make(patience=3)
    with pytest.raises(ValueError, match="patience"):
        make(patience=4).load_state_dict(a.state_dict())


# ---- per-cluster tracking and adaptive pacing ---------------------------------------------------------------------
def test_per_cluster_losses():
    cur = make(pacing="none", eval_every=2)
    t = torch.tensor([0, 1, 5, 22, 22])
    loss = torch.tensor([1.0, 3.0, 4.0, 6.0, 8.0])
    cur.observe_per_timestep(t, loss)
    cur.observe(0, 1.0)
    cur.observe_per_timestep(torch.tensor([10]), torch.tensor([5.0]))
    cur.observe(1, 1.0)
    got = cur.cluster_losses()
    torch.testing.assert_close(got, torch.tensor([2.0, 4.0, 5.0, 7.0], dtype=torch.float64))
    assert cur.cluster_of(torch.tensor([0, 2, 3, 9, 10, 11, 22])).tolist() == [0, 0, 1, 1, 2, 3, 3]
    with pytest.raises(ValueError, match="shape"):
        cur.observe_per_timestep(torch.tensor([0, 1]), torch.tensor([1.0]))


def test_adaptive_favours_clusters_that_still_learn():
    cur = make(pacing="adaptive", patience=0, ema=0.5, adaptive_floor=0.4)
    for s in range(3):  # patience 0: unlock at every evaluation
        cur.observe(s, 1.0)
    assert cur.finished
    sizes = torch.tensor([hi - lo for lo, hi in CLUSTERS], dtype=torch.float64)
    torch.testing.assert_close(cur.cluster_probabilities(), sizes / T)  # no progress data yet: uniform
    t = torch.tensor([1, 5, 10, 15])
    for s in range(3, 40):
        # Cluster 1 keeps improving; the others are flat.
        cur.observe_per_timestep(t, torch.tensor([1.0, 2.0 * 0.9 ** (s - 3), 1.0, 1.0]))
        cur.observe(s, 1.0)
    p = cur.cluster_probabilities()
    assert float(p.sum()) == pytest.approx(1.0)
    assert int(p.argmax()) == 1 and float(p[1]) > float(sizes[1] / T)
    assert bool((p >= 0.4 * sizes / T - 1e-12).all())  # the floor
    w = cur.timestep_weights()
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-6) and bool((w > 0).all())


# ---- configuration errors ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(pacing="cosine"), "unknown pacing 'cosine'"),
        (dict(order="random"), "unknown order 'random'"),
        (dict(eval_every=0), "eval_every"),
        (dict(pacing="fixed"), "stage_iters"),
    ],
)
def test_bad_config(kw, match):
    with pytest.raises(ValueError, match=match):
        Curriculum(CLUSTERS, T, **kw)


def test_bad_clusters():
    with pytest.raises(ValueError, match="cover"):
        Curriculum(CLUSTERS, T + 1)
    with pytest.raises(ValueError, match="contiguous"):
        Curriculum([(0, 3), (4, 23)], T)


def test_paper_defaults():
    cur = Curriculum(cluster_timesteps(DDPMSchedule(1000), 20, "uniform"), 1000)
    assert cur.clusters == uniform_clusters(1000, 20)
    assert cur.patience * cur.eval_every == 200  # the paper's maximum patience tau in iterations
    assert cur.unlocked_clusters == [19] and cur.timestep_weights()[950:].sum() == pytest.approx(1.0)


def test_observe_reads_nothing_back_between_evaluations():
    """The accumulators stay on the device: a read (a sync on a GPU) only at the evaluation steps, counted on the
    CPU (the GPU test below runs the same steps under CUDA's sync debug mode)."""
    cur = Curriculum(CLUSTERS, T, patience=2, eval_every=5)
    gen = torch.Generator().manual_seed(0)
    t = torch.randint(0, T, (64,), generator=gen)
    cur.observe_per_timestep(t, torch.rand(64, generator=gen))
    cur.observe(0, torch.tensor(1.0))
    read_at = []
    for step in range(1, 40):
        per_sample, loss = torch.rand(64, generator=gen), torch.tensor(1.0)  # made outside the counter: a read counts
        with SyncCounter() as counter:
            cur.observe_per_timestep(t, per_sample)
            cur.observe(step, loss)
        if counter.syncs:
            read_at.append(step)
    assert read_at == [4, 9, 14, 19, 24, 29, 34, 39] and cur.history == [14, 29]


@pytest.mark.gpu
def test_observe_does_not_synchronise_between_evaluations():
    cur = Curriculum(CLUSTERS, T, patience=2, eval_every=5)
    dev = torch.device("cuda")
    t = torch.randint(0, T, (64,), device=dev)
    cur.observe_per_timestep(t, torch.rand(64, device=dev))  # first call allocates the accumulators
    cur.observe(0, torch.tensor(1.0, device=dev))
    for step in range(1, 40):
        loss = torch.tensor(1.0, device=dev)
        boundary = (step + 1) % 5 == 0
        torch.cuda.set_sync_debug_mode(0 if boundary else "error")
        try:
            cur.observe_per_timestep(t, torch.rand(64, device=dev))
            cur.observe(step, loss)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    assert cur.history and cur.cluster_losses().isfinite().any()
