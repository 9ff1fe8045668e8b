"""Immiscible diffusion (terms/immiscible.py, terms.immiscible): the assignment is the least total distance (brute
force), the objective with it equals a float64 hand computation with the noise assigned to the images, its per-sample
losses are the assigned pairs', off leaves the loss bitwise unchanged, and a run with it is deterministic and resumes
bit for bit."""

import itertools

import pytest
import torch
from conftest import assert_resumed_state, tiny

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.objective import Objective
from diffcurr_fast.ops import diffusion_loss_coef, philox_randn, q_sample_coef
from diffcurr_fast.runs.config import DiffusionConfig
from diffcurr_fast.terms.base import TermInputs, TrainingTerm
from diffcurr_fast.terms.immiscible import assign_noise

SHAPE = (3, 4, 4)


def _brute_force(x0: torch.Tensor, noise: torch.Tensor) -> tuple[torch.Tensor, float]:
    """(sigma, cost): sigma[i] the noise of image i over all B! pairings, least sum_i || x0_i - eps_sigma(i) ||_2."""
    d = torch.cdist(x0.flatten(1).double(), noise.flatten(1).double())  # (B, B): image i, noise j
    b = x0.shape[0]
    best = min(itertools.permutations(range(b)), key=lambda s: float(d[torch.arange(b), torch.tensor(s)].sum()))
    return torch.tensor(best), float(d[torch.arange(b), torch.tensor(best)].sum())


def _model(x, t, y):
    """A toy network of (x_in, t_in, y): every sample's output depends on its own input, level and label."""
    s = (1.0 + 0.001 * t.to(x.dtype)).view(-1, 1, 1, 1)
    return torch.tanh(x) * s + 0.1 * y.to(x.dtype).view(-1, 1, 1, 1)


@pytest.mark.parametrize("trial", range(4))
def test_the_assignment_is_the_least_total_distance_of_all_pairings(trial):
    g = torch.Generator().manual_seed(trial)
    b = 5
    x0 = torch.randn(b, *SHAPE, generator=g) * (0.5 + trial)  # data farther from the noise as trial grows
    noise = torch.randn(b, *SHAPE, generator=g)
    pi = assign_noise(x0, noise)  # pi[b]: the image of noise stream b
    assert pi.dtype == torch.int64 and sorted(pi.tolist()) == list(range(b))
    d = torch.cdist(x0.flatten(1).double(), noise.flatten(1).double())
    got = float(d[pi, torch.arange(b)].sum())
    _, best = _brute_force(x0, noise)
    assert got == pytest.approx(best, rel=1e-12)
    assert got <= float(d.diagonal().sum()) + 1e-12  # never worse than the loader's pairing


@pytest.mark.parametrize(
    "formulation, prediction, weighting",
    [("ddpm", "eps", "min_snr"), ("ddpm", "v", "none"), ("flow", "velocity", "none"), ("edm", "x0", "none")],
)
@pytest.mark.parametrize("b", [1, 3, 7])
def test_objective_equals_the_float64_loss_with_the_noise_assigned_to_the_images(formulation, prediction, weighting, b):
    d = DiffusionConfig(formulation=formulation, prediction=prediction, num_timesteps=50, weighting=weighting)
    obj = Objective(build_formulation(d), num_cells=50, prediction=prediction, weighting=weighting,
                    backend="reference", pairing=assign_noise)  # fmt: skip
    g = torch.Generator().manual_seed(100 + b)
    x0 = torch.randn(b, *SHAPE, generator=g) * 1.5
    y = torch.randint(0, 10, (b,), generator=g)
    k = torch.randint(0, 50, (b,), generator=g)
    seed = 4321 + b
    got = obj(_model, x0, y, k, seed=seed, generator=torch.Generator().manual_seed(7))  # (B,)

    # by hand, in float64: the paper's draw, image i diffused with its assigned noise eps_sigma(i); the level of the
    # noise stream's position goes with it (drawn per position, independent of the content: terms/immiscible.py)
    eps = philox_randn(seed, (b, *SHAPE)).double()  # (B, C, H, W): stream j = position j
    sigma, _ = _brute_force(x0, eps)  # the least total distance over all B! pairings, without scipy
    draw = obj.draw(k, torch.Generator().manual_seed(7))
    want = torch.empty(b, dtype=torch.float64)
    for i in range(b):
        j = int(sigma[i])  # image i's noise stream, at position j
        a, c, p, q, w = (float(getattr(draw, n)[j]) for n in "acpqw")
        x_in = a * x0[i].double() + c * eps[j]
        t_in = draw.t_in[j : j + 1].double()
        out = _model(x_in[None], t_in, y[i : i + 1])[0]
        want[j] = w * ((out - (p * x0[i].double() + q * eps[j])) ** 2).mean()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-6)


