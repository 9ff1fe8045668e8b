"""The device-side training step (``engine.cuda_graphs``) against the host path it replaces.

The host path reads the finiteness vote back and skips a non-finite step on the host; the device-side step keeps
the vote on the device and masks the optimizer (fused AdamW's ``found_inf``), the EMA, the curriculum's pacing
statistics and the timestep sampler's statistics with it. Both must end in the same bits: weights, EMA, AdamW
moments, curriculum and sampler state, and the skip counts, with finite steps and with non-finite ones (a NaN
gradient or loss injected at chosen steps), on one process and on 2 DDP ranks. The stop rules fire at the next log
step (or checkpoint) with the message the host path gives at the step that broke them.
"""

from __future__ import annotations

import json
import math
import struct
import textwrap

import pytest
import torch
from conftest import assert_resumed_state, run_torchrun2

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.skips import NonFiniteLossError

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = [
    "optim.name=adamw",  # the device-side step is fused AdamW's (the demo ships Muon)
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "diffusion.num_timesteps=60",
    "curriculum.num_clusters=4",
    "curriculum.patience=1",
    "curriculum.eval_every=2",
    "data.batch_size=20",
    "engine.max_skip_share=1",
    "logging.log_every=4",
    "logging.progress=false",
    "logging.num_samples=0",
    "logging.plots=false",
    "checkpoint.export_ema=false",
    "checkpoint.every=100",
    "optim.warmup_steps=2",
    "optim.grad_clip=1.0",
    "engine.device=cpu",
]
# pacing rules and samplers whose statistics a skipped step must not touch
VARIANTS = {
    "patience": (),
    "fixed+importance+accum": (
        "curriculum.pacing=fixed",
        "curriculum.stage_iters=3",
        "timesteps.sampler=importance",
        "timesteps.importance_history=2",
        "optim.grad_accum_steps=2",
    ),
    "adaptive": ("curriculum.pacing=adaptive", "curriculum.patience=0"),
}
BAD_GRAD, BAD_LOSS = {1, 4, 5, 9}, {7}  # 0-based steps: a skip at a window end, two in a row, a fixed stage's end


def _cfg(run_dir, *extra):
    return load_config(None, [f"checkpoint.run_dir={run_dir}", *BASE, *extra])


def _inject(tr: Trainer, bad_grad=(), bad_loss=(), rank_of_bad: int | None = None) -> None:
    """NaN in one parameter's gradient at the steps ``bad_grad`` and a NaN loss at ``bad_loss`` (0-based); under
    DDP only on rank ``rank_of_bad`` (the vote must skip every rank)."""
    if rank_of_bad is not None and tr.engine.rank != rank_of_bad:
        return
    p0 = next(p for p in tr.model.parameters() if p.requires_grad)
    p0.register_hook(lambda g: g * float("nan") if tr.step in bad_grad else g)
    real = tr.objective
    tr.objective = lambda *a, **k: real(*a, **k) * (float("nan") if tr.step in bad_loss else 1.0)


def _run(run_dir, steps: int, *extra, **bad) -> Trainer:
    tr = Trainer(_cfg(run_dir, *extra))
    _inject(tr, **bad)
    for _ in range(steps):
        tr.train_step(*next(tr.loader))
    return tr


def _state(tr: Trainer) -> dict:
    """Everything a skipped step could change; the skip counts read as a checkpoint reads them."""
    st = tr.state_dict()
    return {
        "model": st["model"],
        "ema": st["ema"],
        "optimizer": st["optimizer"]["state"],
        "curriculum": st["curriculum"],
        "timesteps": st["timesteps"],
        "skips": (st["nan_skips"], *st["nan_skip_run"]),
        "step": st["step"],
    }


