"""Philox4x32-10 noise: known answers, agreement with Triton's generator, normality, reproducibility."""

import pytest
import torch
from conftest import op_backends
from scipy import stats

from diffcurr_fast.ops import _backend, philox_randn, philox_randn_ref
from diffcurr_fast.ops.philox import normalize_seed, philox4x32_10, philox_words, uniform_from_uint32

CPU = torch.device("cpu")


def _need(backend: str, op: str = "randn_like") -> None:
    reason = _backend.unavailable_reason(backend, op, CPU)
    if reason is not None:
        pytest.skip(reason)


def test_known_answer_vectors():
    # Random123 kat_vectors: philox4x32_10, counter 0, key 0 and counter/key all ones.
    z = torch.zeros(1, dtype=torch.int64)
    out = [int(v) for v in philox4x32_10(z, z, z, z, 0, 0)]
    assert out == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    f = torch.full((1,), 0xFFFFFFFF, dtype=torch.int64)
    out = [int(v) for v in philox4x32_10(f, f, f, f, 0xFFFFFFFF, 0xFFFFFFFF)]
    assert out == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    pi = [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]
    c = [torch.tensor([v], dtype=torch.int64) for v in pi]
    out = [int(v) for v in philox4x32_10(*c, 0xA4093822, 0x299F31D0)]
    assert out == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_matches_triton_randint4x_under_interpreter():
    triton = pytest.importorskip("triton")
    import triton.language as tl

    if _backend.unavailable_reason("triton", "randn", CPU) is not None:
        pytest.skip("Triton kernels need TRITON_INTERPRET=1 on CPU")

    @triton.jit
    def _words(out_ptr, seed, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        ctr = offs + 4294967290  # crosses 2**32: exercises the high counter word
        r0, r1, r2, r3 = tl.randint4x(seed, ctr)
        for k, r in ((0, r0), (1, r1), (2, r2), (3, r3)):
            tl.store(out_ptr + offs * 4 + k, r.to(tl.int32, bitcast=True), mask=mask)

    seed = 0x1234567890ABCDEF
    n = 13
    got = torch.zeros(n * 4, dtype=torch.int32)
    _words[(1,)](got, seed, n, BLOCK=16)
    ctr = torch.arange(n, dtype=torch.int64) + 4294967290
    want = torch.stack(philox_words(seed, ctr), 1).reshape(-1)
    assert torch.equal(got.to(torch.int64) & 0xFFFFFFFF, want)


def test_uniform_mapping_range():
    r = torch.tensor([0, 1, 2**31 - 1, 2**31, 2**32 - 1], dtype=torch.int64)
    u = uniform_from_uint32(r)
    assert u.dtype == torch.float32
    assert float(u.min()) >= 0.0 and float(u.max()) <= 1.0
    assert float(u[0]) == 0.0 and float(u[4]) == 0.0  # 0xffffffff is int32 -1 -> folded to 0


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
@pytest.mark.parametrize("shape", [(1,), (3, 5), (17, 3, 5, 7), (2, 4099)])
def test_backends_agree_with_reference(backend, shape):
    _need(backend)
    seed = 987654321012345
    ref = philox_randn_ref(seed, shape)
    got = philox_randn(seed, shape, "cpu", backend=backend)
    assert got.shape == torch.Size(shape) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=2e-6)


def test_prefix_property_and_reproducibility(each_cpu_isa):
    a = philox_randn_ref(5, (1001,))
    b = philox_randn_ref(5, (3, 7, 11))  # 231 elements: the same flat stream
    assert torch.equal(a[:231], b.reshape(-1))
    assert torch.equal(philox_randn(5, (3, 7, 11), backend="reference"), b)
    torch.testing.assert_close(philox_randn(5, (3, 7, 11)), b, rtol=1e-5, atol=2e-6)  # auto backend
    assert torch.equal(philox_randn(5, (3, 7, 11)), philox_randn(5, (3, 7, 11)))
    assert not torch.equal(philox_randn_ref(6, (231,)), a[:231])


def test_standard_normal_statistics():
    n = 200_000
    x = philox_randn_ref(2024, (n,)).double()
    # mean ~ N(0, 1/n), variance ~ N(1, 2/n): 5 sigma bounds
    assert abs(float(x.mean())) < 5 / n**0.5
    assert abs(float(x.var()) - 1.0) < 5 * (2 / n) ** 0.5
    assert stats.kstest(x.numpy(), "norm").pvalue > 1e-3
    # the four Box-Muller lanes are each standard normal and uncorrelated
    lanes = x[: n - n % 4].reshape(-1, 4)
    corr = torch.corrcoef(lanes.T)
    assert float((corr - torch.eye(4, dtype=torch.float64)).abs().max()) < 5 / (n / 4) ** 0.5
    for k in range(4):
        assert stats.kstest(lanes[:, k].numpy(), "norm").pvalue > 1e-4


def test_seed_normalization_and_errors():
    assert normalize_seed(2**64 - 1) == -1
    assert torch.equal(philox_randn_ref(2**64 - 1, (8,)), philox_randn_ref(-1, (8,)))
    for bad in (2**64, -(2**63) - 1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="seed"):
            philox_randn(bad, (4,))
    with pytest.raises(ValueError, match="shape"):
        philox_randn(0, (3, -1))
    with pytest.raises(ValueError, match="backend"):
        philox_randn(0, (3,), backend="fortran")
