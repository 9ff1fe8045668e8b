"""The timestep sampler: each strategy against its closed form or its paper's rule on DDPM, EDM and flow; importance
sampling is unbiased; locked clusters get probability 0 under every composition; state round trips."""

import math
from collections import deque
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from diffcurr_fast.diffusion import DDPMSchedule, EDMFormulation, FlowFormulation
from diffcurr_fast.ops import sample_timesteps
from diffcurr_fast.runs.config import CurriculumConfig, TimestepsConfig
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.timesteps.anuts import ANUTS
from diffcurr_fast.timesteps.base import Product, TimestepSampler, range_mask
from diffcurr_fast.timesteps.build import build_curriculum, build_timesteps
from diffcurr_fast.timesteps.importance import LossSecondMoment
from diffcurr_fast.timesteps.lognormal import LogNormal, cell_log_snr
from diffcurr_fast.timesteps.registry import SAMPLERS, strategy_class
from diffcurr_fast.timesteps.speed import SpeeD, speed_boundary

FORMS = {"ddpm": lambda: DDPMSchedule(1000, "linear"), "edm": EDMFormulation, "flow": FlowFormulation}


def _t(**kw):
    return TimestepsConfig(**kw)


def _p(w):
    w = w.double()
    return w / w.sum()


def _draw_cells(form, num_cells, values_log_snr):
    """The cell of each log SNR value: the cell whose log SNR is nearest (DDPM: its ``t_from_log_snr``)."""
    if isinstance(form, DDPMSchedule):
        return form.t_from_log_snr(values_log_snr)
    lam = cell_log_snr(form, num_cells)  # (G,) descending
    order = torch.argsort(lam)
    pos = torch.searchsorted(lam[order], values_log_snr).clamp(1, num_cells - 1)
    lo, hi = order[pos - 1], order[pos]
    return torch.where((values_log_snr - lam[lo]).abs() <= (lam[hi] - values_log_snr).abs(), lo, hi)


# ---- uniform ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(FORMS))
def test_uniform_is_the_formulations_training_distribution(name):
    form, g = FORMS[name](), 200 if name != "ddpm" else 1000
    ts = build_timesteps(_t(), form, g)
    w = _p(ts.weights())
    if name == "edm":  # ln sigma ~ N(P_mean, P_std^2) inside [sigma_min, sigma_max] (EDM Table 1)
        edges = form.log_sigma_edges(g)
        cdf = torch.distributions.Normal(form.P_mean, form.P_std).cdf(edges)
        torch.testing.assert_close(w, _p(cdf[1:] - cdf[:-1]), rtol=1e-5, atol=1e-12)
    else:
        torch.testing.assert_close(w, torch.full((g,), 1.0 / g, dtype=torch.float64))
    assert ts.loss_weights(torch.arange(5)) is None


# ---- lognormal --------------------------------------------------------------------------------------------------
def test_lognormal_flow_defaults_are_sd3_logit_normal():
    """SD3's logit-normal(0, 1) t: density 1 / (sqrt(2 pi) t (1 - t)) exp(-logit(t)^2 / 2) at the cell centres."""
    g = 1000
    w = _p(LogNormal.from_config(_t(), FlowFormulation(), g).weights())
    t = (torch.arange(g, dtype=torch.float64) + 0.5) / g
    logit = torch.log(t / (1 - t))
    dens = torch.exp(-(logit**2) / 2) / (math.sqrt(2 * math.pi) * t * (1 - t))
    inner = slice(5, g - 5)
    torch.testing.assert_close(w[inner], (dens / g)[inner], rtol=2e-3, atol=1e-9)


@pytest.mark.parametrize("name", list(FORMS))
def test_lognormal_matches_monte_carlo_on_log_snr(name):
    form, g = (FORMS[name](), 100) if name != "ddpm" else (DDPMSchedule(100, "linear"), 100)
    mean, std = -1.0, 2.5
    w = _p(LogNormal(cell_log_snr(form, g), mean, std).weights())
    gen = torch.Generator().manual_seed(0)
    lam = mean + std * torch.randn(400_000, generator=gen, dtype=torch.float64)
    hist = torch.bincount(_draw_cells(form, g, lam), minlength=g).double() / lam.numel()
    assert float((hist - w).abs().sum()) / 2 < 0.01  # total variation, Monte-Carlo error ~ 0.005


