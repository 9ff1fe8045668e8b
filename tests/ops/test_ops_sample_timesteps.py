"""sample_timesteps: distribution (chi-square), support, importance unbiasedness, backends, validation."""

import pytest
import torch
from conftest import op_backends
from scipy import stats

from diffcurr_fast.ops import _backend, sample_timesteps, sample_timesteps_ref
from diffcurr_fast.ops.philox import philox_words, uniform_from_uint32

CPU = torch.device("cpu")


def _need(backend: str) -> None:
    reason = _backend.unavailable_reason(backend, "sample_timesteps", CPU)
    if reason is not None:
        pytest.skip(reason)


def _weights(T: int = 37) -> torch.Tensor:
    w = torch.rand(T, dtype=torch.float64) + 0.05
    w[::5] = 0.0  # a curriculum mask: these timesteps must never be drawn
    w[-1] = 0.0
    return w


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_chi_square_and_support(backend):
    _need(backend)
    w = _weights()
    n = 20_000
    t = sample_timesteps(n, w, seed=11, backend=backend)
    assert t.dtype == torch.int64 and t.shape == (n,)
    assert bool((w[t] > 0).all()), "a zero-weight timestep was drawn"
    counts = torch.bincount(t, minlength=w.numel()).double()
    support = w > 0
    expected = n * w / w.sum()
    assert stats.chisquare(counts[support].numpy(), expected[support].numpy()).pvalue > 1e-3


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("batch", [1, 3, 17, 1000])
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64])
def test_backends_agree_with_reference(backend, batch, wdtype):
    _need(backend)
    w = _weights(101).to(wdtype)
    t, imp = sample_timesteps(batch, w, seed=2**40 + 3, backend=backend, return_importance=True)
    t_ref, imp_ref = sample_timesteps_ref(w, batch, 2**40 + 3)
    assert torch.equal(t, t_ref)
    torch.testing.assert_close(imp, imp_ref)


def test_matches_inverse_cdf_definition_in_float64():
    w = _weights(53)
    B, seed = 17, 99
    t, imp = sample_timesteps(B, w, seed=seed, return_importance=True, backend="reference")
    u = uniform_from_uint32(philox_words(seed, torch.arange(B))[0]).double()
    cdf = torch.cumsum(w, 0)
    for b in range(B):
        k = int(t[b])
        assert cdf[k] > u[b] * cdf[-1] and (k == 0 or cdf[k - 1] <= u[b] * cdf[-1])
    torch.testing.assert_close(imp, ((cdf[-1] / w.numel()) / w[t]).float())


def test_importance_weights_are_unbiased(each_cpu_isa):
    # E_w[imp f(t)] = (1/T) sum_{w>0} f(t): the uniform-t mean over the support
    T = 64
    w = torch.linspace(0.1, 3.0, T, dtype=torch.float64)
    f = torch.sin(torch.arange(T, dtype=torch.float64) / 7.0) + 2.0
    n = 40_000
    t, imp = sample_timesteps(n, w, seed=5, return_importance=True)
    est = imp.double() * f[t]
    se = float(est.std()) / n**0.5
    assert abs(float(est.mean()) - float(f.mean())) < 5 * se


def test_reproducible_and_generator_driven():
    w = _weights()
    assert torch.equal(sample_timesteps(50, w, seed=1), sample_timesteps(50, w, seed=1))
    assert not torch.equal(sample_timesteps(50, w, seed=1), sample_timesteps(50, w, seed=2))
    g1, g2 = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    assert torch.equal(sample_timesteps(50, w, generator=g1), sample_timesteps(50, w, generator=g2))
    assert not torch.equal(sample_timesteps(50, w, generator=g1), sample_timesteps(50, w, generator=g2.manual_seed(8)))


def test_single_positive_weight_and_uniform_top_word():
    w = torch.zeros(10)
    w[4] = 2.0
    t, imp = sample_timesteps(64, w, seed=3, return_importance=True)
    assert bool((t == 4).all())
    torch.testing.assert_close(imp, torch.full((64,), 0.1))


# (seed, b) whose first Philox word is among the 128 that give the largest uniform, float32(2**31) * UNIFORM_SCALE
TOP_DRAWS = [(71991, 223), (12173, 881)]
U_MAX = 1 - 2**-24  # 0.99999994: UNIFORM_SCALE rounds to the float32 below 2**-31, so u never reaches 1


def test_largest_uniform_is_below_one():
    top = torch.tensor([2**31 - 64, 2**31 - 1, 2**31, 2**31 + 63, 2**32 - 1], dtype=torch.int64)
    assert uniform_from_uint32(top).tolist() == [U_MAX, U_MAX, U_MAX, U_MAX, 0.0]
    for seed, b in TOP_DRAWS:
        assert uniform_from_uint32(philox_words(seed, torch.tensor([b]))[0]).item() == U_MAX


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64])
def test_largest_uniform_with_trailing_zero_weights_draws_the_last_positive_weight(backend, wdtype):
    """No clamp is needed: thr = u * cdf[T-1] < cdf[T-1] for every draw, so t < T and w[t] > 0."""
    _need(backend)
    w = torch.tensor([1.0, 1.0, 0.0, 0.0], dtype=wdtype)  # cdf 1, 2, 2, 2: the top draw's thr 2 (1 - 2**-24) -> t 1
    for seed, b in TOP_DRAWS:
        t, imp = sample_timesteps(b + 1, w, seed=seed, return_importance=True, backend=backend)
        assert t[b].item() == 1 and imp[b].item() == 0.5  # (2 / 4) / w[1]
        assert set(t.tolist()) == {0, 1} and bool((imp == 0.5).all())


def test_validation():
    for bad, msg in [
        (torch.tensor([1.0, -0.5, 2.0]), "non-negative"),
        (torch.tensor([1.0, float("nan")]), "finite"),
        (torch.tensor([1.0, float("inf")]), "finite"),
        (torch.zeros(5), "all zero"),
        (torch.ones(2, 3), "1-D"),
        (torch.ones(4, dtype=torch.int64), "floating"),
        (torch.ones(0), "non-empty"),
    ]:
        with pytest.raises(ValueError, match=msg):
            sample_timesteps(4, bad, seed=0)
    with pytest.raises(ValueError, match="batch_size"):
        sample_timesteps(-1, torch.ones(3), seed=0)
    with pytest.raises(ValueError, match="either seed or generator"):
        sample_timesteps(2, torch.ones(3), seed=0, generator=torch.Generator())
    # validate=False skips the (host-syncing) check entirely
    t = sample_timesteps(4, torch.ones(3), seed=0, validate=False)
    assert t.shape == (4,)
