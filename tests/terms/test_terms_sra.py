"""Self-representation alignment (terms/sra.py): the teacher's lower noise levels, the loss against a hand computation
on odd batch sizes, the teacher (the run's EMA model) runs without gradient while the projector and the student
learn, weight 0 leaves the loss bitwise unchanged, and a run with it resumes bit for bit, keeps its projector in the
model's checkpoint (``term_heads``) and leaves it out of sampling, export and a fine-tune's start."""

import copy

import pytest
import torch
from conftest import assert_resumed_state, tiny

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.models import DiT
from diffcurr_fast.objective import Objective
from diffcurr_fast.ops import philox_randn
from diffcurr_fast.runs.config import DiffusionConfig
from diffcurr_fast.terms.base import TermInputs
from diffcurr_fast.terms.sra import SRA, alignment_loss, default_blocks

KW = dict(
    input_size=8,
    patch_size=2,
    in_channels=1,
    hidden_size=32,
    depth=3,
    num_heads=2,
    num_classes=10,
    class_dropout_prob=0.0,
)
G = 50


def _model(seed=0):
    torch.manual_seed(seed)
    m = DiT(**KW)
    with torch.no_grad():  # the zero-initialised adaLN and final layers would hide the blocks
        for p in m.parameters():
            if p.requires_grad:
                p.normal_(std=0.1)
    return m


def _inputs(formulation, prediction, b, seed=1234, dtype=torch.float64):
    """TermInputs of a draw at random cells of ``formulation`` (pred and features are filled by the caller)."""
    d = DiffusionConfig(formulation=formulation, prediction=prediction, num_timesteps=G)
    form = build_formulation(d)
    g = torch.Generator().manual_seed(b)
    k = torch.randint(0, G, (b,), generator=g)
    x0 = torch.randn(b, 1, 8, 8, generator=g, dtype=dtype)
    draw = form.training_draw(k, G, prediction, "none", 5.0, g)
    redraw = lambda kk, gen: form.training_draw(kk, G, prediction, "none", 5.0, gen)  # noqa: E731
    eps = philox_randn(seed, tuple(x0.shape)).to(dtype)
    y = torch.arange(b) % 10
    inputs = TermInputs(x0, y, draw, x0, seed, x0, {}, eps, cells=k, num_cells=G, redraw=redraw)
    return inputs


def test_default_blocks_are_the_quarter_and_three_quarters_of_the_depth():
    assert default_blocks(28) == (6, 20) and default_blocks(12) == (2, 8) and default_blocks(4) == (0, 2)
    assert default_blocks(1) == (0, 0) and default_blocks(2) == (0, 0)


@pytest.mark.parametrize("formulation, prediction", [("ddpm", "eps"), ("flow", "velocity"), ("edm", "x0")])
def test_the_teacher_is_never_noisier_and_at_most_the_gap_below(formulation, prediction):
    term = SRA(32, 0, 2, gap=0.2)
    inputs = _inputs(formulation, prediction, 301)
    d = term.teacher_draw(inputs)
    own = inputs.draw
    assert bool((d.t <= own.t).all())  # t increases with the noise in every formulation
    assert bool((d.t < own.t).float().mean() > 0.5)  # mostly strictly lower
    if formulation == "ddpm":  # t is the cell: d in {0, ..., floor(0.2 G) - 1}, clamped at 0
        gap = own.t - d.t
        assert int(gap.max()) <= 9 and set(gap[own.t >= 9].tolist()) == set(range(10))
    if formulation == "flow":  # t' in the cell k - d: at most (d + 1) / G below
        assert float((own.t - d.t).max()) < 11 / G
    form = build_formulation(DiffusionConfig(formulation=formulation, prediction=prediction, num_timesteps=G))
    a, c = form.coefficients(d.t)  # the coefficients are those of the teacher's own level
    if formulation != "edm":  # EDM's network input is c_in x_t: a = c_in, c = c_in sigma
        torch.testing.assert_close(d.a, a.to(d.a.dtype))
        torch.testing.assert_close(d.c, c.to(d.c.dtype))
    else:
        torch.testing.assert_close(d.c / d.a, d.t)
    again = term.teacher_draw(inputs)  # drawn from the step's seed: repeatable
    assert torch.equal(again.t, d.t)


def test_the_gaps_are_drawn_from_the_steps_noise_seed():
    """Each step, rank and micro-batch has its own noise seed, so each draws its own gaps; a seed repeats its gaps
    whatever the global random state."""
    term = SRA(32, 0, 2, gap=0.2)

    def gaps(seed):
        inputs = _inputs("ddpm", "eps", 301, seed=seed)  # the same cells and data, the noise of ``seed``
        return (inputs.draw.t - term.teacher_draw(inputs).t).tolist()

    seeds = (1234, 1235, 2**61 + 7)  # two neighbours (micro-batches i and i + 1) and a far one
    drawn = [gaps(s) for s in seeds]
    assert len({tuple(g) for g in drawn}) == 3
    torch.manual_seed(99)
    assert [gaps(s) for s in seeds] == drawn