def test_lognormal_on_edm_is_its_own_prior_inside():
    form, g = EDMFormulation(), 64
    w = _p(LogNormal(cell_log_snr(form, g), -2 * form.P_mean, 2 * form.P_std).weights())
    prior = form.cell_prior(g)
    torch.testing.assert_close(w[1:-1] / w[1:-1].sum(), prior[1:-1] / prior[1:-1].sum(), rtol=1e-9, atol=1e-15)


# ---- speed ------------------------------------------------------------------------------------------------------
def _official_speed_draws(abar: np.ndarray, n: int, rng: np.random.Generator) -> np.ndarray:
    """SpeeD's official sampler (speedit/diffusion/speed), rewritten in numpy: asymmetric draws and their duals."""
    s = np.sqrt(1.0 - abar)
    grad = np.gradient(s)
    tau = int(np.argmax(grad < 1e-4)) + 1
    p = np.tanh(1e6 * (grad - 1e-4)) + 1.5
    p = p / p.sum()
    t = rng.choice(len(p), size=n, p=p)
    dual = np.where(t < tau, tau - t, t - tau)
    return np.concatenate([t, dual]), tau


@pytest.mark.parametrize("beta", ["linear", "cosine"])
def test_speed_is_the_marginal_of_the_official_sampler(beta):
    form = DDPMSchedule(1000, beta)
    sp = SpeeD.from_config(_t(), form, 1000)
    draws, tau = _official_speed_draws(form.alphas_cumprod.numpy(), 200_000, np.random.default_rng(0))
    assert sp.tau == tau
    hist = np.bincount(np.clip(draws, 0, 999), minlength=1000) / draws.size
    w = _p(sp.weights()).numpy()
    coarse = lambda p: p.reshape(50, 20).sum(1)  # noqa: E731  (bins of 20 cells: Monte-Carlo error ~ 0.003)
    assert np.abs(coarse(hist) - coarse(w)).sum() / 2 < 0.01
    assert abs(w[:tau].sum() - hist[:tau].sum()) < 0.005


@pytest.mark.parametrize("name", ["edm", "flow"])
def test_speed_reaches_continuous_formulations(name):
    form, g = FORMS[name](), 200
    sp = SpeeD.from_config(_t(), form, g)
    assert 1 <= sp.tau <= g and speed_boundary(cell_log_snr(form, g)) == sp.tau
    w = _p(sp.weights())
    assert float(w.min()) > 0 and abs(float(w.sum()) - 1) < 1e-12


# ---- importance -------------------------------------------------------------------------------------------------
def _reference_second_moment(g, h, floor, batches):
    """IDDPM's LossSecondMomentResampler, rewritten: per-t lists of the last h losses, shifted in order."""
    hist = [deque(maxlen=h) for _ in range(g)]
    for k, loss in batches:
        for t, v in zip(k.tolist(), loss.tolist()):
            hist[t].append(v)
    if not all(len(q) == h for q in hist):
        return np.full(g, 1.0 / g)
    w = np.sqrt(np.array([np.mean(np.square(list(q))) for q in hist]))
    w = w / w.sum() * (1 - floor) + floor / g
    return w


def test_importance_matches_iddpm_rule_with_warm_up():
    g, h = 7, 3
    s = LossSecondMoment(g, h, 1e-3)
    gen = torch.Generator().manual_seed(1)
    batches = []
    warm_seen = False
    for step in range(12):
        k = torch.randint(0, g, (9,), generator=gen)
        if step == 0:
            k[:5] = 2  # more losses of one cell in one batch than its history holds
        loss = torch.rand(9, generator=gen, dtype=torch.float64) * (k + 1)
        batches.append((k, loss))
        s.observe(k, loss.float())
        ref = _reference_second_moment(g, h, 1e-3, [(a, b.float().double()) for a, b in batches])
        np.testing.assert_allclose(s.weights().numpy(), ref, rtol=1e-6)
        warm_seen |= bool(s.warmed_up)
        if not bool(s.warmed_up):
            assert torch.equal(s.weights(), torch.full((g,), 1.0 / g, dtype=torch.float64))
    assert warm_seen


