"""TDC core: grouping and budgets, analytic FLOPs, structured pruning, multi-expert routing, bundles, accounting."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from diffcurr_fast.curriculum.clustering import interval_cost_matrix
from diffcurr_fast.diffusion import DDPMSchedule, Readout, ddim_sample, ddpm_sample, respace
from diffcurr_fast.models import DiT
from diffcurr_fast.tdc.accounting import sampling_flops, training_flops
from diffcurr_fast.tdc.experts import MultiExpertDenoiser, load_bundle, save_bundle
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.grouping import budget_ratio, make_groups, snr_db
from diffcurr_fast.tdc.prune import (
    group_loss,
    importance_scores,
    keep_indices,
    prune_dit,
    prune_to_budget,
    prune_to_widths,
    select_widths,
    unit_costs,
)

# Odd, non-power-of-two geometry: 9 tokens, hidden 36, 3 heads of 12, MLP 90.
TINY = dict(
    input_size=6,
    patch_size=2,
    in_channels=3,
    hidden_size=36,
    depth=3,
    num_heads=3,
    mlp_ratio=2.5,
    num_classes=5,
    num_timesteps=100,
    attn_backend="math",
)


def tiny_dit(dtype=torch.float32, **kw) -> DiT:
    torch.manual_seed(0)
    m = DiT(**{**TINY, **kw}).to(dtype).eval()
    with torch.no_grad():  # the release zero-inits adaLN / output layers: randomize so every path matters
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(0, 0.08)
    return m


def inputs(n: int, dtype=torch.float32, t=None):
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, 3, 6, 6, generator=g, dtype=dtype)
    t = torch.randint(0, 100, (n,), generator=g) if t is None else t
    y = torch.randint(0, 6, (n,), generator=g)  # label 5 is the null label
    return x, t, y


# ---------------------------------------------------------------------------------------------- grouping
def test_snr_db_matches_definition():
    s = DDPMSchedule(1000)
    abar = s.alphas_cumprod.numpy()
    ref = 10 * __import__("numpy").log10(abar / (1 - abar))
    got = snr_db(s).numpy()
    assert abs(got - ref).max() < 1e-9
    assert torch.allclose(snr_db(s, torch.tensor([0, 999])), torch.tensor(ref[[0, 999]], dtype=torch.float64))


@pytest.mark.parametrize("n,k", [(1, 0.5), (3, 0.25), (5, 0.5), (7, 1.0)])
@pytest.mark.parametrize("method", ["db", "uniform", "log_snr"])
def test_groups_partition_and_budgets(n, k, method):
    s = DDPMSchedule(1000)
    groups = make_groups(s, n, k, 1000.0, method=method)
    assert [g.index for g in groups] == list(range(n))
    assert groups[0].lo == 0 and groups[-1].hi == 1000
    assert all(a.hi == b.lo for a, b in zip(groups, groups[1:]))
    for g in groups:
        i = n - g.index  # hardest (lowest t) group has rank N
        assert g.rank == i
        assert g.ratio == pytest.approx(i / n + (n - i) / n * k, abs=1e-12)  # TDC Eq. 2
        assert g.flops == pytest.approx(1000.0 * g.ratio)
        assert g.snr_db_range[0] >= g.snr_db_range[1]  # SNR falls with t
    assert groups[0].ratio == 1.0
    assert groups[-1].ratio == pytest.approx(1 / n + (n - 1) / n * k)
    if k == 1.0:
        assert all(g.ratio == 1.0 for g in groups)
    easy = make_groups(s, n, k, 1000.0, method=method, full_budget="easiest")
    assert [g.ratio for g in easy] == [g.ratio for g in reversed(groups)]


def test_db_grouping_is_balanced_on_the_db_axis():
    s = DDPMSchedule(1000)
    groups = make_groups(s, 5, 0.5, method="db")
    sizes = [g.hi - g.lo for g in groups]
    assert min(sizes) > 100  # linear-SNR clustering would leave single-timestep groups at low t
    # the DP grouping minimises the total L1 deviation of SNR_dB from each group's median
    cost = interval_cost_matrix(snr_db(s))

    def total(gs):
        return sum(float(cost[g.lo, g.hi]) for g in gs)

    for other in ("uniform", "log_snr", "snr"):
        assert total(groups) <= total(make_groups(s, 5, 0.5, method=other)) + 1e-9


def test_group_roundtrip_and_errors():
    s = DDPMSchedule(100)
    g = make_groups(s, 3, 0.5, 10.0, ranges=[(0, 10), (10, 50), (50, 100)])
    assert [(x.lo, x.hi) for x in g] == [(0, 10), (10, 50), (50, 100)]
    assert type(g[1]).from_dict(json.loads(json.dumps(g[1].to_dict()))) == g[1]
    assert g[1].contains(10) and not g[1].contains(50)
    with pytest.raises(ValueError, match="k must be"):
        make_groups(s, 3, 0.0)
    with pytest.raises(ValueError, match="k must be"):
        budget_ratio(1, 3, 1.5)
    with pytest.raises(ValueError, match="valid choices"):
        make_groups(s, 3, 0.5, method="kmeans")
    with pytest.raises(ValueError, match="valid choices"):
        make_groups(s, 3, 0.5, full_budget="middle")
    with pytest.raises(ValueError, match="num_groups"):
        make_groups(s, 101, 0.5)
    with pytest.raises(ValueError, match="clusters"):
        make_groups(s, 2, 0.5, ranges=[(0, 10), (20, 100)])


# ---------------------------------------------------------------------------------------------- FLOPs
@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"learn_sigma": False},
        {"block_num_heads": [2, 0, 3], "block_mlp_hidden": [17, 90, 0]},
        {"patch_size": 1, "depth": 2, "hidden_size": 20, "num_heads": 5, "mlp_ratio": 3.3},
        {"input_size": 10, "patch_size": 5, "depth": 1, "block_num_heads": [1], "block_mlp_hidden": [7]},
    ],
)
@pytest.mark.parametrize("batch", [1, 3])
def test_flops_match_flop_counter(kw, batch):
    m = tiny_dit(**kw)
    size = m.input_size
    x = torch.randn(batch, 3, size, size)
    t = torch.randint(0, 100, (batch,))
    y = torch.randint(0, 5, (batch,))
    with FlopCounterMode(display=False) as fc:
        m(x, t, y)
    counted = fc.get_total_flops()
    assert dit_flops(m, batch) == pytest.approx(counted, rel=1e-3)
    assert dit_flops(m.config(), batch) == batch * dit_flops(m)


def test_routed_flops_match_flop_counter():
    """Token routing: the span's blocks on the K kept tokens, the others on all T (``dit_flops(route=)``), as
    counted on the routed forward."""
    from diffcurr_fast.models.routing import draw_route

    m = tiny_dit(depth=4, routing=(1, 3)).train()
    tokens = (m.input_size // m.patch_size) ** 2
    x, t, y = torch.randn(3, 3, m.input_size, m.input_size), torch.randint(0, 100, (3,)), torch.randint(0, 5, (3,))
    for kept in (1, 5, tokens):
        route = draw_route(3, tokens, kept, torch.Generator().manual_seed(kept))
        with FlopCounterMode(display=False) as fc:
            m(x, t, y, route=route)
        assert dit_flops(m, 3, (kept, 1, 3)) == pytest.approx(fc.get_total_flops(), rel=1e-3)
    assert dit_flops(m, 3, (tokens, 1, 3)) == dit_flops(m, 3)
    assert dit_flops(m, 3, (1, 1, 3)) < dit_flops(m, 3)


def test_flops_errors():
    with pytest.raises(ValueError, match="batch_size"):
        dit_flops(tiny_dit(), 0)
    with pytest.raises(ValueError, match="expected a DiT"):
        dit_flops(torch.nn.Linear(2, 2))


# ---------------------------------------------------------------------------------------------- pruning
def _masked_reference(base: DiT, keep_heads, keep_mlp) -> DiT:
    """Full-width float64 copy with the removed units' weights zeroed: equal to the pruned model."""
    ref = tiny_dit(torch.float64)
    ref.load_state_dict(base.state_dict())
    with torch.no_grad():
        for block, kh, km in zip(ref.blocks, keep_heads, keep_mlp):
            h, dh = block.attn.num_heads, block.attn.head_dim
            head_mask = torch.zeros(h, dtype=torch.float64)
            head_mask[kh] = 1
            rows = head_mask.repeat_interleave(dh).repeat(3)  # (3 H Dh,) q, k, v
            block.attn.qkv.weight.mul_(rows[:, None])
            block.attn.qkv.bias.mul_(rows)
            block.attn.proj.weight.mul_(head_mask.repeat_interleave(dh)[None])
            ch = torch.zeros(block.mlp.fc1.out_features, dtype=torch.float64)
            ch[km] = 1
            block.mlp.fc1.weight.mul_(ch[:, None])
            block.mlp.fc1.bias.mul_(ch)
            block.mlp.fc2.weight.mul_(ch[None])
    return ref


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_pruned_model_equals_masked_reference(batch):
    base = tiny_dit(torch.float64)
    keep_heads = [torch.tensor([0, 2]), torch.tensor([], dtype=torch.long), torch.tensor([1])]
    keep_mlp = [torch.tensor([3, 5, 88]), torch.arange(0, 90, 2), torch.tensor([], dtype=torch.long)]
    pruned = prune_dit(base, keep_heads, keep_mlp)
    assert pruned.config()["block_num_heads"] == [2, 0, 1]
    assert pruned.config()["block_mlp_hidden"] == [3, 45, 0]
    assert type(pruned) is DiT
    ref = _masked_reference(base, keep_heads, keep_mlp)
    x, t, y = inputs(batch, torch.float64)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, want = pruned(xa, t, y), ref(xb, t, y)
    torch.testing.assert_close(out, want, rtol=1e-10, atol=1e-12)
    g = torch.randn_like(out)
    (out * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, rtol=1e-10, atol=1e-12)
    # gradients of the kept slices equal the reference's gradients at the same positions
    dh = 12
    rows = torch.cat([j * 36 + (keep_heads[0][:, None] * dh + torch.arange(dh)).flatten() for j in range(3)])
    torch.testing.assert_close(pruned.blocks[0].attn.qkv.weight.grad, ref.blocks[0].attn.qkv.weight.grad[rows])
    torch.testing.assert_close(pruned.blocks[1].mlp.fc2.weight.grad, ref.blocks[1].mlp.fc2.weight.grad[:, ::2])
    torch.testing.assert_close(pruned.final_layer.linear.weight.grad, ref.final_layer.linear.weight.grad)


