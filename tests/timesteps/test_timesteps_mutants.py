"""Pinned values for the composition of timestep samplers and its helpers (``timesteps/base.py``, ``build.py``,
``curriculum.py``, ``lognormal.py``), written against the survivors of the mutation run (docs/mutation.md).

Each number is computed here by hand from the rule in the module docs on tiny inputs: the patience pacing's unlock
step and weights (``curriculum/pacing.py``: improved iff EMA < best - min_delta |best|, next cluster after
``patience`` evaluations without improvement, the stage reset at an unlock), the product's float64-then-float32
weights and its correction u / p, the log-normal cell masses, the exact error messages of bad arguments, the device
the composition lives on ("meta" stands for a second device on a CPU-only machine), and the distributed helpers over
two fake ranks.
"""

import math
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist

from diffcurr_fast.curriculum.pacing import Curriculum
from diffcurr_fast.diffusion import DDPMSchedule, EDMFormulation, FlowFormulation
from diffcurr_fast.runs.config import CurriculumConfig, TimestepsConfig
from diffcurr_fast.timesteps import base
from diffcurr_fast.timesteps.base import Fixed, Product, TimestepSampler, all_gather_cat, all_reduce_mean, range_mask
from diffcurr_fast.timesteps.build import build_curriculum, build_timesteps
from diffcurr_fast.timesteps.curriculum import CurriculumMask
from diffcurr_fast.timesteps.lognormal import LogNormal, cell_log_snr, lognormal_cell_mass

NAN = math.nan
META = torch.device("meta")


def _phi(x):
    """The standard normal CDF."""
    return 0.5 * (1.0 + math.erf(x / math.sqrt(2.0)))


class _Unbiased(Fixed):
    """Constant weights that are importance-corrected (as ``importance`` is)."""

    unbiased = True


class _Probing(TimestepSampler):
    name = "probing"

    def probe(self, step):
        return torch.tensor([0]), 1, step


class _Stateful(TimestepSampler):
    name = "stateful"

    def state_dict(self):
        return {"n": 1}


class _Recorder(TimestepSampler):
    """Keeps what ``observe`` receives."""

    def __init__(self, num_cells):
        super().__init__(num_cells)
        self.seen = []

    def observe(self, k, per_sample_loss, step=None, ok=None):
        self.seen.append((k.tolist(), per_sample_loss.tolist(), step, ok))


class _Changing(TimestepSampler):
    """Weights that are a new tensor object after ``set``."""

    def __init__(self, w):
        super().__init__(w.numel())
        self._w = w

    def set(self, w):
        self._w = w

    def weights(self):
        return self._w


@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(old)


# ---- range_mask and Fixed -----------------------------------------------------------------------------------------
def test_range_mask_is_the_float32_indicator_of_lo_to_hi_and_named_range():
    m = range_mask(5, (0, 2))  # lo = 0 is allowed
    assert m.name == "range" and m.num_cells == 5
    assert m.weights().dtype == torch.float32 and m.weights().tolist() == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert range_mask(5, (1, 3)).weights().tolist() == [0.0, 1.0, 1.0, 0.0, 0.0]
    assert range_mask(5, (4, 5)).weights().tolist() == [0.0, 0.0, 0.0, 0.0, 1.0]
    # alone in a product, the indicator is passed through unchanged (one non-uniform factor)
    assert Product([range_mask(4, (1, 3))]).weights().tolist() == [0.0, 1.0, 1.0, 0.0]
    assert Fixed(torch.ones(3), "prior").name == "prior"


def test_range_mask_rejects_bad_ranges_with_their_messages():
    with pytest.raises(ValueError, match=re.escape("timestep_range must be a (lo, hi) pair of ints, got 'ab'")):
        range_mask(5, "ab")
    for bad in [(2, 2), (3, 2), (-1, 2), (0, 6)]:
        with pytest.raises(ValueError, match=re.escape(f"timestep_range {bad!r} must satisfy 0 <= lo < hi <= 5")):
            range_mask(5, bad)