def test_importance_sampling_is_unbiased():
    """With fixed per-cell losses L_k, E_p[L_k w_k] under the importance distribution is the uniform mean of L."""
    g = 50
    s = LossSecondMoment(g, 2, 1e-3)
    losses = torch.linspace(0.1, 5.0, g, dtype=torch.float64) ** 2  # (G,) fixed
    for _ in range(2):  # warm up with every cell's loss
        s.observe(torch.arange(g), losses.float())
    ts = Product([s])
    p = _p(ts.weights())
    assert float(p.max() / p.min()) > 10  # far from uniform
    k = sample_timesteps(200_000, ts.weights(), generator=torch.Generator().manual_seed(0))
    lw = ts.loss_weights(k)
    vals = losses[k] * lw.double()
    se = float(vals.std()) / math.sqrt(k.numel())
    assert abs(float(vals.mean()) - float(losses.mean())) < 4 * se
    assert abs(float(losses[k].mean()) - float(losses.mean())) > 20 * se  # without the correction: biased


def test_importance_correction_inside_a_curriculum_keeps_the_unlocked_mean():
    g = 60
    cur = build_curriculum(CurriculumConfig(num_clusters=3, pacing="fixed", stage_iters=1000), DDPMSchedule(g), g, None)
    s = LossSecondMoment(g, 1, 0.0)
    losses = torch.linspace(1.0, 3.0, g, dtype=torch.float64)
    s.observe(torch.arange(g), losses.float())
    ts = build_timesteps(_t(sampler="importance"), DDPMSchedule(g), g, cur)
    ts.parts[0] = s  # the warmed-up strategy
    ts._src = None
    live = _p(cur.timestep_weights()) > 0
    k = torch.arange(g)[live]
    p = _p(ts.weights())[k]
    exact = float((p * losses[k] * ts.loss_weights(k).double()).sum())
    assert exact == pytest.approx(float(losses[k].mean()), rel=1e-6)


# ---- anuts ------------------------------------------------------------------------------------------------------
def test_anuts_weights_are_the_beta_density_at_cell_centres():
    g = 100
    a = ANUTS(g)
    torch.testing.assert_close(a.weights(), torch.full((g,), 1.0 / g, dtype=torch.float64))
    with torch.no_grad():
        a.theta.copy_(torch.tensor([math.log(2.0), math.log(5.0)], dtype=torch.float64))
    a._w = None
    u = (torch.arange(g, dtype=torch.float64) + 0.5) / g
    dens = torch.exp(torch.distributions.Beta(2.0, 5.0).log_prob(u))
    torch.testing.assert_close(a.weights(), dens / dens.sum(), rtol=1e-10, atol=1e-14)


