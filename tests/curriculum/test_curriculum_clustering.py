import itertools

import pytest
import torch

from diffcurr_fast.curriculum.clustering import (
    CLUSTER_METHODS,
    check_clusters,
    cluster_snr,
    cluster_timesteps,
    interval_cost_matrix,
    snr_interval_clusters,
    uniform_clusters,
)
from diffcurr_fast.diffusion import DDPMSchedule


def assert_partition(clusters, T, N):
    assert len(clusters) == N
    assert clusters[0][0] == 0 and clusters[-1][1] == T
    for (_, hi), (lo2, _) in zip(clusters, clusters[1:]):
        assert hi == lo2
    assert all(hi > lo for lo, hi in clusters)
    assert check_clusters(clusters, T) == clusters


class EDMGrid:
    """A continuous formulation on a sigma grid: SNR = 1 / sigma^2 (no num_timesteps)."""

    def snr(self, sigma):
        return 1.0 / torch.as_tensor(sigma, dtype=torch.float64) ** 2

    def log_snr(self, sigma):
        return -2.0 * torch.log(torch.as_tensor(sigma, dtype=torch.float64))


@pytest.mark.parametrize("method", CLUSTER_METHODS)
@pytest.mark.parametrize("T,N", [(T, N) for T in (1, 17, 100) for N in sorted({1, 2, 3, 7, 13, T}) if N <= T])
def test_partition_every_method(method, T, N):
    betas = torch.linspace(1e-3, 0.2, T, dtype=torch.float64)
    sched = DDPMSchedule(betas=betas)
    clusters = cluster_timesteps(sched, N, method)
    assert_partition(clusters, T, N)


@pytest.mark.parametrize("method", CLUSTER_METHODS)
@pytest.mark.parametrize("beta_schedule", ["linear", "cosine"])
def test_partition_full_schedules(method, beta_schedule):
    sched = DDPMSchedule(1000, beta_schedule)
    for N in (1, 19, 20):
        assert_partition(cluster_timesteps(sched, N, method), 1000, N)


@pytest.mark.parametrize("method", CLUSTER_METHODS)
def test_continuous_grid(method):
    sigma = torch.exp(torch.linspace(-6.0, 4.4, 257, dtype=torch.float64))  # ascending sigma: SNR descends
    clusters = cluster_timesteps(EDMGrid(), 9, method, grid=sigma)
    assert_partition(clusters, 257, 9)
    assert cluster_snr(EDMGrid().snr(sigma), 9, method) == clusters


def test_uniform_sizes():
    for T, N in [(1000, 20), (1000, 7), (17, 3), (5, 5)]:
        sizes = [hi - lo for lo, hi in uniform_clusters(T, N)]
        assert sum(sizes) == T and max(sizes) - min(sizes) <= 1


def _l1_median_cost(v):
    med = v.median()  # any median minimises the sum of absolute deviations
    return float((v - med).abs().sum())


def test_cost_matrix_matches_direct():
    v = torch.rand(11, dtype=torch.float64).sort(descending=True).values
    C = interval_cost_matrix(v)
    for lo in range(12):
        for hi in range(12):
            if hi <= lo:
                assert C[lo, hi] == float("inf")
            else:
                assert C[lo, hi].item() == pytest.approx(_l1_median_cost(v[lo:hi]), abs=1e-12)


@pytest.mark.parametrize("T", [1, 6, 9, 10])
@pytest.mark.parametrize("descending", [True, False])
def test_dp_optimal_vs_brute_force(T, descending):
    gen = torch.Generator().manual_seed(T)
    v = torch.exp(torch.randn(T, generator=gen, dtype=torch.float64) * 3).sort(descending=descending).values
    for N in range(1, min(T, 5) + 1):
        best = min(
            sum(_l1_median_cost(v[lo:hi]) for lo, hi in zip((0,) + cuts, cuts + (T,)))
            for cuts in itertools.combinations(range(1, T), N - 1)
        )
        clusters, cost = snr_interval_clusters(v, N)
        assert_partition(clusters, T, N)
        direct = sum(_l1_median_cost(v[lo:hi]) for lo, hi in clusters)
        assert cost == pytest.approx(best, rel=1e-12, abs=1e-12)
        assert direct == pytest.approx(best, rel=1e-12, abs=1e-12)


def test_snr_clusters_shrink_where_snr_is_large():
    clusters = cluster_timesteps(DDPMSchedule(1000), 20, "snr")
    sizes = [hi - lo for lo, hi in clusters]
    assert sizes[0] < sizes[-1]  # high-SNR (low t) region is cut finely, as in ANT
    assert clusters == cluster_snr(DDPMSchedule(1000).snr(torch.arange(1000)), 20, "snr")


def test_log_snr_equal_ranges_on_linear_axis():
    log_snr = torch.linspace(6.0, -6.0, 120, dtype=torch.float64)
    assert cluster_snr(torch.exp(log_snr), 6, "log_snr") == uniform_clusters(120, 6)
    assert cluster_snr(torch.exp(log_snr.flip(0)), 4, "log_snr") == uniform_clusters(120, 4)


def test_log_snr_nudges_empty_bins():
    # Most of the log-SNR range sits in the last two steps: bins there would be empty without the nudge.
    log_snr = torch.cat([torch.linspace(0.0, -1.0, 8, dtype=torch.float64), torch.tensor([-50.0, -100.0])])
    clusters = cluster_snr(torch.exp(log_snr), 5, "log_snr")
    assert_partition(clusters, 10, 5)


