"""SPRINT (models/routing.py, ``DiT(routing=(start, end), sprint=True)``): the dense encoder, the sparse middle, the
[MASK] put-back and the concat-linear fusion against a loop written by hand; keep 1.0 bitwise the unrouted model;
where the gradients go; torch.compile(fullgraph=True); the state dict of the models without SPRINT; the loss over
every token; a resumed run bit-identical with its full-token phase; the refusals of export and TDC."""

import pytest
import torch

from diffcurr_fast.models.dit import DiT
from diffcurr_fast.models.routing import draw_route

T = 16  # tokens of the 8x8 inputs at patch 2


def _dit(span=(1, 3), **kw):
    torch.manual_seed(0)
    m = DiT(
        input_size=8,
        patch_size=2,
        in_channels=3,
        hidden_size=32,
        depth=4,
        num_heads=2,
        num_classes=5,
        routing=span,
        **kw,
    )
    for p in m.parameters():  # non-zero everywhere (the release zeroes the adaLN and output layers)
        p.data.add_(0.05 * torch.randn_like(p))
    return m.double()


def _inputs(b=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 3, 8, 8, generator=g, dtype=torch.float64), torch.tensor([3, 500, 999][:b]), torch.arange(b)


def _by_hand(m, x, t, y, idx, span):
    """The SPRINT forward written plainly, one sample at a time: encoder on every token, middle blocks on the kept
    tokens idx[b] (all tokens when idx is None), the dropped ones set to the [MASK] token, [deep ; shallow] through
    the fusion linear, decoder on every token."""
    start, end = span
    with torch.no_grad():
        tok = m.x_embedder(x) + m.pos_embed  # (B, T, D)
        c = m.t_embedder(t) + m.y_embedder(y, False)
        rows = []
        for b in range(x.shape[0]):
            keep = torch.arange(T) if idx is None else idx[b]
            h = tok[b : b + 1]
            for j in range(start):
                h = m.blocks[j](h, c[b : b + 1], None)
            shallow, h = h, h[:, keep]
            for j in range(start, end):
                h = m.blocks[j](h, c[b : b + 1], None)
            deep = m.sprint_mask_token.expand(1, T, 32).clone()
            for i, tk in enumerate(keep.tolist()):
                deep[0, tk] = h[0, i]
            h = torch.cat([deep, shallow], dim=-1) @ m.sprint_fusion.weight.T + m.sprint_fusion.bias
            for j in range(end, len(m.blocks)):
                h = m.blocks[j](h, c[b : b + 1], None)
            rows.append(m.final_layer(h, c[b : b + 1]))
        return m.unpatchify(torch.cat(rows))


@pytest.mark.parametrize("span", [(1, 3), (0, 4), (2, 3)])
def test_sprint_is_the_loop_written_by_hand_routed_and_unrouted(span):
    """Dropped tokens come back as the [MASK] token, kept ones at their positions; the fusion is W [deep ; shallow]
    + b; without a route the fusion runs on the dense deep path."""
    m = _dit(span, sprint=True)
    m.train()
    x, t, y = _inputs()
    idx = torch.tensor([[0, 5, 6, 15], [1, 2, 3, 4], [3, 8, 9, 12]])  # deterministic, sorted
    force = torch.zeros(3, dtype=torch.long)  # no label dropout: the loop sees the same labels
    out = m(x, t, y, route=idx, force_drop_ids=force)
    torch.testing.assert_close(out, _by_hand(m, x, t, y, idx, span), rtol=1e-12, atol=1e-12)
    m.eval()
    dense = m(x, t, y)
    torch.testing.assert_close(dense, _by_hand(m, x, t, y, None, span), rtol=1e-12, atol=1e-12)
    assert not torch.equal(dense, out)


