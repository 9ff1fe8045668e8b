"""Denoising Task Routing: mask values, the routed block, config handling."""

import math

import numpy as np
import pytest
import torch

from diffcurr_fast.models import DiT, DTRConfig, dtr_mask
from diffcurr_fast.models.dtr import dtr_window


def _masks_from_paper(num_timesteps, dim, beta, alpha):
    """All T masks as the DTR release builds them: linspace(0, 1, T) ** alpha * (D - k), numpy rounding."""
    k = int(dim * beta)
    index = np.round((np.linspace(0, 1, num_timesteps) ** alpha) * (dim - k)).astype(np.int64)
    masks = np.zeros((num_timesteps, dim))
    for task in range(num_timesteps):
        masks[task, index[task] : index[task] + k] = 1.0
    return masks, index, k


@pytest.mark.parametrize(
    "num_timesteps,dim,beta,alpha",
    [(1000, 1152, 0.8, 4.0), (1000, 384, 0.8, 4.0), (1000, 97, 0.5, 2.0), (17, 50, 0.3, 1.0), (250, 768, 1.0, 4.0)],
)
def test_mask_values_match_paper_formula(num_timesteps, dim, beta, alpha):
    cfg = DTRConfig(beta=beta, alpha=alpha)
    t = torch.arange(num_timesteps)
    masks = dtr_mask(t, dim, num_timesteps, cfg, dtype=torch.float64)
    expected, index, k = _masks_from_paper(num_timesteps, dim, beta, alpha)
    np.testing.assert_array_equal(masks.numpy(), expected)
    start, k2 = dtr_window(t, dim, num_timesteps, cfg)
    assert k2 == k == math.floor(beta * dim)
    np.testing.assert_array_equal(start.numpy(), index)
    assert bool((masks.sum(1) == k).all())
    assert int(start[0]) == 0 and int(start[-1]) == dim - k  # easy end at channel 0, hard end at D - k


def test_specific_values():
    # D = 1152, beta = 0.8: k = floor(921.6) = 921, D - k = 231; t = 500: round((500/999)^4 * 231) = round(14.495)
    start, k = dtr_window(torch.tensor([0, 500, 999]), 1152, 1000, DTRConfig())
    assert k == 921
    assert start.tolist() == [0, 14, 231]
    assert round((500 / 999) ** 4 * 231) == 14


def test_float_t_agrees_with_integer_t_and_clamps():
    cfg = DTRConfig()
    t = torch.tensor([0, 3, 250, 998, 999])
    torch.testing.assert_close(dtr_mask(t.double(), 64, 1000, cfg), dtr_mask(t, 64, 1000, cfg))
    torch.testing.assert_close(
        dtr_mask(torch.tensor([-5.0, 2000.0]), 64, 1000, cfg), dtr_mask(t[[0, 4]], 64, 1000, cfg)
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [({"beta": 0.0}, "beta"), ({"beta": 1.5}, "beta"), ({"alpha": 0.0}, "alpha"), ({"alpha": float("inf")}, "alpha")],
)
def test_config_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DTRConfig(**kwargs)


def test_config_dict_round_trip_and_unknown_keys():
    cfg = DTRConfig(beta=0.6, alpha=2.0)
    assert DTRConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(ValueError, match="unknown DTRConfig keys.*gamma"):
        DTRConfig.from_dict({"beta": 0.5, "gamma": 1.0})
    with pytest.raises(ValueError, match="num_timesteps >= 2"):
        DiT(input_size=4, patch_size=2, hidden_size=8, depth=1, num_heads=2, dtr=cfg, num_timesteps=1)


def _tiny(**kw):
    args = dict(input_size=8, patch_size=2, in_channels=3, hidden_size=44, depth=3, num_heads=2, num_classes=7)
    args.update(kw)
    m = DiT(**args).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(0.0, 0.2)
    return m


def _manual_dtr_forward(plain, x, t, y, cfg, num_timesteps):
    """Block output = Block(x * m) + x * (1 - m) with m from the paper's formula, around an un-routed model."""
    masks, _, _ = _masks_from_paper(num_timesteps, plain.hidden_size, cfg.beta, cfg.alpha)
    m = torch.from_numpy(masks)[t][:, None, :]  # (N, 1, D)
    h = plain.x_embedder(x) + plain.pos_embed
    c = plain.t_embedder(t) + plain.y_embedder(y, False)
    for block in plain.blocks:
        h = block(h * m, c) + h * (1 - m)
    return plain.unpatchify(plain.final_layer(h, c))


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_routed_model_matches_manual_routing(batch):
    cfg = DTRConfig(beta=0.7, alpha=3.0)
    routed = _tiny(dtr=cfg, num_timesteps=100)
    plain = _tiny(num_timesteps=100)
    plain.load_state_dict(routed.state_dict(), strict=True)  # DTR adds no parameters or buffers
    x = torch.randn(batch, 3, 8, 8, dtype=torch.float64)
    t = torch.randint(0, 100, (batch,))
    y = torch.randint(0, 7, (batch,))
    out = routed(x, t, y)
    torch.testing.assert_close(out, _manual_dtr_forward(plain, x, t, y, cfg, 100), atol=1e-12, rtol=1e-12)
    assert not torch.allclose(out, plain(x, t, y))  # routing changes the function


def test_beta_one_is_the_plain_model():
    routed = _tiny(dtr=DTRConfig(beta=1.0))
    plain = _tiny()
    plain.load_state_dict(routed.state_dict())
    x, t, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 500, 999]), torch.tensor([0, 3, 6])
    torch.testing.assert_close(routed(x, t, y), plain(x, t, y), atol=1e-12, rtol=1e-12)


def test_routed_grad_checkpointing_same_grads():
    a = _tiny(dtr=DTRConfig())
    b = _tiny(dtr=DTRConfig(), grad_checkpointing=True)
    b.load_state_dict(a.state_dict())
    x, t, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([4, 600, 999]), torch.tensor([0, 3, 6])
    a(x, t, y).square().sum().backward()
    b(x, t, y).square().sum().backward()
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.requires_grad:
            torch.testing.assert_close(pa.grad, pb.grad, atol=1e-12, rtol=1e-12, msg=name)


def test_routed_config_round_trip():
    m = _tiny(dtr=DTRConfig(beta=0.6, alpha=2.0), num_timesteps=50)
    cfg = m.config()
    assert cfg["dtr"] == {"beta": 0.6, "alpha": 2.0} and cfg["num_timesteps"] == 50
    m2 = DiT.from_config(cfg).double().eval()
    m2.load_state_dict(m.state_dict(), strict=True)
    assert m2.dtr == DTRConfig(beta=0.6, alpha=2.0)
    x, t, y = torch.randn(3, 3, 8, 8, dtype=torch.float64), torch.tensor([0, 25, 49]), torch.tensor([0, 3, 6])
    torch.testing.assert_close(m2(x, t, y), m(x, t, y))
