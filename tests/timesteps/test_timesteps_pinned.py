"""Pinned values of the timestep strategies: each number is computed here by hand (numpy, float64) from the equations
of the strategy's module doc, on tiny inputs, after a few updates, or of a rule at its boundary.

The other timestep tests check directions (the weights move, a resume round-trips); these fail on a one-line slip in
a rule: a swapped EMA decay, a reward over the wrong subset, an off-by-one buffer or history, a ranking reversed, an
entropy bonus of the wrong sign, a missing sqrt, a boundary moved by one cell, losses filed under absolute cells.
"""

import math

import numpy as np
import pytest
import torch

from diffcurr_fast.diffusion import DDPMSchedule
from diffcurr_fast.runs.config import CurriculumConfig, TimestepsConfig
from diffcurr_fast.timesteps.anuts import ANUTS
from diffcurr_fast.timesteps.base import Product, range_mask
from diffcurr_fast.timesteps.build import build_curriculum, build_timesteps
from diffcurr_fast.timesteps.importance import LossSecondMoment
from diffcurr_fast.timesteps.speed import SpeeD, speed_boundary, speed_weights

NAN = math.nan


# ---- anuts (Kim et al., CVPR 2025; anuts.py module doc, steps 1-3) ------------------------------------------------
def _anuts_reference(num_cells, num_cand, probes, buffer, lr, entropy, theta0, updates):
    """The module doc's rule in numpy, per update (k, before, after): d = mean_n (before - after); the last ``buffer``
    rows of d; S = the ``probes`` candidates of largest squared correlation of d_c with sum_c d_c over the rows (from
    two rows on; before: ``probes`` evenly spaced candidates); r = sum_{c in S} d_c; b <- r, then 0.9 b + 0.1 r; one
    Adam step (torch's defaults: betas 0.9, 0.999, eps 1e-8) on theta = (log a, log b) ascending
    J = (r - b) mean_i log pi(k_i) + entropy H(pi), pi the Beta(a, b) density at the cell centres, normalised.

    The gradient by hand: with l_j = (a - 1) log u_j + (b - 1) log(1 - u_j) and f_j = dl_j / dtheta =
    (a log u_j, b log(1 - u_j)), d log pi_j / dtheta = f_j - E_pi[f] =: fc_j; dH / dtheta = -sum_j pi_j fc_j log pi_j.
    Returns, per update, (selected, r, b, theta, rows)."""
    u = (np.arange(num_cells) + 0.5) / num_cells
    theta = np.array(theta0, dtype=np.float64)
    m, v = np.zeros(2), np.zeros(2)
    rows: list[np.ndarray] = []
    sel = np.round(np.linspace(0, num_cand - 1, probes)).astype(int)
    b = None
    out = []
    for t, (k, before, after) in enumerate(updates, start=1):
        d = (before - after).mean(axis=1)
        rows = (rows + [d])[-buffer:]
        if len(rows) >= 2:
            x = np.stack(rows)
            y = x.sum(axis=1)
            xc, yc = x - x.mean(axis=0), y - y.mean()
            corr2 = (xc * yc[:, None]).sum(0) ** 2 / np.maximum((xc**2).sum(0) * (yc**2).sum(), 1e-300)
            sel = np.sort(np.argsort(-corr2, kind="stable")[:probes])
        r = float(d[sel].sum())
        b = r if b is None else 0.9 * b + 0.1 * r
        adv = r - b
        a_, b_ = np.exp(theta)
        logit = (a_ - 1.0) * np.log(u) + (b_ - 1.0) * np.log1p(-u)
        logp = logit - np.logaddexp.reduce(logit)
        p = np.exp(logp)
        f = np.stack([a_ * np.log(u), b_ * np.log1p(-u)], axis=1)  # (G, 2)
        fc = f - p @ f
        grad_j = adv * fc[np.asarray(k)].mean(axis=0) - entropy * ((p * logp) @ fc)
        g = -grad_j  # the loss minimised is -J
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        theta = theta - lr * (m / (1 - 0.9**t)) / (np.sqrt(v / (1 - 0.999**t)) + 1e-8)
        out.append((sel.tolist(), r, b, theta.copy(), [row.copy() for row in rows]))
    return out


