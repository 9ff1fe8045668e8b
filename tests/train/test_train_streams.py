"""Every random stream of a training step differs between steps, micro-batches and ranks, and repeats with the seed:
the timestep cells, the noise seeds, the points inside continuous cells, token routing's kept sets, label dropout,
SRA's teacher gaps, immiscible noise's assignment and the data each rank reads (train/loop.py: one generator per rank,
seeded with engine.seed and the rank, and torch's global RNG; everything else is drawn from them).

A rank is played in one process by the single-process engine with another rank and world size (``RankStandIn``):
nothing a step draws depends on the other ranks, so its draws are those the rank draws under torchrun
(tests/train/test_two_ranks.py and test_train_timesteps.py compare real gloo ranks)."""

import numpy as np
import pytest
import torch
from conftest import tiny

from diffcurr_fast.data.loader import EpochBatchSampler
from diffcurr_fast.data.order import flip_decisions
from diffcurr_fast.models import routing as routing_module
from diffcurr_fast.models.dit import LabelEmbedder
from diffcurr_fast.objective import Objective
from diffcurr_fast.terms import immiscible as immiscible_module
from diffcurr_fast.terms.sra import SRA
from diffcurr_fast.train import loop
from diffcurr_fast.train.engine import Engine
from diffcurr_fast.train.loop import Trainer

pytestmark = pytest.mark.usefixtures("one_thread")

SETS = (
    "diffusion.formulation=flow",
    "diffusion.prediction=velocity",
    "diffusion.learn_sigma=false",
    "diffusion.weighting=none",
    "logging.sampler=euler",
    "model.depth=3",
    "model.routing=tread",
    "model.routing_start=1",
    "model.routing_end=2",
    "model.routing_keep=0.5",
    "model.class_dropout_prob=0.5",
    "terms.use=[sra]",
    "terms.immiscible=true",
    "optim.grad_accum_steps=2",
    "data.batch_size=32",  # 8 samples per micro-batch on each of 2 ranks
    "engine.cpu_threads=1",
)
STEPS, ACCUM = 3, 2
STREAMS = ("cells", "noise_seed", "cell_points", "route", "label_dropout", "sra_gap", "immiscible", "data")


class RankStandIn(Engine):
    """The single-process engine as rank ``rank`` of ``world`` (no communication: each rank trains alone)."""

    def __init__(self, rank: int, world: int = 2):
        super().__init__("cpu")
        self.rank, self.world_size = rank, world

    def gather_objects(self, obj):
        return [obj] * self.world_size


def _draws(run_dir, rank: int, seed: int) -> dict:
    """{stream: one entry per micro-batch (per step for ``data``)} of STEPS steps of rank ``rank`` of 2."""
    out = {name: [] for name in STREAMS}
    real_call, real_draw, real_route = Objective.__call__, Objective.draw, routing_module.draw_route
    real_drop, real_gaps, real_assign = LabelEmbedder.token_drop, SRA.teacher_draw, immiscible_module.assign_noise
    first = [False]  # the first draw of a call is the student's (SRA's redraws at the teacher's cells follow it)

    def call(self, model, x0, y, k, *, seed, **kw):
        out["cells"].append(k.tolist())
        out["noise_seed"].append(seed)
        first[0] = True
        return real_call(self, model, x0, y, k, seed=seed, **kw)

    def draw(self, k, generator=None):
        d = real_draw(self, k, generator)
        if first[0]:  # u of t = (k + u) / G: the point inside each cell
            out["cell_points"].append([round(u, 9) for u in (d.t.double() * self.num_cells - k).tolist()])
            first[0] = False
        return d

    def route(*a, **kw):
        r = real_route(*a, **kw)
        out["route"].append(r.tolist())
        return r

    def drop(self, labels, force_drop_ids=None):
        dropped = real_drop(self, labels, force_drop_ids)
        if force_drop_ids is None and torch.is_grad_enabled():  # the student's forward (the teacher is in eval mode)
            out["label_dropout"].append((dropped == self.num_classes).tolist())
        return dropped

    def gaps(self, inputs):  # the gaps d of k' = max(k - d, 0), SRA's one torch.randint
        drawn, real_randint = [], torch.randint

        def randint(*a, **kw):
            drawn.append(real_randint(*a, **kw))
            return drawn[-1]

        with pytest.MonkeyPatch.context() as m:
            m.setattr(torch, "randint", randint)
            d = real_gaps(self, inputs)
        (gap,) = drawn
        out["sra_gap"].append(gap.tolist())
        return d

    def assign(x0, noise):
        order = real_assign(x0, noise)
        out["immiscible"].append(order.tolist())
        return order

    real_process = loop._set_process

    def process(*a):  # seeds torch's global RNG: label dropout's stream (and rank 0's model initialisation's)
        real_process(*a)
        out["global_rng"] = torch.get_rng_state()

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Objective, "__call__", call)
        mp.setattr(Objective, "draw", draw)
        mp.setattr(routing_module, "draw_route", route)
        mp.setattr(LabelEmbedder, "token_drop", drop)
        mp.setattr(SRA, "teacher_draw", gaps)
        mp.setattr(immiscible_module, "assign_noise", assign)
        mp.setattr(loop, "_set_process", process)
        tr = Trainer(tiny(run_dir, *SETS, f"engine.seed={seed}"), RankStandIn(rank))
        for _ in range(STEPS):
            x0, y = next(tr.loader)
            out["data"].append(y.tolist())
            tr.train_step(x0, y)
    return out