def test_the_put_back_takes_the_mask_token_at_the_dropped_positions():
    m = _dit(sprint=True)
    m.train()
    x, t, y = _inputs()
    idx = torch.tensor([[0, 5, 6, 15], [1, 2, 3, 4], [3, 8, 9, 12]])
    seen = {}

    def spy(module, args):
        seen["in"] = args[0].detach()

    m.sprint_fusion.register_forward_pre_hook(spy)
    m(x, t, y, route=idx)
    deep, shallow = seen["in"].split(32, dim=-1)  # (B, T, D) each
    for b in range(3):
        dropped = [k for k in range(T) if k not in idx[b].tolist()]
        assert torch.equal(deep[b, dropped], m.sprint_mask_token.expand(len(dropped), 32))
        assert not (deep[b, idx[b]] == m.sprint_mask_token).all(-1).any()
    m(x, t, y)  # unrouted: no mask token anywhere
    assert not (seen["in"][..., :32] == m.sprint_mask_token).all(-1).any()


def test_keep_all_is_bitwise_the_unrouted_sprint_model_and_other_state_dicts_are_unchanged():
    m = _dit(sprint=True)
    m.train()
    x, t, y = _inputs()
    x.requires_grad_(True)
    force = torch.zeros(3, dtype=torch.long)
    a = m(x, t, y, force_drop_ids=force)
    b = m(x, t, y, force_drop_ids=force, route=torch.arange(T).expand(3, T).contiguous())
    assert torch.equal(a, b)
    params = [p for p in m.parameters() if p.requires_grad]
    ga = torch.autograd.grad(a.square().sum(), [x, *params], allow_unused=True)
    gb = torch.autograd.grad(b.square().sum(), [x, *params], allow_unused=True)
    assert all((u is None and v is None) or torch.equal(u, v) for u, v in zip(ga, gb))
    plain, tread = _dit(None), _dit()
    assert plain.state_dict().keys() == tread.state_dict().keys()
    assert set(m.state_dict()) - set(plain.state_dict()) == {
        "sprint_mask_token",
        "sprint_fusion.weight",
        "sprint_fusion.bias",
    }
    assert m.sprint_mask_token.shape == (32,) and m.sprint_fusion.weight.shape == (32, 64)
    assert not plain.config()["sprint"] and not tread.config()["sprint"]
    rebuilt = DiT.from_config(m.config())
    assert rebuilt.sprint and rebuilt.routing == (1, 3)
    old = {k: v for k, v in plain.config().items() if k != "sprint"}  # a config written before the key existed
    assert not DiT.from_config(old).sprint
    with pytest.raises(ValueError, match=r"sprint needs the routing span"):
        _dit(None, sprint=True)


def test_initialisation_is_the_official_codes():
    """The fusion linear xavier-uniform with a zero bias, the [MASK] token N(0, 0.02) and frozen."""
    torch.manual_seed(0)
    m = DiT(
        input_size=8, patch_size=2, in_channels=3, hidden_size=64, depth=4, num_heads=2, routing=(1, 3), sprint=True
    )
    w = m.sprint_fusion.weight
    bound = (6 / (64 + 128)) ** 0.5
    assert w.abs().max() <= bound and w.abs().max() > 0.9 * bound and torch.equal(m.sprint_fusion.bias, torch.zeros(64))
    assert not m.sprint_mask_token.requires_grad and 0.01 < m.sprint_mask_token.std() < 0.03


def test_gradients_reach_the_mask_token_only_through_the_dropped_positions():
    """The mask token is frozen in training; made trainable here, its gradient is the sum of the fusion input's
    gradient (deep half) over the dropped positions, and it gets none without a route. The fusion is trained either
    way."""
    m = _dit(sprint=True)
    m.train()
    m.sprint_mask_token.requires_grad_(True)
    x, t, y = _inputs()
    idx = torch.tensor([[0, 5, 6, 15], [1, 2, 3, 4], [3, 8, 9, 12]])
    seen = {}

    def spy(module, args):
        args[0].retain_grad()
        seen["in"] = args[0]

    m.sprint_fusion.register_forward_pre_hook(spy)
    m(x, t, y, route=idx).square().sum().backward()
    g = seen["in"].grad[..., :32]  # (B, T, D): the deep half
    dropped = torch.ones(3, T, dtype=torch.bool).scatter(1, idx, False)
    torch.testing.assert_close(m.sprint_mask_token.grad, g[dropped].sum(0), rtol=1e-12, atol=1e-14)
    assert m.sprint_fusion.weight.grad.abs().sum() > 0 and m.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    m.zero_grad(set_to_none=True)
    m(x, t, y).square().sum().backward()
    assert m.sprint_mask_token.grad is None and m.sprint_fusion.weight.grad.abs().sum() > 0


