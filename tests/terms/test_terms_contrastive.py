"""Contrastive flow matching (terms/contrastive.py, DeltaFM): the term against a hand computation of its equation on
odd batch sizes for each formulation, weight 0 leaves the loss bitwise unchanged, a run with it trains and resumes
bit for bit, and a batch of one is refused."""

import pytest
import torch
from conftest import assert_resumed_state, tiny

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.objective import Objective
from diffcurr_fast.ops import philox_randn
from diffcurr_fast.runs.config import DiffusionConfig
from diffcurr_fast.terms.base import TermInputs
from diffcurr_fast.terms.contrastive import Contrastive


@pytest.mark.parametrize(
    "formulation, prediction, weighting",
    [("ddpm", "eps", "min_snr"), ("ddpm", "v", "min_snr"), ("flow", "velocity", "none"), ("edm", "x0", "none")],
)
@pytest.mark.parametrize("b", [2, 5])
def test_contrastive_is_minus_the_weighted_distance_to_the_previous_samples_target(
    formulation, prediction, weighting, b
):
    d = DiffusionConfig(formulation=formulation, prediction=prediction, num_timesteps=50, weighting=weighting)
    form = build_formulation(d)
    g = torch.Generator().manual_seed(b)
    x0 = torch.randn(b, 3, 4, 4, generator=g, dtype=torch.float64)
    pred = torch.randn(b, 3, 4, 4, generator=g, dtype=torch.float64)
    terms = form.training_draw(torch.randint(0, 50, (b,), generator=g), 50, prediction, weighting, 5.0, g)
    seed = 1234
    eps = philox_randn(seed, (b, 3, 4, 4)).double()
    got = Contrastive()(TermInputs(x0, torch.zeros(b, dtype=torch.long), terms, x0, seed, pred, {}, eps))
    for i in range(b):
        j = (i - 1) % b  # the negative of sample i: sample i - 1's data and noise at sample i's own level
        neg = terms.p[i].double() * x0[j] + terms.q[i].double() * eps[j]
        want = -terms.w[i].double() * ((pred[i] - neg) ** 2).mean()
        torch.testing.assert_close(got[i], want, rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="needs at least 2 samples per"):
        Contrastive()(TermInputs(x0[:1], torch.zeros(1, dtype=torch.long), terms, x0[:1], seed, pred[:1], {}, eps[:1]))


def test_a_run_with_the_contrastive_term_changes_the_loss_resumes_exactly_and_weight_is_lambda(tmp_path):
    from diffcurr_fast.train.loop import Trainer

    sets = ["model.depth=2", "checkpoint.every=2", "terms.use=[contrastive]", "terms.contrastive_weight=0.05"]
    cfg = tiny(tmp_path / "a", *sets, "engine.max_steps=4")
    obj = Objective.from_config(cfg)
    assert [(w, type(t).__name__) for w, t in obj.terms] == [(0.05, "Contrastive")]
    whole = Trainer(cfg)
    whole.fit()
    half = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=2"))
    half.fit()
    resumed = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=4"), resume=True)
    resumed.fit()
    assert_resumed_state(whole, resumed)
    plain = Trainer(tiny(tmp_path / "c", "model.depth=2", "engine.max_steps=4"))
    plain.fit()
    assert any(
        not torch.equal(u, v) for u, v in zip(whole.model.state_dict().values(), plain.model.state_dict().values())
    )


def test_contrastive_weight_zero_is_refused_and_unknown_terms_named(tmp_path):
    from diffcurr_fast.runs.recipes import load_config

    with pytest.raises(ValueError, match="terms.contrastive_weight"):
        load_config(None, ["terms.contrastive_weight=0"])
    with pytest.raises(ValueError, match=r"terms.use \['nope'\]: each term once, from contrastive, dispersive"):
        load_config(None, ["terms.use=[nope]"])
    from diffcurr_fast.train.preflight import check_run

    one = tiny(tmp_path / "r", "terms.use=[contrastive]", "data.batch_size=2", "optim.grad_accum_steps=2")
    with pytest.raises(
        ValueError, match="needs at least 2 samples per micro-batch, got 1 .data.batch_size 2 over 1 rank"
    ):
        check_run(one)
