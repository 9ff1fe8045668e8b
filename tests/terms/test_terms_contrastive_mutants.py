"""Contrastive flow matching (terms/contrastive.py): the term is computed in the data's precision, whatever the
precision of the noise and of the draw's (float64) coefficients, and equals the module doc's equation there."""

import pytest
import torch

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.runs.config import DiffusionConfig
from diffcurr_fast.terms.base import TermInputs
from diffcurr_fast.terms.contrastive import Contrastive


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_term_is_computed_in_the_datas_dtype_from_float32_noise_and_float64_coefficients(dtype):
    """x0 and pred in ``dtype``, the noise float32 (as the objective regenerates it), the draw float64 (v target, MinSNR
    weights): every factor is cast to x0's dtype, so the (B,) loss is in x0's dtype and equals the equation computed
    with the factors rounded to it."""
    b = 4
    form = build_formulation(DiffusionConfig(formulation="ddpm", prediction="v", num_timesteps=50, weighting="min_snr"))
    g = torch.Generator().manual_seed(3)
    draw = form.training_draw(torch.randint(0, 50, (b,), generator=g), 50, "v", "min_snr", 5.0, g)
    assert draw.p.dtype == draw.q.dtype == draw.w.dtype == torch.float64  # the test means something
    assert not torch.all(draw.w == 1)
    x0 = torch.randn(b, 2, 3, 3, generator=g).to(dtype)
    pred = torch.randn(b, 2, 3, 3, generator=g).to(dtype)
    eps = torch.randn(b, 2, 3, 3, generator=g)  # float32
    got = Contrastive()(TermInputs(x0, torch.zeros(b, dtype=torch.long), draw, x0, 0, pred, {}, eps))
    assert got.dtype == dtype and got.shape == (b,)
    # the same equation with every factor rounded to the data's dtype, then computed in float64
    p, q, w = (getattr(draw, n).to(dtype).double().view(-1, 1, 1, 1) for n in "pqw")
    e = eps.to(dtype).double()
    neg = p * x0.double().roll(1, dims=0) + q * e.roll(1, dims=0)
    want = -w.flatten() * (pred.double() - neg).square().flatten(1).mean(dim=1)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
