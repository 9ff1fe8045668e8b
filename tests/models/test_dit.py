"""DiT: official architecture (names, shapes, counts, init, math), CFG, backends, checkpointing, pruned models."""

import io
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import assert_near_reference

from diffcurr_fast.models import DiT, DiT_models, create_dit
from diffcurr_fast.models import dit as dit_module
from diffcurr_fast.models.attention import BackendUnavailableError

# Official presets (facebookresearch/DiT models.py): name -> (depth, hidden_size, patch_size, num_heads)
OFFICIAL_PRESETS = {
    "DiT-XL/2": (28, 1152, 2, 16),
    "DiT-XL/4": (28, 1152, 4, 16),
    "DiT-XL/8": (28, 1152, 8, 16),
    "DiT-L/2": (24, 1024, 2, 16),
    "DiT-L/4": (24, 1024, 4, 16),
    "DiT-L/8": (24, 1024, 8, 16),
    "DiT-B/2": (12, 768, 2, 12),
    "DiT-B/4": (12, 768, 4, 12),
    "DiT-B/8": (12, 768, 8, 12),
    "DiT-S/2": (12, 384, 2, 6),
    "DiT-S/4": (12, 384, 4, 6),
    "DiT-S/8": (12, 384, 8, 6),
}


def official_state_dict_shapes(
    depth,
    hidden,
    patch,
    in_ch=4,
    input_size=32,
    num_classes=1000,
    learn_sigma=True,
    dropout=0.1,
    mlp_ratio=4.0,
    freq=256,
):
    """Ordered (name, shape) list of the release's DiT state dict, derived from its module tree."""
    d = hidden
    out_ch = 2 * in_ch if learn_sigma else in_ch
    mlp = int(hidden * mlp_ratio)
    tokens = (input_size // patch) ** 2
    entries = [
        ("pos_embed", (1, tokens, d)),
        ("x_embedder.proj.weight", (d, in_ch, patch, patch)),
        ("x_embedder.proj.bias", (d,)),
        ("t_embedder.mlp.0.weight", (d, freq)),
        ("t_embedder.mlp.0.bias", (d,)),
        ("t_embedder.mlp.2.weight", (d, d)),
        ("t_embedder.mlp.2.bias", (d,)),
        ("y_embedder.embedding_table.weight", (num_classes + int(dropout > 0), d)),
    ]
    for i in range(depth):
        entries += [
            (f"blocks.{i}.attn.qkv.weight", (3 * d, d)),
            (f"blocks.{i}.attn.qkv.bias", (3 * d,)),
            (f"blocks.{i}.attn.proj.weight", (d, d)),
            (f"blocks.{i}.attn.proj.bias", (d,)),
            (f"blocks.{i}.mlp.fc1.weight", (mlp, d)),
            (f"blocks.{i}.mlp.fc1.bias", (mlp,)),
            (f"blocks.{i}.mlp.fc2.weight", (d, mlp)),
            (f"blocks.{i}.mlp.fc2.bias", (d,)),
            (f"blocks.{i}.adaLN_modulation.1.weight", (6 * d, d)),
            (f"blocks.{i}.adaLN_modulation.1.bias", (6 * d,)),
        ]
    entries += [
        ("final_layer.linear.weight", (patch * patch * out_ch, d)),
        ("final_layer.linear.bias", (patch * patch * out_ch,)),
        ("final_layer.adaLN_modulation.1.weight", (2 * d, d)),
        ("final_layer.adaLN_modulation.1.bias", (2 * d,)),
    ]
    return entries


def analytic_param_count(depth, hidden, patch, in_ch=4, input_size=32, num_classes=1000):
    """Closed-form parameter count (pos_embed included, as the release's train.py counts model.parameters())."""
    d, p, out = hidden, patch, 2 * in_ch
    embed = (p * p * in_ch * d + d) + (256 * d + d + d * d + d) + (num_classes + 1) * d + (input_size // p) ** 2 * d
    block = (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d) + (6 * d * d + 6 * d)
    final = (2 * d * d + 2 * d) + (p * p * out * d + p * p * out)
    return embed + depth * block + final


def _rand_params_(model, std=0.2):
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.normal_(0.0, std)
    return model


def _tiny(**kw):
    args = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=44, depth=2, num_heads=2, num_classes=7)
    args.update(kw)
    return DiT(**args)


def _inputs(n, model, dtype=torch.float64):
    x = torch.randn(n, model.in_channels, model.input_size, model.input_size, dtype=dtype)
    t = torch.randint(0, model.num_timesteps, (n,))
    y = torch.randint(0, model.num_classes, (n,))
    return x, t, y


# ----------------------------------------------------------------------------- presets, names, counts


def test_registry_has_the_twelve_official_presets():
    assert list(DiT_models) == list(OFFICIAL_PRESETS)


@pytest.mark.parametrize("name", list(OFFICIAL_PRESETS))
def test_preset_architecture_state_dict_and_meta_forward(name):
    depth, hidden, patch, heads = OFFICIAL_PRESETS[name]
    with torch.device("meta"):
        model = create_dit(name, input_size=32)
    assert (len(model.blocks), model.hidden_size, model.patch_size, model.num_heads) == (depth, hidden, patch, heads)
    assert all(b.attn.num_heads == heads and b.attn.head_dim == hidden // heads for b in model.blocks)
    got = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    assert got == official_state_dict_shapes(depth, hidden, patch)
    assert sum(p.numel() for p in model.parameters()) == analytic_param_count(depth, hidden, patch)
    x = torch.empty(2, 4, 32, 32, device="meta")
    t = torch.empty(2, dtype=torch.long, device="meta")
    out = model(x, t, t)
    assert out.shape == (2, 8, 32, 32)


def test_dit_xl2_parameter_count_matches_release():
    # The release's train.py logs "DiT Parameters: 675,129,632" for DiT-XL/2 at 256px (32x32 latents).
    assert analytic_param_count(28, 1152, 2) == 675_129_632
    with torch.device("meta"):
        model = create_dit("DiT-XL/2")
    assert sum(p.numel() for p in model.parameters()) == 675_129_632
    assert len(model.state_dict()) == 292


@pytest.mark.parametrize("name", ["DiT-S/2", "DiT-S/4", "DiT-S/8"])
def test_small_presets_run(name):
    p = int(name.split("/")[1])
    model = create_dit(name, input_size=16, num_classes=10, learn_sigma=False).eval()  # eval: no label dropout
    assert (len(model.blocks), model.hidden_size, model.num_heads, model.patch_size) == (12, 384, 6, p)  # DiT-S
    assert model.x_embedder.num_patches == (16 // p) ** 2
    n_params = sum(q.numel() for q in model.parameters())
    # the closed form counts 2 * in_channels outputs (learned sigma): remove the second half of the last linear
    assert n_params == analytic_param_count(12, 384, p, input_size=16, num_classes=10) - (p * p * 4) * (384 + 1)
    final = model.final_layer
    assert all(torch.equal(q, torch.zeros_like(q)) for q in final.parameters())  # adaLN-Zero: output 0 at init
    with torch.no_grad():
        for q in final.parameters():
            q.normal_(0, 0.05)
    x = torch.randn(3, 4, 16, 16)
    t, y = torch.tensor([0, 10, 999]), torch.tensor([0, 9, 10])
    out = model(x, t, y)
    assert out.shape == (3, 4, 16, 16) and out.abs().max() > 0
    # the same batch plus sample 0 at another timestep and with another label: every sample depends on its own
    # input, timestep and label only
    more = model(
        torch.cat([x, x[:1], x[:1]]), torch.cat([t, torch.tensor([500, 0])]), torch.cat([y, torch.tensor([0, 3])])
    )
    torch.testing.assert_close(more[:3], out, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(more[3], out[0], atol=1e-3) and not torch.allclose(more[4], out[0], atol=1e-3)


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown DiT preset 'DiT-XXL/2'; valid names: DiT-XL/2, DiT-XL/4"):
        create_dit("DiT-XXL/2")


# ----------------------------------------------------------------------------- init


def _official_pos_embed(embed_dim, grid_size):
    """MAE / DiT numpy sin-cos embedding, transcribed formula by formula."""
    grid_h = np.arange(grid_size, dtype=np.float32)
    grid_w = np.arange(grid_size, dtype=np.float32)
    grid = np.stack(np.meshgrid(grid_w, grid_h), axis=0).reshape([2, 1, grid_size, grid_size])

    def one_d(dim, pos):
        omega = np.arange(dim // 2, dtype=np.float64) / (dim / 2.0)
        omega = 1.0 / 10000**omega
        out = np.einsum("m,d->md", pos.reshape(-1), omega)
        return np.concatenate([np.sin(out), np.cos(out)], axis=1)

    return np.concatenate([one_d(embed_dim // 2, grid[0]), one_d(embed_dim // 2, grid[1])], axis=1)


def test_initialization_matches_release():
    model = DiT(input_size=16, patch_size=2, hidden_size=96, depth=3, num_heads=4, num_classes=50)
    expected = torch.from_numpy(_official_pos_embed(96, 8)).float().unsqueeze(0)
    assert torch.equal(model.pos_embed.data, expected)
    assert not model.pos_embed.requires_grad
    for block in model.blocks:
        assert not block.adaLN_modulation[-1].weight.any() and not block.adaLN_modulation[-1].bias.any()
        for lin in (block.attn.qkv, block.attn.proj, block.mlp.fc1, block.mlp.fc2):
            fan_out, fan_in = lin.weight.shape
            bound = math.sqrt(6.0 / (fan_in + fan_out))  # xavier_uniform
            assert lin.weight.abs().max() <= bound and lin.weight.abs().max() > 0.8 * bound
            assert not lin.bias.any()
    for lin in (model.final_layer.linear, model.final_layer.adaLN_modulation[-1]):
        assert not lin.weight.any() and not lin.bias.any()
    w = model.x_embedder.proj.weight
    assert w.abs().max() <= math.sqrt(6.0 / (w[0].numel() + w.shape[0]))  # patch embed initialized like a linear
    assert not model.x_embedder.proj.bias.any()
    for p in (model.y_embedder.embedding_table.weight, model.t_embedder.mlp[0].weight, model.t_embedder.mlp[2].weight):
        assert abs(p.std().item() - 0.02) < 0.003 and abs(p.mean().item()) < 0.003
    x = torch.randn(3, 4, 16, 16)
    out = model(x, torch.tensor([1, 2, 3]), torch.tensor([4, 5, 50]))
    assert out.shape == (3, 8, 16, 16) and not out.any()  # adaLN-Zero: the network starts at zero output


# ----------------------------------------------------------------------------- independent port of the release


def _official_forward(sd, *, depth, num_heads, patch, out_channels, x, t, y):
    """Functional transcription of the release's DiT forward, reading its state-dict names (float64)."""
    d = sd["pos_embed"].shape[-1]
    h = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=patch)  # timm PatchEmbed
    h = h.flatten(2).transpose(1, 2) + sd["pos_embed"]
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half, dtype=torch.float64) / half)
    args = t[:, None].double() * freqs[None]
    t_freq = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    temb = F.linear(t_freq, sd["t_embedder.mlp.0.weight"], sd["t_embedder.mlp.0.bias"])
    temb = F.linear(F.silu(temb), sd["t_embedder.mlp.2.weight"], sd["t_embedder.mlp.2.bias"])
    c = temb + sd["y_embedder.embedding_table.weight"][y]

    def lin(v, name):
        return F.linear(v, sd[name + ".weight"], sd[name + ".bias"])

    def modulate(v, shift, scale):
        return F.layer_norm(v, (d,), eps=1e-6) * (1 + scale[:, None]) + shift[:, None]

    B, N = h.shape[:2]
    for i in range(depth):
        p = f"blocks.{i}."
        sm, cm, gm, sf, cf, gf = lin(F.silu(c), p + "adaLN_modulation.1").chunk(6, dim=1)
        qkv = lin(modulate(h, sm, cm), p + "attn.qkv").reshape(B, N, 3, num_heads, d // num_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)
        a = ((q @ k.transpose(-2, -1)) * (d // num_heads) ** -0.5).softmax(dim=-1)
        o = (a @ v).transpose(1, 2).reshape(B, N, d)
        h = h + gm[:, None] * lin(o, p + "attn.proj")
        m = lin(F.gelu(lin(modulate(h, sf, cf), p + "mlp.fc1"), approximate="tanh"), p + "mlp.fc2")
        h = h + gf[:, None] * m
    shift, scale = lin(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, dim=1)
    h = lin(modulate(h, shift, scale), "final_layer.linear")
    g = int(N**0.5)
    h = h.reshape(B, g, g, patch, patch, out_channels)
    return torch.einsum("nhwpqc->nchpwq", h).reshape(B, out_channels, g * patch, g * patch)


@pytest.mark.parametrize("batch", [1, 3, 17])
@pytest.mark.parametrize("backend", ["math", "sdpa"])
def test_matches_independent_port_of_release(batch, backend):
    model = _rand_params_(_tiny(depth=3, attn_backend=backend)).double().eval()
    x, t, y = _inputs(batch, model)
    kw = dict(depth=3, num_heads=2, patch=2, out_channels=6, x=x, t=t, y=y)
    ref = _official_forward({k: v.detach() for k, v in model.state_dict().items()}, **kw)
    out = model(x, t, y)
    torch.testing.assert_close(out, ref, atol=1e-11, rtol=1e-11)
    # fractional t (continuous-time formulations) goes through the same embedding
    tf = torch.rand(batch, dtype=torch.float64) * 999
    torch.testing.assert_close(model(x, tf, y), _official_forward(model.state_dict(), **{**kw, "t": tf}))


def test_label_dropout_and_force_drop_ids():
    model = _rand_params_(_tiny(class_dropout_prob=0.5)).double().eval()
    x, t, y = _inputs(4, model)
    forced = model(x, t, y, force_drop_ids=torch.tensor([1, 0, 1, 0]))
    torch.testing.assert_close(forced, model(x, t, torch.where(torch.tensor([1, 0, 1, 0]) == 1, 7, y)))
    model.train()
    torch.manual_seed(1)
    drop = torch.rand(4) < 0.5
    torch.manual_seed(1)
    out = model(x, t, y)
    torch.testing.assert_close(out, model.eval()(x, t, torch.where(drop, 7, y)))
    no_cfg = _tiny(class_dropout_prob=0.0)
    assert no_cfg.y_embedder.embedding_table.num_embeddings == 7


# ----------------------------------------------------------------------------- CFG


@pytest.mark.parametrize("guide_all", [False, True])
def test_forward_with_cfg_equals_manual_guidance(guide_all):
    model = _rand_params_(_tiny(in_channels=4)).double().eval()
    n = 3
    x = torch.randn(2 * n, 4, 8, 8, dtype=torch.float64)
    t = torch.tensor([5, 500, 999] * 2)
    y = torch.cat([torch.tensor([1, 2, 6]), torch.full((n,), 7)])  # cond labels, then the null label
    out = model.forward_with_cfg(x, t, y, 4.0, guide_all_channels=guide_all)
    cond = model(x[:n], t[:n], y[:n])
    uncond = model(x[:n], t[n:], y[n:])
    g = 4 if guide_all else 3
    guided = uncond[:, :g] + 4.0 * (cond[:, :g] - uncond[:, :g])
    torch.testing.assert_close(out[:n, :g], guided)
    torch.testing.assert_close(out[n:, :g], guided)
    torch.testing.assert_close(out[:n, g:], cond[:, g:])  # unguided channels: the plain model outputs
    torch.testing.assert_close(out[n:, g:], uncond[:, g:])
    with pytest.raises(ValueError, match="even batch"):
        model.forward_with_cfg(x[:5], t[:5], y[:5], 4.0)


# ----------------------------------------------------------------------------- backends, checkpointing, precision


@pytest.mark.parametrize("batch", [1, 3])
def test_attention_backends_agree_in_model(batch):
    # each float32 backend against a float64 copy, with a tolerance scaled to the output (about 12 here): two float32
    # attention kernels round differently by CPU and vector width, so they are not held to each other
    a = _rand_params_(_tiny(input_size=10, attn_backend="math"))  # 25 tokens
    x, t, y = _inputs(batch, a, dtype=torch.float32)
    ref = _tiny(input_size=10, attn_backend="math").double()
    ref.load_state_dict(a.state_dict())
    want = ref.eval()(x.double(), t, y)
    for backend in ("math", "sdpa", "auto"):
        m = _tiny(input_size=10, attn_backend=backend)
        m.load_state_dict(a.state_dict())
        assert_near_reference(m.eval()(x, t, y), want, 1e-4, backend)  # measured: up to 1.1e-5 (AMD, seeds 0-3)


def test_explicit_flash_attn_unusable_is_loud():
    model = _tiny(attn_backend="flash_attn")
    x, t, y = _inputs(2, model, dtype=torch.float32)
    with pytest.raises(BackendUnavailableError, match="flash_attn"):
        model(x, t, y)


def test_grad_checkpointing_same_grads():
    a = _rand_params_(_tiny(depth=3)).double()
    b = _tiny(depth=3, grad_checkpointing=True).double()
    b.load_state_dict(a.state_dict())
    x, t, y = _inputs(3, a)
    xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    a.eval()(xa, t, y).square().sum().backward()
    b.eval()(xb, t, y).square().sum().backward()
    torch.testing.assert_close(xa.grad, xb.grad, atol=1e-12, rtol=1e-12)
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.requires_grad:
            torch.testing.assert_close(pa.grad, pb.grad, atol=1e-12, rtol=1e-12, msg=name)


@pytest.mark.parametrize("fused", [False, True])
def test_bf16_autocast_forward_backward(fused):
    model = _rand_params_(_tiny(fused_adaln=fused), std=0.05).eval()
    x, t, y = _inputs(3, model, dtype=torch.float32)
    ref = model(x, t, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, t, y)
    assert out.dtype == torch.bfloat16
    err = (out.float() - ref).norm() / ref.norm()
    assert err < 3e-2
    out.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)


# ----------------------------------------------------------------------------- fused adaLN path


def _ref_adaln_modulate(x, shift, scale, eps=1e-6):
    return F.layer_norm(x, x.shape[-1:], eps=eps) * (1 + scale[:, None]) + shift[:, None]


def _ref_gated_residual(x, gate, y):
    return x + gate[:, None] * y


def _check_fused_equals_plain(atol):
    plain = _rand_params_(_tiny(depth=3, hidden_size=36)).double()
    fused = _tiny(depth=3, hidden_size=36, fused_adaln=True).double()
    fused.load_state_dict(plain.state_dict())
    for batch in (1, 3, 17):
        x, t, y = _inputs(batch, plain)
        xp, xf = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        op, of = plain.eval()(xp, t, y), fused.eval()(xf, t, y)
        torch.testing.assert_close(of, op, atol=atol, rtol=atol)
        g = torch.randn_like(op)
        op.backward(g)
        of.backward(g)
        torch.testing.assert_close(xf.grad, xp.grad, atol=atol, rtol=atol)
        for (name, pp), pf in zip(plain.named_parameters(), fused.parameters()):
            if pp.requires_grad:
                torch.testing.assert_close(pf.grad, pp.grad, atol=atol, rtol=atol, msg=name)
                pp.grad = pf.grad = None


def test_fused_adaln_path_wiring(monkeypatch):
    """The fused branch calls diffcurr_fast.ops.adaln_modulate / gated_residual / gelu_tanh with the right
    arguments."""
    calls = []

    def adaln_modulate(x, shift, scale, eps=1e-6):
        calls.append("adaln_modulate")
        assert eps == 1e-6 and shift.shape == scale.shape == (x.shape[0], x.shape[2])
        return _ref_adaln_modulate(x, shift, scale, eps)

    def gated_residual(x, gate, y):
        calls.append("gated_residual")
        return _ref_gated_residual(x, gate, y)

    def gelu_tanh(x):
        calls.append("gelu_tanh")
        return F.gelu(x, approximate="tanh")

    for fn in (adaln_modulate, gated_residual, gelu_tanh):
        monkeypatch.setattr(dit_module, fn.__name__, fn)
    _check_fused_equals_plain(atol=1e-12)
    assert calls.count("adaln_modulate") == calls.count("gated_residual") == 2 * calls.count("gelu_tanh") > 0


def test_fused_adaln_with_real_ops():
    _check_fused_equals_plain(atol=1e-9)


# ----------------------------------------------------------------------------- pruned (heterogeneous) models


def _sliced_state_dict(sd, keep_heads, keep_units, head_dim):
    """Hand-slice a full model's weights to the kept heads and MLP units of each block."""
    out = dict(sd)
    for i, (heads, units) in enumerate(zip(keep_heads, keep_units)):
        p = f"blocks.{i}."
        d = sd[p + "attn.proj.weight"].shape[0]
        cols = torch.tensor([h * head_dim + j for h in heads for j in range(head_dim)], dtype=torch.long)
        rows = torch.cat([cols + s * d for s in range(3)])  # q, k, v sections of qkv
        out[p + "attn.qkv.weight"] = sd[p + "attn.qkv.weight"][rows]
        out[p + "attn.qkv.bias"] = sd[p + "attn.qkv.bias"][rows]
        out[p + "attn.proj.weight"] = sd[p + "attn.proj.weight"][:, cols]
        u = torch.tensor(units, dtype=torch.long)
        out[p + "mlp.fc1.weight"] = sd[p + "mlp.fc1.weight"][u]
        out[p + "mlp.fc1.bias"] = sd[p + "mlp.fc1.bias"][u]
        out[p + "mlp.fc2.weight"] = sd[p + "mlp.fc2.weight"][:, u]
    return out


def _masked_full_state_dict(sd, keep_heads, keep_units, head_dim, num_heads, mlp):
    """Same function in the full model: zero the output columns of pruned heads and MLP units."""
    out = {k: v.clone() for k, v in sd.items()}
    for i, (heads, units) in enumerate(zip(keep_heads, keep_units)):
        p = f"blocks.{i}."
        for h in set(range(num_heads)) - set(heads):
            out[p + "attn.proj.weight"][:, h * head_dim : (h + 1) * head_dim] = 0
        drop = sorted(set(range(mlp)) - set(units))
        out[p + "mlp.fc2.weight"][:, drop] = 0
    return out


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_pruned_model_equals_hand_sliced_full_model(batch):
    full = _rand_params_(_tiny(depth=4, hidden_size=60, num_heads=4)).double().eval()  # head_dim 15, mlp 240
    keep_heads = [[0, 1, 2, 3], [1, 3], [], [2]]
    keep_units = [list(range(0, 240, 3)), [], list(range(7)), [239]]
    cfg = {**full.config(), "block_num_heads": [len(h) for h in keep_heads]}
    pruned = DiT(**{**cfg, "block_mlp_hidden": [len(u) for u in keep_units]}).double().eval()
    assert pruned.blocks[2].attn.qkv.weight.shape == (0, 60) and pruned.blocks[1].mlp.fc1.weight.shape == (0, 60)
    assert pruned.blocks[3].attn.qkv.weight.shape == (45, 60) and pruned.blocks[3].attn.proj.weight.shape == (60, 15)
    sd = full.state_dict()
    pruned.load_state_dict(_sliced_state_dict(sd, keep_heads, keep_units, 15), strict=True)
    full.load_state_dict(_masked_full_state_dict(sd, keep_heads, keep_units, 15, 4, 240))
    x, t, y = _inputs(batch, full)
    xp = x.clone().requires_grad_(True)
    out = pruned(xp, t, y)
    torch.testing.assert_close(out, full(x, t, y), atol=1e-11, rtol=1e-11)
    out.square().sum().backward()  # zero-width layers keep their (bias) gradients
    assert pruned.blocks[2].attn.proj.bias.grad is not None and pruned.blocks[1].mlp.fc2.bias.grad is not None
    assert torch.isfinite(xp.grad).all()


def test_pruned_model_checkpoint_round_trip():
    model = _tiny(depth=3, block_num_heads=[2, 0, 1], block_mlp_hidden=[5, 176, 0], attn_backend="sdpa")
    _rand_params_(model)
    buf = io.BytesIO()
    torch.save({"config": model.config(), "model": model.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf, weights_only=True)
    assert ckpt["config"]["block_num_heads"] == [2, 0, 1] and ckpt["config"]["block_mlp_hidden"] == [5, 176, 0]
    clone = DiT.from_config(ckpt["config"])
    clone.load_state_dict(ckpt["model"], strict=True)
    assert type(clone) is DiT and clone.config() == model.config()
    x, t, y = _inputs(3, model, dtype=torch.float32)
    torch.testing.assert_close(clone.eval()(x, t, y), model.eval()(x, t, y), atol=0, rtol=0)
    assert DiT.from_config(ckpt["config"], attn_backend="math").config()["attn_backend"] == "math"
    with pytest.raises(ValueError, match="unknown DiT config keys \\['bogus'\\]; valid keys: attn_backend"):
        DiT.from_config({**ckpt["config"], "bogus": 1})


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"input_size": 9}, "input_size 9 is not divisible by patch_size 2"),
        ({"num_heads": 5}, "hidden_size 44 is not divisible by num_heads 5"),
        ({"hidden_size": 42, "num_heads": 3}, "multiple of 4"),
        ({"attn_backend": "xformers"}, "unknown attn_backend 'xformers'; valid choices: auto, flash_attn, sdpa, math"),
        ({"block_num_heads": [1]}, "block_num_heads must have one entry per block \\(depth=2\\)"),
        ({"block_mlp_hidden": [4, -1]}, "block_mlp_hidden\\[1\\] must be an int >= 0"),
        ({"class_dropout_prob": 1.0}, "class_dropout_prob"),
        ({"dtr": "yes"}, "dtr must be None, a DTRConfig"),
        ({"depth": 0}, "depth must be an int >= 1"),
    ],
)
def test_bad_constructor_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _tiny(**kwargs)


def test_bad_forward_inputs():
    model = _tiny(num_timesteps=100)
    x, t, y = _inputs(3, model, dtype=torch.float32)
    cases = [
        ((torch.randn(3, 4, 8, 8), t, y), "x has 4 channels, the model expects in_channels=3"),
        ((torch.randn(3, 3, 16, 16), t, y), "x is 16x16, the model expects 8x8"),
        ((torch.randn(3, 8, 8), t, y), "x must be \\(N, C, H, W\\)"),
        ((x, torch.tensor([0, 100, 5]), y), "integer t must lie in \\[0, 100\\).*got values in \\[0, 100\\]"),
        ((x, torch.tensor([-1, 0, 5]), y), "integer t must lie in \\[0, 100\\)"),
        ((x, torch.tensor([0.5, float("nan"), 1.0]), y), "float t must be finite"),
        ((x, t[:2], y), "t must have shape \\(3,\\)"),
        ((x, t, torch.tensor([0, 8, 1])), "y must lie in \\[0, 8\\) \\(7 is the null label\\)"),
        ((x, t, torch.tensor([0, -1, 1])), "y must lie in \\[0, 8\\)"),
        ((x, t, torch.tensor([0.0, 1.0, 1.0])), "y must be an integer tensor"),
    ]
    for args, match in cases:
        with pytest.raises(ValueError, match=match):
            model(*args)
    no_null = _tiny(class_dropout_prob=0.0)
    with pytest.raises(ValueError, match="y must lie in \\[0, 7\\), got"):
        no_null(x, t, torch.tensor([0, 7, 1]))
    # accepted: float t (continuous time), a scalar t, the null label when class dropout is on
    assert model(x, torch.tensor([0.25, 50.5, 99.9]), y).shape == (3, 6, 8, 8)
    assert model(x, torch.tensor(7), torch.tensor([7, 0, 1])).shape == (3, 6, 8, 8)


# ----------------------------------------------------------------------------- CUDA


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["sdpa", "auto", "flash_attn"])
@pytest.mark.parametrize("fused", [False, True])
def test_cuda_bf16_model_matches_fp32_math(backend, fused):
    from diffcurr_fast.models.attention import flash_attn_reason

    if backend == "flash_attn" and flash_attn_reason(torch.empty(1, device="cuda", dtype=torch.bfloat16)):
        pytest.skip("flash_attn unusable on this machine")
    ref = _rand_params_(_tiny(input_size=16, hidden_size=256, num_heads=4, depth=3, attn_backend="math"), std=0.05)
    ref = ref.cuda().eval()
    model = _tiny(input_size=16, hidden_size=256, num_heads=4, depth=3, attn_backend=backend, fused_adaln=fused)
    model.load_state_dict(ref.state_dict())
    model = model.cuda().eval()
    x, t, y = (a.cuda() for a in _inputs(17, ref, dtype=torch.float32))
    expected = ref(x, t, y)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, t, y)
    assert (out.float() - expected).norm() / expected.norm() < 3e-2
    out.float().square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.requires_grad)