def _bits(x):
    """``x`` with every float and tensor replaced by its bytes: equal iff bitwise equal (NaN and -0.0 included)."""
    if isinstance(x, torch.Tensor):
        return (str(x.dtype), tuple(x.shape), x.detach().cpu().contiguous().numpy().tobytes())
    if isinstance(x, float):
        return struct.pack("<d", x)
    if isinstance(x, dict):
        return {k: _bits(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_bits(v) for v in x]
    return x


def assert_same(a: dict, b: dict) -> None:
    for key in a:
        # a plain bool: pytest's diff of two unequal byte dumps (difflib, quadratic) would take many minutes
        same = _bits(a[key]) == _bits(b[key])
        assert same, f"{key} differs between the host path and the device-side step"


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_finite_steps_are_bitwise_the_host_path(tmp_path, variant):
    extra = VARIANTS[variant]
    host = _run(tmp_path / "host", 10, *extra)
    dev = _run(tmp_path / "dev", 10, *extra, "engine.cuda_graphs=true")
    a, b = _state(host), _state(dev)
    assert_same(a, b)
    assert a["skips"] == (0, 0, 0) and a["ema"]["num_updates"] == 10
    assert dev.engine.device_side and not host.engine.device_side


@pytest.mark.parametrize(
    "variant", [pytest.param(v, marks=pytest.mark.slow) if "accum" in v else v for v in VARIANTS]
)  # grad accumulation: twice the micro-steps
def test_skipped_steps_end_in_the_host_paths_state(tmp_path, variant):
    extra, bad = VARIANTS[variant], {"bad_grad": BAD_GRAD, "bad_loss": BAD_LOSS}
    host = _run(tmp_path / "host", 12, *extra, **bad)
    dev = _run(tmp_path / "dev", 12, *extra, "engine.cuda_graphs=true", **bad)
    a, b = _state(host), _state(dev)
    assert_same(a, b)
    assert a["skips"] == (5, 0, 2)  # 5 skipped, none at the end, the first at step 2 (1-based)
    assert a["ema"]["num_updates"] == 7 and a["curriculum"]["win_count"] == 7 % 2
    if variant.startswith("fixed"):
        assert a["curriculum"]["history"] == [3, 10]  # an unlock after every 3 applied steps: the skips shift it


def test_first_step_skipped_only_initialises_the_optimizer_state(tmp_path):
    """A skipped first step: the fused kernel has created zero moments at step count 0 (the host path creates them
    at the first applied step); every later step is the same."""
    host = _run(tmp_path / "host", 3, bad_grad={0})
    dev = _run(tmp_path / "dev", 3, "engine.cuda_graphs=true", bad_grad={0})
    assert_same(_state(host), _state(dev))


def test_a_masked_bug_is_seen(tmp_path, monkeypatch):
    """The comparison catches an EMA that is not masked (the update applied on a skipped step)."""
    from diffcurr_fast.train.ema import EMA

    real = EMA._masked_update
    monkeypatch.setattr(EMA, "_masked_update", lambda self, model, ok: real(self, model, torch.ones_like(ok)))
    host = _run(tmp_path / "host", 3, bad_grad={1})
    dev = _run(tmp_path / "dev", 3, "engine.cuda_graphs=true", bad_grad={1})
    with pytest.raises(AssertionError, match="ema differs"):
        assert_same(_state(host), _state(dev))


# (extra settings, 0-based steps with a NaN gradient, the step (1-based) the host path stops at, and the step the
# device-side step stops at: the next log step (4, 8, ...) or checkpoint)
STOPS = {
    "in a row": (("engine.max_nan_skips=1",), {5, 6, 7, 8, 9}, 7, 8),
    "share": (("engine.max_skip_share=0.2",), {1, 5, 6}, 7, 8),
    "policy stop": (("engine.nan_policy=stop",), {4}, 5, 8),
    "at a checkpoint": (("engine.max_nan_skips=1", "checkpoint.every=3"), {3, 4}, 5, 6),
}


@pytest.mark.parametrize("rule", list(STOPS))
def test_stop_rules_fire_at_the_next_log_step_with_the_host_message(tmp_path, rule):
    extra, bad, host_at, dev_at = STOPS[rule]
    msgs, runs = {}, {"host": (), "dev": ("engine.cuda_graphs=true",)}
    for name, flag in runs.items():
        tr = Trainer(_cfg(tmp_path / name, "engine.max_steps=12", *extra, *flag))
        _inject(tr, bad_grad=bad)
        with pytest.raises(NonFiniteLossError) as exc:
            tr.fit()
        msgs[name] = str(exc.value)
        stopped_at = host_at if name == "host" else dev_at
        assert tr.step == (host_at - 1 if name == "host" else dev_at), name  # the host path stops inside the step
        logged = [json.loads(line)["step"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        assert logged == [s for s in (4, 8) if s < stopped_at], name  # nothing logged at the step that raised
    assert msgs["dev"] == msgs["host"] and f"at step {host_at}:" in msgs["host"]
    ckpts = [sorted(p.name for p in (tmp_path / name / "checkpoints").glob("ckpt_*.pt")) for name in runs]
    assert ckpts[0] == ckpts[1]  # no checkpoint of a run a rule has stopped


def test_the_log_counts_only_applied_steps(tmp_path):
    """metrics.jsonl: the loss of a window is the mean over its applied steps, and nan_skips as of that step."""
    recs = {}
    for name, flag in (("host", ()), ("dev", ("engine.cuda_graphs=true",))):
        tr = Trainer(_cfg(tmp_path / name, "engine.max_steps=8", *flag))
        _inject(tr, bad_grad={1, 2}, bad_loss={5})
        summary = tr.fit()
        assert summary["nan_skips"] == 3 and summary["first_nan_skip"] == 2
        recs[name] = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    drop = ("img_per_s",)
    for a, b in zip(recs["host"], recs["dev"], strict=True):
        assert {k: v for k, v in a.items() if k not in drop} == {k: v for k, v in b.items() if k not in drop}
    assert [r["nan_skips"] for r in recs["dev"]] == [2, 3] and all(math.isfinite(r["loss"]) for r in recs["dev"])


def test_a_resumed_device_side_run_continues_its_counts(tmp_path):
    """Skip counts survive a checkpoint: 4 + 4 steps with a resume equal 8 uninterrupted (and the host path's)."""
    bad = {"bad_grad": {2, 5}}
    host = _run(tmp_path / "host", 8, **bad)
    dev = _run(tmp_path / "dev", 4, "engine.cuda_graphs=true", **bad)
    dev.save()
    dev = Trainer(_cfg(tmp_path / "dev", "engine.cuda_graphs=true"), resume=True)
    _inject(dev, **bad)
    for _ in range(4):
        dev.train_step(*next(dev.loader))
    assert_same(_state(host), _state(dev))
    whole = _run(tmp_path / "dev_whole", 8, "engine.cuda_graphs=true", **bad)
    assert_resumed_state(whole, dev)  # every field of the state, the device-side path's against itself


@pytest.mark.parametrize(
    "extra, match",
    [
        (
            ("engine.kind=deepspeed", "engine.deepspeed_config=ds.json"),
            r"^engine.cuda_graphs does not apply to engine.kind 'deepspeed' \(DeepSpeed decides its overflow skips",
        ),
        (("timesteps.sampler=anuts",), r"^engine.cuda_graphs does not work with timesteps.sampler 'anuts'"),
        (("optim.impl=apex",), r"^engine.cuda_graphs does not work with optim.impl 'apex'"),
        (("terms.immiscible=true",), r"^engine.cuda_graphs does not work with terms.immiscible \(its assignment"),
    ],
)
def test_host_only_combinations_are_refused(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tmp_path / "r", "engine.cuda_graphs=true", *extra)
    _cfg(tmp_path / "r", *extra)  # accepted without it


DDP_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    sys.path[:0] = [sys.argv[1], str(__import__("pathlib").Path(sys.argv[1]).parent)]  # this file, conftest
    from test_train_device_step import BAD_GRAD, BAD_LOSS, VARIANTS, _cfg, _inject, _state
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import Trainer

    run_dir, out = sys.argv[2], sys.argv[3]
    engine = create_engine("ddp", "cpu")
    for variant in ("patience", "fixed+importance+accum"):
        for name, flag in (("host", []), ("dev", ["engine.cuda_graphs=true"])):
            extra = [*VARIANTS[variant], "engine.kind=ddp", *flag]
            tr = Trainer(_cfg(f"{run_dir}/{variant}-{name}", *extra), engine)
            _inject(tr, bad_grad=BAD_GRAD, rank_of_bad=1)  # a NaN on rank 1 only: both ranks skip
            _inject(tr, bad_loss=BAD_LOSS, rank_of_bad=0)
            for _ in range(12):
                tr.train_step(*next(tr.loader))
            torch.save(_state(tr), f"{out}.{variant}.{name}.{engine.rank}.pt")
    with open(f"{out}.{engine.rank}.json", "w") as fh:
        json.dump({"rank": engine.rank}, fh)
    del tr  # its DDP reducer dies before the process group is destroyed, not at interpreter exit
    engine.close()
    """
)


@pytest.mark.slow
def test_two_ddp_ranks_skip_together_as_the_host_path(tmp_path):
    tests_dir = str(__import__("pathlib").Path(__file__).parent)
    run_torchrun2(tmp_path, DDP_SCRIPT, tests_dir, tmp_path / "runs", timeout=400)
    prefix = tmp_path / "torchrun_out"
    for variant in ("patience", "fixed+importance+accum"):
        states = {
            (name, r): torch.load(f"{prefix}.{variant}.{name}.{r}.pt", weights_only=False)
            for name in ("host", "dev")
            for r in (0, 1)
        }
        for r in (0, 1):
            assert_same(states["host", r], states["dev", r])
            assert states["dev", r]["skips"] == (5, 0, 2), (variant, r)
        assert _bits(states["dev", 0]["model"]) == _bits(states["dev", 1]["model"])  # replicas stay identical