def test_float32_weights_under_a_float64_default_dtype(float64_default):
    """The documented float32 of the range indicator, the product's uniform weights and the curriculum mask (the
    curriculum's float32 weights, zero-padded) do not follow torch's default dtype."""
    m = range_mask(4, (1, 3)).weights()
    assert m.dtype == torch.float32 and m.tolist() == [0.0, 1.0, 1.0, 0.0]
    w = Product([TimestepSampler(4)]).weights()
    assert w.dtype == torch.float32 and w.tolist() == [0.25] * 4
    cur = Curriculum([(0, 2), (2, 4)], 4)
    cm = CurriculumMask(cur, 6, 1).weights()
    assert cm.dtype == torch.float32 and cm.tolist() == [0.0, 0.0, 0.0, 0.5, 0.5, 0.0]


# ---- Product ------------------------------------------------------------------------------------------------------
def test_product_argument_errors_have_their_messages():
    with pytest.raises(ValueError, match=r"^Product needs at least one sampler$"):
        Product([])
    with pytest.raises(ValueError, match=r"^the samplers of a product must share their number of cells, got \[3, 4\]$"):
        Product([TimestepSampler(4), TimestepSampler(3)])


def test_product_of_uniform_factors_is_one_over_g():
    w = Product([TimestepSampler(4), TimestepSampler(4)]).weights()
    assert w.dtype == torch.float32 and w.tolist() == [0.25] * 4


def test_product_weights_are_float32_for_one_float64_factor_and_for_several():
    one = Product([Fixed(torch.tensor([1.0, 3.0], dtype=torch.float64), "prior")]).weights()
    assert one.dtype == torch.float32 and one.tolist() == [1.0, 3.0]  # passed through, not renormalised
    two = Product(
        [Fixed(torch.tensor([1.0, 3.0], dtype=torch.float64), "prior"), Fixed(torch.tensor([2.0, 2.0]), "b")]
    ).weights()
    assert two.dtype == torch.float32 and two.tolist() == [0.25, 0.75]
    lw = Product([_Unbiased(torch.tensor([1.0, 3.0]), "u")]).loss_weights(torch.tensor([0, 1]))
    assert lw.dtype == torch.float32 and lw.tolist() == [2.0, float(np.float32(2 / 3))]  # u = 1/2, p = (1/4, 3/4)


def test_product_lives_on_its_device():
    """Every branch of the composition builds on ``device`` (meta here, a second device on any machine)."""
    assert Product([TimestepSampler(4)], "meta").device == META
    assert Product([TimestepSampler(4)], "meta").weights().device == META  # all uniform
    assert Product([range_mask(4, (1, 3))], "meta").weights().device == META  # one factor
    two = Product([range_mask(4, (1, 3)), Fixed(torch.tensor([1.0, 2.0, 3.0, 4.0]), "b")], "meta")
    assert two.weights().device == META  # a normalised product
    ub = Product([_Unbiased(torch.tensor([1.0, 2.0, 3.0, 4.0]), "u"), range_mask(4, (1, 3))], "meta")
    assert ub.weights().device == META and ub.loss_weights(torch.tensor([1, 2])).device == META
    ts = build_timesteps(TimestepsConfig(), DDPMSchedule(4, "cosine"), 4, device="meta")
    assert ts.device == META and ts.weights().device == META


def test_product_cache_is_rebuilt_when_a_later_factor_changes():
    """Same number of sources, the first one the same object: the product must still follow the second."""
    ch = _Changing(torch.tensor([1.0, 1.0, 0.0, 0.0]))
    ts = Product([range_mask(4, (0, 3)), ch])
    assert ts.weights().tolist() == [0.5, 0.5, 0.0, 0.0]
    ch.set(torch.tensor([0.0, 1.0, 1.0, 1.0]))
    assert ts.weights().tolist() == [0.0, 0.5, 0.5, 0.0]


@pytest.mark.parametrize(
    "w",
    [
        [34.0, 3.0, 48.0],  # u = 1/3 in float32 would give 0.8333333731 for 5/6
        [37.0, 3.0, 1.0, 15.0],  # p in float32 would give 13.999999 for 14
        [2124.0, 0.3521728515625],  # sum w in float32 (2124.3521) would give 0.50008285 and 3016.0645
    ],
)
def test_importance_correction_alone_is_formed_in_float64(w):
    """One unbiased factor, nothing else: u uniform, p = w / sum w, correction u_k / p_k = sum w / (G w_k), in
    float64 and cast to float32 once (the values are far from a float32 rounding midpoint)."""
    wt = torch.tensor(w, dtype=torch.float32)
    got = Product([_Unbiased(wt, "u")]).loss_weights(torch.arange(len(w)))
    a = np.asarray(w, dtype=np.float64)
    want = (a.sum() / (len(w) * a)).astype(np.float32)
    assert got.dtype == torch.float32
    np.testing.assert_array_equal(got.numpy(), want)