def test_anuts_policy_gradient_moves_towards_rewarded_draws():
    """Draws at high cells, then a larger decrease than the baseline: the policy must favour high cells."""
    g = 40
    a = ANUTS(g, every=1, candidates=8, probes=2, probe_batch=1, lr=0.1)
    before = torch.ones(8, 1)
    a.observe(torch.full((16,), g - 3), torch.ones(16))
    a.observe_probe(before, before - 0.1)  # first update: reward = baseline, no move
    w0 = a.weights().clone()
    for _ in range(5):
        a.observe(torch.full((16,), g - 3), torch.ones(16))
        a.observe_probe(before, before - 1.0)  # larger decrease than before: positive advantage
    w = a.weights()
    assert float(w[g // 2 :].sum()) > float(w0[g // 2 :].sum()) + 0.05


def test_anuts_selects_probes_that_predict_the_total():
    g = 30
    a = ANUTS(g, every=1, candidates=6, probes=2, probe_batch=1)
    gen = torch.Generator().manual_seed(0)
    for _ in range(6):
        d = torch.rand(6, 1, generator=gen, dtype=torch.float64) * 1e-3
        d[4] = d[1] = torch.rand(1, generator=gen, dtype=torch.float64) * 10  # cells 1, 4 carry the total
        a.observe(torch.zeros(3, dtype=torch.long), torch.ones(3))
        a.observe_probe(d, torch.zeros_like(d))
    assert a.selected.tolist() == [1, 4]
    p = a.probe(0)
    assert p[0].tolist() == a.candidates.tolist() and p[1] == 1


def test_anuts_probe_noise_is_new_at_each_update_and_draws_from_no_stream():
    """The probe's noise seed is a function of the update count: one noise before and after a step, a new one at
    the next update, and no random stream is read (the same on every rank and for every engine.seed)."""
    a = ANUTS(30, every=2, candidates=6, probes=2, probe_batch=1)
    state = torch.get_rng_state()
    assert a.probe(0) is None and a.probe(2) is None
    seeds = []
    for step in (1, 3, 5):
        seeds.append(a.probe(step)[2])
        assert a.probe(step)[2] == seeds[-1]
        a.observe(torch.arange(3), torch.ones(3))
        a.observe_probe(torch.ones(6, 1), torch.zeros(6, 1))
    assert len(set(seeds)) == 3 and torch.equal(torch.get_rng_state(), state)


# ---- compositions: a locked cluster gets probability 0 ------------------------------------------------------------
@pytest.mark.parametrize("sampler", list(SAMPLERS))
@pytest.mark.parametrize("name", list(FORMS))
def test_locked_clusters_get_zero_under_every_composition(sampler, name):
    form, g = FORMS[name](), 120
    if name == "ddpm":
        form = DDPMSchedule(g)
    c = CurriculumConfig(num_clusters=4, pacing="fixed", stage_iters=1)
    cur = build_curriculum(c, form, g, None)
    ts = build_timesteps(_t(sampler=sampler), form, g, cur)
    if sampler == "importance":  # a warmed-up, non-uniform strategy
        for _ in range(10):
            ts.parts[-2].observe(torch.arange(g), torch.rand(g) + torch.arange(g) / g)
    for step in range(3):
        w = ts.weights()
        live = torch.zeros(g, dtype=torch.bool)
        for ci in cur.unlocked_clusters:
            lo, hi = cur.clusters[ci]
            live[lo:hi] = True
        assert bool((w[~live] == 0).all()) and bool((w[live] > 0).all()), (sampler, step)
        cur.observe(step, 1.0)


@pytest.mark.parametrize("sampler", ["uniform", "lognormal", "importance"])
def test_curriculum_inside_a_tdc_range(sampler):
    form, g, rng = DDPMSchedule(100), 100, (30, 70)
    c = CurriculumConfig(num_clusters=4, pacing="fixed", stage_iters=1)
    cur = build_curriculum(c, form, g, rng)
    ts = build_timesteps(_t(sampler=sampler), form, g, cur, timestep_range=rng)
    assert cur.num_timesteps == 40 and len(cur.clusters) == 4
    for step in range(4):
        w = ts.weights()
        live = torch.zeros(g, dtype=torch.bool)
        for ci in cur.unlocked_clusters:
            lo, hi = cur.clusters[ci]
            live[30 + lo : 30 + hi] = True
        assert bool((w[~live] == 0).all()) and bool((w[live] > 0).all())
        assert bool((w[:30] == 0).all()) and bool((w[70:] == 0).all())
        k = sample_timesteps(64, w, generator=torch.Generator().manual_seed(step))
        ts.observe(k, torch.rand(64), step)  # the curriculum sees cells relative to the range
        assert cur.history == list(range(min(step + 1, 3)))


def test_bad_range_and_unknown_sampler():
    with pytest.raises(ValueError, match=r"0 <= lo < hi <= 10"):
        range_mask(10, (5, 20))
    with pytest.raises(ValueError, match="unknown timesteps.sampler 'cosmic'; valid choices: uniform, lognormal"):
        strategy_class("cosmic")
    with pytest.raises(ValueError, match="timesteps.sampler"):
        load_config(None, ["timesteps.sampler=cosmic"])
    with pytest.raises(ValueError, match="timesteps.anuts_probes 9 must be <= timesteps.anuts_candidates 4"):
        load_config(None, ["timesteps.sampler=anuts", "timesteps.anuts_candidates=4", "timesteps.anuts_probes=9"])


# ---- state --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("sampler", list(SAMPLERS))
def test_state_round_trip_continues_identically(sampler):
    g = 30
    form = DDPMSchedule(g)
    t = _t(sampler=sampler, anuts_every=2, anuts_candidates=5, anuts_probes=2, importance_history=2)

    def run(ts, steps, start):
        gen = torch.Generator().manual_seed(start)
        for step in range(start, start + steps):
            k = sample_timesteps(8, ts.weights(), generator=gen)
            ts.observe(k, (k.float() + 1) * torch.rand(8, generator=gen), step)
            p = ts.probe(step)
            if p is not None:
                before = torch.rand(len(p[0]), 1, generator=gen)
                ts.observe_probe(before, before * 0.9)

    a = build_timesteps(t, form, g)
    run(a, 7, 0)
    saved = a.state_dict()
    b = build_timesteps(t, form, g)
    b.load_state_dict(saved)
    run(a, 5, 7)
    run(b, 5, 7)
    assert torch.equal(a.weights(), b.weights())


# ---- collectives stay inside the run's process group ------------------------------------------------------------
def _feed_group(sampler: str, rank: int, group=None) -> dict:
    """A strategy x patience curriculum on ``group``, fed 8 steps of rank-dependent draws, losses and probes; each
    factor's weights and the unlock history at the end. Rank 0's loss plateaus, rank 1's halves every step."""
    g, form = 24, DDPMSchedule(24)
    c = CurriculumConfig(num_clusters=3, pacing="patience", patience=1, eval_every=2, ema=0.0, min_delta=0.5)
    cur = build_curriculum(c, form, g, None)
    t = _t(sampler=sampler, importance_history=1, anuts_every=2, anuts_candidates=5, anuts_probes=2)
    ts = build_timesteps(t, form, g, cur, process_group=group)
    gen = torch.Generator().manual_seed(rank)
    for step in range(8):
        k = sample_timesteps(6, ts.weights(), generator=gen)
        scale = 1.0 if rank == 0 else 10.0 * 0.5**step
        ts.observe(k, scale * (1.0 + k.double() / g), step)
        p = ts.probe(step)
        if p is not None:
            before = torch.rand(len(p[0]), p[1], generator=gen, dtype=torch.float64) * (1 + 3 * rank)
            ts.observe_probe(before, before * torch.rand(len(p[0]), 1, generator=gen, dtype=torch.float64))
    return {"w": [w.double().tolist() for w in (p.weights() for p in ts.parts) if w is not None], "h": cur.history}


def _subgroup_worker(rank: int, init_file: str, out_dir: str) -> None:
    import json
    import os

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        groups = [dist.new_group([0]), dist.new_group([1])]  # every rank creates every group, in one order
        res = {s: _feed_group(s, rank, groups[rank]) for s in SAMPLERS}
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
            json.dump(res, fh)
    finally:
        dist.destroy_process_group()


def test_two_runs_on_their_own_rank_subgroups_do_not_mix(tmp_path):
    """Two gloo ranks, each its own run (``engine.split``, as TDC trains its groups): every strategy's collectives
    and the curriculum's go over the run's group only, so each rank ends exactly where it would alone."""
    import json

    import torch.multiprocessing as mp

    mp.spawn(_subgroup_worker, args=(str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    got = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    for s in SAMPLERS:
        alone = [_feed_group(s, r) for r in (0, 1)]
        assert alone[0] != alone[1], s  # the ranks' data lead to different distributions
        assert got[0][s] == alone[0] and got[1][s] == alone[1], s


def test_a_new_strategy_is_one_class_and_one_registry_line(monkeypatch):
    class Reverse(TimestepSampler):
        name = "reverse"

        @classmethod
        def from_config(cls, t, formulation, num_cells):
            s = cls(num_cells)
            s._w = torch.arange(num_cells, 0, -1, dtype=torch.float64)
            s.weights = lambda: s._w
            return s

    import diffcurr_fast.timesteps.registry as reg

    module = SimpleNamespace(Reverse=Reverse)
    monkeypatch.setitem(reg.STRATEGIES, "reverse", "fake_module:Reverse")
    monkeypatch.setattr(reg.importlib, "import_module", lambda name: module)
    ts = build_timesteps(SimpleNamespace(sampler="reverse"), DDPMSchedule(10, "cosine"), 10)
    assert _p(ts.weights())[0] > _p(ts.weights())[-1]