@pytest.fixture(scope="module")
def draws(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("streams")
    runs = {
        "rank0": _draws(tmp / "a", 0, 0),
        "again": _draws(tmp / "b", 0, 0),
        "rank1": _draws(tmp / "c", 1, 0),
        "seed1": _draws(tmp / "d", 0, 1),
    }
    torch.set_num_threads(n)
    return runs


@pytest.mark.parametrize("stream", STREAMS)
def test_a_stream_differs_between_steps_micro_batches_and_ranks_and_repeats_with_the_seed(draws, stream):
    a = draws["rank0"][stream]
    per_step = len(a) // STEPS
    assert per_step == (1 if stream == "data" else ACCUM), stream  # drawn once per micro-batch (the data per step)
    steps = [a[i * per_step : (i + 1) * per_step] for i in range(STEPS)]
    assert all(s != t for i, s in enumerate(steps) for t in steps[i + 1 :]), "the same draws at two steps"
    if per_step > 1:
        assert all(s[0] != s[1] for s in steps), "the same draws in two micro-batches of a step"
    assert draws["again"][stream] == a  # the same seed and rank: the same draws
    assert draws["rank1"][stream] != a and draws["seed1"][stream] != a
    if stream == "noise_seed":  # micro-batch i of a step has the step's seed + i
        assert all(s[1] == s[0] + 1 for s in steps)
    if stream == "sra_gap":  # the gaps: 0 to floor(0.2 G) - 1
        assert set(sum(a, [])) == set(range(8))
    if stream == "cell_points":
        assert all(0 <= u < 1 for u in sum(a, []))


def test_torchs_global_rng_is_seeded_per_rank(draws):
    states = [draws[r]["global_rng"] for r in ("rank0", "again", "rank1", "seed1")]
    assert torch.equal(states[0], states[1])
    assert not torch.equal(states[0], states[2]) and not torch.equal(states[0], states[3])


def test_the_data_order_reshuffles_each_epoch_and_repeats_with_the_seed():
    """The digits sampler's order per epoch (ranks read disjoint slices of the same global batch) and the flips of
    the sharded loader (per dataset index, the same on every rank, new each epoch)."""

    def order(seed, epoch, rank):
        return list(EpochBatchSampler(97, 16, rank, 2, seed, epoch))

    first = order(0, 0, 0)
    assert order(0, 0, 0) == first and order(0, 1, 0) != first and order(1, 0, 0) != first
    for b0, b1 in zip(first, order(0, 0, 1)):
        assert len(b0) == len(b1) == 8 and not set(b0) & set(b1)
    flips = flip_decisions(np.arange(97), 97, 3, 0)
    assert 20 < flips.sum() < 77
    np.testing.assert_array_equal(flip_decisions(np.arange(97), 97, 3, 0), flips)
    assert not np.array_equal(flip_decisions(np.arange(97), 97, 3, 1), flips)
    assert not np.array_equal(flip_decisions(np.arange(97), 97, 4, 0), flips)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_ranks_cuda_stream_keeps_its_seed_while_the_trainer_is_built(tmp_path, monkeypatch, rank):
    """On a GPU, label dropout draws from the rank's CUDA stream, which the trainer seeds with engine.seed + rank.
    Building the model (rank 0's initialisation on every rank) and SRA's projector seed the host's generator only: a
    CUDA seed set after the trainer's would give every rank the same dropped labels."""
    seeds = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", lambda s: seeds.append(int(s)))
    monkeypatch.setattr(torch.cuda, "manual_seed", lambda s: seeds.append(int(s)))
    Trainer(tiny(tmp_path / "r", "terms.use=[sra]", "engine.seed=5", "engine.cpu_threads=1"), RankStandIn(rank))
    assert seeds == [5 + rank]