def test_importance_correction_inside_one_float32_factor_is_formed_in_float64():
    """An unbiased factor times one float32 factor r (a curriculum mask, a range): w = float32(normalised q r);
    p = w / sum w and u = r / sum r in float64; correction float32(u_k / p_k)."""
    q, r = [2.0, 15.0, 48.0], [25.0, 47.0, 29.0]
    ts = Product([_Unbiased(torch.tensor(q), "u"), Fixed(torch.tensor(r), "r")])
    got = ts.loss_weights(torch.arange(3))
    prod = np.asarray(q) * np.asarray(r)
    w = (prod / prod.sum()).astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(ts.weights().numpy(), w.astype(np.float32))
    u = np.asarray(r) / np.sum(r)
    want = (u / (w / w.sum())).astype(np.float32)  # [10.628713, 1.4171618, 0.44286302]
    np.testing.assert_array_equal(got.numpy(), want)


def test_product_forwards_ok_to_every_factor():
    rec = _Recorder(3)
    ok = torch.tensor(False)
    Product([rec]).observe(torch.tensor([1]), torch.tensor([2.0]), 5, ok)
    assert rec.seen == [([1], [2.0], 5, ok)]


def test_product_probe_allows_one_asking_factor():
    assert Product([_Probing(3), TimestepSampler(3)]).probe(7)[2] == 7
    with pytest.raises(ValueError, match=r"^at most one sampler of a product can probe the loss$"):
        Product([_Probing(3), _Probing(3)]).probe(0)


def test_product_load_state_dict_names_both_key_sets():
    ts = Product([_Stateful(3)])
    with pytest.raises(
        ValueError, match=re.escape("timestep sampler state holds ['other'], this run's samplers ['stateful']")
    ):
        ts.load_state_dict({"other": {}})


# ---- the distributed helpers, over two fake ranks -----------------------------------------------------------------
class _Traced(torch.Tensor):
    """Records the arguments of every ``Tensor.to`` call made on it or its results."""

    to_args: list = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.to:
            cls.to_args.append(tuple(args[1:]))
        return super().__torch_function__(func, types, args, kwargs or {})


def _fake_two_ranks(monkeypatch, other):
    """Rank 0 of two; the other rank holds ``other``. Returns the devices ``collective_device`` was asked about."""
    group, asked = object(), []

    class FakeDist:
        ReduceOp = dist.ReduceOp

        @staticmethod
        def get_world_size(g=None):
            assert g is group
            return 2

        @staticmethod
        def all_reduce(buf, op=dist.ReduceOp.SUM, group=None):
            assert op == dist.ReduceOp.SUM
            buf += other

        @staticmethod
        def all_gather(parts, buf, group=None):
            parts[0].copy_(buf)
            parts[1].copy_(other)

    def collective_device(device):
        asked.append(device)
        return torch.device("cpu", 0)  # an explicit device, told apart from x's own ("cpu") in the records

    monkeypatch.setattr(base, "dist", FakeDist)
    monkeypatch.setattr(base, "dist_active", lambda: True)
    monkeypatch.setattr(base, "collective_device", collective_device)
    return group, asked


def test_all_reduce_mean_over_two_ranks(monkeypatch):
    group, asked = _fake_two_ranks(monkeypatch, torch.tensor([3.0, 6.0]))
    x = torch.tensor([1.0, 2.0])
    assert all_reduce_mean(x, group).tolist() == [2.0, 4.0]  # (1 + 3) / 2, (2 + 6) / 2
    assert x.tolist() == [1.0, 2.0]  # reduced in a copy
    _Traced.to_args = []
    all_reduce_mean(x.as_subclass(_Traced), group)
    # to the collective device (asked about x's device) and back to x's device
    assert asked[-1] == torch.device("cpu")
    assert _Traced.to_args == [(torch.device("cpu", 0),), (torch.device("cpu"),)]


def test_all_gather_cat_over_two_ranks(monkeypatch):
    group, asked = _fake_two_ranks(monkeypatch, torch.tensor([3.0, 6.0]))
    assert all_gather_cat(torch.tensor([1.0, 2.0]), group).tolist() == [1.0, 2.0, 3.0, 6.0]  # in rank order
    _Traced.to_args = []
    all_gather_cat(torch.tensor([1.0, 2.0]).as_subclass(_Traced), group)
    assert asked[-1] == torch.device("cpu")
    assert _Traced.to_args == [(torch.device("cpu", 0),), (torch.device("cpu"),)]