def test_per_sample_losses_are_the_assigned_pairs_and_terms_see_the_permuted_batch():
    seen = {}

    class Spy(TrainingTerm):
        needs_noise = True

        def forward(self, inputs: TermInputs) -> torch.Tensor:
            seen.update(x0=inputs.x0, y=inputs.y, noise=inputs.noise)
            return torch.zeros(inputs.x0.shape[0])

    b, seed = 7, 99
    form = build_formulation(DiffusionConfig(num_timesteps=50))
    g = torch.Generator().manual_seed(0)
    x0, y, k = torch.randn(b, *SHAPE, generator=g) * 2, torch.arange(b), torch.randint(0, 50, (b,), generator=g)
    on = Objective(
        form, num_cells=50, prediction="eps", backend="reference", pairing=assign_noise, terms=[(1.0, Spy())]
    )
    off = Objective(form, num_cells=50, prediction="eps", backend="reference")
    noise = philox_randn(seed, (b, *SHAPE))
    pi = assign_noise(x0, noise)
    assert not torch.equal(pi, torch.arange(b))  # the test means something: the assignment moves the data
    got = on(_model, x0, y, k, seed=seed)
    # position j: image pi[j] with noise stream j and cell k[j], i.e. the plain objective on the permuted batch
    assert torch.equal(got, off(_model, x0[pi], y[pi], k, seed=seed))
    assert torch.equal(seen["x0"], x0[pi]) and torch.equal(seen["y"], y[pi])
    assert torch.equal(seen["noise"], noise)  # the one regenerated noise, in place: stream j at position j


def test_off_leaves_the_loss_bitwise_unchanged_and_an_identity_assignment_changes_nothing():
    b, seed = 5, 1234
    form = build_formulation(DiffusionConfig(num_timesteps=50))
    g = torch.Generator().manual_seed(1)
    x0, y, k = torch.randn(b, *SHAPE, generator=g), torch.arange(b), torch.randint(0, 50, (b,), generator=g)
    kw = dict(num_cells=50, prediction="eps", backend="reference")
    off = Objective(form, **kw)(_model, x0, y, k, seed=seed)
    draw = Objective(form, **kw).draw(k)
    x_in = q_sample_coef(x0, draw.a, draw.c, seed=seed, backend="reference")
    plain = diffusion_loss_coef(_model(x_in, draw.t_in, y), x0, None, draw.p, draw.q, draw.w, reduction="none",
                                seed=seed, backend="reference")  # fmt: skip
    assert torch.equal(off, plain)
    assert torch.equal(Objective(form, **kw, pairing=None)(_model, x0, y, k, seed=seed), off)
    # data next to their own noise: the assignment is the identity, and the loss is the plain one bit for bit
    near = philox_randn(seed, (b, *SHAPE)) + 0.01 * x0
    assert torch.equal(assign_noise(near, philox_randn(seed, (b, *SHAPE))), torch.arange(b))
    on = Objective(form, **kw, pairing=assign_noise)(_model, near, y, k, seed=seed)
    assert torch.equal(on, Objective(form, **kw)(_model, near, y, k, seed=seed))


def test_a_run_with_immiscible_noise_is_deterministic_resumes_exactly_and_changes_training(tmp_path):
    from diffcurr_fast.train.loop import Trainer

    sets = ["model.depth=2", "checkpoint.every=2", "terms.immiscible=true", "optim.grad_accum_steps=2"]
    cfg = tiny(tmp_path / "a", *sets, "engine.max_steps=4")
    assert (
        Objective.from_config(cfg).pairing is assign_noise
        and Objective.from_config(tiny(tmp_path / "p")).pairing is None
    )
    whole = Trainer(cfg)
    whole.fit()
    again = Trainer(tiny(tmp_path / "a2", *sets, "engine.max_steps=4"))
    again.fit()
    half = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=2"))
    half.fit()
    resumed = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=4"), resume=True)
    resumed.fit()
    assert_resumed_state(whole, again)  # deterministic
    assert_resumed_state(whole, resumed)
    plain = Trainer(tiny(tmp_path / "c", "model.depth=2", "optim.grad_accum_steps=2", "engine.max_steps=4"))
    plain.fit()
    assert any(
        not torch.equal(u, v) for u, v in zip(whole.model.state_dict().values(), plain.model.state_dict().values())
    )


def test_shapes_must_match():
    with pytest.raises(ValueError, match=r"immiscible: x0 \(2, 3\) and noise \(3, 3\) must have one shape"):
        assign_noise(torch.zeros(2, 3), torch.zeros(3, 3))
