"""Dispersive loss (terms/dispersive.py): the term built from the config reads its block (default depth // 4) and its
tau, tau is 1 when not given (the official code's), the batch's value comes back once per sample, and a batch of one
sample is refused while two are enough."""

import pytest
import torch
from conftest import tiny

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.terms.base import TermInputs
from diffcurr_fast.terms.dispersive import Dispersive, dispersive_loss


def _inputs(z: torch.Tensor, block: int) -> TermInputs:
    """The term's inputs: only the features of ``block`` matter to it."""
    b = z.shape[0]
    x = torch.zeros(b, 1, 2, 2)
    return TermInputs(x, torch.zeros(b, dtype=torch.long), None, x, 0, x, {block: z})


def test_from_config_reads_the_block_and_tau_and_defaults_the_block_to_a_quarter_of_the_depth():
    """``terms.dispersive_block`` and ``terms.dispersive_tau`` reach the term; no block: depth // 4."""
    cfg = load_config(None, ["model.depth=8", "terms.use=[dispersive]", "terms.dispersive_block=0",
                             "terms.dispersive_tau=0.25"])  # fmt: skip
    term = Dispersive.from_config(cfg)
    assert term.features == (0,) and term.tau == 0.25
    term = Dispersive.from_config(load_config(None, ["model.depth=8", "terms.use=[dispersive]"]))
    assert term.features == (2,) and term.tau == 1.0


def test_the_term_is_the_batchs_loss_at_its_tau_once_per_sample_and_tau_is_one_by_default():
    """B = 3 samples of T = 5 tokens: a (3,) loss, each the batch's L_disp at the term's tau (1 unless given)."""
    z = torch.randn(3, 5, 2, generator=torch.Generator().manual_seed(0))
    got = Dispersive(block=1, tau=0.5)(_inputs(z, 1))
    assert got.shape == (3,)
    torch.testing.assert_close(got, dispersive_loss(z, 0.5).expand(3))
    assert float(dispersive_loss(z, 0.5)) != pytest.approx(float(dispersive_loss(z, 1.0)))  # tau matters here
    default = Dispersive(block=1)(_inputs(z, 1))
    torch.testing.assert_close(default, dispersive_loss(z, 1.0).expand(3))


def test_a_batch_of_one_is_refused_and_two_samples_of_one_token_are_enough():
    """The term compares the samples (B > 1); the token count plays no part in that rule."""
    with pytest.raises(ValueError, match="terms.use dispersive needs at least 2 samples per"):
        Dispersive(block=0)(_inputs(torch.randn(1, 4, 2), 0))
    z = torch.tensor([[[0.0, 0.0]], [[1.0, 1.0]]])  # B = 2, one token of 2 features: squared distance 2, F = 2
    got = Dispersive(block=0)(_inputs(z, 0))
    want = torch.log((2 + 2 * torch.exp(torch.tensor(-1.0))) / 4)  # log (1/B^2) (two zeros + two exp(-2/2))
    torch.testing.assert_close(got, want.expand(2))


def test_preflight_takes_a_micro_batch_of_two_and_refuses_one(tmp_path):
    """The run's rule matches the term's: 2 samples per micro-batch pass, 1 is refused."""
    from diffcurr_fast.train.preflight import check_run

    sets = ["terms.use=[dispersive]", "data.batch_size=2"]
    check_run(tiny(tmp_path / "two", *sets, "optim.grad_accum_steps=1"))
    with pytest.raises(ValueError, match="needs at least 2 samples per micro-batch, got 1"):
        check_run(tiny(tmp_path / "one", *sets, "optim.grad_accum_steps=2"))