@pytest.mark.parametrize("method", ["taylor", "magnitude"])
def test_prune_nothing_is_identity(method):
    base = tiny_dit()
    s = DDPMSchedule(100)
    batches = [inputs(3)[::2]]
    imp = importance_scores(base, method, objective=s, group=(0, 50), batches=batches)
    same = prune_to_budget(base, dit_flops(base), imp)
    assert same.config() == {**base.config(), "block_num_heads": [3] * 3, "block_mlp_hidden": [90] * 3}
    for batch in (1, 3, 17):
        x, t, y = inputs(batch)
        assert torch.equal(same(x, t, y), base(x, t, y))


@pytest.mark.parametrize("fraction", [0.93, 0.71, 0.5, 0.37])
@pytest.mark.parametrize("normalize", ["cost", "none"])
def test_prune_hits_budget_within_one_unit(fraction, normalize):
    base = tiny_dit()
    imp = importance_scores(base, "magnitude")
    full = dit_flops(base)
    budget = fraction * full
    pruned = prune_to_budget(base, budget, imp, normalize=normalize)
    got = dit_flops(pruned)
    head_cost, chan_cost = unit_costs(base.config())
    assert got <= budget
    assert budget - got < max(head_cost, chan_cost)
    # kept units are the most important ones of each block
    heads, mlp = select_widths(base.config(), imp, budget, normalize=normalize)
    assert pruned.config()["block_num_heads"] == heads and pruned.config()["block_mlp_hidden"] == mlp
    for b in range(3):
        kept = keep_indices(imp.mlp[b], mlp[b])
        if 0 < mlp[b] < 90:
            dropped = torch.ones(90, dtype=torch.bool)
            dropped[kept] = False
            assert imp.mlp[b][kept].min() >= imp.mlp[b][dropped].max()


