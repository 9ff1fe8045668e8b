"""The optimizers of ``optim.name`` (diffcurr_fast/optim/): which parameters Muon takes, Muon and AdamW
stepped as one, schedule-free AdamW read at its averaged point x wherever the weights are read, its warmup, and a
resume that repeats the uninterrupted run bit for bit for each optimizer, on one rank and on two gloo ranks."""

import json
import textwrap

import pytest
import torch
from conftest import TINY_SETS, resume_in_copy, run_torchrun2, tiny

from diffcurr_fast.models.dit import DiT
from diffcurr_fast.optim.muon import MuonAdamW, muon_params
from diffcurr_fast.optim.registry import build_optimizer
from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.train import loop
from diffcurr_fast.train.engine import Engine
from diffcurr_fast.train.loop import Trainer, lr_at

pytestmark = pytest.mark.usefixtures("one_thread")
SF = ("optim.name=schedule_free", "optim.schedule=constant")  # the demo recipe decays its lr: constant here
schedulefree = pytest.importorskip("schedulefree", reason="schedulefree is not installed (the schedulefree extra)")


def _dit(**kw):
    return DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2, num_classes=10, **kw)


def _matrices(depth, names):
    return [f"blocks.{i}.{part}.{n}.weight" for i in range(depth) for part, n in names]


@pytest.mark.parametrize(
    "options, names",
    [
        ({}, [("attn", "qkv"), ("attn", "proj"), ("mlp", "fc1"), ("mlp", "fc2")]),
        (
            {"mlp": "swiglu", "qk_norm": True, "norm": "rmsnorm", "routing": (0, 1), "sprint": True},
            [("attn", "qkv"), ("attn", "proj"), ("mlp", "w12"), ("mlp", "w3")],
        ),
    ],
    ids=["plain", "modern-sprint"],
)
def test_muon_takes_the_blocks_attention_and_mlp_matrices(options, names):
    """Muon: qkv, proj and the MLP's two matrices of every block; AdamW: the embedders, adaLN, the final layer, norms
    (QK-norm's too), biases and SPRINT's fusion layer."""
    model = _dit(**options)
    want = _matrices(2, names)
    assert muon_params(model) == want
    opt = build_optimizer(model, tiny("unused", "optim.name=muon", "optim.lr=3e-3"), torch.device("cpu"))
    assert isinstance(opt, MuonAdamW)
    named = {id(p): n for n, p in model.named_parameters()}
    in_muon = [named[id(p)] for g in opt.muon.param_groups for p in g["params"]]
    in_adamw = [named[id(p)] for g in opt.adamw.param_groups for p in g["params"]]
    assert in_muon == want
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert sorted(in_muon + in_adamw) == sorted(trainable)
    assert any(n.startswith("t_embedder") for n in in_adamw) and any("adaLN" in n for n in in_adamw)
    if options:
        assert "sprint_fusion.weight" in in_adamw and "blocks.0.attn.q_norm.weight" in in_adamw
    muon = opt.muon.param_groups[0]
    assert (muon["adjust_lr_fn"], muon["momentum"], muon["nesterov"]) == ("match_rms_adamw", 0.95, True)
    assert muon["lr"] == opt.adamw.param_groups[0]["lr"] == 3e-3
    assert opt.adamw.param_groups[0]["fused"]


