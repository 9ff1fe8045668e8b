"""The modern DiT block (models/modern.py; LightningDiT, arXiv 2501.01423): RMSNorm and QK-norm against their float64
formula, SwiGLU against its formula and the GELU MLP's parameter count, 2-D RoPE against a float64 rotation and its
relative-position property, the defaults' state dict and outputs unchanged, and the options composed with the fused
adaLN path, DTR, token routing (the kept tokens rotate with their original positions), gradient checkpointing,
bf16 autocast and torch.compile(fullgraph=True); the config's fields and their checks."""

import math

import pytest
import torch
from conftest import assert_near_reference

from diffcurr_fast.models.dit import Attention, DiT, DiTBlock, Mlp, SwiGLU
from diffcurr_fast.models.modern import (
    MLPS,
    NORMS,
    POSITIONS,
    RMSNorm,
    apply_rope2d,
    rope2d_tables,
    swiglu_hidden,
)
from diffcurr_fast.models.routing import draw_route

ALL = dict(norm="rmsnorm", qk_norm=True, mlp="swiglu", pos="rope2d")


def _rms64(x, weight=None, eps=1e-6):
    x = x.double()
    y = x / torch.sqrt(x.square().mean(-1, keepdim=True) + eps)  # Zhang & Sennrich 2019, Eq. 4
    return y if weight is None else y * weight.double()