def test_taylor_scores_are_w_times_grad_per_unit():
    base = tiny_dit(torch.float64)
    s = DDPMSchedule(100)
    batches = [inputs(3, torch.float64)[::2], inputs(5, torch.float64)[::2]]
    imp = importance_scores(base, "taylor", objective=s, group=(10, 40), batches=batches, seed=7)
    loss = sum(
        group_loss(base, s, (10, 40), x, y, torch.Generator().manual_seed(7 + i)) for i, (x, y) in enumerate(batches)
    )
    loss.backward()
    blk = base.blocks[1]
    wg = lambda p: (p.detach() * p.grad).abs()  # noqa: E731
    qkv_w, qkv_b, proj_w = wg(blk.attn.qkv.weight), wg(blk.attn.qkv.bias), wg(blk.attn.proj.weight)
    for h in range(3):
        rows = [j * 36 + h * 12 + i for j in range(3) for i in range(12)]
        want = qkv_w[rows].sum() + qkv_b[rows].sum() + proj_w[:, h * 12 : (h + 1) * 12].sum()
        assert float(imp.heads[1][h]) == pytest.approx(float(want), rel=1e-9)
    fc1_w, fc1_b, fc2_w = wg(blk.mlp.fc1.weight), wg(blk.mlp.fc1.bias), wg(blk.mlp.fc2.weight)
    want = fc1_w.sum(1) + fc1_b + fc2_w.sum(0)
    torch.testing.assert_close(imp.mlp[1], want, rtol=1e-9, atol=0)