# ---- CurriculumMask (curriculum.py, curriculum/pacing.py module doc) ---------------------------------------------
def test_curriculum_mask_patience_pacing_unlocks_at_the_pinned_steps():
    """3 clusters of 2 cells, easy to hard (cluster 2 = cells 4, 5 first); patience 2, eval_every 2, ema 0 (the
    monitored loss is the window mean), min_delta 0.25. Steps are counted by the mask from 0 (no ``step`` given).

    window (steps)  mean   threshold (best - 0.25 best)  improved  bad evals
    0-1             1.0    inf                           yes       0   best 1
    2-3             0.75   0.75 (equal: not below)       no        1
    4-5             0.5    0.75                          yes       0   best 0.5
    6-7             0.5    0.375                         no        1
    8-9             0.375  0.375                         no        2   -> cluster 1 unlocks at step 9; stage reset
    10-11           2.0    inf                           yes       0   best 2
    12-13           1.5    1.5                           no        1
    14-15           1.0    1.5                           yes       0   best 1
    16-17           1.0    0.75                          no        1
    18-19           0.75   0.75                          no        2   -> cluster 0 unlocks at step 19
    """
    cur = Curriculum([(0, 2), (2, 4), (4, 6)], 6, patience=2, eval_every=2, ema=0.0, min_delta=0.25)
    mask = CurriculumMask(cur)
    assert mask.num_cells == 6 and mask.offset == 0
    assert mask.weights().tolist() == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    means = [1.0, 0.75, 0.5, 0.5, 0.375, 2.0, 1.5, 1.0, 1.0, 0.75]
    for i, m in enumerate(means):
        for _ in range(2):
            mask.observe(torch.tensor([4, 5]), torch.tensor([m, m]))
        if i == 1:
            assert cur.best_loss == 1.0 and cur.bad_evals == 1 and cur.history == []
        if i == 4:
            assert cur.history == [9] and cur.unlocked_clusters == [2, 1]
            assert cur.monitored_loss is None and cur.best_loss == math.inf and cur.bad_evals == 0
            assert mask.weights().tolist() == [0.0, 0.0, 0.25, 0.25, 0.25, 0.25]
        if i == 6:
            assert cur.best_loss == 2.0 and cur.bad_evals == 1
    assert cur.history == [9, 19] and cur.finished
    np.testing.assert_allclose(mask.weights().numpy(), np.full(6, 1 / 6), rtol=1e-7, atol=0)


def test_curriculum_mask_counts_steps_from_the_last_given_step():
    """patience 0, eval_every 1: every evaluation unlocks, at the step it is made on; a step not given is the
    previous one plus one (from 0)."""
    cur = Curriculum([(0, 1), (1, 2), (2, 3), (3, 4)], 4, patience=0, eval_every=1, ema=0.0)
    mask = CurriculumMask(cur)
    mask.observe(torch.tensor([3]), torch.tensor([1.0]))
    mask.observe(torch.tensor([3]), torch.tensor([1.0]), 7)
    mask.observe(torch.tensor([3]), torch.tensor([1.0]))
    assert cur.history == [0, 7, 8] and cur.finished


def test_curriculum_mask_skips_masked_steps_in_its_pacing_and_cluster_losses():
    """A step whose ``ok`` is false counts nowhere: not in the window (no evaluation, no unlock), not in the
    cluster sums. patience 0, eval_every 1, 2 clusters of 2 cells; through a product, as the trainer calls it."""
    cur = Curriculum([(0, 2), (2, 4)], 4, patience=0, eval_every=1, ema=0.0)
    ts = Product([CurriculumMask(cur)])
    ts.observe(torch.tensor([2, 3]), torch.tensor([8.0, 8.0]), 0, torch.tensor(False))
    assert cur.history == [] and ts.weights().tolist() == [0.0, 0.0, 0.5, 0.5]
    ts.observe(torch.tensor([2, 3]), torch.tensor([2.0, 4.0]), 1, torch.tensor(True))
    assert cur.history == [1]  # the window of step 1 alone: mean 3; cluster 1: (2 + 4) / 2
    torch.testing.assert_close(cur.cluster_losses(), torch.tensor([NAN, 3.0], dtype=torch.float64), equal_nan=True)
    assert ts.weights().tolist() == [0.25] * 4


