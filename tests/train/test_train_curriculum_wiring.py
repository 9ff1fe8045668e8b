"""The trainer samples what the curriculum unlocks, and its loss uses the configured MinSNR gamma.

Observed through behaviour only: a forward pre-hook on the model records the time input of every training forward
together with the clusters the curriculum has unlocked at that moment (the curriculum observes a step's loss after
its forward, so these are the clusters unlocked before the step). DDPM: the network time is the timestep k. Flow:
the network time is t in [0, 1), cell floor(t G). EDM: the network time is c_noise = ln(sigma) / 4, cell
(ln sigma - ln sigma_min) / (ln sigma_max - ln sigma_min) G. Every cell must lie in an unlocked cluster.
"""

import json
import math

import pytest
import torch

from diffcurr_fast.data.loader import ArrayDataset
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.loop import Trainer

G = 60  # timesteps / cells
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


pytestmark = pytest.mark.usefixtures("one_thread")


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
            "engine.max_steps=10",
            "logging.log_every=1",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
            "checkpoint.export_ema=false",
            "checkpoint.every=1000",
            *extra,
        ],
    )


def _record(tr):
    """Hook the model: a list of (network time input, unlocked cluster indices) per training forward."""
    seen = []

    def hook(module, args, kwargs):
        t = args[1] if len(args) > 1 else kwargs["t"]
        seen.append((t.detach().double().cpu().clone(), list(tr.curriculum.unlocked_clusters)))

    tr.model.register_forward_pre_hook(hook, with_kwargs=True)
    return seen


def _cells(tr, t_in):
    """Continuous cell coordinate of the network time input (see the module doc)."""
    d = tr.cfg.diffusion
    if d.formulation == "flow":
        return t_in * G
    if d.formulation == "edm":
        lo, hi = math.log(d.sigma_min), math.log(d.sigma_max)
        return (4.0 * t_in - lo) / (hi - lo) * G
    return t_in


def _check_inside_unlocked(tr, seen, tol):
    clusters = tr.curriculum.clusters
    for step, (t_in, unlocked) in enumerate(seen):
        pos = _cells(tr, t_in)
        inside = torch.zeros_like(pos, dtype=torch.bool)
        for c in unlocked:
            lo, hi = clusters[c]
            upper = hi - 1 if tr.cfg.diffusion.formulation == "ddpm" else hi  # DDPM: integer k in [lo, hi)
            inside |= (pos >= lo - tol) & (pos <= upper + tol)
        assert bool(inside.all()), (step, unlocked, pos[~inside].tolist(), [clusters[c] for c in unlocked])


@pytest.mark.parametrize("formulation", [(), FLOW, EDM], ids=["ddpm", "flow", "edm"])
@pytest.mark.parametrize("order", ["easy_to_hard", "hard_to_easy"])
def test_fixed_pacing_samples_only_unlocked_clusters(tmp_path, formulation, order):
    cfg = tiny(
        tmp_path / "r", *formulation, "curriculum.pacing=fixed", "curriculum.stage_iters=2", f"curriculum.order={order}"
    )
    tr = Trainer(cfg)
    seen = _record(tr)
    tr.fit()
    assert len(seen) == 10
    _check_inside_unlocked(tr, seen, tol=1e-4)
    # the curriculum did move on, one cluster every 2 steps, and the first stage is the single first cluster
    assert [len(u) for _, u in seen] == [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]
    first = 3 if order == "easy_to_hard" else 0
    assert seen[0][1] == [first]
    # once everything is unlocked, every cluster is sampled: the restriction came from the curriculum
    late = torch.cat([_cells(tr, t) for t, _ in seen[6:]])
    lo, hi = tr.curriculum.clusters[first]
    assert bool(((late < lo) | (late >= hi)).any())


@pytest.mark.parametrize("formulation", [(), FLOW, EDM], ids=["ddpm", "flow", "edm"])
def test_patience_pacing_samples_only_unlocked_clusters(tmp_path, formulation):
    cfg = tiny(
        tmp_path / "r",
        *formulation,
        "curriculum.pacing=patience",
        "curriculum.patience=1",
        "curriculum.eval_every=1",
        "curriculum.min_delta=0.5",
        "engine.max_steps=8",
    )
    tr = Trainer(cfg)
    seen = _record(tr)
    tr.fit()
    _check_inside_unlocked(tr, seen, tol=1e-4)
    assert tr.curriculum.history, "no cluster was unlocked: the test would not see the pacing"
    assert seen[0][1] == [3] and len(seen[-1][1]) > 1


def _constant_dataset(x0, n=34):
    return ArrayDataset(x0.expand(n, *x0.shape[1:]).clone(), torch.arange(n) % 10)


@pytest.mark.parametrize("gamma", [1.0, 20.0])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_min_snr_gamma_reaches_the_training_loss(tmp_path, gamma, backend, each_cpu_isa):
    """The logged loss of one step equals mean_b min(SNR_b, gamma) / SNR_b |out_b - eps_b|^2 / D (eps target),
    with eps recovered from the recorded network input x_t = sqrt(abar) x0 + sqrt(1 - abar) eps."""
    torch.manual_seed(0)
    x0 = torch.rand(1, 1, 8, 8) * 2 - 1  # every sample is this image: x0 is known whatever the data order
    run = tmp_path / "r"
    cfg = tiny(
        run,
        "diffusion.weighting=min_snr",
        f"diffusion.min_snr_gamma={gamma}",
        "diffusion.learn_sigma=false",
        "diffusion.prediction=eps",
        f"diffusion.ops_backend={backend}",
        "curriculum.pacing=none",
        "engine.max_steps=1",
    )
    tr = Trainer(cfg, dataset=_constant_dataset(x0))
    calls = []
    keep = lambda m, args, out: calls.append((args[0].double(), args[1], out.detach().double()))  # noqa: E731
    tr.model.register_forward_hook(keep)
    tr.fit()
    ((x_t, t, out),) = calls
    logged = json.loads((run / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    ab = tr.formulation.alphas_cumprod[t.cpu()].double().view(-1, 1, 1, 1)
    eps = (x_t - ab.sqrt() * x0.double()) / (1 - ab).sqrt()
    snr = (ab / (1 - ab)).flatten()
    w = torch.minimum(snr, torch.full_like(snr, gamma)) / snr
    hand = float((w * (out - eps).square().flatten(1).mean(1)).mean())
    assert logged == pytest.approx(hand, rel=2e-4)
    other = float(
        (torch.minimum(snr, torch.full_like(snr, 5.0)) / snr * (out - eps).square().flatten(1).mean(1)).mean()
    )
    assert abs(other - hand) > 1e-2 * hand  # the batch holds timesteps where gamma matters
