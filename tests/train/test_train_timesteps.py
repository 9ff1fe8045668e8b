"""The trainer with every timestep strategy: it draws t only from the composed sampler, for every formulation;
a resumed run (mid-warm-up, mid-curriculum) is bit-identical for importance and anuts; two gloo ranks hold the same
sampling weights at every step."""

import textwrap

import pytest
import torch
from conftest import assert_resumed_state, resume_in_copy

from diffcurr_fast.objective import Objective
from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.timesteps.registry import SAMPLERS
from diffcurr_fast.train import loop
from diffcurr_fast.train.loop import Trainer, train

pytestmark = pytest.mark.usefixtures("one_thread")

G = 60
FLOW = (
    "diffusion.formulation=flow",
    "diffusion.prediction=velocity",
    "diffusion.learn_sigma=false",
    "diffusion.weighting=none",
    "logging.sampler=euler",
)
EDM = (
    "diffusion.formulation=edm",
    "diffusion.prediction=x0",
    "diffusion.learn_sigma=false",
    "diffusion.weighting=none",
    "logging.sampler=heun",
)
ANUTS = (
    "timesteps.anuts_every=3",
    "timesteps.anuts_candidates=6",
    "timesteps.anuts_probes=2",
    "timesteps.anuts_probe_batch=2",
)


def tiny(run_dir, *extra):
    return load_config(
        None,
        [
            f"checkpoint.run_dir={run_dir}",
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            f"diffusion.num_timesteps={G}",
            "curriculum.num_clusters=4",
            "data.batch_size=17",
            "engine.max_steps=6",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
            "checkpoint.export_ema=false",
            "checkpoint.every=1000",
            "checkpoint.keep_last=5",
            *extra,
        ],
    )


@pytest.mark.parametrize("formulation", [(), FLOW, EDM], ids=["ddpm", "flow", "edm"])
@pytest.mark.parametrize("sampler", SAMPLERS)
def test_trainer_draws_only_from_the_composed_sampler(tmp_path, monkeypatch, sampler, formulation):
    """Every draw is ``ops.sample_timesteps`` on the composed sampler's current weights; the cells drawn have positive
    weight (so lie in the curriculum's unlocked clusters); the importance correction reaches the loss."""
    cfg = tiny(
        tmp_path / "r",
        *formulation,
        f"timesteps.sampler={sampler}",
        *(ANUTS if sampler == "anuts" else ()),  # the options of a strategy the run does not use are refused
        "curriculum.pacing=fixed",
        "curriculum.stage_iters=1",
    )
    tr = Trainer(cfg)
    draws, means = [], []
    real_draw, real_mean = loop.sample_timesteps, Objective.mean

    def draw(b, weights, **kw):
        assert weights is tr.timesteps.weights()  # the composed sampler's weights, nothing assembled beside it
        k = real_draw(b, weights, **kw)
        draws.append((weights.clone(), k.clone()))
        return k

    def mean(per, weights=None):
        means.append(weights)
        return real_mean(per, weights)

    monkeypatch.setattr(loop, "sample_timesteps", draw)
    monkeypatch.setattr(Objective, "mean", staticmethod(mean))
    x0, y = next(tr.loader)
    for _ in range(4):
        tr.train_step(x0, y)
    assert len(draws) == 4
    for w, k in draws:
        assert bool((w[k] > 0).all())
    assert tr.curriculum.stage == 3  # the curriculum moved: weights of 4 stages were drawn from
    assert len({tuple(w.tolist()) for w, _ in draws}) >= 3
    if sampler == "importance":
        assert all(m is not None and m.shape == (17,) for m in means)
    else:
        assert all(m is None for m in means)


@pytest.mark.parametrize("sampler", ["importance", "anuts"])
def test_resume_mid_warm_up_and_mid_curriculum_is_bit_identical(tmp_path, sampler):
    extra = (
        f"timesteps.sampler={sampler}",
        *(ANUTS if sampler == "anuts" else ["timesteps.importance_history=3"]),
        "curriculum.pacing=fixed",
        "curriculum.stage_iters=3",
        "engine.max_steps=9",
        "checkpoint.every=4",
    )
    full = tmp_path / "full"
    train(tiny(full, *extra))
    state4 = ck.load_checkpoint(full / ck.CKPT_DIR / "ckpt_00000004.pt")
    assert 0 < state4["curriculum"]["stage"] < 3  # mid-curriculum
    if sampler == "importance":
        assert int((state4["timesteps"]["importance"]["count"] >= 3).sum()) < G  # mid-warm-up
    else:
        assert state4["timesteps"]["anuts"]["updates"] == 1  # between two policy updates
    half = tmp_path / "half"
    resume_in_copy(full, half, 4, tiny(half, *extra)).fit()
    a, b = (ck.load_checkpoint(ck.latest_checkpoint(d)) for d in (full, half))
    assert a["step"] == b["step"] == 9
    assert_resumed_state(a, b)  # the sampler's state among the rest
    sa = a["timesteps"][sampler]
    if sampler == "anuts":
        assert sa["updates"] == 3 and not torch.equal(sa["theta"], torch.zeros(2, dtype=torch.float64))


DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import Trainer

    run_dir, out = sys.argv[1], sys.argv[2]
    base = [f"checkpoint.run_dir={run_dir}", "model.hidden_size=32", "model.depth=1", "model.num_heads=2",
            "diffusion.num_timesteps=20", "curriculum.pacing=none", "data.batch_size=18", "logging.progress=false",
            "logging.num_samples=0", "logging.plots=false", "checkpoint.export_ema=false", "checkpoint.every=1000",
            "engine.kind=ddp", "engine.device=cpu", "engine.max_steps=12"]
    own = {"importance": ["timesteps.importance_history=1"],
           "anuts": ["timesteps.anuts_every=2", "timesteps.anuts_candidates=5", "timesteps.anuts_probes=2"]}

    def run(engine):  # the trainers (and their DDP reducers) die on return, before the process group is destroyed
        res = {}
        for sampler in ("importance", "anuts"):
            tr = Trainer(load_config(None, base + own[sampler] + [f"timesteps.sampler={sampler}"]), engine,
                         overwrite=True)
            x0, y = next(tr.loader)
            ws, ks = [], []
            for _ in range(12):
                ks.append(tr.train_step(x0, y)["k"].tolist())
                ws.append(tr.timesteps.weights().double().tolist())
            res[sampler] = {"w": ws, "k": ks}
        return res

    engine = create_engine("ddp", "cpu")
    res = run(engine)
    with open(f"{out}.{engine.rank}.json", "w") as fh:
        json.dump(res, fh)
    engine.close()
    """
)


@pytest.mark.slow
def test_two_gloo_ranks_hold_the_same_weights_every_step(tmp_path):
    from conftest import run_torchrun2

    r0, r1 = run_torchrun2(tmp_path, DDP_SCRIPT, tmp_path / "run")
    for sampler in ("importance", "anuts"):
        assert r0[sampler]["k"] != r1[sampler]["k"]  # the ranks draw different cells
        assert r0[sampler]["w"] == r1[sampler]["w"], sampler  # and hold the same distribution at every step
        moved = [w != r0[sampler]["w"][0] for w in r0[sampler]["w"]]
        assert sum(moved) >= 4, sampler  # it moved (importance: warmed up) for several steps


def test_resume_from_a_checkpoint_of_before_the_timesteps_section(tmp_path):
    """A checkpoint without the ``timesteps`` state and config section (and with the curriculum's old write-only
    fields) resumes as the default uniform strategy."""
    run = tmp_path / "run"
    train(tiny(run, "engine.max_steps=4", "checkpoint.every=4"))
    path = run / ck.CKPT_DIR / "ckpt_00000004.pt"
    state = torch.load(path, weights_only=True)
    del state["timesteps"], state["config"]["timesteps"]
    state["curriculum"].update(steps_seen=4, evals=0, last_step=3)
    state["lr_schedule"] = {"step": 4}
    torch.save(state, path)
    tr = Trainer(tiny(run, "engine.max_steps=6"), resume=True)
    assert tr.step == 4 and tr.fit()["step"] == 6
    with pytest.raises(ValueError, match="timesteps.sampler: checkpoint 'uniform' vs now 'importance'"):
        Trainer(tiny(run, "engine.max_steps=8", "timesteps.sampler=importance"), resume=True)


def test_help_config_lists_the_timesteps_section():
    from diffcurr_fast.runs.recipes import describe_config

    text = describe_config()
    assert "timesteps:" in text and "sampler: 'uniform'" in text
    assert "one of uniform, lognormal, importance, speed, anuts" in text
    for key in ("lognormal_std", "importance_history", "speed_k", "anuts_every", "anuts_entropy"):
        assert f"  {key}:" in text
