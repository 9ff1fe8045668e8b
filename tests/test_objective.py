"""The one training objective against the previous per-formulation reference formulas (float64, kept here).

Every formulation x prediction x weighting (x learned sigma for DDPM) gives the same per-sample loss and gradient
through ``Objective`` as through the formulas the trainer used before it (IDDPM ``hybrid_loss`` with
``loss_weights``, SiT's velocity MSE, EDM's lambda-weighted denoiser loss), on odd batch sizes; the terms put t
inside the sampled cell; the fused backends agree with the reference backend.
"""

import math

import pytest
import torch

from diffcurr_fast.diffusion import DDPMSchedule, EDMFormulation, FlowFormulation, hybrid_loss, loss_weights
from diffcurr_fast.objective import Objective, batch_loss, fit_steps
from diffcurr_fast.ops import q_sample_coef


def _noise(seed, like):
    """The Philox noise the fused ops draw for ``seed`` in ``like``'s shape and precision."""
    return q_sample_coef(like, 0.0, 1.0, seed=seed, return_noise=True, backend="reference")[1]


class _Net(torch.nn.Module):
    """A tiny deterministic network that records its inputs: out = conv(x) + t-dependent bias."""

    def __init__(self, channels_out=1):
        super().__init__()
        torch.manual_seed(0)
        self.conv = torch.nn.Conv2d(1, channels_out, 3, padding=1).double()
        self.seen = []

    def forward(self, x, t, y):
        self.seen.append((x.detach().clone(), t.detach().clone()))
        return self.conv(x) + 0.01 * t.double().view(-1, 1, 1, 1)