def test_drop_empty_blocks_and_errors():
    base = tiny_dit()
    imp = importance_scores(base, "magnitude")
    pruned = prune_to_widths(base, imp, [3, 0, 2], [90, 0, 10], drop_empty_blocks=True)
    assert pruned.config()["depth"] == 2 and pruned.config()["block_num_heads"] == [3, 2]
    kept = prune_to_widths(base, imp, [3, 0, 2], [90, 0, 10])
    assert kept.config()["depth"] == 3
    assert dit_flops(pruned) < dit_flops(kept)
    x, t, y = inputs(3)
    assert pruned(x, t, y).shape == base(x, t, y).shape
    with pytest.raises(ValueError, match="keep_heads"):
        prune_dit(base, [torch.tensor([3])] * 3, [torch.arange(90)] * 3)
    with pytest.raises(ValueError, match="below the FLOPs"):
        prune_to_budget(base, 1.0, imp)
    with pytest.raises(ValueError, match="valid choices"):
        importance_scores(base, "random")
    with pytest.raises(ValueError, match="needs objective"):
        importance_scores(base, "taylor")
    with pytest.raises(ValueError, match="width must be"):
        prune_to_widths(base, imp, [4, 3, 3], [90, 90, 90])


# ---------------------------------------------------------------------------------------------- experts
def _ranges():
    return [(0, 30), (30, 61), (61, 100)]


