"""q_sample: fused forward process against a float64 reference, on every available backend."""

import pytest
import torch
from conftest import op_backends

from diffcurr_fast.diffusion import DDPMSchedule
from diffcurr_fast.ops import _backend, philox_randn_ref, q_sample, q_sample_coef

CPU = torch.device("cpu")
SCHED = DDPMSchedule(1000)
SHAPES = [(1, 37), (3, 3, 5, 7), (17, 2, 3, 5)]


def _need(backend: str) -> None:
    reason = _backend.unavailable_reason(backend, "q_sample", CPU)
    if reason is not None:
        pytest.skip(reason)


def _t(b: int) -> torch.Tensor:
    return torch.randint(0, 1000, (b,))


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("given_noise", [True, False])
def test_matches_float64(backend, shape, given_noise):
    _need(backend)
    x0 = torch.randn(shape)
    t = _t(shape[0])
    seed = 1234567
    noise = torch.randn(shape) if given_noise else None
    eps = noise if given_noise else philox_randn_ref(seed, shape)
    want = SCHED.q_sample(x0.double(), t, eps.double())
    got = q_sample(x0, t, SCHED, noise, seed=None if given_noise else seed, backend=backend)
    assert got.dtype == torch.float32 and got.shape == x0.shape
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_gradients_match_float64_autograd(backend):
    _need(backend)
    B, shape = 3, (3, 4, 5)
    x0 = torch.randn(B, *shape, requires_grad=True)
    noise = torch.randn(B, *shape, requires_grad=True)
    a = torch.rand(B, requires_grad=True)
    c = torch.rand(B, requires_grad=True)
    out = q_sample_coef(x0, a, c, noise, backend=backend)
    g = torch.randn_like(out)
    out.backward(g)
    ref_in = [v.detach().double().requires_grad_() for v in (x0, noise, a, c)]
    x6, n6, a6, c6 = ref_in
    ref = a6.view(-1, 1, 1, 1) * x6 + c6.view(-1, 1, 1, 1) * n6
    ref.backward(g.double())
    for mine, theirs in zip((x0, noise, a, c), ref_in):
        torch.testing.assert_close(mine.grad.double(), theirs.grad, rtol=1e-5, atol=1e-5)


def test_seeded_noise_gradient_wrt_c_uses_regenerated_noise(each_cpu_isa):
    x0 = torch.randn(3, 11)
    c = torch.rand(3, requires_grad=True)
    q_sample_coef(x0, 1.0, c, seed=77).sum().backward()
    torch.testing.assert_close(c.grad, philox_randn_ref(77, (3, 11)).sum(1))


def test_return_noise_and_seed_reproducibility():
    x0 = torch.randn(5, 13)
    t = _t(5)
    xt, noise = q_sample(x0, t, SCHED, seed=42, return_noise=True)
    torch.testing.assert_close(noise, philox_randn_ref(42, x0.shape))
    assert torch.equal(q_sample(x0, t, SCHED, seed=42), xt)
    torch.testing.assert_close(q_sample(x0, t, SCHED, noise), xt)
    torch.manual_seed(3)
    a = q_sample(x0, t, SCHED)
    torch.manual_seed(3)
    assert torch.equal(q_sample(x0, t, SCHED), a)  # the seed is drawn from torch's generator


def test_schedule_as_alphas_cumprod_tensor_and_coef_forms():
    x0 = torch.randn(4, 9)
    t = _t(4)
    noise = torch.randn(4, 9)
    want = q_sample(x0, t, SCHED, noise)
    torch.testing.assert_close(q_sample(x0, t, SCHED.alphas_cumprod, noise), want)
    # flow (SiT): a = 1 - s, c = s; EDM: a = 1, c = sigma
    s = torch.rand(4)
    torch.testing.assert_close(q_sample_coef(x0, 1 - s, s, noise), (1 - s)[:, None] * x0 + s[:, None] * noise)
    torch.testing.assert_close(q_sample_coef(x0, 1.0, 2.5, noise), x0 + 2.5 * noise)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs(dtype, each_cpu_isa):
    x0 = torch.randn(3, 2, 5, dtype=dtype)
    noise = torch.randn(3, 2, 5, dtype=dtype)
    t = _t(3)
    got = q_sample(x0, t, SCHED, noise)
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), SCHED.q_sample(x0.double(), t, noise.double()), rtol=1e-2, atol=1e-2)


def test_float64_runs_on_reference_and_passes_gradcheck():
    x0 = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    a = torch.rand(3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda x, a: q_sample_coef(x, a, 0.3, seed=5), (x0, a))


def test_non_contiguous_input(each_cpu_isa):
    x0 = torch.randn(7, 6).t()  # (6, 7) non-contiguous
    noise = torch.randn(7, 6).t()
    t = _t(6)
    for backend in _backend.available_backends("q_sample", CPU):
        torch.testing.assert_close(q_sample(x0, t, SCHED, noise, backend=backend), SCHED.q_sample(x0, t, noise))


def test_bad_inputs():
    x0 = torch.randn(3, 4)
    with pytest.raises(ValueError, match="out of range"):
        q_sample(x0, torch.tensor([0, 1, 1000]), SCHED, seed=1)
    with pytest.raises(ValueError, match="out of range"):
        q_sample(x0, torch.tensor([0, -1, 2]), SCHED, seed=1)
    with pytest.raises(ValueError, match="integer"):
        q_sample(x0, torch.tensor([0.0, 1.0, 2.0]), SCHED, seed=1)
    with pytest.raises(ValueError, match=r"shape \(3,\)"):
        q_sample(x0, torch.tensor([0, 1]), SCHED, seed=1)
    with pytest.raises(ValueError, match="noise shape"):
        q_sample(x0, _t(3), SCHED, torch.randn(3, 5))
    with pytest.raises(ValueError, match="dtype"):
        q_sample(x0, _t(3), SCHED, torch.randn(3, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="either noise or seed"):
        q_sample(x0, _t(3), SCHED, torch.randn(3, 4), seed=3)
    with pytest.raises(ValueError, match="dtype"):
        q_sample(x0.long(), _t(3), SCHED, seed=3)
    with pytest.raises(ValueError, match="schedule"):
        q_sample(x0, _t(3), [0.9, 0.5], seed=3)
    with pytest.raises(ValueError, match="shape"):
        q_sample_coef(x0, torch.rand(4), 1.0, seed=3)
    with pytest.raises(ValueError, match="noise is on meta"):
        q_sample(x0, _t(3), SCHED, torch.empty(3, 4, device="meta"))
    with pytest.raises(ValueError, match="t is on meta"):
        q_sample(x0, torch.zeros(3, dtype=torch.int64, device="meta"), SCHED, seed=1)
    with pytest.raises(ValueError, match="a is on meta"):
        q_sample_coef(x0, torch.ones(3, device="meta"), 1.0, seed=1)
    with pytest.raises(ValueError, match="alphas_cumprod"):
        q_sample(x0, _t(3), torch.full((1000,), 1.5, dtype=torch.float64), seed=3)


@pytest.mark.parametrize("backend", op_backends("cpu", "triton"))
def test_float16_kernels_match_reference(backend):
    _need(backend)
    x0 = torch.randn(3, 37, dtype=torch.float16)
    t = _t(3)
    got = q_sample(x0, t, SCHED, seed=3, backend=backend)
    want = q_sample(x0, t, SCHED, seed=3, backend="reference")
    assert got.dtype == torch.float16
    torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-3)