def _beta_cells(num_cells, theta):
    u = (np.arange(num_cells) + 0.5) / num_cells
    a_, b_ = np.exp(theta)
    dens = u ** (a_ - 1.0) * (1.0 - u) ** (b_ - 1.0)
    return dens / dens.sum()


def test_anuts_candidates_and_spread_when_the_share_does_not_divide():
    """Candidates: round(linspace(0, G - 1, C)) (half to even), at most G of them; S before two rows of the buffer:
    round(linspace(0, C - 1, P))."""
    a = ANUTS(12, candidates=5, probes=2)  # linspace(0, 11, 5) = 0, 2.75, 5.5, 8.25, 11
    assert a.candidates.tolist() == [0, 3, 6, 8, 11]
    assert a.selected.tolist() == [0, 4]
    a = ANUTS(10, candidates=7, probes=3)  # 0, 1.5, 3, 4.5, 6, 7.5, 9 -> 0, 2, 3, 4, 6, 8, 9
    assert a.candidates.tolist() == [0, 2, 3, 4, 6, 8, 9]
    assert a.selected.tolist() == [0, 3, 6]  # linspace(0, 6, 3)
    a = ANUTS(10, candidates=4, probes=3)  # spread: linspace(0, 3, 3) = 0, 1.5, 3 -> 0, 2, 3
    assert a.candidates.tolist() == [0, 3, 6, 9] and a.selected.tolist() == [0, 2, 3]
    a = ANUTS(5, candidates=16, probes=5)  # more candidates than cells: every cell once
    assert a.candidates.tolist() == [0, 1, 2, 3, 4] and a.selected.tolist() == [0, 1, 2, 3, 4]


# The rows d (C = 5) of five updates. Rows 0 and 1 differ in candidates 1 and 3 only: with two rows every candidate
# that varies has squared correlation exactly 1 and the constant ones 0, so S = {1, 3} without a tie. Rows 2-4 are
# chosen so that the ranking over the last three rows differs from the ranking over the last four (buffer + 1).
_D = np.array(
    [
        [0.50, 0.10, 0.20, 0.05, 0.30],
        [0.50, 0.90, 0.20, 0.45, 0.30],
        [0.80, 0.35, 0.45, 0.60, 0.05],
        [0.50, 1.05, 0.45, 1.35, 0.90],
        [0.75, 0.80, 1.30, 0.30, 1.40],
    ]
)
_K = [[11, 10, 9, 9], [0, 1, 2, 3], [6, 6, 7, 11], [2, 3, 10, 11], [5, 5, 5, 0]]  # the step's draws per update


def _anuts_updates():
    after = np.array([[0.25, 1.0], [0.5, 0.75], [1.0, 0.5], [0.125, 0.25], [0.75, 0.5]])  # (C, n = 2)
    jitter = np.array([[0.05, -0.05]] * 5)  # the mean over the n samples removes it
    return [(np.array(k), after + d[:, None] + jitter, after) for k, d in zip(_K, _D)]


def _drive(a, updates):
    """Each update as the trainer makes it (the step's draws, then the probe losses); yields the update's index."""
    for i, (k, before, after) in enumerate(updates):
        a.observe(torch.tensor(k), torch.ones(len(k)))
        a.observe_probe(torch.tensor(before), torch.tensor(after))
        yield i