@pytest.mark.parametrize("cfg_scale", [1.0, 2.5])
@pytest.mark.parametrize("kind", ["ddpm", "ddim"])
def test_k1_routing_reproduces_base_in_sampling(cfg_scale, kind):
    base = tiny_dit()
    s = DDPMSchedule(100)
    multi = MultiExpertDenoiser.from_base(base, _ranges()).eval()
    y = torch.tensor([0, 4, 2])
    if kind == "ddim":
        sched, tmap = respace(s, "ddim10")
        kw = dict(timestep_map=tmap, seed=3, readout=Readout(learn_sigma=True), cfg_scale=cfg_scale, num_classes=5)
        a = ddim_sample(base, sched, (3, 3, 6, 6), y, **kw)
        b = ddim_sample(multi, sched, (3, 3, 6, 6), y, **kw)
    else:
        sched, tmap = respace(s, "7")
        kw = dict(timestep_map=tmap, seed=3, readout=Readout(learn_sigma=True), cfg_scale=cfg_scale, num_classes=5)
        a = ddpm_sample(base, sched, (3, 3, 6, 6), y, **kw)
        b = ddpm_sample(multi, sched, (3, 3, 6, 6), y, **kw)
    assert torch.equal(a, b)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_per_sample_routing_with_pruned_experts(batch):
    base = tiny_dit(torch.float64)
    imp = importance_scores(base, "magnitude")
    experts = [base, prune_to_widths(base, imp, [2, 3, 1], [60, 45, 90]), prune_to_widths(base, imp, [1] * 3, [30] * 3)]
    multi = MultiExpertDenoiser(experts, _ranges())
    x, t, y = inputs(batch, torch.float64)
    x = x.requires_grad_()
    out = multi(x, t, y)
    gid = multi.group_index(t)
    assert gid.tolist() == [0 if v < 30 else 1 if v < 61 else 2 for v in t.tolist()]
    ref = torch.empty_like(out)
    for g, e in enumerate(experts):
        idx = (gid == g).nonzero().squeeze(1)
        if idx.numel():
            ref[idx] = e(x[idx], t[idx], y[idx])
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    (gx,) = torch.autograd.grad(out.square().sum(), x)
    (rx,) = torch.autograd.grad(ref.square().sum(), x)
    torch.testing.assert_close(gx, rx, rtol=1e-12, atol=1e-14)


def test_mixed_batch_k1_matches_base_and_cfg():
    base = tiny_dit(torch.float64)
    multi = MultiExpertDenoiser.from_base(base, _ranges())
    x, t, y = inputs(17, torch.float64, t=torch.arange(0, 100, 6))
    torch.testing.assert_close(multi(x, t, y), base(x, t, y), rtol=1e-12, atol=1e-13)
    x, _, y = inputs(6, torch.float64)
    tt = torch.full((6,), 45)
    torch.testing.assert_close(multi.forward_with_cfg(x, tt, y, 3.0), base.forward_with_cfg(x, tt, y, 3.0))
    with pytest.raises(ValueError, match="even batch"):
        multi.forward_with_cfg(x[:5], tt[:5], y[:5], 3.0)
    assert torch.equal(multi(x[:2], torch.tensor(99), y[:2]), base(x[:2], torch.tensor(99), y[:2]))


def test_bundle_roundtrip(tmp_path):
    base = tiny_dit()
    imp = importance_scores(base, "magnitude")
    experts = [base, prune_to_widths(base, imp, [2, 0, 1], [61, 45, 0]), prune_to_widths(base, imp, [1] * 3, [7] * 3)]
    groups = [g.to_dict() for g in make_groups(DDPMSchedule(100), 3, 0.5, 1.0, ranges=_ranges())]
    multi = MultiExpertDenoiser(experts, _ranges(), groups=groups)
    save_bundle(multi, tmp_path / "b")
    meta = json.loads((tmp_path / "b" / "bundle.json").read_text())
    assert meta["ranges"] == [list(r) for r in _ranges()] and meta["groups"] == groups
    loaded = load_bundle(tmp_path / "b")
    assert [e.config() for e in loaded.experts] == [e.config() for e in experts]
    x, t, y = inputs(17)
    assert torch.equal(loaded(x, t, y), multi(x, t, y))
    assert loaded.expert_flops() == multi.expert_flops()
    with pytest.raises(ValueError, match="not a bundle"):
        load_bundle(tmp_path)


