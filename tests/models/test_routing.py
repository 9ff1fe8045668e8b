"""Token routing (TREAD, models/routing.py): the gather and scatter ops against a float64 loop, the kept count and
the draw, a routed DiT against a per-sample loop of its blocks, keep 1.0 bitwise the plain model, a resumed routed
run bit-identical, torch.compile(fullgraph=True), and the state dict of the plain model."""

import copy

import pytest
import torch

from diffcurr_fast.models.dit import DiT
from diffcurr_fast.models.routing import draw_route, kept_tokens
from diffcurr_fast.ops import token_gather, token_gather_ref, token_scatter, token_scatter_ref


def _idx(b, t, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(b)])  # (B, K), unsorted on purpose


@pytest.mark.parametrize("b, t, k, d", [(3, 13, 5, 7), (1, 4, 4, 1), (2, 17, 1, 9)])
def test_gather_and_scatter_match_a_float64_loop_outputs_and_gradients(b, t, k, d):
    torch.manual_seed(0)
    x = torch.randn(b, t, d, dtype=torch.float64, requires_grad=True)
    src = torch.randn(b, k, d, dtype=torch.float64, requires_grad=True)
    idx = _idx(b, t, k)
    g = token_gather(x, idx)
    want = torch.stack([torch.stack([x[i, idx[i, j]] for j in range(k)]) for i in range(b)])
    assert torch.equal(g, want) and torch.equal(token_gather_ref(x, idx), want)
    s = token_scatter(x, idx, src)
    rows = [[src[i, (idx[i] == j).nonzero()[0, 0]] if j in idx[i] else x[i, j] for j in range(t)] for i in range(b)]
    assert torch.equal(s, torch.stack([torch.stack(r) for r in rows])) and torch.equal(
        token_scatter_ref(x, idx, src), s
    )
    w1, w2 = torch.randn(b, k, d, dtype=torch.float64), torch.randn(b, t, d, dtype=torch.float64)
    (gx,) = torch.autograd.grad((g * w1).sum(), x)
    want_gx = torch.zeros_like(x)
    for i in range(b):
        for j in range(k):
            want_gx[i, idx[i, j]] += w1[i, j]
    assert torch.equal(gx, want_gx)
    gx, gs = torch.autograd.grad((s * w2).sum(), (x, src))
    kept = torch.zeros(b, t, 1, dtype=torch.bool).scatter(1, idx.unsqueeze(-1), True)
    assert torch.equal(gx, torch.where(kept, 0.0, w2)) and torch.equal(gs, token_gather_ref(w2, idx))
    assert torch.autograd.gradcheck(lambda a, c: token_scatter(a, idx, token_gather(a, idx) * 2 + c), (x, src))


def test_route_inputs_are_checked():
    x = torch.zeros(2, 5, 3)
    with pytest.raises(ValueError, match=r"takes x \(B, T, D\) and idx \(B, K <= T\)"):
        token_gather(x, torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="indices must be int64"):
        token_gather(x, torch.zeros(2, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"src must be \(2, 2, 3\)"):
        token_scatter(x, torch.zeros(2, 2, dtype=torch.long), torch.zeros(2, 3, 3))
    if not torch.cuda.is_available():  # a backend asked for by name that cannot run is an error (Liger's rule)
        with pytest.raises(RuntimeError, match="'cuda' requested"):
            token_gather(x, torch.zeros(2, 2, dtype=torch.long), backend="cuda")


def test_kept_count_and_the_draw():
    """K = T - floor(T (1 - keep)) (TREAD's num_keep); K distinct sorted tokens per sample, from the generator."""
    assert [kept_tokens(256, k) for k in (0.5, 0.25, 1.0)] == [128, 64, 256]
    assert kept_tokens(16, 0.7) == 16 - 4 and kept_tokens(196, 0.5) == 98 and kept_tokens(3, 0.01) == 1
    with pytest.raises(ValueError, match=r"routing_keep must be in \(0, 1\]"):
        kept_tokens(16, 0.0)
    a = draw_route(4, 16, 7, torch.Generator().manual_seed(3))
    assert a.shape == (4, 7) and a.dtype == torch.int64
    assert all(len(set(r.tolist())) == 7 and r.tolist() == sorted(r.tolist()) for r in a)
    assert torch.equal(a, draw_route(4, 16, 7, torch.Generator().manual_seed(3)))
    seen = torch.zeros(16)
    for s in range(200):  # uniform over the tokens
        seen += torch.bincount(draw_route(8, 16, 4, torch.Generator().manual_seed(s)).flatten(), minlength=16)
    assert (seen / seen.sum() - 1 / 16).abs().max() < 0.01


def _dit(**kw):
    torch.manual_seed(0)
    m = DiT(input_size=8, patch_size=2, in_channels=3, hidden_size=32, depth=4, num_heads=2, num_classes=5, **kw)
    for p in m.parameters():  # non-zero everywhere (the release zeroes the adaLN and output layers)
        p.data.add_(0.05 * torch.randn_like(p))
    return m.double()


def _inputs(b=3):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, 3, 8, 8, generator=g, dtype=torch.float64), torch.tensor([3, 500, 999][:b]), torch.arange(b)


