"""The training-term interface: the DiT returns block features from the same pass, and the objective adds each
term's weighted per-sample loss (terms.base)."""

import pytest
import torch
from torch import nn

from diffcurr_fast.diffusion import DDPMSchedule
from diffcurr_fast.models import DiT
from diffcurr_fast.objective import Objective
from diffcurr_fast.terms.base import TermInputs, TrainingTerm

KW = dict(
    input_size=8,
    patch_size=2,
    in_channels=1,
    hidden_size=32,
    depth=3,
    num_heads=2,
    num_classes=10,
    class_dropout_prob=0.0,
)  # no label dropout: two passes over one batch see the same labels


def _model():
    torch.manual_seed(0)
    m = DiT(**KW)
    with torch.no_grad():  # the zero-initialised adaLN and final layers would hide the blocks
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    return m


def test_dit_returns_the_block_features_of_the_same_pass():
    m = _model().eval()
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([1, 500, 999]), torch.tensor([0, 3, 9])
    seen = {}
    hooks = [b.register_forward_hook(lambda mod, a, o, j=j: seen.__setitem__(j, o)) for j, b in enumerate(m.blocks)]
    out, feats = m(x, t, y, features=(2, 0))
    for h in hooks:
        h.remove()
    assert set(feats) == {0, 2}
    for j in (0, 2):
        assert feats[j].shape == (3, 16, 32) and torch.equal(feats[j], seen[j])
    assert torch.equal(out, m(x, t, y))  # asking for features changes nothing else
    with pytest.raises(ValueError, match=r"features \[3\]: this DiT has blocks 0 to 2"):
        m(x, t, y, features=(3,))


class ProjectedNorm(TrainingTerm):
    """A toy term with a trainable part: the mean square of a linear projection of block 1's tokens."""

    features = (1,)

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(32, 5)

    def forward(self, inputs: TermInputs) -> torch.Tensor:
        return self.proj(inputs.features[1]).square().mean((1, 2))  # (B,)


@pytest.mark.parametrize("batch", [1, 5])
def test_objective_adds_each_weighted_term_from_one_forward(batch):
    model, term = _model(), ProjectedNorm()
    calls = []
    model.register_forward_pre_hook(lambda mod, args, kwargs: calls.append(kwargs.get("features")), with_kwargs=True)
    x0, y = torch.randn(batch, 1, 8, 8), torch.arange(batch) % 10
    k = torch.arange(batch) * 97 % 1000
    sched = DDPMSchedule(1000)
    plain = Objective(sched, num_cells=1000, prediction="eps", backend="reference")
    base = plain(model, x0, y, k, seed=11)
    assert calls == [None]
    for weight in (0.0, 0.3):
        calls.clear()
        obj = Objective(sched, num_cells=1000, prediction="eps", backend="reference", terms=[(weight, term)])
        per = obj(model, x0, y, k, seed=11)
        assert calls == [(1,)]  # one pass, asked for the block the term reads
        # by hand: the regression loss plus weight x the term on block 1's tokens of that pass
        _, feats = model(*_network_input(plain, x0, k), y, features=(1,))
        want = base + weight * term.proj(feats[1]).square().mean((1, 2))
        if weight == 0.0:
            assert torch.equal(per, base)  # weight 0: the run's loss is unchanged
        torch.testing.assert_close(per, want, rtol=1e-6, atol=1e-7)
    per.sum().backward()  # the term's trainable part gets its gradient from the same loss
    assert term.proj.weight.grad is not None and term.proj.weight.grad.abs().sum() > 0


def _network_input(obj, x0, k):
    """The network input and time of ``obj``'s draw at cells ``k`` with seed 11 (what ``Objective`` feeds)."""
    from diffcurr_fast.ops import q_sample_coef

    draw = obj.draw(k)
    return q_sample_coef(x0, draw.a, draw.c, seed=11, backend="reference"), draw.t_in