def test_curriculum_mask_placement_on_the_cells():
    cur = Curriculum([(0, 2), (2, 4)], 4)  # patience pacing: cluster 1 (cells 2, 3) first
    assert CurriculumMask(cur).weights() is cur.timestep_weights()
    assert CurriculumMask(cur, 6).weights().tolist() == [0.0, 0.0, 0.5, 0.5, 0.0, 0.0]  # offset 0 of 6 cells
    assert CurriculumMask(cur, 6, 1).weights().tolist() == [0.0, 0.0, 0.0, 0.5, 0.5, 0.0]
    assert CurriculumMask(cur, 6, 2).weights().tolist() == [0.0, 0.0, 0.0, 0.0, 0.5, 0.5]
    with pytest.raises(ValueError, match=r"^a curriculum on 4 cells does not fit at offset 3 of 6 cells$"):
        CurriculumMask(cur, 6, 3)
    with pytest.raises(ValueError, match=r"^a curriculum on 4 cells does not fit at offset 1 of 4 cells$"):
        CurriculumMask(cur, None, 1)


# ---- build_curriculum / build_timesteps ---------------------------------------------------------------------------
def test_build_curriculum_on_a_range_of_ddpm_cells_clusters_the_range():
    """DDPM, 8 cells, range [1, 8): 3 uniform clusters of the 7 cells, sizes 3, 2, 2."""
    c = CurriculumConfig(num_clusters=3, method="uniform")
    cur = build_curriculum(c, DDPMSchedule(8, "cosine"), 8, (1, 8))
    assert cur.clusters == [(0, 3), (3, 5), (5, 7)] and cur.num_timesteps == 7


def test_build_curriculum_caps_the_clusters_at_the_ranges_cells():
    c = CurriculumConfig(num_clusters=4, method="uniform")
    cur = build_curriculum(c, DDPMSchedule(8, "cosine"), 8, (2, 5))
    assert cur.clusters == [(0, 1), (1, 2), (2, 3)]


def test_build_curriculum_on_a_range_of_flow_cells_uses_the_flows_grid():
    """Flow, 8 cells, t_k = (k + 0.5) / 8; range [2, 6): t = 5/16, 7/16, 9/16, 11/16, log SNR = 2 ln((1 - t) / t)
    = 2 ln(11/5), 2 ln(9/7), -2 ln(9/7), -2 ln(11/5) = +-1.5769, +-0.5026. log_snr clustering, 3 clusters: equal
    widths of [-1.5769, 1.5769], interior edges -+0.5256; ascending, the cuts fall at 1 and 3 -> [0, 1, 3, 4],
    mirrored for log SNR falling in t -> [(0, 1), (1, 3), (3, 4)]."""
    c = CurriculumConfig(num_clusters=3, method="log_snr")
    cur = build_curriculum(c, FlowFormulation(), 8, (2, 6))
    assert cur.clusters == [(0, 1), (1, 3), (3, 4)] and cur.num_timesteps == 4


def test_build_curriculum_passes_order_and_adaptive_floor():
    """DDPM, 4 cells, 2 uniform clusters; hard to easy: cluster 0 (cells 0, 1) first."""
    c = CurriculumConfig(num_clusters=2, method="uniform", order="hard_to_easy")
    cur = build_curriculum(c, DDPMSchedule(4, "cosine"), 4, None)
    assert cur.order == "hard_to_easy"
    assert build_timesteps(TimestepsConfig(), DDPMSchedule(4, "cosine"), 4, cur).weights().tolist() == [
        0.5,
        0.5,
        0.0,
        0.0,
    ]