@pytest.mark.parametrize("span", [(1, 3), (0, 4), (2, 3)])
def test_a_routed_dit_is_the_per_sample_loop_of_its_blocks(span):
    """Blocks [start, end) run on each sample's kept tokens alone; the others keep their value from before the
    span; the features of a block inside the span are the tokens as they would be returned after it."""
    m = _dit(routing=span)
    m.train()
    x, t, y = _inputs()
    idx = _idx(3, 16, 6, seed=2)
    force = torch.zeros(3, dtype=torch.long)  # no label dropout: the loop below sees the same labels
    out, feats = m(x, t, y, route=idx, force_drop_ids=force, features=(span[0],))
    with torch.no_grad():
        tok = m.x_embedder(x) + m.pos_embed  # (B, T, D)
        c = m.t_embedder(t) + m.y_embedder(y, False)
        rows = []
        for b in range(3):
            h = tok[b : b + 1]
            for j, block in enumerate(m.blocks):
                if j == span[0]:
                    before, h = h, h[:, idx[b]]
                h = block(h, c[b : b + 1], None)
                if j == span[1] - 1:
                    merged = before.clone()
                    merged[:, idx[b]] = h
                    h = merged
            rows.append(m.final_layer(h, c[b : b + 1]))
        want = m.unpatchify(torch.cat(rows))
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert feats[span[0]].shape == (3, 16, 32)
    m.eval()
    assert not torch.equal(m(x, t, y), out)  # without route: every token


def test_keep_all_tokens_is_bitwise_the_plain_model_and_the_state_dict_is_the_plain_models():
    plain, routed = _dit(), _dit(routing=(1, 3))
    assert plain.state_dict().keys() == routed.state_dict().keys()
    routed.load_state_dict(plain.state_dict(), strict=True)
    x, t, y = _inputs()
    x.requires_grad_(True)
    force = torch.zeros(3, dtype=torch.long)
    a = plain(x, t, y, force_drop_ids=force)
    b = routed(x, t, y, force_drop_ids=force, route=torch.arange(16).expand(3, 16).contiguous())
    assert torch.equal(a, b)
    pa, pb = ([p for p in m.parameters() if p.requires_grad] for m in (plain, routed))
    ga = torch.autograd.grad(a.square().sum(), [x, *pa], allow_unused=True)
    gb = torch.autograd.grad(b.square().sum(), [x, *pb], allow_unused=True)
    assert all((u is None and v is None) or torch.equal(u, v) for u, v in zip(ga, gb))
    assert routed.config()["routing"] == [1, 3] and DiT.from_config(routed.config()).routing == (1, 3)
    with pytest.raises(ValueError, match="route given to a DiT built without routing"):
        plain(x, t, y, route=torch.arange(16).expand(3, 16).contiguous())
    with pytest.raises(ValueError, match=r"routing must be \(start, end\) blocks with 0 <= start < end <= depth 4"):
        _dit(routing=(3, 5))


def test_the_routed_model_compiles_with_fullgraph():
    m = _dit(routing=(1, 3)).float()
    m.train()
    m.check_values = False
    x, t, y = (v.float() if v.is_floating_point() else v for v in _inputs())
    idx = draw_route(3, 16, 8, torch.Generator().manual_seed(0))
    force = torch.zeros(3, dtype=torch.long)
    eager = m(x, t, y, route=idx, force_drop_ids=force)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")(x, t, y, route=idx, force_drop_ids=force)
    torch.testing.assert_close(compiled, eager)


def test_a_resumed_routed_run_is_bit_identical_and_the_full_token_phase_is_taken(tmp_path):
    from conftest import assert_resumed_state, tiny

    from diffcurr_fast.train.loop import Trainer

    sets = ["model.depth=3", "model.routing=tread", "model.routing_start=1", "model.routing_end=3"]
    sets += ["model.routing_keep=0.5", "checkpoint.every=2", "model.routing_until=3"]
    calls = []
    whole = Trainer(tiny(tmp_path / "a", *sets, "engine.max_steps=4"))
    real = whole.net.forward

    def spy(*a, **kw):
        calls.append(kw.get("route"))
        return real(*a, **kw)

    whole.net.forward = spy
    whole.fit()
    assert [c is None for c in calls] == [False, False, False, True]  # routing_until=3: step 4 runs every token
    assert calls[0].shape == (16, 8)  # 16 tokens of the 8x8 digits at patch 2, half kept
    first = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=2"))
    first.fit()
    resumed = Trainer(tiny(tmp_path / "b", *sets, "engine.max_steps=4"), resume=True)
    resumed.fit()
    assert_resumed_state(whole, resumed)
    plain = Trainer(tiny(tmp_path / "c", "model.depth=3", "engine.max_steps=2"))
    plain.fit()
    keep_all = Trainer(
        tiny(
            tmp_path / "d",
            "model.depth=3",
            "engine.max_steps=2",
            "model.routing=tread",
            "model.routing_keep=1.0",
            "model.routing_start=1",
            "model.routing_end=3",
        )
    )
    keep_all.fit()
    for u, v in zip(plain.model.state_dict().values(), keep_all.model.state_dict().values()):
        assert torch.equal(u, v)
    assert copy.deepcopy(keep_all.model.config())["routing"] == [1, 3]
