"""Self-representation alignment (terms/sra.py), the edges its main tests leave open: the default blocks floor the
quarters of a depth that four does not divide; an unknown loss, a missing teacher, a partitioned projector and a draw
without its cells are named; TDC is the one use refused, naming why and the fix; the constructor's defaults are the
documented ones and ``from_config`` reads every option and the seed; the teacher keeps the student's level on a
one-cell axis or a gap under one cell, gets its x_t and float t in the data's dtype (an integer t stays one) and skips
its value checks only for a trusted t, its own setting restored; the student's tokens are cast to the projector's
dtype; and building the projector touches no CUDA device nor its random stream."""

import dataclasses

import pytest
import torch
from torch import nn

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.diffusion.axis import trusted_t
from diffcurr_fast.runs.config import DiffusionConfig
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.terms.base import TermInputs
from diffcurr_fast.terms.sra import SRA, SRAOptions, alignment_loss, default_blocks

UNKNOWN_LOSS = "terms.sra_loss 'l2'; valid choices: cosine, smooth_l1"


def test_the_default_blocks_floor_the_quarters_of_a_depth_four_does_not_divide():
    """depth // 4 - 1 and 3 depth // 4 - 1: whole block indices, never a fraction of one."""
    for depth, want in ((6, (0, 3)), (10, (1, 6)), (13, (2, 8))):
        got = default_blocks(depth)
        assert got == want and all(type(b) is int for b in got)


def test_an_unknown_loss_is_named_with_the_valid_choices():
    """Both the loss function and the term's constructor name the bad value and list cosine and smooth_l1."""
    x = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError) as e:
        alignment_loss(x, x, "l2")
    assert str(e.value) == UNKNOWN_LOSS
    with pytest.raises(ValueError) as e:
        SRA(8, 0, 1, loss="l2")
    assert str(e.value) == UNKNOWN_LOSS


def test_tdc_is_refused_naming_why_and_the_fix_and_no_other_use_is():
    """A TDC run cannot carry the projector: the refusal says so and how to go on; CUDA graphs are not refused."""
    cfg = load_config(None, ["terms.use=[sra]"])
    with pytest.raises(ValueError) as e:
        cfg.check_refusals("tdc")
    msg = str(e.value)
    assert msg.startswith(
        "terms.use 'sra' trains a projector attached to the model, which TDC's pruned experts do not carry; "
    )
    assert msg.endswith("; drop it from terms.use for a TDC run")
    assert SRAOptions().refusal(cfg, "cuda_graphs") is None


def test_the_constructors_defaults_are_the_documented_ones():
    """gap 0.2 (the official t_max), cosine loss, a 2 D wide projector drawn from seed 0 (engine.seed's default)."""
    term = SRA(16, 0, 1)
    assert term.gap == 0.2 and term.loss == "cosine"
    assert term.projector[0].weight.shape == (32, 16)
    assert load_config(None, []).engine.seed == 0
    same, other = SRA(16, 0, 1, seed=0).state_dict(), SRA(16, 0, 1, seed=1).state_dict()
    assert all(torch.equal(v, same[k]) for k, v in term.state_dict().items())
    assert not torch.equal(term.state_dict()["projector.0.weight"], other["projector.0.weight"])


def test_from_config_reads_the_gap_the_projector_width_and_the_blocks():
    cfg = load_config(None, ["terms.use=[sra]", "model.depth=8", "terms.sra_gap=0.5", "terms.sra_projector_dim=48"])
    term = SRA.from_config(cfg)
    assert term.gap == 0.5
    assert term.projector[0].weight.shape == (48, cfg.model.hidden_size)
    assert term.features == (1,) and term.teacher_block == 5  # 8 // 4 - 1, 3 * 8 // 4 - 1
    assert term.loss == "cosine"


def test_from_config_reads_the_blocks_the_loss_and_the_seed_it_is_given():
    sets = ["terms.use=[sra]", "model.depth=8", "terms.sra_student_block=2", "terms.sra_teacher_block=6"]
    cfg = load_config(None, [*sets, "terms.sra_loss=smooth_l1", "engine.seed=5"])
    term = SRA.from_config(cfg)
    assert term.features == (2,) and term.teacher_block == 6 and term.loss == "smooth_l1"
    want = SRA(cfg.model.hidden_size, 2, 6, seed=5).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in term.state_dict().items())


