"""TDC keeps every group on its own timesteps, and sampling routes every step to its group's expert.

Observed from outside: a global forward pre-hook records the time input of every ``DiT`` forward. Importance
scoring, recovery, proxy scoring and the whole proxy search of a group must only ever show the network that
group's t; so must stage-2 fine-tuning inside ``run_tdc`` (told apart by wrapping ``Trainer.fit``, and the search by
wrapping the pipeline's calls of the public search functions, which set the phase the records are filed under).
"""

import contextlib
import copy

import pytest
import torch

from diffcurr_fast.diffusion import DDPMSchedule, Readout
from diffcurr_fast.models import DiT
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.tdc.experts import MultiExpertDenoiser
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.grouping import make_groups
from diffcurr_fast.tdc.proposers import make_proposer
from diffcurr_fast.tdc.proxy import proxy_loss, recover
from diffcurr_fast.tdc.prune import importance_scores
from diffcurr_fast.tdc.search import proxy_search

TINY = dict(
    input_size=4,
    patch_size=2,
    in_channels=3,
    hidden_size=24,
    depth=2,
    num_heads=3,
    mlp_ratio=2.5,
    num_classes=4,
    num_timesteps=100,
    attn_backend="math",
)


pytestmark = pytest.mark.usefixtures("one_thread")


@contextlib.contextmanager
def record_dit_times(phase=None):
    """Yield a list of (phase, t) for every DiT forward while active; ``phase`` is a one-element list to read."""
    seen = []

    def hook(module, args):
        if isinstance(module, DiT):
            assert len(args) > 1, "DiT called with t as a keyword: extend this hook"
            seen.append((phase[0] if phase else None, args[1].detach().double().cpu().clone()))

    handle = torch.nn.modules.module.register_module_forward_pre_hook(hook)
    try:
        yield seen
    finally:
        handle.remove()


def _random_dit(seed=0, **kw):
    torch.manual_seed(seed)
    m = DiT(**{**TINY, **kw}).eval()
    with torch.no_grad():  # the release zero-inits adaLN / output layers: randomize so every path matters
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(0, 0.08)
    return m


def _assert_in(seen, lo, hi):
    assert seen, "the network was never called"
    t = torch.cat([s[1] for s in seen])
    assert bool(((t >= lo) & (t < hi)).all()), (lo, hi, t[(t < lo) | (t >= hi)].tolist()[:10])
    return t


@pytest.fixture(scope="module")
def setup():
    model = _random_dit()
    s = DDPMSchedule(100)
    groups = make_groups(s, 3, 0.5, dit_flops(model))
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(6, 3, 4, 4, generator=g), torch.randint(0, 4, (6,), generator=g)) for _ in range(2)]
    held = [(torch.randn(4, 3, 4, 4, generator=g), torch.randint(0, 4, (4,), generator=g))]
    return model, s, groups, train, held


@pytest.mark.parametrize("gi", [0, 2])
def test_importance_recovery_and_proxy_see_only_the_group(setup, gi):
    model, s, groups, train, held = setup
    g = groups[gi]
    assert 0 < g.hi - g.lo < 100
    with record_dit_times() as seen:
        imp = importance_scores(model, "taylor", objective=s, group=g, batches=train)
    _assert_in(seen, g.lo, g.hi)
    m = copy.deepcopy(model)
    with record_dit_times() as seen:
        recover(m, g, train, 3, objective=s, lr=1e-3)
    t = _assert_in(seen, g.lo, g.hi)
    assert len(t) == 3 * 6  # three recovery steps of six samples
    with record_dit_times() as seen:
        proxy_loss(m, g, held, objective=s)
    _assert_in(seen, g.lo, g.hi)
    with record_dit_times() as seen:
        res = proxy_search(
            model,
            g,
            g.flops,
            train,
            held,
            objective=s,
            importance=imp,
            rounds=2,
            candidates_per_round=2,
            recover_steps=1,
            proposer=make_proposer("local"),
        )
    t = _assert_in(seen, g.lo, g.hi)
    assert len(res.bank) >= 1 and len(t) >= len(res.bank) * (6 + 4)  # every candidate was recovered and scored
    # with the same inputs, the importance of another group differs: the group reaches the loss
    other = importance_scores(model, "taylor", objective=s, group=groups[1], batches=train)
    assert not torch.allclose(torch.cat(imp.heads), torch.cat(other.heads))


@pytest.mark.parametrize("formulation", ["ddpm", "edm"])
def test_pruning_draws_the_groups_cells_as_its_fine_tune_does(tmp_path, formulation):
    """Importance, recovery and the proxy draw a group's cells from the weights the stage-2 trainer draws from
    (``timesteps.sampler=uniform`` on ``timestep_range``): for DDPM the indicator of the group, for EDM its
    log-normal sigma prior restricted to the group (not uniform over the group's cells)."""
    from diffcurr_fast.objective import Objective
    from diffcurr_fast.tdc.prune import group_weights
    from diffcurr_fast.train.loop import Trainer

    lo, hi = 12, 31
    cfg = load_config(
        None,
        [
            f"checkpoint.run_dir={tmp_path}",
            f"diffusion.formulation={formulation}",
            "diffusion.num_timesteps=40",
            "curriculum.pacing=none",
            "model.hidden_size=24",
            "model.depth=1",
            "model.num_heads=2",
            "logging.num_samples=0",
            "logging.plots=false",
        ],
    )
    tr = Trainer(cfg, timestep_range=(lo, hi), overwrite=True)
    w = group_weights(Objective.from_config(cfg), (lo, hi)).double()
    torch.testing.assert_close(w / w.sum(), tr.timesteps.weights().double() / tr.timesteps.weights().double().sum())
    assert bool((w[:lo] == 0).all()) and bool((w[hi:] == 0).all())
    inside = w[lo:hi] / w[lo:hi].sum()
    if formulation == "ddpm":
        torch.testing.assert_close(inside, torch.full((hi - lo,), 1.0 / (hi - lo), dtype=torch.float64))
    else:  # ln sigma ~ N(P_mean, P_std^2) on the group's cells
        prior = tr.formulation.cell_prior(40)[lo:hi]
        torch.testing.assert_close(inside, prior / prior.sum(), rtol=1e-5, atol=1e-9)
        assert float(inside.max() / inside.min()) > 2.0