def _run(obj, x0, k, seed, channels_out):
    """(objective's loss, d loss / d out) and the network inputs it used, in float64 (reference backend)."""
    net = _Net(channels_out)
    gen = torch.Generator().manual_seed(7)
    terms = obj.draw(k, torch.Generator().manual_seed(7))
    loss = obj(net, x0, torch.zeros(len(x0), dtype=torch.long), k, seed=seed, generator=gen)
    x_in, t_in = net.seen[0]
    out = net.conv(x_in) + 0.01 * t_in.double().view(-1, 1, 1, 1)
    out_leaf = out.detach().requires_grad_(True)
    per = obj.loss(out_leaf, x0, x_in, terms, seed)
    per.sum().backward()
    torch.testing.assert_close(per.detach(), loss.detach(), rtol=0, atol=0)  # __call__ == loss(out)
    return per.detach(), out_leaf.grad, out.detach(), x_in, t_in, terms


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
@pytest.mark.parametrize(
    "weighting, gamma", [("none", 5.0), ("p2", 5.0), ("min_snr", 1.0), ("min_snr", 5.0), ("min_snr", 20.0)]
)
@pytest.mark.parametrize("learn_sigma", [False, True])
@pytest.mark.parametrize("batch", [1, 5])
def test_ddpm_objective_matches_hybrid_loss(prediction, weighting, gamma, learn_sigma, batch):
    sched = DDPMSchedule(60, "cosine")
    obj = Objective(
        sched,
        num_cells=60,
        prediction=prediction,
        weighting=weighting,
        gamma=gamma,
        learn_sigma=learn_sigma,
        backend="reference",
    )
    x0 = torch.rand(batch, 1, 5, 7, dtype=torch.float64) * 2 - 1
    k = torch.randint(0, 60, (batch,), generator=torch.Generator().manual_seed(batch))
    k[0] = 0  # SNR largest: MinSNR's clip and v's weights at the end of the axis
    seed = 1234
    per, grad, out, x_in, t_in, _ = _run(obj, x0, k, seed, 2 if learn_sigma else 1)
    noise = _noise(seed, x0)
    x_t = sched.q_sample(x0, k, noise)
    torch.testing.assert_close(x_in, x_t, rtol=1e-12, atol=1e-12)  # Ho et al. Eq. 4, same Philox noise
    assert torch.equal(t_in, k)
    w = loss_weights(sched.snr(k), prediction, weighting, gamma)
    ref_out = out.clone().requires_grad_(True)
    ref = hybrid_loss(sched, ref_out, x0, x_t, k, noise, learn_sigma, prediction, weights=w)["loss"]
    ref.sum().backward()
    torch.testing.assert_close(per, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_out.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_flow_objective_matches_velocity_mse(batch):
    form = FlowFormulation()
    obj = Objective(form, num_cells=50, prediction="velocity", backend="reference")
    x0 = torch.randn(batch, 1, 5, 7, dtype=torch.float64)
    k = torch.randint(0, 50, (batch,))
    per, grad, out, x_in, t_in, terms = _run(obj, x0, k, 99, 1)
    t = terms.t
    assert torch.equal(torch.floor(t * 50).long(), k)  # t inside cell k
    torch.testing.assert_close(t_in, t)
    noise = _noise(99, x0)
    s = t.view(-1, 1, 1, 1)
    torch.testing.assert_close(x_in, (1 - s) * x0 + s * noise, rtol=1e-12, atol=1e-12)
    ref_out = out.clone().requires_grad_(True)
    ref = ((ref_out - (noise - x0)) ** 2).mean((1, 2, 3))  # velocity target eps - x0 (SiT)
    ref.sum().backward()
    torch.testing.assert_close(per, ref.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_out.grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch", [1, 3, 17])
def test_edm_objective_matches_weighted_denoiser_loss(batch):
    """lambda(sigma) |c_skip x + c_out F - x0|^2 (EDM Eq. 2, 7, Table 1) in float64, outputs and gradients."""
    form = EDMFormulation()
    obj = Objective(form, num_cells=50, prediction="x0", backend="reference")
    x0 = torch.randn(batch, 1, 5, 7, dtype=torch.float64) * 0.5
    k = torch.randint(0, 50, (batch,))
    per, grad, out, x_in, t_in, terms = _run(obj, x0, k, 5, 1)
    sigma = terms.t
    lo, hi = math.log(0.002), math.log(80.0)
    cell = torch.floor((sigma.log() - lo) / (hi - lo) * 50).long()
    assert torch.equal(cell.clamp(0, 49), k)
    noise = _noise(5, x0)
    s, sd = sigma.view(-1, 1, 1, 1), 0.5
    x_t = x0 + s * noise
    torch.testing.assert_close(x_in, x_t / (s**2 + sd**2).sqrt(), rtol=1e-12, atol=1e-12)  # c_in x
    torch.testing.assert_close(t_in, sigma.log() / 4)  # c_noise
    ref_out = out.clone().requires_grad_(True)
    den = sd**2 / (s**2 + sd**2) * x_t + s * sd / (s**2 + sd**2).sqrt() * ref_out
    ref = (sigma**2 + sd**2) / (sigma * sd) ** 2 * ((den - x0) ** 2).mean((1, 2, 3))
    ref.sum().backward()
    torch.testing.assert_close(per, ref.detach(), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(grad, ref_out.grad, rtol=1e-9, atol=1e-10)


def test_edm_cell_prior_is_the_log_normal_mass():
    w = EDMFormulation().cell_prior(50)
    lo, hi = math.log(0.002), math.log(80.0)
    centres = (torch.arange(50, dtype=torch.float64) + 0.5) / 50 * (hi - lo) + lo
    assert abs(float((w * centres).sum() / w.sum()) - (-1.2)) < 0.05
    assert abs(float(w.sum()) - 1.0) < 1e-3 and int(w.argmax()) == int((centres + 1.2).abs().argmin())


@pytest.mark.parametrize("formulation", ["ddpm", "flow", "edm"])
def test_fused_backend_matches_reference(formulation, each_cpu_isa):
    """The cpu backend computes what the reference backend defines (float32, same Philox noise)."""
    from diffcurr_fast.ops import available_backends

    if "cpu" not in available_backends("q_sample", torch.device("cpu")):
        pytest.skip("the C++ extension is not built")
    form, pred = {
        "ddpm": (DDPMSchedule(40), "v"),
        "flow": (FlowFormulation(), "velocity"),
        "edm": (EDMFormulation(), "x0"),
    }[formulation]
    x0 = torch.randn(3, 1, 5, 7)
    k = torch.tensor([0, 17, 39])
    net = torch.nn.Conv2d(1, 1, 3, padding=1)
    res = {}
    for backend in ("reference", "cpu"):
        obj = Objective(
            form,
            num_cells=40,
            prediction=pred,
            weighting="min_snr" if formulation == "ddpm" else "none",
            backend=backend,
        )
        net.zero_grad()
        loss = obj(lambda x, t, y: net(x), x0, None, k, seed=3, generator=torch.Generator().manual_seed(1))
        loss.sum().backward()
        res[backend] = (loss.detach(), net.weight.grad.clone())
    torch.testing.assert_close(res["cpu"][0], res["reference"][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(res["cpu"][1], res["reference"][1], rtol=1e-4, atol=1e-6)


def test_objective_rejects_what_a_formulation_cannot_train():
    with pytest.raises(ValueError, match="unknown prediction"):
        Objective(DDPMSchedule(100), num_cells=100, prediction="velocity")
    with pytest.raises(ValueError, match="flow training has no 'min_snr' weighting"):
        Objective(FlowFormulation(), num_cells=10, prediction="velocity", weighting="min_snr").draw(
            torch.zeros(2, dtype=torch.long)
        )
    with pytest.raises(ValueError, match="has no learned variance"):
        FlowFormulation().variance_loss(None, None, None, None, "velocity")


def test_fit_steps_and_batch_loss_draw_from_the_cell_weights():
    """The cells come from the weights through ops.sample_timesteps, as the trainer draws: a range [10, 20) gives
    cells in it only, a weight vector is followed, and the same generator seed gives the same loss."""
    sched = DDPMSchedule(30)
    obj = Objective(sched, num_cells=30, prediction="eps")
    net = _Net()
    x0 = torch.randn(4, 1, 5, 7, dtype=torch.float64)
    y = torch.zeros(4, dtype=torch.long)
    w = torch.zeros(30)
    w[10:20] = 1.0
    losses = fit_steps(net, obj, [(x0, y)], w, 3, lr=1e-3, generator=torch.Generator().manual_seed(0))
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    ts = torch.cat([t for _, t in net.seen])
    assert int(ts.min()) >= 10 and int(ts.max()) < 20
    a = batch_loss(obj, net, x0, y, w, torch.Generator().manual_seed(1))
    b = batch_loss(obj, net, x0, y, w, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    net.seen.clear()
    x_big = torch.randn(4000, 1, 1, 1, dtype=torch.float64)
    skew = torch.zeros(30, dtype=torch.float64)
    skew[[3, 7]] = torch.tensor([1.0, 3.0], dtype=torch.float64)
    batch_loss(obj, net, x_big, torch.zeros(4000, dtype=torch.long), skew, torch.Generator().manual_seed(2))
    ts = net.seen[0][1]
    assert set(ts.tolist()) == {3, 7} and float((ts == 7).double().mean()) == pytest.approx(0.75, abs=0.03)
    with pytest.raises(ValueError, match=r"cell weights must be a \(30,\) tensor, got \(20,\)"):
        batch_loss(obj, net, x0, y, torch.ones(20), torch.Generator())
    with pytest.raises(ValueError, match="weights are all zero"):
        batch_loss(obj, net, x0, y, torch.zeros(30), torch.Generator())