G = 50


def _inputs(b=64, num_cells=G, formulation="ddpm", dtype=torch.float32, **replace):
    """TermInputs of a draw at random cells of ``num_cells`` (DDPM's t is the cell), x0 (b, 1, 2, 2) in ``dtype``,
    float32 noise and student tokens (b, 4, 8) of block 0, with ``replace`` applied."""
    prediction = {"ddpm": "eps", "flow": "velocity"}[formulation]
    form = build_formulation(DiffusionConfig(formulation=formulation, prediction=prediction, num_timesteps=num_cells))
    g = torch.Generator().manual_seed(b)
    k = torch.randint(0, num_cells, (b,), generator=g)
    x0, eps = torch.randn(b, 1, 2, 2, generator=g).to(dtype), torch.randn(b, 1, 2, 2, generator=g)
    draw = form.training_draw(k, num_cells, prediction, "none", 5.0, g)
    redraw = lambda kk, gen: form.training_draw(kk, num_cells, prediction, "none", 5.0, gen)  # noqa: E731
    feats = {0: torch.randn(b, 4, 8, generator=g)}
    inputs = TermInputs(x0, torch.zeros(b, dtype=torch.long), draw, x0, 7, x0, feats, eps, k, num_cells, redraw)
    return dataclasses.replace(inputs, **replace)


NO_DRAW = "terms.use sra needs the cells of the draw and the formulation's redraw (the Objective)"


@pytest.mark.parametrize("missing", [{"cells": None}, {"redraw": None}, {"num_cells": 0}])
def test_the_teachers_draw_names_what_it_lacks(missing):
    """Without the cells, the redraw or a cell count the teacher cannot be placed: a ValueError naming them."""
    with pytest.raises(ValueError) as e:
        SRA(8, 0, 1).teacher_draw(dataclasses.replace(_inputs(), **missing))
    assert str(e.value) == NO_DRAW


def test_a_one_cell_axis_gives_the_teacher_the_students_cell():
    """G = 1: the gap rounds to no cell (D = max(1, floor(0.2)) = 1), the teacher sits at the student's level."""
    inputs = _inputs(b=5, num_cells=1)
    assert torch.equal(SRA(8, 0, 1).teacher_draw(inputs).t, inputs.draw.t)


def test_a_gap_under_one_cell_leaves_the_teacher_at_the_students_level():
    """floor(gap G) = 0: D = 1, d = 0 for every sample; DDPM's t is the cell, so the teacher's t is the student's."""
    inputs = _inputs()
    assert torch.equal(SRA(8, 0, 1, gap=0.01).teacher_draw(inputs).t, inputs.draw.t)
    assert not torch.equal(SRA(8, 0, 1, gap=0.2).teacher_draw(inputs).t, inputs.draw.t)  # a wider gap moves some


def test_the_gaps_go_to_the_cells_device():
    """The gaps are drawn on the host and moved to the cells' device before k - d (here the meta device)."""
    seen = []

    def redraw(kk, gen):
        seen.append(kk.device)
        raise LookupError("stop here")

    inputs = _inputs(b=4, cells=torch.zeros(4, dtype=torch.long, device="meta"), redraw=redraw)
    with pytest.raises(LookupError, match="stop here"):
        SRA(8, 0, 1).teacher_draw(inputs)
    assert seen == [torch.device("meta")]


@pytest.fixture
def cuda_calls(monkeypatch):
    """The calls building a term makes into ``torch.cuda``, on a stand-in machine with one GPU."""
    calls = []

    def record(name, result=None):
        return lambda *args, **kwargs: calls.append(name) or result

    monkeypatch.setattr(torch.cuda, "device_count", record("device_count", 1))
    monkeypatch.setattr(torch.cuda, "get_rng_state", record("get_rng_state", torch.zeros(8, dtype=torch.uint8)))
    monkeypatch.setattr(torch.cuda, "set_rng_state", record("set_rng_state"))
    monkeypatch.setattr(torch.cuda, "manual_seed_all", record("manual_seed_all"))
    monkeypatch.setattr(torch.cuda, "manual_seed", record("manual_seed"))
    return calls