def test_the_sprint_model_compiles_with_fullgraph():
    m = _dit(sprint=True).float()
    m.train()
    m.check_values = False
    x, t, y = (v.float() if v.is_floating_point() else v for v in _inputs())
    idx = draw_route(3, T, 4, torch.Generator().manual_seed(0))
    force = torch.zeros(3, dtype=torch.long)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(
        compiled(x, t, y, route=idx, force_drop_ids=force), m(x, t, y, route=idx, force_drop_ids=force)
    )
    torch.testing.assert_close(compiled(x, t, y, force_drop_ids=force), m(x, t, y, force_drop_ids=force))


def test_the_loss_covers_every_token(tmp_path):
    """The routed step's loss reaches every output token, the dropped ones included."""
    from conftest import tiny

    from diffcurr_fast.objective import Objective
    from diffcurr_fast.runs.sampling import build_model

    sets = ["model.depth=3", "model.routing=sprint", "model.routing_start=1", "model.routing_end=2"]
    cfg = tiny(tmp_path, *sets, "model.routing_keep=0.25")
    torch.manual_seed(0)
    model = build_model(cfg).train()
    for p in model.parameters():
        p.data.add_(0.05 * torch.randn_like(p))
    objective = Objective.from_config(cfg)
    assert (objective.route.tokens, objective.route.kept) == (16, 4)
    grads, routes = [], []

    def net(*a, **kw):
        routes.append(kw.get("route"))
        out = model(*a, **kw)
        out.register_hook(grads.append)
        return out

    net.training = True
    x0 = torch.randn(4, 1, 8, 8)
    per = objective(net, x0, torch.arange(4), torch.tensor([1, 10, 20, 39]), seed=3, generator=torch.Generator())
    per.sum().backward()
    assert routes[0].shape == (4, 4)
    per_token = grads[0][:, :1].abs().reshape(4, 1, 4, 2, 4, 2).sum((1, 3, 5))  # (B, 4, 4) patches of 2x2
    assert (per_token > 0).all()


def test_a_resumed_sprint_run_is_bit_identical_and_the_full_token_phase_is_taken(tmp_path):
    from conftest import assert_resumed_state, tiny

    from diffcurr_fast.train.loop import Trainer

    sets = ["model.depth=3", "model.routing=sprint", "model.routing_start=1", "model.routing_end=2"]
    sets += ["model.routing_keep=0.25", "checkpoint.every=2", "model.routing_until=3"]
    calls = []
    whole = Trainer(tiny(tmp_path / "a", *sets, "engine.max_steps=4"))
    mask0 = whole.model.sprint_mask_token.detach().clone()
    fusion0 = whole.model.sprint_fusion.weight.detach().clone()
    real = whole.net.forward

    def spy(*a, **kw):
        calls.append(kw.get("route"))
        return real(*a, **kw)

    whole.net.forward = spy
    whole.fit()
    assert [c is None for c in calls] == [False, False, False, True]  # routing_until=3: step 4 runs every token
    assert calls[0].shape == (16, 4)  # 16 tokens of the 8x8 digits at patch 2, a quarter kept
    assert torch.equal(whole.model.sprint_mask_token, mask0)  # frozen
    assert not torch.equal(whole.model.sprint_fusion.weight, fusion0)  # trained
    first = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=2"))
    first.fit()
    resumed = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=4"), resume=True)
    resumed.fit()
    assert_resumed_state(whole, resumed)
    assert resumed.model.config()["sprint"] and resumed.model.config()["routing"] == [1, 2]