def test_run_tdc_search_and_finetune_stay_in_their_groups(tmp_path, monkeypatch):
    from diffcurr_fast.tdc import pipeline
    from diffcurr_fast.train.loop import Trainer

    phase = ["outside"]
    real_fit, real_imp, real_search = Trainer.fit, pipeline.importance_scores, pipeline.proxy_search

    def fit(self):
        phase[0] = ("fit", self.run_dir.relative_to(tmp_path / "run").as_posix())
        try:
            return real_fit(self)
        finally:
            phase[0] = "outside"

    def phased(real, name):
        def call(*args, **kwargs):
            group = kwargs.get("group", args[1] if len(args) > 1 else None)
            phase[0] = (name, group.index)
            try:
                return real(*args, **kwargs)
            finally:
                phase[0] = "outside"

        return call

    monkeypatch.setattr(Trainer, "fit", fit)
    monkeypatch.setattr(pipeline, "importance_scores", phased(real_imp, "importance"))
    monkeypatch.setattr(pipeline, "proxy_search", phased(real_search, "search"))
    cfg = load_config(
        None,
        [
            "model.hidden_size=32",
            "model.depth=2",
            "model.num_heads=2",
            "diffusion.num_timesteps=40",
            "curriculum.pacing=none",
            "data.batch_size=17",
            "engine.max_steps=3",
            "engine.cpu_threads=1",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.log_every=1",
            "logging.plots=false",
            f"checkpoint.run_dir={tmp_path / 'unused'}",
        ],
    )
    opts = {
        "num_groups": 2,
        "budget_floor": 0.5,
        "rounds": 1,
        "candidates": 2,
        "recover_steps": 1,
        "search_batches": 1,
        "heldout_batches": 1,
        "importance_batches": 1,
        "finetune_steps": 4,
        "search_batch_size": 9,
    }
    with record_dit_times(phase) as seen:
        out = pipeline.run_tdc(cfg, opts, tmp_path / "run", verbose=False)
    groups = [p["group"] for p in out["groups"]]
    assert [(g["lo"], g["hi"]) for g in groups][0][0] == 0 and groups[-1]["hi"] == 40
    by_phase = {}
    for ph, t in seen:
        by_phase.setdefault(ph, []).append(t)
    stage1 = torch.cat(by_phase[("fit", "stage1")])
    assert bool((stage1 < groups[0]["hi"]).any()) and bool((stage1 >= groups[1]["lo"]).any())  # all timesteps
    for i, g in enumerate(groups):
        for ph in (("importance", i), ("search", i), ("fit", f"group_{i}/finetune")):
            t = _assert_in([(ph, v) for v in by_phase.get(ph, [])], g["lo"], g["hi"])
            if ph[0] == "fit":
                assert len(t) == 4 * 17  # every fine-tuning step, on the group's range only


# ---- sampling with distinct experts --------------------------------------------------------------------------

RANGES = [(0, 30), (30, 61), (61, 100)]


def _experts():
    return [_random_dit(seed=10 + i, learn_sigma=True) for i in range(3)]


def _hand_router(experts):
    """Route by hand: the whole batch of one sampling step has one t; pick the range holding it."""

    def model(x, t, y):
        assert bool((t == t[0]).all())
        (g,) = [i for i, (lo, hi) in enumerate(RANGES) if lo <= float(t[0]) < hi]
        return experts[g](x, t, y)

    return model


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
@pytest.mark.parametrize("sampler", ["ddpm", "ddim", "heun"])
def test_sampling_routes_each_step_to_its_groups_expert(sampler, cfg_scale):
    from diffcurr_fast.runs.sampling import sample

    experts = _experts()
    multi = MultiExpertDenoiser(experts, RANGES).eval()
    calls = {i: [] for i in range(3)}
    for i, e in enumerate(experts):
        e.register_forward_pre_hook(lambda m, a, i=i: calls[i].append(a[1].detach().double().clone()))
    kw = dict(
        sampler=sampler,
        steps=10,
        labels=torch.tensor([0, 3, 1]),
        channels=3,
        size=4,
        num_classes=4,
        readout=Readout("eps", learn_sigma=True),
        cfg_scale=cfg_scale,
        seed=5,
    )
    s = DDPMSchedule(100)
    got = sample(multi, s, **kw)
    routed = {i: list(c) for i, c in calls.items()}
    for c in calls.values():
        c.clear()
    for i, (lo, hi) in enumerate(RANGES):
        assert routed[i], f"expert {i} was never used"
        t = torch.cat(routed[i])
        assert bool(((t >= lo) & (t < hi)).all()), (i, t.unique().tolist())
        assert all(len(c) == (6 if cfg_scale != 1.0 else 3) for c in routed[i])  # guided: cond + uncond halves
    n_steps = sum(len(c) for c in routed.values())
    assert n_steps >= 10  # every step went to exactly one expert
    want = sample(_hand_router(experts), s, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    single = sample(experts[0], s, **kw)
    assert (single - got).abs().max() > 1e-3  # the experts differ, so the routing matters
