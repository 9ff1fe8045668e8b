"""Post-hoc EMA (EDM2, Karras et al. 2024) on hand-made inputs: the profiles' inner product against its integral,
the bisection for gamma, the least-squares coefficients against the normal equations solved by hand, the snapshot
files (name, metadata, listing order) and the reconstruction from a few hand-written snapshots."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch
from safetensors import safe_open

from diffcurr_fast.optim.registry import PHEMA_SIGMA_REL_MAX
from diffcurr_fast.runs.posthoc_ema import (
    list_snapshots,
    profile_dot,
    reconstruct,
    sigma_rel_to_gamma,
    snapshot_path,
    solve_coefficients,
    write_snapshot,
)


# ---- the profiles ------------------------------------------------------------------------------------------------
def _dot_by_hand(t_a: float, g_a: float, t_b: float, g_b: float) -> float:
    """int_0^min(t_a, t_b) p_a p_b dtau with p = (g + 1) tau^g / t^(g + 1), integrated by hand:
    (g_a + 1)(g_b + 1) m^(g_a + g_b + 1) / ((g_a + g_b + 1) t_a^(g_a + 1) t_b^(g_b + 1)), m = min(t_a, t_b)."""
    m = min(t_a, t_b)
    return (g_a + 1) * (g_b + 1) * m ** (g_a + g_b + 1) / ((g_a + g_b + 1) * t_a ** (g_a + 1) * t_b ** (g_b + 1))


def _dot_by_quadrature(t_a: float, g_a: float, t_b: float, g_b: float, n: int = 200_000) -> float:
    """The same integral by the midpoint rule in float64."""
    m = min(t_a, t_b)
    tau = (torch.arange(n, dtype=torch.float64) + 0.5) * (m / n)
    p_a = (g_a + 1) * tau**g_a / t_a ** (g_a + 1)
    p_b = (g_b + 1) * tau**g_b / t_b ** (g_b + 1)
    return float((p_a * p_b).sum() * (m / n))


@pytest.mark.parametrize(
    "t_a, g_a, t_b, g_b",
    [(100.0, 6.94, 100.0, 16.97), (40.0, 6.94, 100.0, 16.97), (100.0, 6.94, 40.0, 16.97), (3.0, 0.0, 7.0, 2.5)],
)
def test_profile_dot_is_the_integral_of_the_product_of_the_two_profiles(t_a, g_a, t_b, g_b):
    """EDM2 Appendix C.2: the closed form, in float64 from plain Python numbers, equals the integral."""
    got = profile_dot(t_a, g_a, t_b, g_b)
    assert got.dtype == torch.float64
    assert float(got) == pytest.approx(_dot_by_hand(t_a, g_a, t_b, g_b), rel=1e-12)
    assert float(got) == pytest.approx(_dot_by_quadrature(t_a, g_a, t_b, g_b), rel=1e-6)
    assert float(profile_dot(t_b, g_b, t_a, g_a)) == pytest.approx(float(got), rel=1e-12)  # symmetric


def test_profile_dot_broadcasts():
    t_a, g_a = torch.tensor([[10.0], [30.0]]), torch.tensor([[1.0], [4.0]])
    t_b, g_b = torch.tensor([[20.0, 30.0, 5.0]]), torch.tensor([[2.0, 4.0, 0.5]])
    got = profile_dot(t_a, g_a, t_b, g_b)
    assert got.shape == (2, 3) and got.dtype == torch.float64
    for i in range(2):
        for j in range(3):
            want = _dot_by_hand(float(t_a[i, 0]), float(g_a[i, 0]), float(t_b[0, j]), float(g_b[0, j]))
            assert float(got[i, j]) == pytest.approx(want, rel=1e-12), (i, j)


def _excess(gamma: float, sigma_rel: float) -> float:
    """sigma_rel(gamma)^2 - sigma_rel^2 in float64 (EDM2 eq. 3): positive below the root, negative above."""
    return (gamma + 1.0) / ((gamma + 2.0) ** 2 * (gamma + 3.0)) - sigma_rel * sigma_rel


def test_sigma_rel_to_gamma_is_the_better_end_of_the_last_bisection_bracket():
    """Bisection to the last bit: the result and its neighbour float on the other side of the root (the float64
    residual of eq. 3 changes sign between them) form the final bracket, and the result is the end with the smaller
    residual (either on a tie; a residual of exactly 0 is a root). Over many sigma_rel, both ends win
    some of the time."""
    gen = torch.Generator().manual_seed(0)
    sigmas = [0.05, 0.07, 0.1, 0.2, 0.28] + (
        1e-3 + 0.287 * torch.rand(300, generator=gen, dtype=torch.float64)
    ).tolist()
    ends = set()
    for s in sigmas:
        g = sigma_rel_to_gamma(s)
        e = _excess(g, s)
        if e > 0.0:  # below the root: the float above is past it and no closer
            other = _excess(math.nextafter(g, math.inf), s)
            assert other <= 0.0 and abs(e) <= abs(other), s
            ends.add("lo")
        elif e < 0.0:  # above the root: the float below is before it and no closer
            other = _excess(math.nextafter(g, -math.inf), s)
            assert other >= 0.0 and abs(e) <= abs(other), s
            ends.add("hi")
    assert ends == {"lo", "hi"}


def test_the_largest_sigma_rel_is_the_running_mean_exactly():
    """sigma_rel = 12^-1/2 (``PHEMA_SIGMA_REL_MAX``) is gamma = 0, the running mean, not a float next to it."""
    assert sigma_rel_to_gamma(PHEMA_SIGMA_REL_MAX) == 0.0


# ---- the least-squares coefficients ------------------------------------------------------------------------------
def test_solve_coefficients_solves_the_normal_equations_then_sums_to_one():
    """Two snapshots (t 50.3, gamma 6.94; t 100, gamma 16.97) and the target (t 100, gamma of sigma_rel 0.07): the
    2x2 system A x = b written out by hand (Cramer's rule) in float64, then scaled to sum to 1. The lists of Python
    floats are taken in float64 (float32 would move the result by about 1e-8)."""
    ts, gs = [50.3, 100.0], [6.94, 16.97]
    tt, gt = 100.0, sigma_rel_to_gamma(0.07)
    a = [[_dot_by_hand(ts[i], gs[i], ts[j], gs[j]) for j in range(2)] for i in range(2)]
    b = [_dot_by_hand(ts[i], gs[i], tt, gt) for i in range(2)]
    det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    x = [(b[0] * a[1][1] - a[0][1] * b[1]) / det, (a[0][0] * b[1] - a[1][0] * b[0]) / det]
    assert abs(sum(x) - 1.0) > 1e-3  # the scaling matters here
    got = solve_coefficients(ts, gs, tt, gt)
    assert got.dtype == torch.float64 and got.shape == (2,)
    assert got.tolist() == pytest.approx([v / sum(x) for v in x], rel=1e-12)


def test_a_profile_listed_twice_gets_half_of_the_weight_each():
    """Rank-deficient: the minimum-norm solution splits the weight evenly."""
    got = solve_coefficients([100, 100], [6.94, 6.94], 100, 16.97)
    assert got.tolist() == pytest.approx([0.5, 0.5], abs=1e-12)


@pytest.mark.parametrize("t_i, gamma_i, counts", [([], [], "0 and 0"), ([10, 20], [1.0], "2 and 1")])
def test_solve_coefficients_refuses_no_snapshots_or_unpaired_lists(t_i, gamma_i, counts):
    with pytest.raises(ValueError, match=rf"needs as many times as exponents \(>= 1\), got {counts}$"):
        solve_coefficients(t_i, gamma_i, 10, 1.0)


# ---- snapshot files ----------------------------------------------------------------------------------------------
def _meta(path) -> dict:
    with safe_open(str(path), "pt") as f:
        return {k: json.loads(v) for k, v in f.metadata().items()}


def test_write_snapshot_names_the_file_and_records_its_profile(tmp_path):
    """The run directory need not exist yet; the file is phema/phema-<step:08d>-<sigma_rel>.safetensors with the
    step, t, sigma_rel, gamma and buffer names beside the given metadata."""
    run = tmp_path / "new" / "run"
    path = write_snapshot(run, 12, 0.07, 10, {"w": torch.ones(3), "n": torch.tensor(4)}, ["n"], {"config": {"a": 1}})
    assert path == run / "phema" / "phema-00000012-0.07.safetensors" and path.is_file()
    assert _meta(path) == {
        "config": {"a": 1},
        "step": 12,
        "t": 10,
        "sigma_rel": 0.07,
        "gamma": sigma_rel_to_gamma(0.07),
        "buffers": ["n"],
    }
    assert snapshot_path(run, 123456789, 0.1).name == "phema-123456789-0.1.safetensors"


def test_list_snapshots_reads_the_metadata_and_orders_by_step_then_sigma_rel(tmp_path):
    """Numeric order where the names sort otherwise (a ninth digit, 1e-05 against 0.05); other files, a folder with
    a snapshot's name and an unfinished write are not snapshots."""
    assert list_snapshots(tmp_path) == [] and list_snapshots(tmp_path / "missing") == []
    sd = {"w": torch.zeros(2)}
    for step, s, t in [(100_000_000, 0.05, 99_999_990), (99_999_999, 0.05, 99_999_989), (99_999_999, 1e-05, 7)]:
        write_snapshot(tmp_path, step, s, t, sd, [], {})
    d = tmp_path / "phema"
    (d / "README.txt").write_text("mine")  # sorts before the snapshots
    (d / "phema-00000001-0.1.safetensors").mkdir()
    (d / "phema-00000002-0.1.safetensors.tmp").write_bytes(b"")
    (d / "zz.txt").write_text("mine")
    got = list_snapshots(tmp_path)
    assert [(s.step, s.t, s.sigma_rel) for s in got] == [
        (99_999_999, 7, 1e-05),
        (99_999_999, 99_999_989, 0.05),
        (100_000_000, 99_999_990, 0.05),
    ]
    assert [s.gamma for s in got] == [sigma_rel_to_gamma(s.sigma_rel) for s in got]
    assert [s.path for s in got] == [snapshot_path(tmp_path, s.step, s.sigma_rel) for s in got]


# ---- reconstruction ----------------------------------------------------------------------------------------------
@pytest.fixture
def hand_run(tmp_path):
    """Snapshots of sigma_rel 0.1 at steps 1, 2, 4 and 6 with t = 0, 1, 2, 3 (the first steps skipped): a float
    parameter "w", an int64 buffer "n", a float16 buffer "h" and an int32 tensor "k" that is no buffer."""
    gen = torch.Generator().manual_seed(5)
    files = {}
    for step, t in [(1, 0), (2, 1), (4, 2), (6, 3)]:
        sd = {
            "w": torch.randn(4096, generator=gen) * 10,
            "n": torch.tensor([step, -step]),
            "h": torch.tensor([0.1 * step, 1.0 + step], dtype=torch.float16),
            "k": torch.tensor([3 * step], dtype=torch.int32),
        }
        write_snapshot(tmp_path, step, 0.1, t, sd, ["n", "h"], {})
        files[step] = sd
    return tmp_path, files


def test_reconstruct_combines_the_snapshots_with_the_solved_coefficients(hand_run):
    """At the newest step (6, t 3) from the snapshots with t > 0: the coefficients of the normal equations, the
    parameters summed in float64 (in the snapshots' order) and returned in float32; buffers and other non-float
    tensors are the target step's, as they are."""
    run, files = hand_run
    gamma = sigma_rel_to_gamma(0.07)
    state, how = reconstruct(run, 0.07)
    assert (how.step, how.t, how.sigma_rel) == (6, 3, 0.07)
    assert [(s.step, s.t) for s in how.snapshots] == [(2, 1), (4, 2), (6, 3)]  # the t = 0 snapshot has no profile
    g = sigma_rel_to_gamma(0.1)
    want_x = solve_coefficients([1, 2, 3], [g, g, g], 3, gamma)
    assert how.coefficients.tolist() == pytest.approx(want_x.tolist(), rel=1e-12, abs=1e-15)
    want = 0.0
    for step, x in zip((2, 4, 6), how.coefficients.tolist()):
        want = want + x * files[step]["w"].double()
    assert state["w"].dtype == torch.float32 and torch.equal(state["w"], want.float())
    for key in ("n", "h", "k"):
        assert state[key].dtype == files[6][key].dtype and torch.equal(state[key], files[6][key]), key
    assert sorted(state) == ["h", "k", "n", "w"]


def test_reconstruct_at_a_snapshot_step_uses_it(hand_run):
    run, files = hand_run
    state, how = reconstruct(run, 0.07, step=4)
    assert (how.step, how.t) == (4, 2) and [s.step for s in how.snapshots] == [2, 4]
    assert torch.equal(state["n"], files[4]["n"])
    state, how = reconstruct(run, 0.1, step=5)
    assert (how.step, how.t) == (4, 2) and how.coefficients.tolist() == pytest.approx([0.0, 1.0], abs=1e-9)


def test_reconstruct_refusals_name_the_run_directory(hand_run, tmp_path_factory):
    run, _ = hand_run
    with pytest.raises(
        ValueError, match=r"has no post-hoc EMA snapshot at or before step 0 \(the first is of step 1\)"
    ):
        reconstruct(run, 0.07, step=0)
    with pytest.raises(
        ValueError, match=rf"^run directory {re.escape(repr(str(run)))} has no post-hoc EMA snapshot at or before"
    ):
        reconstruct(run, 0.07, step=0)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(
        ValueError, match=rf"^run directory {re.escape(repr(str(empty)))} has no post-hoc EMA snapshots under phema/"
    ):
        reconstruct(empty, 0.07)
    with pytest.raises(ValueError, match="sigma_rel must lie in"):
        reconstruct(run, 0.3)