@pytest.mark.parametrize("loss", ["cosine", "smooth_l1"])
@pytest.mark.parametrize("b", [3, 5])
def test_the_loss_is_the_per_token_distance_to_the_teachers_later_block_by_hand(b, loss):
    student, teacher = _model(0).double().train(), _model(1).double().eval()
    term = SRA(32, 0, 2, gap=0.2, loss=loss).double()
    term.attach_teacher(teacher)
    inputs = _inputs("ddpm", "eps", b)
    _, feats = student(inputs.x0, inputs.draw.t_in, inputs.y, features=(0,))
    inputs.features = feats
    got = term(inputs)
    assert got.shape == (b,) and got.dtype == torch.float32
    # by hand: the teacher at its own level, its block 2; the projector on the student's block 0
    d = term.teacher_draw(inputs)
    x_t = d.a.view(-1, 1, 1, 1) * inputs.x0 + d.c.view(-1, 1, 1, 1) * inputs.noise
    with torch.no_grad():
        _, tf = teacher(x_t, d.t_in, inputs.y, features=(2,))
    h = term.projector(feats[0])  # (b, 16, 32)
    for i in range(b):
        u, v = h[i].detach(), tf[2][i]
        if loss == "cosine":
            cos = (u * v).sum(-1) / (u.norm(dim=-1).clamp_min(1e-8) * v.norm(dim=-1).clamp_min(1e-8))
            want = (1.0 - cos).mean()
        else:
            r = (u - v).abs()
            want = torch.where(r < 0.05, 0.5 * r**2 / 0.05, r - 0.025).mean()
        torch.testing.assert_close(got[i].double(), want, rtol=1e-5, atol=1e-6)
    assert float(alignment_loss(tf[2], tf[2]).abs().max()) < 1e-6  # aligned: zero


def test_the_teacher_runs_without_gradient_and_the_projector_and_student_learn():
    model, teacher = _model(0).train(), _model(1).eval()  # the teacher's weights require grad: none may reach them
    term = SRA(32, 0, 2)
    term.attach_teacher(teacher)
    grad_on = []
    teacher.register_forward_pre_hook(lambda mod, args: grad_on.append(torch.is_grad_enabled()))
    form = build_formulation(DiffusionConfig(formulation="ddpm", prediction="eps", num_timesteps=1000))
    obj = Objective(form, num_cells=1000, prediction="eps", backend="reference", terms=[(0.5, term)])
    x0, y, k = torch.randn(5, 1, 8, 8), torch.arange(5), torch.tensor([3, 250, 500, 750, 999])
    obj(model, x0, y, k, seed=7).mean().backward()
    assert grad_on == [False]  # once per batch, under no_grad
    assert all(p.grad is None for p in teacher.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in term.projector.parameters())
    block0 = model.blocks[0].attn.qkv.weight.grad
    only_regression = _model(0).train()
    Objective(form, num_cells=1000, prediction="eps", backend="reference")(
        only_regression, x0, y, k, seed=7
    ).mean().backward()
    assert not torch.equal(block0, only_regression.blocks[0].attn.qkv.weight.grad)  # the student block learns from it
    with pytest.raises(ValueError, match="terms.use sra needs its teacher, the run's EMA model"):
        Objective(form, num_cells=1000, prediction="eps", terms=[(0.5, SRA(32, 0, 2))])(model, x0, y, k, seed=7)


def test_weight_zero_leaves_the_loss_bitwise_unchanged():
    model, term = _model(0), SRA(32, 0, 2)
    term.attach_teacher(_model(1).eval())
    form = build_formulation(DiffusionConfig(formulation="flow", prediction="velocity", num_timesteps=G))
    x0, y, k = torch.randn(5, 1, 8, 8), torch.arange(5), torch.tensor([0, 7, 21, 33, 49])

    def loss(*terms):
        obj = Objective(form, num_cells=G, prediction="velocity", backend="reference", terms=terms)
        return obj(model, x0, y, k, seed=3, generator=torch.Generator().manual_seed(0))  # the points in the cells

    base = loss()
    assert torch.equal(loss((0.0, term)), base)
    assert not torch.equal(loss((0.5, term)), base)


def test_the_projector_has_its_own_stream_and_the_official_initialisation():
    torch.manual_seed(5)
    before = torch.get_rng_state()
    a, b = SRA(32, 0, 2, seed=3), SRA(32, 0, 2, seed=3)
    assert torch.equal(torch.get_rng_state(), before)  # the model's random stream is untouched
    assert all(torch.equal(u, v) for u, v in zip(a.state_dict().values(), b.state_dict().values()))
    assert a.projector[0].weight.shape == (64, 32) and a.projector[2].weight.shape == (32, 64)  # 2 D hidden
    assert float(a.projector[0].bias.detach().abs().sum()) == 0.0
    assert SRA(32, 0, 2, projector_dim=48).projector[0].weight.shape == (48, 32)
    c = copy.deepcopy(a)
    teacher = _model()
    a.attach_teacher(teacher)
    assert copy.deepcopy(a).teacher is teacher and c.teacher is None  # a reference, never a copy
    assert not any(k.startswith("_teacher") for k in a.state_dict())  # not a submodule