def test_build_curriculum_adaptive_weights_with_a_floor_of_a_quarter():
    """Adaptive pacing, patience 0, eval_every 1, ema 0.5 (slow decay 0.75), floor 0.25, 2 clusters of 2 cells.
    After the step-2 evaluation: cluster 0 fast 6, slow 7 (progress 1/7); cluster 1 fast 2.5, slow 3.125 (1/5):
    p = 0.25 x (1/2, 1/2) + 0.75 x (5/12, 7/12) = (0.4375, 0.5625), halved per cell."""
    c = CurriculumConfig(
        num_clusters=2, method="uniform", pacing="adaptive", patience=0, eval_every=1, ema=0.5, adaptive_floor=0.25
    )
    form = DDPMSchedule(4, "cosine")
    cur = build_curriculum(c, form, 4, None)
    assert cur.adaptive_floor == 0.25
    ts = build_timesteps(TimestepsConfig(), form, 4, cur)
    ts.observe(torch.tensor([2, 3]), torch.tensor([4.0, 4.0]), 0)  # cluster 1: 4; unlocks cluster 0
    ts.observe(torch.tensor([0, 1, 2, 3]), torch.tensor([8.0, 8.0, 2.0, 2.0]), 1)
    ts.observe(torch.tensor([0, 1, 2, 3]), torch.tensor([4.0, 4.0, 2.0, 2.0]), 2)
    assert ts.weights().tolist() == [0.21875, 0.21875, 0.28125, 0.28125]


def test_build_timesteps_names_its_fixed_factors():
    ts = build_timesteps(TimestepsConfig(), EDMFormulation(), 4, timestep_range=(1, 3))
    assert [p.name for p in ts.parts] == ["prior", "uniform", "range"]


# ---- lognormal (lognormal.py module doc) --------------------------------------------------------------------------
def test_lognormal_cell_mass_pinned_for_falling_and_rising_log_snr():
    """Edges: the midpoints, +-inf outside; mass of N(1, 2^2) between them, not normalised."""
    want = [1.0 - _phi(0.0), _phi(0.0) - _phi(-1.0), _phi(-1.0)]  # falling: edges inf, 1, -1, -inf
    got = lognormal_cell_mass(torch.tensor([2.0, 0.0, -2.0], dtype=torch.float64), 1.0, 2.0)
    assert got.dtype == torch.float64
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-12)
    got = lognormal_cell_mass(torch.tensor([-2.0, 0.0, 2.0], dtype=torch.float64), 1.0, 2.0)
    np.testing.assert_allclose(got.numpy(), want[::-1], rtol=1e-12)  # rising: edges -inf, -1, 1, inf


def test_lognormal_cell_mass_on_one_and_two_cells():
    """Two rising cells -1, 1 under N(0.5, 1): edges -inf, 0, inf. One cell holds all the mass."""
    got = lognormal_cell_mass(torch.tensor([-1.0, 1.0], dtype=torch.float64), 0.5, 1.0)
    np.testing.assert_allclose(got.numpy(), [_phi(-0.5), 1.0 - _phi(-0.5)], rtol=1e-12)
    assert lognormal_cell_mass(torch.tensor([0.3], dtype=torch.float64), 0.0, 1.0).tolist() == [1.0]


def test_lognormal_defaults_are_mean_0_std_2():
    s = LogNormal(torch.tensor([2.0, 0.0, -2.0], dtype=torch.float64))
    assert (s.mean, s.std) == (0.0, 2.0)
    want = [1.0 - _phi(0.5), _phi(0.5) - _phi(-0.5), _phi(-0.5)]  # edges +-1 over std 2
    np.testing.assert_allclose(s.weights().numpy(), want, rtol=1e-12)


def test_lognormal_std_must_be_positive():
    x = torch.tensor([1.0, -1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match=r"^timesteps.lognormal_std must be > 0, got 0.0$"):
        LogNormal(x, 0.0, 0.0)
    s = LogNormal(x, 0.0, 0.5)  # edges inf, 0, -inf
    np.testing.assert_allclose(s.weights().numpy(), [0.5, 0.5], rtol=1e-12)


def test_lognormal_from_config_takes_mean_and_std():
    """Flow, 2 cells: t = 1/4, 3/4, log SNR = +-2 ln 3, edge 0; mean -1, std 1: masses 1 - Phi(1), Phi(1)."""
    t = TimestepsConfig(sampler="lognormal", lognormal_mean=-1.0, lognormal_std=1.0)
    s = LogNormal.from_config(t, FlowFormulation(), 2)
    assert (s.mean, s.std) == (-1.0, 1.0)
    np.testing.assert_allclose(s.weights().numpy(), [1.0 - _phi(1.0), _phi(1.0)], rtol=1e-12)


def test_cell_log_snr_is_float64_for_any_formulation():
    form = SimpleNamespace(cell_grid=lambda n: None, log_snr=lambda t: (-t).to(torch.float32))
    got = cell_log_snr(form, 3)
    assert got.dtype == torch.float64 and got.tolist() == [0.0, -1.0, -2.0]