def test_muon_adamw_is_torchs_muon_and_fused_adamw_at_the_engines_lr():
    """One ``Engine.step`` sets the learning rate of both groups and steps both: the weights are those of torch's Muon
    and fused AdamW stepped apart at that rate, and the state dict restores both."""
    torch.manual_seed(0)
    model = _dit()
    ref = _dit()
    ref.load_state_dict(model.state_dict())
    cfg = tiny("unused", "optim.name=muon", "optim.weight_decay=0.01", "optim.muon_momentum=0.9")
    opt = build_optimizer(model, cfg, torch.device("cpu"))
    named_ref = dict(ref.named_parameters())
    to_muon = muon_params(ref)
    ref_muon = torch.optim.Muon(
        [named_ref[n] for n in to_muon], lr=1.0, weight_decay=0.01, momentum=0.9, adjust_lr_fn="match_rms_adamw"
    )
    rest = [p for n, p in ref.named_parameters() if n not in to_muon and p.requires_grad]
    ref_adamw = torch.optim.AdamW(rest, lr=1.0, weight_decay=0.01, fused=True)
    engine = Engine("cpu")
    for step in range(3):
        lr = 1e-3 * (step + 1)
        for p, q in zip(model.parameters(), ref.parameters()):
            if p.requires_grad:
                p.grad = torch.randn(p.shape)
                q.grad = p.grad.clone()
        assert engine.step(opt, lr) is True
        for o in (ref_muon, ref_adamw):
            for g in o.param_groups:
                g["lr"] = lr
            o.step()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), name
    assert {g["lr"] for g in opt.param_groups} == {3e-3}
    again = build_optimizer(model, cfg, torch.device("cpu"))
    again.load_state_dict(opt.state_dict())
    for a, b in zip(opt.muon.state.values(), again.muon.state.values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    assert len(again.adamw.state) == len(rest)


def test_schedule_free_warmup_is_the_trainers_ramp():
    """The trainer's linear warmup, set as the learning rate of each step, gives the weights of schedule-free's own
    ``warmup_steps`` (its averaging weights see the ramp through lr_max^2)."""
    cfg = tiny("unused", *SF, "optim.lr=2e-2", "optim.warmup_steps=4", "engine.max_steps=9")
    torch.manual_seed(0)
    a = [torch.randn(5, 3, requires_grad=True), torch.randn(7, requires_grad=True)]
    b = [p.detach().clone().requires_grad_() for p in a]
    ours = schedulefree.AdamWScheduleFree(a, lr=2e-2, warmup_steps=0)
    own = schedulefree.AdamWScheduleFree(b, lr=2e-2, warmup_steps=4)
    for step in range(9):
        for p, q in zip(a, b):
            p.grad = torch.randn(p.shape)
            q.grad = p.grad.clone()
        for o in (ours, own):
            o.train()
        ours.param_groups[0]["lr"] = lr_at(step, cfg)
        ours.step()
        own.step()
        for o in (ours, own):
            o.eval()
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert ours.param_groups[0]["weight_sum"] == pytest.approx(own.param_groups[0]["weight_sum"], rel=1e-12)


def _flat(module):
    return {n: v.detach().clone() for n, v in module.state_dict().items()}


def _same(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_schedule_free_is_read_at_its_averaged_point_everywhere(tmp_path, monkeypatch):
    """Between steps the weights are x (the optimizer in eval mode), and every reader of the weights gets them: the
    EMA update (decay 0: the EMA is the last weights it read), evaluation during training, the sample grid, the post-hoc
    EMA snapshot (its first average is the first weights it read), the checkpoint and the EMA export. x differs from
    the gradient point y = (1 - beta1) z + beta1 x that the step used."""
    seen = {"eval": [], "grid": []}

    class Recorder:  # the evaluator of a run: what it is given, and what the trainer holds then
        def __init__(self, *args):
            pass

        def __call__(self, step, module, formulation):
            trained = _flat(trainer.model)
            at_rest = not any(g["train_mode"] for g in trainer.opt.param_groups)
            seen["eval"].append((step, trained, _same(_flat(module), trained), at_rest))
            return {"step": step}

    def grid(module, *args):
        seen["grid"].append(_same(_flat(module), _flat(trainer.model)))

    monkeypatch.setattr(loop, "Evaluator", Recorder)
    monkeypatch.setattr(loop, "sample_grid", grid)
    run = tmp_path / "run"
    cfg = tiny(
        run,
        *SF,
        "optim.lr=1e-2",
        "optim.beta1=0.8",
        "optim.warmup_steps=0",
        "optim.ema_decay=0",
        "optim.ema_warmup=false",
        "optim.phema_every=1",
        "logging.eval_every=1",
        "logging.num_samples=2",
        "engine.max_steps=3",
        "checkpoint.every=1",
    )
    trainer = Trainer(cfg)
    trainer.fit()
    assert [s for s, *_ in seen["eval"]] == [1, 2, 3] and all(ok and rest for *_, ok, rest in seen["eval"])
    assert seen["grid"] == [True]
    x = _flat(trainer.model)
    trainer.opt.train()  # the gradient point, from the package's own switch
    y = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.opt.eval()
    moved = 0.0
    for n, p in trainer.model.named_parameters():
        if not p.requires_grad:  # the fixed position embedding
            continue
        z = trainer.opt.state[p]["z"]
        torch.testing.assert_close(x[n], (y[n] - 0.2 * z) / 0.8, rtol=1e-5, atol=1e-6)  # x = (y - (1 - b1) z) / b1
        moved = max(moved, float((y[n] - x[n]).abs().max()))
    assert moved > 1e-3  # y is not x: reading y anywhere would fail the checks below
    state = ck.load_checkpoint(ck.latest_checkpoint(run))
    assert _same(state["model"], x) and _same(state["ema"]["module"], x)
    assert all(not g["train_mode"] for g in state["optimizer"]["param_groups"])
    from safetensors.torch import load_file

    exported = load_file(run / "ema.safetensors")
    assert all(torch.equal(exported[n], x[n]) for n in exported)
    first = load_file(sorted((run / "phema").glob("*00000001*"))[0])
    assert all(torch.equal(first[n], seen["eval"][0][1][n]) for n in first if n in seen["eval"][0][1])


def test_tdc_stage1_hands_on_the_averaged_point(tmp_path):
    """TDC's base model, taken from the trained weights (tdc.base_weights=model), is the x of the run's checkpoint
    (its EMA, the other choice, is an average of x as every EMA is)."""
    from diffcurr_fast.tdc.pipeline import stage1

    run = tmp_path / "stage1"
    cfg = tiny(run, *SF, "optim.lr=1e-2", "tdc.base_weights=model", "engine.max_steps=2")
    base = stage1(cfg, Engine("cpu"), None, verbose=False)
    state = ck.load_checkpoint(ck.latest_checkpoint(run))
    assert not any(g["train_mode"] for g in state["optimizer"]["param_groups"])  # saved at x
    got = base.model.state_dict()
    assert all(torch.equal(got[n], state["model"][n]) for n in state["model"])


RESUME = (
    "optim.schedule=constant",
    "engine.max_steps=6",
    "checkpoint.every=3",
    "optim.lr=1e-2",
    "optim.warmup_steps=2",
    "optim.grad_clip=1.0",
)


@pytest.mark.parametrize("name", ["muon", "schedule_free"])
def test_resume_is_bit_identical(tmp_path, name):
    """A run resumed from its checkpoint at step 3 ends with the weights, EMA and optimizer state of the run that was
    not interrupted."""
    extra = (f"optim.name={name}", *RESUME)
    full = tmp_path / "full"
    Trainer(tiny(full, *extra)).fit()
    half = tmp_path / "half"
    resume_in_copy(full, half, 3, tiny(half, *extra)).fit()
    a, b = (ck.load_checkpoint(ck.latest_checkpoint(d)) for d in (full, half))
    assert a["step"] == b["step"] == 6
    assert _same(a["model"], b["model"]) and _same(a["ema"]["module"], b["ema"]["module"])
    a_opt, b_opt = (torch.cat([t.flatten() for t in _tensors(s["optimizer"])]) for s in (a, b))
    assert a_opt.numel() > 0 and torch.equal(a_opt, b_opt)
    b_full = ck.load_checkpoint(full / ck.CKPT_DIR / "ckpt_00000003.pt")
    assert not _same(a["model"], b_full["model"])  # it trained on after the checkpoint


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for k in sorted(obj, key=str) for t in _tensors(obj[k])]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import Trainer

    tmp, sets, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    engine = create_engine("ddp", "cpu")
    res = {}
    for name in ("muon", "schedule_free"):
        base = [*sets, f"optim.name={name}", "optim.lr=1e-2", "optim.warmup_steps=2", "optim.schedule=constant",
                "data.batch_size=18",
                "checkpoint.every=2", "engine.kind=ddp", "engine.device=cpu"]
        flat = {}
        for run, steps in (("full", [4]), ("half", [2, 4])):
            for i, n in enumerate(steps):
                cfg = load_config(None, [*base, f"checkpoint.run_dir={tmp}/{name}-{run}", f"engine.max_steps={n}"])
                tr = Trainer(cfg, engine, resume=i > 0)
                tr.fit()
            flat[run] = [torch.cat([p.detach().flatten() for p in m.parameters()]).tolist()
                         for m in (tr.model, tr.ema.module)]
            del tr  # its DDP reducer dies before the process group is destroyed
        res[name] = flat
    with open(f"{out}.{engine.rank}.json", "w") as fh:
        json.dump(res, fh)
    engine.close()
    """
)


@pytest.mark.slow
def test_two_gloo_ranks_stay_in_step_and_resume_bit_identically(tmp_path):
    """Under DDP on two ranks, each optimizer keeps the replicas identical, and a run resumed at step 2 ends with the
    weights and EMA of the run that was not interrupted."""
    r0, r1 = run_torchrun2(tmp_path, DDP_SCRIPT, tmp_path, json.dumps(TINY_SETS))
    for name in ("muon", "schedule_free"):
        assert r0[name]["full"] == r1[name]["full"], name  # replicas identical
        assert r0[name]["half"] == r0[name]["full"], name  # resumed == uninterrupted, weights and EMA