SETS = ["model.depth=4", "checkpoint.every=2", "terms.use=[sra]", "data.batch_size=15"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A 4-step run with sra, the same run stopped at 2 and resumed to 4, and a plain run."""
    from diffcurr_fast.train.loop import Trainer

    tmp = tmp_path_factory.mktemp("sra")
    whole = Trainer(tiny(tmp / "a", *SETS, "engine.max_steps=4"))
    whole.fit()
    Trainer(tiny(tmp / "b", *SETS, "engine.max_steps=2")).fit()
    resumed = Trainer(tiny(tmp / "b", *SETS, "engine.max_steps=4"), resume=True)
    resumed.fit()
    plain = Trainer(tiny(tmp / "c", "model.depth=4", "data.batch_size=15", "engine.max_steps=4"))
    plain.fit()
    return tmp, whole, resumed, plain


def test_a_run_trains_the_projector_with_the_model_and_resumes_exactly(runs):
    tmp, whole, resumed, plain = runs
    ((w, term),) = whole.objective.terms
    assert w == 0.5 and isinstance(term, SRA) and term.features == (0,) and term.teacher_block == 2
    assert term.teacher is whole.ema.module  # the run's EMA model itself
    assert whole.model.term_heads["sra"] is term  # in the model: optimised, averaged, checkpointed
    in_opt = {id(p) for group in whole.opt.param_groups for p in group["params"]}
    assert all(id(p) in in_opt for p in term.parameters())
    sd, ema = whole.model.state_dict(), whole.ema.module.state_dict()
    assert "term_heads.sra.projector.0.weight" in sd and "term_heads.sra.projector.0.weight" in ema
    assert_resumed_state(whole, resumed)
    assert not hasattr(plain.model, "term_heads")
    assert any(not torch.equal(sd[k], v) for k, v in plain.model.state_dict().items())


def test_sampling_export_and_a_fine_tune_leave_the_projector_out(runs, tmp_path):
    from safetensors.torch import load_file

    from diffcurr_fast.cli_export import load_model, to_diffusers_transformer
    from diffcurr_fast.runs.checkpoint import latest_checkpoint
    from diffcurr_fast.train.loop import Trainer

    tmp, whole, _, _ = runs
    ckpt = latest_checkpoint(tmp / "a")
    assert any(k.startswith("term_heads.") for k in torch.load(ckpt, weights_only=True)["ema"]["module"])
    for weights in ("ema", "model"):
        model, _, _ = load_model(str(ckpt), weights)  # export and sample load through checkpoint_dit
        assert not hasattr(model, "term_heads")
    assert all(torch.equal(v, whole.model.state_dict()[k]) for k, v in model.state_dict().items())
    net = to_diffusers_transformer(model)
    assert not any("term_heads" in k for k in net.state_dict())
    exported = load_file(str(tmp / "a" / "ema.safetensors"))
    assert exported and not any(k.startswith("term_heads.") for k in exported)
    # a fine-tune from an sra checkpoint without the term, and from a plain checkpoint with it: heads start fresh
    plain = Trainer(tiny(tmp_path / "p", "model.depth=4", f"model.init_from={ckpt}", "engine.max_steps=1"))
    assert not hasattr(plain.model, "term_heads")
    init = f"model.init_from={tmp / 'c' / 'ema.safetensors'}"
    start = Trainer(tiny(tmp_path / "s", *SETS, init, "engine.max_steps=1"))
    fresh = SRA(32, 0, 2, seed=start.cfg.engine.seed)
    for k, v in fresh.state_dict().items():
        assert torch.equal(start.model.term_heads["sra"].state_dict()[k], v)


def test_sra_options_are_checked():
    from diffcurr_fast.runs.recipes import load_config

    with pytest.raises(ValueError, match="terms.sra_teacher_block 9 must be a block of the model: 0 to 3"):
        load_config(None, ["model.depth=4", "terms.use=[sra]", "terms.sra_teacher_block=9"])
    with pytest.raises(ValueError, match="terms.sra_student_block 4 must be a block of the model: 0 to 3"):
        load_config(None, ["model.depth=4", "terms.use=[sra]", "terms.sra_student_block=4"])
    with pytest.raises(ValueError, match="terms.sra_loss"):
        load_config(None, ["terms.sra_loss=l2"])
    with pytest.raises(ValueError, match="terms.sra_weight"):
        load_config(None, ["terms.sra_weight=0"])
    with pytest.raises(ValueError, match="terms.sra_gap"):
        load_config(None, ["terms.sra_gap=1.5"])