def test_compiled_experts_route_like_eager():
    # aot_eager traces each expert with dynamo + AOTAutograd like inductor does, without the C++ build time
    base = tiny_dit(depth=1)
    multi = MultiExpertDenoiser.from_base(base, [(0, 50), (50, 100)]).eval()
    x, _, y = inputs(3)
    with torch.no_grad():
        want = [multi(x, torch.full((3,), v), y) for v in (10, 80)]
        multi.compile_experts(mode="default", backend="aot_eager")
        got = [multi(x, torch.full((3,), v), y) for v in (10, 80)]
    assert multi.compile_mode == "default"
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_many_compiled_experts_all_compile():
    """Experts are one DiT.forward with other shapes: past dynamo's recompile limit (8) the rest would run
    uncompiled without a word; compile_experts leaves room for every expert (here 10, each its own graph)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    experts = [tiny_dit(depth=1, mlp_ratio=1.0 + 0.25 * i) for i in range(10)]  # 10 distinct MLP widths
    edges = [(10 * i, 10 * (i + 1)) for i in range(10)]
    multi = MultiExpertDenoiser(experts, edges).eval().compile_experts(mode="default", backend="eager")
    x, _, y = inputs(2)
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for lo, _ in edges:
            multi(x, torch.full((2,), lo), y)
    assert counters["stats"]["unique_graphs"] - before == 10


def test_experts_validation():
    base = tiny_dit()
    with pytest.raises(ValueError, match="one \\(lo, hi\\) range per expert"):
        MultiExpertDenoiser([base], _ranges())
    with pytest.raises(ValueError, match="clusters"):
        MultiExpertDenoiser([base, base], [(0, 10), (11, 100)])
    with pytest.raises(ValueError, match="disagree on in_channels"):
        MultiExpertDenoiser([base, tiny_dit(in_channels=4)], [(0, 10), (10, 100)])
    with pytest.raises(ValueError, match="valid choices"):
        MultiExpertDenoiser([base], [(0, 100)]).compile_experts(mode="fastest")


# ---------------------------------------------------------------------------------------------- accounting
def test_sampling_and_training_flops(tmp_path):
    base = tiny_dit()
    imp = importance_scores(base, "magnitude")
    f = dit_flops(base)
    experts = [base, prune_to_budget(base, 0.75 * f, imp), prune_to_budget(base, 0.5 * f, imp)]
    multi = MultiExpertDenoiser(experts, _ranges())
    fe = multi.expert_flops()
    steps = torch.tensor([0, 10, 29, 30, 60, 61, 99])
    out = sampling_flops(multi, f, steps, cfg=True, path=tmp_path / "s.json")
    assert out["steps_per_group"] == [3, 2, 2]
    want = 2 * (3 * fe[0] + 2 * fe[1] + 2 * fe[2])
    assert out["multi_expert_flops_per_image"] == want
    assert out["flops_ratio"] == pytest.approx(2 * 7 * f / want)
    assert json.loads((tmp_path / "s.json").read_text()) == out
    tr = training_flops(f, fe, 1000, [100, 200, 300], 8, path=tmp_path / "t.json")
    assert tr["tdc_flops"] == pytest.approx(3 * 8 * (1000 * f + 100 * fe[0] + 200 * fe[1] + 300 * fe[2]))
    assert tr["single_model_flops"] == pytest.approx(3 * 8 * 1600 * f)
    assert tr["saving"] == pytest.approx(1 - tr["tdc_flops"] / tr["single_model_flops"])
    assert 0 < tr["saving"] < 1 and math.isclose(tr["ratio"] + tr["saving"], 1.0)
    with pytest.raises(ValueError, match="stage2_steps"):
        training_flops(f, fe, 10, [1, 2], 8)
    with pytest.raises(ValueError, match="timesteps must lie"):
        sampling_flops(multi, f, [100])
