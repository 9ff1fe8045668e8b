"""Dispersive loss (terms/dispersive.py): against the official code's form by hand on odd batch sizes, its value at
full collapse and its floor, the block's features read from the same pass, and a run that resumes bit for bit."""

import math

import pytest
import torch
from conftest import assert_resumed_state, tiny

from diffcurr_fast.objective import Objective
from diffcurr_fast.terms.dispersive import Dispersive, dispersive_loss


@pytest.mark.parametrize("b", [2, 3, 7])
def test_dispersive_loss_is_the_log_mean_exp_of_the_scaled_squared_distances(b):
    z = torch.randn(b, 5, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(b))
    flat, f = z.reshape(b, -1), 15
    # the official form: pdist^2 / F over the pairs i < j, counted twice, and B zeros of the diagonal
    pairs = [((flat[i] - flat[j]) ** 2).sum() / f for i in range(b) for j in range(i + 1, b)]
    want = math.log((2 * sum(math.exp(-float(p)) for p in pairs) + b) / b**2)
    assert float(dispersive_loss(z)) == pytest.approx(want, rel=1e-6)
    tau = 0.5
    want_tau = math.log((2 * sum(math.exp(-float(p) / tau) for p in pairs) + b) / b**2)
    assert float(dispersive_loss(z, tau)) == pytest.approx(want_tau, rel=1e-6)
    assert float(dispersive_loss(torch.zeros(b, 4))) == pytest.approx(0.0, abs=1e-7)  # collapsed: log 1
    assert float(dispersive_loss(1e3 * torch.eye(b))) == pytest.approx(-math.log(b), rel=1e-6)  # spread: -log B


def test_the_term_reads_its_block_from_the_same_pass_and_a_run_resumes_exactly(tmp_path):
    from diffcurr_fast.train.loop import Trainer

    sets = ["model.depth=4", "checkpoint.every=2", "terms.use=[dispersive]"]
    cfg = tiny(tmp_path / "a", *sets, "engine.max_steps=4")
    obj = Objective.from_config(cfg)
    ((w, term),) = obj.terms
    assert w == 0.5 and isinstance(term, Dispersive) and term.features == (1,) and obj.features == (1,)  # depth // 4
    whole = Trainer(cfg)
    seen = []
    real = whole.net.forward

    def spy(*a, **kw):
        seen.append(kw.get("features"))
        return real(*a, **kw)

    whole.net.forward = spy
    whole.fit()
    assert seen and all(f == (1,) for f in seen)  # one forward per step, with the block's features
    half = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=2"))
    half.fit()
    resumed = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=4"), resume=True)
    resumed.fit()
    assert_resumed_state(whole, resumed)


def test_a_block_outside_the_model_is_refused():
    from diffcurr_fast.runs.recipes import load_config

    with pytest.raises(ValueError, match="terms.dispersive_block 9 must be a block of the model: 0 to 3"):
        load_config(None, ["terms.use=[dispersive]", "terms.dispersive_block=9"])