def test_anuts_selection_reward_baseline_and_adam_steps_are_pinned():
    g, lr = 12, 0.05
    a = ANUTS(g, every=1, candidates=5, probes=2, probe_batch=2, buffer=3, lr=lr)
    updates = _anuts_updates()
    ref = _anuts_reference(g, 5, 2, 3, lr, 0.0, [0.0, 0.0], updates)
    # S by hand: update 1 the spread {0, 4}; update 2 the two candidates that vary; then the largest corr^2 over the
    # last 3 rows (buffer filled past its size from update 4 on: row 0, then row 1, leave it).
    selected = [[0, 4], [1, 3], [1, 3], [3, 4], [1, 4]]
    reward = [0.50 + 0.30, 0.90 + 0.45, 0.35 + 0.60, 1.35 + 0.90, 0.80 + 1.40]  # sum of d over S only
    baseline = [0.8]
    for r in reward[1:]:
        baseline.append(0.9 * baseline[-1] + 0.1 * r)
    assert baseline == pytest.approx([0.8, 0.855, 0.8645, 1.00305, 1.122745], rel=1e-12)
    assert [x[0] for x in ref] == selected and [x[1] for x in ref] == pytest.approx(reward, rel=1e-12)
    for i in _drive(a, updates):
        theta = ref[i][3]
        assert a.selected.tolist() == selected[i], i
        assert a.baseline == pytest.approx(baseline[i], rel=1e-12), i
        assert len(a.rows) == min(i + 1, 3), i
        np.testing.assert_allclose(torch.stack(a.rows).numpy(), _D[max(0, i - 2) : i + 1], rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(a.theta.detach().numpy(), theta, rtol=1e-9, atol=1e-13, err_msg=str(i))
        assert a.updates == i + 1
    assert ref[0][3].tolist() == [0.0, 0.0]  # the first update: r = b, no advantage, no step
    assert np.abs(ref[-1][3]).min() > 0.04  # the policy has moved
    np.testing.assert_allclose(a.weights().numpy(), _beta_cells(g, ref[-1][3]), rtol=1e-9, atol=1e-15)


def test_anuts_entropy_bonus_pushes_towards_the_uniform_policy():
    """entropy > 0 from a = 2, b = 3: the first update has r = b (no advantage), so its Adam step is the entropy
    term's alone, lr x sign(dH / dtheta): log a up, log b down (towards the symmetric, flatter Beta: larger
    entropy); then both terms, pinned."""
    g, lr, ent = 12, 0.05, 0.3
    a = ANUTS(g, every=1, candidates=5, probes=2, probe_batch=2, buffer=3, lr=lr, entropy=ent)
    theta0 = [math.log(2.0), math.log(3.0)]
    with torch.no_grad():
        a.theta.copy_(torch.tensor(theta0, dtype=torch.float64))
    a._w = None
    updates = _anuts_updates()[:3]
    ref = _anuts_reference(g, 5, 2, 3, lr, ent, theta0, updates)

    def entropy(theta):
        p = _beta_cells(g, theta)
        return float(-(p * np.log(p)).sum())

    step1 = ref[0][3] - np.array(theta0)
    np.testing.assert_allclose(step1, [lr, -lr], rtol=1e-5)  # Adam: lr g / (|g| + eps)
    assert entropy(ref[0][3]) > entropy(theta0)
    for i in _drive(a, updates):
        np.testing.assert_allclose(a.theta.detach().numpy(), ref[i][3], rtol=1e-9, atol=1e-13, err_msg=str(i))
        assert a.baseline == pytest.approx(ref[i][2], rel=1e-12)


def test_anuts_ranks_candidates_by_squared_correlation_with_the_total():
    """S is the candidates with the largest squared Pearson correlation of d_c with sum_c d_c over the buffer. The
    rows are chosen so that the sign of the correlation (candidate 0 is strongly anti-correlated), the centring of
    d_c, each column's own variance and a denominator below 1 all change the pick. A probe before any draw of the
    sampler has no draws to credit: with no entropy bonus the policy does not move."""
    d = np.array([[0.56, -0.05, -0.16, -0.30, -0.25], [0.23, 0.38, 0.59, 0.31, -0.25], [0.30, 0.07, 0.08, 0.01, 0.17]])
    corr = np.array([np.corrcoef(d[:, c], d.sum(1))[0, 1] for c in range(5)])
    np.testing.assert_allclose(corr, [-0.970861, 0.946461, 0.959983, 0.997589, 0.078843], atol=1e-6)
    a = ANUTS(5, every=1, candidates=5, probes=2, buffer=3)
    for row in d:
        a.observe_probe(torch.tensor(row)[:, None], torch.zeros(5, 1))
        assert a.theta.detach().tolist() == [0.0, 0.0]
    assert a.selected.tolist() == sorted(np.argsort(-(corr**2))[:2].tolist()) == [0, 3]


def test_anuts_probe_schedule_and_seed():
    a = ANUTS(12, every=3, candidates=5, probes=2, probe_batch=2)
    assert [a.probe(s) is None for s in range(6)] == [True, True, False, True, True, False]
    cells, n, seed = a.probe(2)
    assert cells.tolist() == [0, 3, 6, 8, 11] and n == 2 and seed == 1_000_003 + 17
    list(_drive(a, _anuts_updates()[:2]))
    assert a.probe(5)[2] == 1_000_003 * 3 + 17  # a function of the update count


# ---- importance (Nichol & Dhariwal 2021, Sec. 3.3, Eq. 18; importance.py module doc) --------------------------------
def _second_moment_p(hist, floor):
    """p_k = (1 - floor) sqrt(E[L_k^2]) / sum_j sqrt(E[L_j^2]) + floor / G over the kept losses of each cell."""
    w = np.sqrt(np.array([np.mean(np.square(h)) for h in hist]))
    return (1.0 - floor) * w / w.sum() + floor / len(hist)


def test_importance_weights_pinned_through_the_warm_up_boundary():
    g, h, floor = 3, 2, 0.1
    s = LossSecondMoment(g, h, floor)
    ts = Product([s])
    uniform = torch.full((g,), 1.0 / g, dtype=torch.float64)
    # 1: four losses of cell 0 in one batch: only its last h = 2 (3, 4) are kept; cell 2 has no history yet
    s.observe(torch.tensor([0, 0, 0, 0, 1]), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert s._count.tolist() == [4, 1, 0] and not bool(s.warmed_up)
    assert torch.equal(s.weights(), uniform)
    assert torch.equal(ts.loss_weights(torch.arange(g)), torch.ones(g))  # uniform draws: no correction
    # 2: cells 1 and 2 one more loss each; cell 2 still has one of its two: still uniform
    s.observe(torch.tensor([2, 1]), torch.tensor([6.0, 7.0]))
    assert torch.equal(s.weights(), uniform) and torch.equal(ts.loss_weights(torch.arange(g)), torch.ones(g))
    # a skipped step (ok false) and a non-finite loss fold nothing
    s.observe(torch.tensor([2, 2]), torch.tensor([9.0, 9.0]), ok=torch.tensor(False))
    s.observe(torch.tensor([2]), torch.tensor([math.inf]))
    assert s._count.tolist() == [4, 2, 1] and torch.equal(s.weights(), uniform)
    # 3: cell 2's second loss fills the last history at this very call (count == h): p by Eq. 18 with the floor
    s.observe(torch.tensor([2]), torch.tensor([8.0]))
    assert bool(s.warmed_up)
    kept = [[3.0, 4.0], [5.0, 7.0], [6.0, 8.0]]  # cell 0: the last two of its batch of four
    p = _second_moment_p(kept, floor)
    w0, w1, w2 = math.sqrt((9 + 16) / 2), math.sqrt((25 + 49) / 2), math.sqrt((36 + 64) / 2)
    assert p.tolist() == pytest.approx([0.9 * w / (w0 + w1 + w2) + 0.1 / 3 for w in (w0, w1, w2)], rel=1e-12)
    np.testing.assert_allclose(s.weights().numpy(), p, rtol=1e-12)
    assert float(s.weights().sum()) == pytest.approx(1.0, rel=1e-12)
    # the correction keeps the uniform mean: 1 / (G p_k) (through the product's float32 weights)
    np.testing.assert_allclose(
        ts.loss_weights(torch.tensor([0, 1, 2, 2])).numpy(), 1.0 / (g * p[[0, 1, 2, 2]]), rtol=2e-6
    )
    # 4: one more loss of cells 1 and 0 replaces each one's oldest (5; 3): kept 7, 2 and 4, 0.5
    s.observe(torch.tensor([1, 0]), torch.tensor([2.0, 0.5]))
    p = _second_moment_p([[4.0, 0.5], [7.0, 2.0], [6.0, 8.0]], floor)
    np.testing.assert_allclose(s.weights().numpy(), p, rtol=1e-12)
    np.testing.assert_allclose(ts.loss_weights(torch.arange(g)).numpy(), 1.0 / (g * p), rtol=2e-6)


def test_importance_loss_weights_at_the_floor_and_inside_a_tdc_range():
    # a cell whose kept losses are all 0: p = floor / G, its draws weighted 1 / floor
    s = LossSecondMoment(2, 1, 0.1)
    s.observe(torch.tensor([0, 1]), torch.tensor([0.0, 2.0]))
    np.testing.assert_allclose(s.weights().numpy(), [0.05, 0.95], rtol=1e-12)
    np.testing.assert_allclose(Product([s]).loss_weights(torch.tensor([0, 1])).numpy(), [10.0, 0.5 / 0.95], rtol=1e-6)
    # floor 0: that cell is never drawn, and its correction is 0, not inf
    s0 = LossSecondMoment(2, 1, 0.0)
    s0.observe(torch.tensor([0, 1]), torch.tensor([0.0, 2.0]))
    assert Product([s0]).loss_weights(torch.tensor([0, 1])).tolist() == [0.0, 0.5]
    # inside a range [1, 4) of 5 cells: p_k = w_k / sum_{range} w, u_k = 1 / 3, correction u_k / p_k; 0 outside
    g, floor = 5, 0.2
    s = LossSecondMoment(g, 1, floor)
    losses = np.array([1.0, 2.0, 3.0, 6.0, 4.0])
    s.observe(torch.arange(g), torch.tensor(losses, dtype=torch.float32))
    w = (1 - floor) * losses / losses.sum() + floor / g  # history 1: sqrt(L^2) = L
    ts = Product([s, range_mask(g, (1, 4))])
    corr = np.zeros(g)
    corr[1:4] = (1.0 / 3.0) / (w[1:4] / w[1:4].sum())
    np.testing.assert_allclose(ts.loss_weights(torch.arange(g)).numpy(), corr, rtol=1e-6)
    np.testing.assert_allclose(ts.weights().numpy(), np.r_[0.0, w[1:4] / w[1:4].sum(), 0.0], rtol=1e-6)


# ---- speed (Wang et al. 2024, Sec. 4; speed.py module doc) -------------------------------------------------------
def _log_snr_of_noise(s):
    """The log SNR at which sqrt(1 / (1 + SNR)) = s: SNR = (1 - s^2) / s^2."""
    s = np.asarray(s, dtype=np.float64)
    return torch.tensor(np.log((1.0 - s**2) / s**2))


def test_speed_boundary_pinned_on_hand_made_noise_levels():
    """tau = 1 + the first cell whose increment of the noise level (central differences inside, one-sided at the
    ends) is below threshold x 1000 / G."""
    s = [0.2, 0.6, 0.8, 0.85, 0.86]
    # increments: 0.4, (0.8 - 0.2) / 2 = 0.3, (0.85 - 0.6) / 2 = 0.125, (0.86 - 0.8) / 2 = 0.03, 0.01
    # (of s^2, a missing sqrt: 0.32, 0.3, 0.18125, 0.04975, 0.0171)
    lam = _log_snr_of_noise(s)
    thr = 7.5e-4  # x 1000 / 5 = 0.15 per cell: cell 2 is the first below it
    assert speed_boundary(lam, thr) == 3
    assert speed_boundary(lam, 2e-4) == 4  # 0.04 per cell: cell 3 (0.03) is the first below
    assert speed_boundary(lam, 2.5e-3) == 1  # 0.5 per cell: the first cell already
    assert speed_boundary(lam, 1e-6) == 5  # no cell below: tau = G
    sp = SpeeD(lam, k=3.0, threshold=thr)
    assert sp.tau == 3
    # p_asym = (3, 3, 3, 1, 1) / 11; duals 0->3, 1->2, 2->1, 3->0, 4->1: p_dual = (1, 4, 3, 3, 0) / 11
    np.testing.assert_allclose(sp.weights().numpy(), np.array([4, 7, 6, 4, 1]) / 22, rtol=1e-12)
    w = sp.weights()
    sp.observe(torch.tensor([0, 4]), torch.tensor([1.0, 2.0]))
    assert sp.weights() is w  # a fixed strategy: nothing observed changes it
    assert Product([sp]).loss_weights(torch.arange(5)) is None  # not importance-corrected


def test_speed_weights_pinned_marginal_of_asymmetric_and_dual_draws():
    # G = 6, tau = 2, k = 5: p_asym = (5, 5, 1, 1, 1, 1) / 14; duals 0->2, 1->1, 2->0, 3->1, 4->2, 5->3
    # p_dual = (1, 5 + 1, 5 + 1, 1, 0, 0) / 14; the marginal (p_asym + p_dual) / 2
    np.testing.assert_allclose(speed_weights(6, 2, 5.0).numpy(), np.array([6, 11, 7, 2, 1, 1]) / 28, rtol=1e-12)
    # tau = 1 (the first cell flat already): p_asym = (5, 1, 1, 1) / 8; duals 0->1, 1->0, 2->1, 3->2
    np.testing.assert_allclose(speed_weights(4, 1, 5.0).numpy(), np.array([6, 7, 2, 1]) / 16, rtol=1e-12)
    # k = 1, tau = 3: p_asym uniform 1 / 6; duals 0->3, 1->2, 2->1, 3->0, 4->1, 5->2: p_dual = (1, 2, 2, 1, 0, 0) / 6
    np.testing.assert_allclose(speed_weights(6, 3, 1.0).numpy(), np.array([2, 3, 3, 2, 1, 1]) / 12, rtol=1e-12)


# ---- a curriculum inside a TDC range (curriculum.py module doc, build.py) ----------------------------------------
def test_curriculum_in_a_tdc_range_files_losses_under_range_relative_clusters():
    """Range [30, 70) of 100 cells, 4 uniform clusters of the range: relative [0, 10), ..., [30, 40), i.e. absolute
    [30, 40), ..., [60, 70). Patience pacing, easy to hard: cluster 3 (absolute 60-69) first, then cluster 2 (50-59).
    A draw k of the composed sampler is absolute; its loss must go to cluster (k - 30) // 10."""
    form, g, rng = DDPMSchedule(100), 100, (30, 70)
    c = CurriculumConfig(
        num_clusters=4, method="uniform", pacing="patience", patience=1, eval_every=2, ema=0.5, min_delta=0.25
    )
    cur = build_curriculum(c, form, g, rng)
    assert cur.clusters == [(0, 10), (10, 20), (20, 30), (30, 40)] and cur.num_timesteps == 40
    ts = build_timesteps(TimestepsConfig(), form, g, cur, timestep_range=rng)
    live = np.zeros(g)
    live[60:70] = 0.1
    np.testing.assert_allclose(ts.weights().numpy(), live, rtol=1e-6, atol=0)

    def step(i, k, loss):
        ts.observe(torch.tensor(k), torch.tensor(loss, dtype=torch.float32), i)

    step(0, [60, 65, 69, 62], [1.0, 2.0, 3.0, 2.0])
    step(1, [61, 63, 64, 66], [1.5, 2.5, 2.0, 2.0])  # evaluation 1: window mean 2, cluster 3's mean 2
    torch.testing.assert_close(
        cur.cluster_losses(), torch.tensor([NAN, NAN, NAN, 2.0], dtype=torch.float64), equal_nan=True
    )
    assert cur.monitored_loss == 2.0 and cur.best_loss == 2.0 and cur.bad_evals == 0
    step(2, [67, 68, 60, 61], [3.0, 3.0, 1.0, 1.0])
    step(3, [62, 63, 64, 65], [1.5, 1.5, 1.5, 1.5])  # evaluation 2: mean 1.75, EMA 0.5 x 2 + 0.5 x 1.75 = 1.875
    # 1.875 is not below 2 - 0.25 x 2 = 1.5: no improvement, patience 1 reached: cluster 2 unlocks at step 3
    assert cur.history == [3] and cur.unlocked_clusters == [3, 2]
    torch.testing.assert_close(
        cur.cluster_losses(), torch.tensor([NAN, NAN, NAN, 1.875], dtype=torch.float64), equal_nan=True
    )
    live[50:70] = 0.05
    np.testing.assert_allclose(ts.weights().numpy(), live, rtol=1e-6, atol=0)
    step(4, [50, 59, 60, 69], [4.0, 6.0, 1.0, 1.0])
    step(5, [55, 52, 68, 61], [5.0, 3.0, 2.0, 0.0])  # evaluation 3: mean 22 / 8
    # cluster 2 (50-59): 4, 6, 5, 3 -> 4.5 (first seen); cluster 3 (60-69): 1, 1, 2, 0 -> 1, EMA 0.5 x 1.875 + 0.5 x 1
    torch.testing.assert_close(
        cur.cluster_losses(), torch.tensor([NAN, NAN, 4.5, 1.4375], dtype=torch.float64), equal_nan=True
    )
    assert cur.monitored_loss == 2.75 and cur.bad_evals == 0  # the new stage is judged against itself


def test_adaptive_curriculum_in_a_tdc_range_weights_pinned():
    """Range [10, 30) of 40 cells, 2 clusters (absolute [10, 20), [20, 30)); adaptive pacing, patience 0 (every
    evaluation unlocks), eval_every 1, ema 0.5 (slow decay 0.75), floor 0.5: after both clusters are live they are
    drawn by progress_k = max(slow_k - fast_k, 0) / slow_k (pacing.py module doc), on the range's cells."""
    form, g, rng = DDPMSchedule(40), 40, (10, 30)
    c = CurriculumConfig(
        num_clusters=2, method="uniform", pacing="adaptive", patience=0, eval_every=1, ema=0.5, adaptive_floor=0.5
    )
    cur = build_curriculum(c, form, g, rng)
    ts = build_timesteps(TimestepsConfig(), form, g, cur, timestep_range=rng)
    ts.observe(torch.tensor([20, 25]), torch.tensor([4.0, 4.0]), 0)  # cluster 1: 4; unlocks cluster 0
    assert cur.finished and cur.history == [0]
    ts.observe(torch.tensor([10, 15, 20, 25]), torch.tensor([8.0, 8.0, 2.0, 2.0]), 1)
    # cluster 0: fast = slow = 8; cluster 1: fast 0.5 x 4 + 0.5 x 2 = 3, slow 0.75 x 4 + 0.25 x 2 = 3.5
    ts.observe(torch.tensor([12, 18, 22, 28]), torch.tensor([4.0, 4.0, 2.0, 2.0]), 2)
    # cluster 0: fast 6, slow 7 -> progress 1/7; cluster 1: fast 2.5, slow 3.125 -> progress 1/5
    torch.testing.assert_close(cur.cluster_losses(), torch.tensor([6.0, 2.5], dtype=torch.float64))
    p0 = 0.5 * 0.5 + 0.5 * (1 / 7) / (1 / 7 + 1 / 5)  # = 11 / 24
    p1 = 0.5 * 0.5 + 0.5 * (1 / 5) / (1 / 7 + 1 / 5)  # = 13 / 24
    assert (p0, p1) == pytest.approx((11 / 24, 13 / 24), rel=1e-12)
    want = np.zeros(g)
    want[10:20], want[20:30] = p0 / 10, p1 / 10
    np.testing.assert_allclose(ts.weights().numpy(), want, rtol=1e-6, atol=0)


def test_importance_history_keeps_each_cells_last_losses_in_arrival_order_in_a_large_batch():
    """A batch of 300 draws over 3 cells (torch's unstable sort reorders equal keys from about 100 elements): each
    cell's ring holds exactly its last ``history`` losses in arrival order, by hand."""
    k = torch.randint(0, 3, (300,), generator=torch.Generator().manual_seed(0))
    loss = torch.arange(300, dtype=torch.float64)  # the arrival index is the loss
    s = LossSecondMoment(3, 4, 0.0)
    s.observe(k, loss)
    for c in range(3):
        mine = loss[k == c]
        n = mine.numel()
        want = {int((n - 4 + j) % 4): float(mine[n - 4 + j]) for j in range(4)}  # slot of the j-th of the last 4
        assert {slot: float(s._hist[c, slot]) for slot in range(4)} == want, c
    assert s._count.tolist() == [int((k == c).sum()) for c in range(3)]