def test_building_the_projector_reads_no_cuda_device(cuda_calls):
    """The projector is built on the host: no GPU is counted, initialised or has its random state saved."""
    SRA(16, 0, 1, seed=3)
    assert not {"device_count", "get_rng_state", "set_rng_state"} & set(cuda_calls)


def test_building_the_projector_leaves_the_cuda_random_stream_alone(cuda_calls):
    """The trainer seeds each rank's CUDA stream with engine.seed + rank (label dropout draws from it); the
    projector's own seed must not reseed it, or every rank would drop the same labels."""
    torch.manual_seed(11)
    before = torch.get_rng_state()
    cuda_calls.clear()
    SRA(16, 0, 1, seed=3)
    assert cuda_calls == []
    assert torch.equal(torch.get_rng_state(), before)


class _Teacher(nn.Module):
    """A stand-in EMA model: records what each call sees (its input, t and its ``check_values`` at the time) and
    returns x's four pixels as the tokens (b, 4, 8) of the blocks asked for."""

    def __init__(self, check_values=True):
        super().__init__()
        self.seen = []
        if check_values is not None:
            self.check_values = check_values

    def forward(self, x, t, y, features=()):
        self.seen.append({"x": x, "t": t, "checks": getattr(self, "check_values", "none")})
        b = x.shape[0]
        return None, {j: x.float().reshape(b, 4, 1).expand(b, 4, 8) for j in features}


def _term(teacher):
    term = SRA(8, 0, 1)
    term.attach_teacher(teacher)
    return term


def test_a_missing_teacher_is_named():
    with pytest.raises(ValueError) as e:
        SRA(8, 0, 1)(_inputs(b=2))
    assert str(e.value) == "terms.use sra needs its teacher, the run's EMA model (the trainer attaches it)"


def test_a_partitioned_projector_is_refused_naming_the_zero_stages_that_work():
    """DeepSpeed ZeRO-3 leaves a flat, empty weight outside the model's forward: refused, naming stages 0 to 2."""
    term = _term(_Teacher())
    term.projector[0].weight = nn.Parameter(torch.empty(0))
    with pytest.raises(ValueError) as e:
        term(_inputs(b=2))
    assert str(e.value) == "terms.use sra: its projector is partitioned (ZeRO stage 3); use ZeRO stage 0 to 2"


def test_the_teacher_sees_x_t_and_a_float_t_in_the_datas_dtype():
    """bfloat16 data, float32 noise and float64 coefficients: the teacher's x_t and flow time t are bfloat16."""
    teacher = _Teacher()
    _term(teacher)(_inputs(b=3, formulation="flow", dtype=torch.bfloat16))
    (call,) = teacher.seen
    assert call["x"].dtype == torch.bfloat16 and call["t"].dtype == torch.bfloat16


def test_an_integer_t_reaches_the_teacher_as_an_integer():
    """DDPM's t is the cell index: the teacher gets it as int64, never cast to the data's dtype."""
    teacher = _Teacher()
    _term(teacher)(_inputs(b=3))
    assert teacher.seen[0]["t"].dtype == torch.int64


def test_student_tokens_in_another_dtype_are_cast_to_the_projectors():
    """float64 tokens through a float32 projector: the loss is that of the tokens cast to float32."""
    term, inputs = _term(_Teacher()), _inputs(b=3)
    want = term(inputs)
    got = term(dataclasses.replace(inputs, features={0: inputs.features[0].double()}))
    assert torch.equal(got, want)


def test_the_teachers_value_checks_are_off_for_a_trusted_t_and_restored_after():
    """Under ``trusted_t`` (t from the trainer's sampler) the teacher skips its range checks, as the student does;
    its own setting is back after the call, and a trusted t changes nothing for a teacher without the setting."""
    on, off, without = _Teacher(True), _Teacher(False), _Teacher(None)
    with trusted_t():
        for teacher in (on, off, without):
            _term(teacher)(_inputs(b=2))
    assert not on.seen[0]["checks"] and on.check_values is True
    assert not off.seen[0]["checks"] and off.check_values is False
    assert without.seen[0]["checks"] == "none" and not hasattr(without, "check_values")


def test_an_untrusted_t_keeps_the_teachers_value_checks():
    teacher = _Teacher(True)
    _term(teacher)(_inputs(b=2))
    assert teacher.seen[0]["checks"] is True and teacher.check_values is True