@pytest.mark.parametrize("N", [0, -1, 11])
def test_bad_num_clusters(N):
    with pytest.raises(ValueError, match="num_clusters"):
        cluster_timesteps(DDPMSchedule(betas=torch.linspace(0.01, 0.2, 10, dtype=torch.float64)), N)


def test_bad_inputs():
    sched = DDPMSchedule(100, "cosine")
    with pytest.raises(ValueError, match="unknown clustering method 'quantile'"):
        cluster_timesteps(sched, 4, "quantile")
    with pytest.raises(ValueError, match="monotone"):
        cluster_snr(torch.tensor([1.0, 3.0, 2.0]), 2)
    with pytest.raises(ValueError, match="finite"):
        cluster_snr(torch.tensor([float("inf"), 3.0, 2.0]), 2)
    with pytest.raises(ValueError, match="positive"):
        cluster_snr(torch.tensor([3.0, 2.0, 0.0]), 2)
    with pytest.raises(ValueError, match="grid"):
        cluster_timesteps(EDMGrid(), 2)
    with pytest.raises(ValueError, match="num_clusters must be an int"):
        cluster_timesteps(sched, 2.0)
    with pytest.raises(ValueError, match="contiguous"):
        check_clusters([(0, 5), (6, 10)], 10)
    with pytest.raises(ValueError, match="cover"):
        check_clusters([(0, 5), (5, 9)], 10)


# ---- the default clustering of the paper's schedules, against an independent interval DP ----------------------


def _np_log_snr(beta_schedule, T=1000):
    """log SNR_t = log(abar_t / (1 - abar_t)) in float64 numpy, betas written out from DDPM / IDDPM."""
    import numpy as np

    if beta_schedule == "linear":  # Ho et al. (DiT / IDDPM scaled to T): linspace(1e-4, 0.02) at T = 1000
        betas = np.linspace(1000 / T * 1e-4, 1000 / T * 0.02, T, dtype=np.float64)
    else:  # Nichol & Dhariwal Eq. 17, s = 0.008, betas clipped at 0.999
        f = lambda x: np.cos((x / T + 0.008) / 1.008 * np.pi / 2) ** 2  # noqa: E731
        i = np.arange(T, dtype=np.float64)
        betas = np.minimum(1 - f(i + 1) / f(i), 0.999)
    abar = np.cumprod(1 - betas)
    return np.log(abar) - np.log1p(-abar)


def _np_interval_dp(v, n_clusters):
    """Contiguous clustering of monotone v minimising sum_k sum_{i in I_k} |v_i - median(I_k)|: O(N T^2) DP."""
    import numpy as np

    T = len(v)
    cost = np.full((T + 1, T + 1), np.inf)
    for lo in range(T):
        s = v[lo:]
        P = np.concatenate([[0.0], np.cumsum(s)])
        n = np.arange(1, T - lo + 1)  # interval lengths
        m = n // 2  # a middle element: every point between the two middles has the same L1 cost
        sm = s[m]
        cost[lo, lo + 1 :] = np.abs(P[n] - P[m] - (n - m) * sm) + np.abs(m * sm - P[m])  # monotone: one sign per side
    best = cost[0].copy()  # one cluster ending at r
    back = []
    for _ in range(1, n_clusters):
        total = best[:, None] + cost  # split l x end r
        back.append(total.argmin(axis=0))
        best = total.min(axis=0)
    bounds = [T]
    for arg in reversed(back):
        bounds.append(int(arg[bounds[-1]]))
    bounds = [0] + bounds[::-1] if bounds[-1] != 0 else bounds[::-1]
    return [(bounds[k], bounds[k + 1]) for k in range(len(bounds) - 1)], float(best[T]), cost


@pytest.mark.parametrize("beta_schedule", ["linear", "cosine"])
def test_default_snr_clusters_of_ddpm1000_match_independent_dp(beta_schedule):
    import numpy as np

    v = _np_log_snr(beta_schedule)
    sched = DDPMSchedule(1000, beta_schedule)
    np.testing.assert_allclose(sched.log_snr(torch.arange(1000)).numpy(), v, rtol=1e-9, atol=1e-9)
    assert np.all(np.diff(v) < 0)  # monotone: the one-sign-per-side cost above holds
    want, total, cost = _np_interval_dp(v, 20)
    rng = np.random.default_rng(0)  # the cost against a brute-force median deviation on random intervals
    spans = [(0, 1), (0, 2), (3, 10), (0, 1000), *(sorted(rng.choice(1001, 2, replace=False)) for _ in range(20))]
    for lo, hi in spans:
        assert cost[lo, hi] == pytest.approx(np.abs(v[lo:hi] - np.median(v[lo:hi])).sum(), rel=1e-9, abs=1e-9)
    got = cluster_timesteps(sched, 20)  # the default method
    assert got == cluster_timesteps(sched, 20, "snr")
    assert got == want, (got, want)
    assert sum(cost[lo, hi] for lo, hi in got) == pytest.approx(total, rel=1e-12)
    sizes = [hi - lo for lo, hi in got]
    assert max(sizes) < 150, sizes  # plain SNR would give [1, 1, ..., 123, 737]