def _rotate64(x, pos, head_dim):
    """Reference 2-D RoPE, one 2x2 rotation per channel pair in float64: x (N, Dh), pos (N, 2) rows and columns."""
    quarter = head_dim // 4
    out = torch.empty(x.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        for m in range(head_dim // 2):
            axis, f = (0, m) if m < quarter else (1, m - quarter)
            angle = float(pos[n, axis]) * 10000.0 ** (-f / quarter)
            rot = torch.tensor(
                [[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]], dtype=torch.float64
            )
            out[n, 2 * m : 2 * m + 2] = rot @ x[n, 2 * m : 2 * m + 2].double()
    return out


def _grid_pos(grid):
    return torch.tensor([(i, j) for i in range(grid) for j in range(grid)])  # (T, 2): token n = i * grid + j


def _dit(**kw):
    torch.manual_seed(0)
    m = DiT(input_size=12, patch_size=2, in_channels=3, hidden_size=48, depth=4, num_heads=4, num_classes=5, **kw)
    for p in m.parameters():  # non-zero everywhere (the release zeroes the adaLN and output layers)
        if p.requires_grad:
            p.data.add_(0.05 * torch.randn_like(p))
    return m


def _inputs(b=3, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(b, 3, 12, 12, generator=g, dtype=dtype)
    return x, torch.tensor([3, 500, 999, 7, 250][:b]), torch.arange(b) % 5


# ----------------------------------------------------------------------------------------------------- defaults


def test_defaults_keep_the_release_state_dict_keys_and_outputs():
    m = DiT(input_size=4, patch_size=2, in_channels=3, hidden_size=8, depth=2, num_heads=2, num_classes=3)
    block = [
        "attn.qkv.weight",
        "attn.qkv.bias",
        "attn.proj.weight",
        "attn.proj.bias",
        "mlp.fc1.weight",
        "mlp.fc1.bias",
        "mlp.fc2.weight",
        "mlp.fc2.bias",
        "adaLN_modulation.1.weight",
        "adaLN_modulation.1.bias",
    ]
    want = ["pos_embed", "x_embedder.proj.weight", "x_embedder.proj.bias"]
    want += ["t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias", "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias"]
    want += ["y_embedder.embedding_table.weight"]
    want += [f"blocks.{i}.{k}" for i in range(2) for k in block]
    want += ["final_layer.linear.weight", "final_layer.linear.bias"]
    want += ["final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias"]
    assert list(m.state_dict()) == want  # the release's names, in its order
    cfg = m.config()
    assert (cfg["norm"], cfg["qk_norm"], cfg["mlp"], cfg["pos"]) == ("layernorm", False, "gelu", "sincos")
    # a config written before the options existed builds the same model
    old = {k: v for k, v in cfg.items() if k not in ("norm", "qk_norm", "mlp", "pos")}
    a, b = _dit(), _dit(norm="layernorm", qk_norm=False, mlp="gelu", pos="sincos")
    b.load_state_dict(a.state_dict(), strict=True)
    x, t, y = _inputs()
    assert torch.equal(a.eval()(x, t, y), b.eval()(x, t, y))
    assert list(DiT.from_config(old).state_dict()) == want
    assert isinstance(a.blocks[0].norm1, torch.nn.LayerNorm) and isinstance(a.blocks[0].mlp, Mlp)


@pytest.mark.parametrize("fused", [False, True])
def test_an_rmsnorm_model_holds_the_release_keys_and_the_options_their_own(fused):
    plain, rms = _dit(), _dit(norm="rmsnorm", fused_adaln=fused)
    assert list(plain.state_dict()) == list(rms.state_dict())  # the norms have no weights either way
    rms.load_state_dict(plain.state_dict(), strict=True)
    keys = set(_dit(**ALL).state_dict())
    assert "pos_embed" not in keys and _dit(pos="rope2d").pos_embed is None
    assert {"blocks.0.attn.q_norm.weight", "blocks.0.attn.k_norm.weight", "blocks.3.mlp.w12.weight"} <= keys
    assert not any(".fc1." in k or ".fc2." in k for k in keys)
    full = _dit(**ALL, fused_adaln=fused)
    assert list(full.state_dict()) == list(_dit(**ALL, fused_adaln=not fused).state_dict())  # the fused ops: no keys
    again = DiT.from_config(full.config())
    again.load_state_dict(full.state_dict(), strict=True)
    x, t, y = _inputs()
    assert torch.equal(again.eval()(x, t, y), full.eval()(x, t, y))


# ----------------------------------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("shape", [(3, 7, 13), (2, 1, 5), (1, 9, 48)])
@pytest.mark.parametrize("affine", [False, True])
def test_rmsnorm_matches_the_float64_formula(shape, affine):
    torch.manual_seed(0)
    x = torch.randn(shape) * 3 + 0.5
    norm = RMSNorm(shape[-1], affine=affine)
    if affine:
        norm.weight.data = torch.randn(shape[-1])
    assert (norm.weight is None) == (not affine) and len(norm.state_dict()) == int(affine)
    torch.testing.assert_close(norm(x).double(), _rms64(x, norm.weight), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(norm.double()(x.double()), _rms64(x, norm.weight), rtol=1e-12, atol=1e-12)
    xb = x.bfloat16()
    out = RMSNorm(shape[-1])(xb)
    assert out.dtype == torch.bfloat16  # float32 math, the input's dtype out (as LayerNorm)
    torch.testing.assert_close(out.double(), _rms64(xb), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fused", [False, True])
def test_rmsnorm_blocks_use_it_for_the_pre_norms_and_the_final_norm(fused):
    m = _dit(norm="rmsnorm", fused_adaln=fused).double()
    block = m.blocks[1]
    assert isinstance(block.norm1, RMSNorm) and isinstance(block.norm2, RMSNorm)
    assert isinstance(m.final_layer.norm_final, RMSNorm) and block.norm1.eps == 1e-6
    x, c = torch.randn(2, 36, 48, dtype=torch.float64), torch.randn(2, 48, dtype=torch.float64)
    s = block.adaLN_modulation(c).chunk(6, dim=1)
    h = _rms64(x) * (1 + s[1][:, None]) + s[0][:, None]  # DiT Sec. 3.2, modulate(RMSNorm(x))
    x1 = x + s[2][:, None] * block.attn(h)
    h = _rms64(x1) * (1 + s[4][:, None]) + s[3][:, None]
    want = x1 + s[5][:, None] * block.mlp(h)
    torch.testing.assert_close(block(x, c), want, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------------------------------- QK-norm


@pytest.mark.parametrize("batch, tokens, heads, head_dim", [(2, 7, 3, 12), (1, 13, 1, 4), (3, 5, 2, 20)])
@pytest.mark.parametrize("rope", [False, True], ids=["qk_norm", "qk_norm+rope2d"])
@pytest.mark.parametrize("fused", [False, True])
def test_attention_with_qk_norm_and_rope_matches_float64_reference(batch, tokens, heads, head_dim, rope, fused):
    torch.manual_seed(0)
    dim = heads * head_dim + 3  # an explicit head_dim need not divide the width
    attn = Attention(dim, heads, head_dim=head_dim, backend="math", qk_norm=True, fused=fused).double()
    attn.q_norm.weight.data = torch.randn(head_dim, dtype=torch.float64)
    attn.k_norm.weight.data = torch.randn(head_dim, dtype=torch.float64)
    assert set(attn.state_dict()) == {f"{n}.{p}" for n in ("qkv", "proj") for p in ("weight", "bias")} | {
        "q_norm.weight",
        "k_norm.weight",
    }
    x = torch.randn(batch, tokens, dim, dtype=torch.float64)
    pos = torch.randint(0, 9, (tokens, 2))  # any positions, repeated ones included
    tables = None
    if rope:
        quarter = head_dim // 4
        theta = 10000.0 ** (-torch.arange(quarter, dtype=torch.float64) / quarter)
        angles = torch.cat([pos[:, :1] * theta, pos[:, 1:] * theta], dim=1)  # (N, Dh/2)
        tables = (angles.cos(), angles.sin())
    out = attn(x, tables)
    qkv = attn.qkv(x).reshape(batch, tokens, 3, heads, head_dim)
    want = []
    for b in range(batch):
        heads_out = []
        for h in range(heads):
            q = _rms64(qkv[b, :, 0, h], attn.q_norm.weight)  # (N, Dh)
            k = _rms64(qkv[b, :, 1, h], attn.k_norm.weight)
            if rope:
                q, k = _rotate64(q, pos, head_dim), _rotate64(k, pos, head_dim)
            p = torch.softmax(q @ k.T / math.sqrt(head_dim), dim=-1)  # Vaswani et al. Eq. 1
            heads_out.append(p @ qkv[b, :, 2, h])
        want.append(torch.cat(heads_out, dim=-1))
    torch.testing.assert_close(out, attn.proj(torch.stack(want)), rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------------------- SwiGLU


@pytest.mark.parametrize("dim, ratio", [(384, 4.0), (1152, 4.0), (30, 4.0), (44, 4.0), (33, 2.5), (7, 3.0)])
def test_swiglu_width_and_parameter_count_against_the_gelu_mlp(dim, ratio):
    gelu_h = int(dim * ratio)
    h = swiglu_hidden(gelu_h)
    assert h == int(2 / 3 * gelu_h)  # the official int(2/3 * H), in integers
    gelu = sum(p.numel() for p in Mlp(dim, gelu_h).parameters())
    swiglu = sum(p.numel() for p in SwiGLU(dim, h).parameters())
    assert gelu == 2 * dim * gelu_h + gelu_h + dim and swiglu == 3 * dim * h + 2 * h + dim
    if gelu_h % 3 == 0:  # equal weights; the biases of w1, w2 are H/3 more than fc1's
        assert 3 * dim * h == 2 * dim * gelu_h and swiglu - gelu == gelu_h // 3
    else:  # the width rounds down: r = 2H mod 3 fewer weights per input channel (r D in all)
        r = 2 * gelu_h % 3
        assert 3 * dim * h == 2 * dim * gelu_h - r * dim
    if ratio == 4.0 and dim in (384, 1152):  # DiT-S, DiT-XL: 512 and 1536 more per block (the biases)
        assert swiglu - gelu == {384: 512, 1152: 1536}[dim]
    block = DiTBlock(dim, 1, mlp_ratio=ratio, mlp="swiglu")
    assert block.mlp.w3.in_features == h and block.mlp.w12.out_features == 2 * h


@pytest.mark.parametrize("shape", [(2, 7, 10), (1, 1, 3), (3, 5, 17)])
@pytest.mark.parametrize("fused", [False, True])
def test_swiglu_matches_its_formula(shape, fused):
    torch.manual_seed(0)
    d = shape[-1]
    mlp = SwiGLU(d, 11, fused=fused).double()
    x = torch.randn(shape, dtype=torch.float64, requires_grad=True)
    w1, w2 = mlp.w12.weight[:11], mlp.w12.weight[11:]
    b1, b2 = mlp.w12.bias[:11], mlp.w12.bias[11:]
    a = x @ w1.T + b1
    want = (a * torch.sigmoid(a) * (x @ w2.T + b2)) @ mlp.w3.weight.T + mlp.w3.bias  # Shazeer 2020, Eq. 6
    torch.testing.assert_close(mlp(x), want, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(mlp, (x,))


# ----------------------------------------------------------------------------------------------------- RoPE


@pytest.mark.parametrize("grid, head_dim", [(3, 12), (5, 4), (2, 20)])
def test_rope2d_matches_a_float64_rotation(grid, head_dim):
    torch.manual_seed(0)
    cos, sin = rope2d_tables(grid, head_dim, dtype=torch.float64)
    assert cos.shape == sin.shape == (grid * grid, head_dim // 2)
    x = torch.randn(2, 3, grid * grid, head_dim, dtype=torch.float64)
    out = apply_rope2d(x, cos, sin)
    for b in range(2):
        for h in range(3):
            torch.testing.assert_close(out[b, h], _rotate64(x[b, h], _grid_pos(grid), head_dim), rtol=0, atol=1e-12)
    c32, s32 = rope2d_tables(grid, head_dim)  # float32 tables and a float32 input: float32 accuracy
    torch.testing.assert_close(apply_rope2d(x.float(), c32, s32).double(), out, rtol=1e-5, atol=1e-5)
    assert apply_rope2d(x.bfloat16(), c32, s32).dtype == torch.bfloat16
    # the first half of the channels turns with the row, the second with the column
    row0 = torch.arange(grid)  # tokens of row 0: the row half is not rotated there
    torch.testing.assert_close(out[..., row0, : head_dim // 2], x[..., row0, : head_dim // 2], rtol=0, atol=0)
    col0 = torch.arange(grid) * grid
    torch.testing.assert_close(out[..., col0, head_dim // 2 :], x[..., col0, head_dim // 2 :], rtol=0, atol=0)


@pytest.mark.parametrize("head_dim", [4, 12, 28])
def test_rope2d_scores_depend_only_on_the_relative_offset(head_dim):
    """q.k after rotating q at position a and k at b is unchanged when a and b move by the same (row, column)."""
    grid = 7
    torch.manual_seed(head_dim)
    q, k = torch.randn(head_dim, dtype=torch.float64), torch.randn(head_dim, dtype=torch.float64)
    cos, sin = rope2d_tables(grid, head_dim, dtype=torch.float64)
    T = grid * grid
    rq = apply_rope2d(q.expand(1, 1, T, head_dim), cos, sin)[0, 0]  # (T, Dh): q at every position
    rk = apply_rope2d(k.expand(1, 1, T, head_dim), cos, sin)[0, 0]
    scores = rq @ rk.T  # (T, T)
    pos = _grid_pos(grid)
    for dr, dc in ((1, 0), (0, 2), (3, -1), (-2, -3)):
        for a in range(T):
            for b in range(T):
                (ia, ja), (ib, jb) = pos[a].tolist(), pos[b].tolist()
                if all(0 <= v < grid for v in (ia + dr, ja + dc, ib + dr, jb + dc)):
                    shifted = scores[(ia + dr) * grid + ja + dc, (ib + dr) * grid + jb + dc]
                    torch.testing.assert_close(shifted, scores[a, b], rtol=1e-12, atol=1e-12)
    # ... and does depend on the offset (not a trivial rotation)
    assert (scores[0, 1] - scores[0, grid]).abs() > 1e-3 and (scores[0, 1] - scores[0, 0]).abs() > 1e-3


def test_rope2d_model_adds_no_absolute_embedding_and_depends_on_positions():
    m = _dit(pos="rope2d").eval()
    x, t, y = _inputs()
    with torch.no_grad():
        out = m(x, t, y)
        # without positions every block is permutation-equivariant: swapping two patches would swap the outputs
        swapped = x.clone()
        swapped[..., 0:2, 0:2], swapped[..., 0:2, 2:4] = x[..., 0:2, 2:4], x[..., 0:2, 0:2]
        out2 = m(swapped, t, y)
    assert not torch.allclose(out2[..., 0:2, 2:4], out[..., 0:2, 0:2], atol=1e-4)
    with pytest.raises(ValueError, match=r"pos rope2d needs a head dim \(hidden_size / num_heads\) divisible by 4"):
        DiT(input_size=4, patch_size=2, in_channels=1, hidden_size=24, depth=1, num_heads=4, pos="rope2d")
    with pytest.raises(ValueError, match=r"unknown norm 'batchnorm'; valid choices: layernorm, rmsnorm"):
        DiT(input_size=4, patch_size=2, in_channels=1, hidden_size=8, depth=1, num_heads=2, norm="batchnorm")
    with pytest.raises(ValueError, match=r"unknown mlp 'relu'; valid choices: gelu, swiglu"):
        DiT(input_size=4, patch_size=2, in_channels=1, hidden_size=8, depth=1, num_heads=2, mlp="relu")


# ------------------------------------------------------------------------------------------------ composition


def _routed_loop(m, x, t, y, idx, span):
    """The routed model written plainly, per sample: blocks [start, end) see the kept tokens and their positions."""
    tok = m.x_embedder(x)  # (B, T, D): rope2d, no absolute embedding
    c = m.t_embedder(t) + m.y_embedder(y, False)
    cos, sin = rope2d_tables(m.x_embedder.grid_size[0], m.hidden_size // m.num_heads, dtype=x.dtype)
    rows = []
    for b in range(x.shape[0]):
        h, rope = tok[b : b + 1], (cos, sin)
        for j, block in enumerate(m.blocks):
            if j == span[0]:
                before, h, rope = h, h[:, idx[b]], (cos[idx[b]], sin[idx[b]])  # the original positions
            h = block(h, c[b : b + 1], None, rope)
            if j == span[1] - 1:
                merged = before.clone()
                merged[:, idx[b]] = h
                h, rope = merged, (cos, sin)
        rows.append(m.final_layer(h, c[b : b + 1]))
    return m.unpatchify(torch.cat(rows))


@pytest.mark.parametrize("fused", [False, True])
def test_routed_rope_rotates_the_kept_tokens_with_their_original_positions(fused):
    m = _dit(**ALL, routing=(1, 3), fused_adaln=fused).double().train()
    x, t, y = _inputs(dtype=torch.float64)
    idx = draw_route(3, 36, 13, torch.Generator().manual_seed(2))
    force = torch.zeros(3, dtype=torch.long)
    out = m(x, t, y, route=idx, force_drop_ids=force)
    with torch.no_grad():
        torch.testing.assert_close(out, _routed_loop(m, x, t, y, idx, (1, 3)), rtol=1e-12, atol=1e-12)
        wrong = _routed_loop(m, x, t, y, torch.arange(13).expand(3, 13), (1, 3))  # positions 0..K-1: differs
    assert not torch.allclose(out, wrong)
    perm = torch.stack([r[torch.randperm(13, generator=torch.Generator().manual_seed(i))] for i, r in enumerate(idx)])
    torch.testing.assert_close(m(x, t, y, route=perm, force_drop_ids=force), out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("fused", [False, True])
def test_all_options_routed_at_keep_one_equal_the_unrouted_model_outputs_and_gradients(fused):
    plain, routed = _dit(**ALL, dtr={}, fused_adaln=fused), _dit(**ALL, dtr={}, fused_adaln=fused, routing=(1, 3))
    routed.load_state_dict(plain.state_dict(), strict=True)
    x, t, y = _inputs()
    x.requires_grad_(True)
    force = torch.zeros(3, dtype=torch.long)
    a = plain(x, t, y, force_drop_ids=force)
    b = routed(x, t, y, force_drop_ids=force, route=torch.arange(36).expand(3, 36).contiguous())
    assert torch.equal(a, b)
    pa, pb = ([p for p in m.parameters() if p.requires_grad] for m in (plain, routed))
    ga = torch.autograd.grad(a.square().sum(), [x, *pa])
    gb = torch.autograd.grad(b.square().sum(), [x, *pb])
    assert all(torch.equal(u, v) for u, v in zip(ga, gb))


@pytest.mark.parametrize(
    "options",
    [ALL, dict(norm="rmsnorm"), dict(qk_norm=True), dict(mlp="swiglu"), dict(pos="rope2d")],
    ids=["all", "rmsnorm", "qk_norm", "swiglu", "rope2d"],
)
def test_gradients_flow_and_checkpointing_and_the_fused_path_agree(options):
    """Every trainable weight gets a finite, non-zero gradient; gradient checkpointing gives the same gradients, on the
    eager and on the fused path; the fused path the same outputs and gradients up to float rounding; DTR runs."""
    x, t, y = _inputs()
    force = torch.zeros(3, dtype=torch.long)
    grads = {}
    runs = [("eager", {}), ("ckpt", {"grad_checkpointing": True}), ("fused", {"fused_adaln": True})]
    runs.append(("fused+ckpt", {"fused_adaln": True, "grad_checkpointing": True}))
    for name, kw in runs:
        m = _dit(**options, dtr={}, **kw).train()
        out = m(x, t, y, force_drop_ids=force)
        out.square().mean().backward()
        grads[name] = (out.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    out, g = grads["eager"]
    assert all(v is not None and torch.isfinite(v).all() and v.abs().sum() > 0 for v in g.values()), [
        n for n, v in g.items() if v is None or v.abs().sum() == 0
    ]
    assert torch.equal(grads["ckpt"][0], out) and all(torch.equal(grads["ckpt"][1][n], v) for n, v in g.items())
    fused, g_fused = grads["fused"]
    assert torch.equal(grads["fused+ckpt"][0], fused)  # recomputing the fused blocks gives the same bits
    assert all(torch.equal(grads["fused+ckpt"][1][n], v) for n, v in g_fused.items())
    torch.testing.assert_close(grads["fused"][0], out, rtol=1e-4, atol=1e-5)
    for n, v in g.items():
        torch.testing.assert_close(grads["fused"][1][n], v, rtol=1e-3, atol=1e-5, msg=n)


def test_fused_path_matches_the_eager_path_on_every_instruction_set(each_cpu_isa):
    """Every option on the fused ops (each instruction set of the C++ kernels) against the eager block: outputs and
    every gradient within float32 rounding of each tensor's scale."""
    x, t, y = _inputs()
    force = torch.zeros(3, dtype=torch.long)
    runs = []
    for fused in (False, True):
        m = _dit(**ALL, dtr={}, fused_adaln=fused).train()
        xi = x.clone().requires_grad_(True)
        out = m(xi, t, y, force_drop_ids=force)
        out.square().mean().backward()
        runs.append((out.detach(), xi.grad, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (eager, gx_e, g_e), (fused, gx_f, g_f) = runs
    assert_near_reference(fused, eager, 1e-5, "output")
    assert_near_reference(gx_f, gx_e, 1e-4, "grad x")
    for n, v in g_e.items():
        assert_near_reference(g_f[n], v, 1e-4, n)


@pytest.mark.parametrize(
    "options, ops",
    [
        (ALL, {"rmsnorm_modulate": 2, "qk_norm_rope": 1, "swiglu": 1, "gated_residual": 2}),
        (dict(norm="rmsnorm"), {"rmsnorm_modulate": 2, "gated_residual": 2, "gelu_tanh": 1}),
        (dict(qk_norm=True), {"adaln_modulate": 2, "qk_norm_rope": 1, "gated_residual": 2, "gelu_tanh": 1}),
        (dict(pos="rope2d"), {"adaln_modulate": 2, "qk_norm_rope": 1, "gated_residual": 2, "gelu_tanh": 1}),
        (dict(mlp="swiglu"), {"adaln_modulate": 2, "swiglu": 1, "gated_residual": 2}),
    ],
    ids=["all", "rmsnorm", "qk_norm", "rope2d", "swiglu"],
)
def test_fused_blocks_call_the_fused_op_of_each_option(monkeypatch, options, ops):
    """With fused_adaln every block runs the fused op of each modern option (per block: the two norms, one QK-norm
    and rotation, one MLP activation, the two gated residuals; the final layer's RMSNorm too), and no other fused
    op."""
    from diffcurr_fast.models import dit as dit_module

    calls = dict.fromkeys(("adaln_modulate", "rmsnorm_modulate", "qk_norm_rope", "swiglu", "gated_residual"), 0)
    calls["gelu_tanh"] = 0
    for name in calls:
        real = getattr(dit_module, name)
        monkeypatch.setattr(
            dit_module, name, lambda *a, _n=name, _f=real, **k: calls.__setitem__(_n, calls[_n] + 1) or _f(*a, **k)
        )
    x, t, y = _inputs()
    _dit(**options, fused_adaln=True)(x, t, y)
    expected = {name: 4 * ops.get(name, 0) for name in calls}  # four blocks
    expected["rmsnorm_modulate"] += options.get("norm") == "rmsnorm"  # and the final layer's norm
    assert calls == expected
    calls.update(dict.fromkeys(calls, 0))
    _dit(**options)(x, t, y)
    assert not any(calls.values())  # the eager path calls none


def test_bf16_autocast_forward_backward_with_every_option():
    m = _dit(**ALL, fused_adaln=True)
    x, t, y = _inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(x, t, y)
    out.float().square().mean().backward()
    ref = _dit(**ALL, fused_adaln=True)(x, t, y)
    assert torch.isfinite(out).all() and (out.float() - ref).abs().max() < 0.1
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters() if p.requires_grad)


def test_every_option_compiles_with_fullgraph():
    m = _dit(**ALL, dtr={}, fused_adaln=True, routing=(1, 3)).train()
    m.check_values = False
    x, t, y = _inputs()
    idx = draw_route(3, 36, 18, torch.Generator().manual_seed(0))
    force = torch.zeros(3, dtype=torch.long)
    eager = m(x, t, y, route=idx, force_drop_ids=force)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, t, y, route=idx, force_drop_ids=force), eager)
    torch.testing.assert_close(compiled(x, t, y, force_drop_ids=force), m(x, t, y, force_drop_ids=force))


# ----------------------------------------------------------------------------------------------------- config


def test_config_fields_choices_checks_and_the_built_model():
    from diffcurr_fast.runs.config import ModelConfig, config_from_dict
    from diffcurr_fast.runs.recipes import describe_config
    from diffcurr_fast.runs.sampling import build_model

    m = ModelConfig()
    assert (m.norm, m.qk_norm, m.mlp, m.pos) == ("layernorm", False, "gelu", "sincos")
    text = describe_config()
    for key, choices in (("norm", NORMS), ("mlp", MLPS), ("pos", POSITIONS)):
        line = next(s for s in text.splitlines() if s.strip().startswith(f"{key}:"))
        assert f"(one of {', '.join(choices)})" in line, line
    assert any(s.strip().startswith("qk_norm: False  # bool;") for s in text.splitlines())
    cfg = config_from_dict({"model": {"hidden_size": 48, "num_heads": 4, "depth": 2, **ALL}})
    model = build_model(cfg)
    assert {k: model.config()[k] for k in ALL} == ALL and model.pos_embed is None
    with pytest.raises(ValueError, match=r"^model\.pos rope2d needs a head dim .* divisible by 4 .*got 6$"):
        config_from_dict({"model": {"hidden_size": 24, "num_heads": 4, "pos": "rope2d"}})
    with pytest.raises(ValueError, match="model.mlp"):
        config_from_dict({"model": {"mlp": "geglu"}})
