"""Training loop: a short run end to end, fused loss vs reference, NaN policy, EMA math, LR schedule, run dir."""

import json
import math

import pytest
import torch
from conftest import set_args

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.ema import EMA
from diffcurr_fast.train.engine import compile_mode
from diffcurr_fast.train.loop import Trainer, lr_at, train
from diffcurr_fast.train.skips import NonFiniteLossError

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(run_dir, *extra):
    return load_config(
        None,
        [
            f"checkpoint.run_dir={run_dir}",
            "optim.name=adamw",  # the field's default (the demo ships Muon); the optimizers' own tests choose theirs
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            "diffusion.num_timesteps=60",
            "curriculum.num_clusters=4",
            "curriculum.patience=1",
            "curriculum.eval_every=2",
            "data.batch_size=17",
            "engine.max_steps=6",
            "logging.log_every=2",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
            "checkpoint.export_ema=false",
            "optim.warmup_steps=2",
            *extra,
        ],
    )


def test_short_run_writes_everything(tmp_path):
    run = tmp_path / "run"
    cfg = tiny(
        run,
        "engine.max_steps=8",
        "logging.num_samples=10",
        "logging.sample_steps=4",
        "logging.plots=true",
        "checkpoint.export_ema=true",
        "checkpoint.every=4",
        "curriculum.pacing=fixed",
        "curriculum.stage_iters=2",
    )
    summary = train(cfg)
    assert summary["step"] == 8 and math.isfinite(summary["loss"]) and summary["nan_skips"] == 0
    for name in (
        "config.yaml",
        "metrics.jsonl",
        "samples.png",
        "cluster_loss.png",
        "curriculum.png",
        "ema.safetensors",
    ):
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt_00000004.pt", "ckpt_00000008.pt"]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 4, 6, 8]
    assert all(math.isfinite(r["loss"]) and len(r["cluster_loss"]) == 4 for r in recs)
    assert [r["unlocked"] for r in recs] == [2, 3, 4, 4]  # fixed pacing: one unlock every 2 steps
    from safetensors.torch import load_file

    ema = load_file(str(run / "ema.safetensors"))
    assert "final_layer.linear.weight" in ema


class _Data(torch.utils.data.Dataset):
    def __init__(self, x):
        from diffcurr_fast.data.loader import ArrayDataset

        self.inner = ArrayDataset(x, torch.arange(len(x)) % 10)
        self.x, self.y = self.inner.x, self.inner.y

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_nan_policy_skip_counts_and_keeps_weights(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "engine.nan_policy=skip", "engine.max_nan_skips=2", "engine.max_skip_share=1"))
    real = tr.objective
    tr.objective = lambda *a, **k: real(*a, **k) * float("nan")
    x, y = next(tr.loader)
    before, ema_before = _params(tr.model), _params(tr.ema.module)
    stats = tr.train_step(x, y)
    assert stats.get("skipped") and tr.skips.total == 1 and tr.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(tr.model)))
    assert all(torch.equal(a, b) for a, b in zip(ema_before, _params(tr.ema.module)))
    assert tr.curriculum.state_dict()["win_count"] == 0  # the curriculum never saw the bad loss
    tr.train_step(x, y)
    with pytest.raises(
        NonFiniteLossError,
        match=r"at step 3: 3 step\(s\) skipped, the first at step 1 \(3 in a row, "
        "more than engine.max_nan_skips=2",
    ):
        tr.train_step(x, y)
    tr.objective = real
    tr.train_step(x, y)  # a finite step still trains
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(tr.model)))


def test_nan_policy_stop(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "engine.nan_policy=stop"))
    real = tr.objective
    tr.objective = lambda *a, **k: real(*a, **k) + float("inf")
    x, y = next(tr.loader)
    with pytest.raises(
        NonFiniteLossError, match=r"at step 1: 1 step\(s\) skipped, the first at step 1 \(engine.nan_policy"
    ):
        tr.train_step(x, y)


def test_ema_math():
    torch.manual_seed(1)
    model = torch.nn.Linear(3, 5)
    ema = EMA(model, decay=0.9, warmup=True)
    ref = [p.detach().double().clone() for p in model.parameters()]
    for n in range(25):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p))
        d = min(0.9, (1 + n) / (10 + n))
        assert ema.current_decay() == pytest.approx(d)
        ema.update(model)
        ref = [d * r + (1 - d) * p.detach().double() for r, p in zip(ref, model.parameters())]
    for r, e in zip(ref, ema.module.parameters()):
        torch.testing.assert_close(e.double(), r, rtol=1e-5, atol=1e-6)
    plain = EMA(model, decay=0.5, warmup=False)
    start = [p.detach().clone() for p in plain.module.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    plain.update(model)
    for s, p, e in zip(start, model.parameters(), plain.module.parameters()):
        torch.testing.assert_close(e, 0.5 * s + 0.5 * p.detach())
    with pytest.raises(ValueError, match="EMA decay must lie in \\[0, 1\\], got 1.5"):
        EMA(model, decay=1.5)
    default = EMA(model)  # DiT's decay with the warm-up: 0.1 at the first update
    assert default.current_decay() == pytest.approx(0.1) and default.decay == 0.9999
    assert not any(p.requires_grad for p in default.module.parameters())  # the averages are no-grad copies
    for edge in (0.0, 1.0):  # both ends of [0, 1] are valid: a plain copy, frozen weights
        assert EMA(model, decay=edge, warmup=False).current_decay() == edge


def _ema_reference(model, decay, steps):
    """The EMA update written per tensor in float64, as the paper's formula reads."""
    ref = [p.detach().double().clone() for p in model.parameters()]
    for _ in range(steps):
        ref = [decay * r + (1 - decay) * p.detach().double() for r, p in zip(ref, model.parameters())]
    return ref


def test_ema_buffers_low_precision_and_a_moved_model():
    torch.manual_seed(2)
    model = torch.nn.Sequential(torch.nn.Linear(3, 7), torch.nn.BatchNorm1d(7), torch.nn.Linear(7, 2))
    ema = EMA(model, decay=0.5, warmup=False)
    model.train()(torch.randn(9, 3))  # the running statistics move: the EMA's buffers must follow
    ema.update(model)
    for b_ema, b in zip(ema.module.buffers(), model.buffers()):
        assert torch.equal(b_ema, b.to(b_ema.dtype))
    # the same model after load_state_dict and a dtype round trip: the cached lists must still see its weights
    model.load_state_dict({k: v * 2 for k, v in model.state_dict().items()})
    model.bfloat16().float()
    start = [p.detach().clone() for p in ema.module.parameters()]
    ema.update(model)
    for s, p, e in zip(start, model.parameters(), ema.module.parameters()):
        torch.testing.assert_close(e, 0.5 * s + 0.5 * p.detach())
    half = torch.nn.Linear(4, 6).bfloat16()  # a bf16 model: averaged in float32
    e16 = EMA(half, decay=0.9, warmup=False)
    ref = _ema_reference(half, 0.9, 1)
    e16.update(half)
    assert all(p.dtype == torch.float32 for p in e16.module.parameters())
    for r, e in zip(ref, e16.module.parameters()):
        torch.testing.assert_close(e.double(), r, rtol=1e-6, atol=1e-7)
    with pytest.raises(ValueError, match="EMA has 6 parameters, the model 2"):
        ema.update(torch.nn.Linear(3, 7))  # another model with another structure


@pytest.mark.parametrize("scale", [1e-3, 1.0, 1e3])
def test_clip_grad_norm_is_torchs(scale):
    from diffcurr_fast.train.engine import Engine

    torch.manual_seed(3)
    model = torch.nn.Sequential(torch.nn.Linear(5, 31), torch.nn.GELU(), torch.nn.Linear(31, 3, bias=False))
    peer = torch.nn.Sequential(torch.nn.Linear(5, 31), torch.nn.GELU(), torch.nn.Linear(31, 3, bias=False))
    engine = Engine("cpu")
    for _ in range(2):  # the second call goes through the cached parameter list
        for p, q in zip(model.parameters(), peer.parameters()):
            p.grad = torch.randn_like(p) * scale
            q.grad = p.grad.clone()
        model[0].bias.grad = None  # a parameter without a gradient is left out, as torch does
        peer[0].bias.grad = None
        ours = engine.clip_grad_norm(model, 1.0)
        theirs = torch.nn.utils.clip_grad_norm_(peer.parameters(), 1.0)
        assert torch.equal(ours, theirs)
        for p, q in zip(model.parameters(), peer.parameters()):
            assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)
    assert engine.clip_grad_norm(model, 0.0) is None


def test_lr_schedule(tmp_path):
    cfg = tiny(
        tmp_path / "r",
        "optim.lr=1.0",
        "optim.warmup_steps=4",
        "optim.schedule=cosine",
        "optim.min_lr=0.1",
        "engine.max_steps=14",
    )
    lrs = [lr_at(s, cfg) for s in range(15)]
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[4] == pytest.approx(1.0) and lrs[9] == pytest.approx(0.55) and lrs[14] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    const = tiny(tmp_path / "r", "optim.lr=0.5", "optim.warmup_steps=0", "optim.schedule=constant")
    assert {lr_at(s, const) for s in range(6)} == {0.5}


def test_run_dir_is_not_overwritten(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="is not empty; pass --resume to continue it or --overwrite"):
        Trainer(tiny(run))
    assert (run / "notes.txt").read_text() == "keep me" and not (run / "config.yaml").exists()
    train(tiny(run), overwrite=True)
    assert (run / "notes.txt").read_text() == "keep me"  # --overwrite replaces only run artifacts
    assert (run / "checkpoints" / "ckpt_00000006.pt").is_file()
    with pytest.raises(FileExistsError):
        train(tiny(run))


def test_dataset_shape_mismatch_is_explained(tmp_path):
    with pytest.raises(ValueError, match="has images 1x8x8 but model.in_channels x model.input_size"):
        Trainer(tiny(tmp_path / "r", "model.input_size=4"))
    with pytest.raises(ValueError, match="data has label 9 but model.num_classes is 5"):
        Trainer(tiny(tmp_path / "r2", "model.num_classes=5"))


def test_bf16_autocast_step_runs(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "engine.precision=bf16"))
    dtypes = []
    lin = next(m for m in tr.model.modules() if isinstance(m, torch.nn.Linear))
    lin.register_forward_hook(lambda m, a, out: dtypes.append(out.dtype))
    before = _params(tr.model)
    x, y = next(tr.loader)
    stats = tr.train_step(x, y)
    assert dtypes == [torch.bfloat16]  # the network ran under bf16 autocast
    assert stats["loss"].dtype == torch.float32 and math.isfinite(float(stats["loss"]))  # reduced in float32
    after = _params(tr.model)
    assert all(p.dtype == torch.float32 for p in after)  # master weights stay float32
    assert not all(torch.equal(a, b) for a, b in zip(before, after))  # and the step updated them
    fp32 = Trainer(tiny(tmp_path / "r32"))
    fp32.model.load_state_dict(tr.model.state_dict())
    with torch.no_grad(), tr.objective.autocast(tr.device):
        xb = torch.randn(4, 1, 8, 8)
        tb, yb = torch.tensor([1, 20, 40, 59]), torch.tensor([0, 1, 2, 3])
        out16 = tr.model(xb, tb, yb)
    out32 = fp32.model(xb, tb, yb)
    assert out16.dtype == torch.bfloat16 and out32.dtype == torch.float32
    torch.testing.assert_close(out16.float(), out32, rtol=0.05, atol=0.05)  # bf16 rounding, same function


def test_cli_train_prints_where_outputs_are(tmp_path, capsys):
    import argparse

    from diffcurr_fast.train import cli_train

    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    run = tmp_path / "run"
    sets = [
        "model.hidden_size=32",
        "model.depth=1",
        "model.num_heads=2",
        "diffusion.num_timesteps=40",
        "curriculum.num_clusters=4",
        "data.batch_size=17",
        "engine.max_steps=2",
        "logging.num_samples=10",
        "logging.sample_steps=2",
        "logging.progress=false",
        "logging.plots=false",
    ]
    argv = ["--run-dir", str(run)] + set_args(*sets)
    assert cli_train.run(p.parse_args(argv)) == 0
    out = capsys.readouterr()
    assert f"sample grid: {run / 'samples.png'}" in out.out and "done: 2 steps" in out.out
    assert "curriculum stage" not in out.out  # the demo trains without a curriculum: no stage to report
    # the start line names the dataset, the model (dimensions and parameter count), the engine and world size
    assert (
        "starting at step 0 of 2; data built-in digits (1x8x8, 10 classes); model custom DiT depth 1, width 32, "
        "patch 2, 2 heads, 0."
        in out.err
        and "M parameters; single engine, world size 1" in out.err
    )
    with pytest.raises(FileExistsError):
        cli_train.run(p.parse_args(argv))
    resume = ["--run-dir", str(run), *set_args(*sets, "engine.max_steps=3"), "--resume"]
    assert cli_train.run(p.parse_args(resume)) == 0
    assert "resuming from" in capsys.readouterr().err
    paced = ["--set", "curriculum.pacing=fixed", "--set", "curriculum.stage_iters=1", "--run-dir", str(tmp_path / "cl")]
    assert cli_train.run(p.parse_args(argv + paced)) == 0
    assert "skipped, curriculum stage 2" in capsys.readouterr().out  # with a curriculum, its stage at the end


@pytest.mark.gpu
def test_cuda_bf16_step(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "engine.device=cuda", "engine.precision=bf16"))
    assert tr.device.type == "cuda" and tr.opt.defaults.get("fused")
    x, y = next(tr.loader)
    stats = tr.train_step(x.cuda(), y.cuda())
    assert math.isfinite(float(stats["loss"]))


def test_compile_mode_captures_the_model_only_where_cuda_graphs_can(tmp_path):
    """engine.cuda_graphs compiles the model with mode reduce-overhead on CUDA (engine.compile or not), nothing on
    CPU; refused with one line for gradient accumulation and for more than one rank."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compile_mode(tiny(tmp_path), cpu, 1) is None
    assert compile_mode(tiny(tmp_path, "engine.compile=true"), cpu, 1) == "default"
    assert compile_mode(tiny(tmp_path, "engine.compile=true"), cuda, 1) == "default"
    assert compile_mode(tiny(tmp_path, "engine.cuda_graphs=true"), cpu, 1) is None
    assert compile_mode(tiny(tmp_path, "engine.cuda_graphs=true", "engine.compile=true"), cpu, 1) == "default"
    assert compile_mode(tiny(tmp_path, "engine.cuda_graphs=true"), cuda, 1) == "reduce-overhead"
    assert compile_mode(tiny(tmp_path, "engine.cuda_graphs=true", "engine.compile=true"), cuda, 1) == "reduce-overhead"
    with pytest.raises(ValueError, match="optim.grad_accum_steps=2"):
        compile_mode(tiny(tmp_path, "engine.cuda_graphs=true", "optim.grad_accum_steps=2"), cuda, 1)
    with pytest.raises(ValueError, match="2 ranks"):
        compile_mode(tiny(tmp_path, "engine.cuda_graphs=true"), cuda, 2)
    assert compile_mode(tiny(tmp_path, "engine.cuda_graphs=true", "optim.grad_accum_steps=2"), cpu, 2) is None
    assert Trainer(tiny(tmp_path / "r", "engine.cuda_graphs=true", "engine.device=cpu")).graphs is False


@pytest.mark.gpu
def test_cuda_graphs_step_matches_the_compiled_step(tmp_path):
    """On CUDA, engine.cuda_graphs replays the model's forward and backward as CUDA graphs: the same weights, EMA
    and losses as the model compiled without graphs, step after step (replays reuse the captured buffers)."""
    from torch._dynamo.utils import counters

    counters.clear()
    runs = {}
    for name, flag in (("graphs", "engine.cuda_graphs=true"), ("compiled", "engine.compile=true")):
        tr = Trainer(tiny(tmp_path / name, "engine.device=cuda", flag, "optim.grad_clip=1.0"))
        batches = [next(tr.loader) for _ in range(6)]
        losses = [float(tr.train_step(x.cuda(), y.cuda())["loss"]) for x, y in batches]
        runs[name] = (tr, losses)
    (g, g_loss), (c, c_loss) = runs["graphs"], runs["compiled"]
    assert g.graphs and not c.graphs
    assert not counters["inductor"]["cudagraph_skips"], "inductor fell back to eager instead of CUDA graphs"
    torch.testing.assert_close(g_loss, c_loss, rtol=1e-5, atol=1e-6)
    for part in ("model", "ema"):
        mine = (g.model if part == "model" else g.ema.module).parameters()
        theirs = (c.model if part == "model" else c.ema.module).parameters()
        for a, b in zip(mine, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_metrics_writer_and_telemetry(tmp_path):
    import importlib.util

    from diffcurr_fast.train.report import MetricsWriter, gpu_stats, read_metrics

    has_tb = importlib.util.find_spec("tensorboard") is not None
    if not has_tb:  # asked for and missing: a clear error, never a silent no-op
        with pytest.raises(ImportError, match="tensorboard is not installed"):
            MetricsWriter(tmp_path, tensorboard=True)
    w = MetricsWriter(tmp_path, tensorboard=has_tb)
    w.write({"step": 1, "loss": 0.5, "cluster_loss": [None, 1.0]})
    w.write({"step": 2, "loss": float("nan")})
    w.close()
    w = MetricsWriter(tmp_path)  # a resumed run appends
    w.write({"step": 3, "loss": 0.25, "lr": 1e-4})
    w.close()
    recs = read_metrics(tmp_path / "metrics.jsonl")
    assert len(recs) == 3 and recs[0] == {"step": 1, "loss": 0.5, "cluster_loss": [None, 1.0]}
    assert math.isnan(recs[1]["loss"]) and recs[2] == {"step": 3, "loss": 0.25, "lr": 1e-4}
    assert (tmp_path / "tb").is_dir() == has_tb and (not has_tb or any((tmp_path / "tb").iterdir()))
    stats = gpu_stats()
    assert stats == {"gpu": "no GPU"} if not torch.cuda.is_available() else "gpu_util" in stats


FLOW = (
    "diffusion.formulation=flow",
    "diffusion.prediction=velocity",
    "diffusion.learn_sigma=false",
    "diffusion.weighting=none",
    "logging.sampler=euler",
)


def test_flow_run(tmp_path):
    summary = train(tiny(tmp_path / "run", *FLOW, "logging.num_samples=10", "logging.sample_steps=3"))
    assert summary["step"] == 6 and math.isfinite(summary["loss"]) and "samples" in summary


@pytest.mark.parametrize(
    "extra, match",
    [
        (("diffusion.prediction=eps",), "diffusion.prediction 'eps' is not a flow target; valid choices: velocity"),
        (("diffusion.learn_sigma=true",), "diffusion.learn_sigma=True is not supported"),
        (("diffusion.weighting=min_snr",), "diffusion.weighting='min_snr' is not supported"),
        (("logging.sampler=ddim",), "logging.sampler 'ddim' cannot sample a flow model; valid choices: euler, heun"),
    ],
)
def test_flow_config_rules(tmp_path, extra, match):
    with pytest.raises(ValueError, match=match):
        tiny(tmp_path / "r", *FLOW, *extra)


def test_ddpm_rejects_velocity(tmp_path):
    with pytest.raises(ValueError, match="'velocity' is not a ddpm target; valid choices: eps, x0, v"):
        tiny(tmp_path / "r", "diffusion.prediction=velocity")


def test_non_finite_gradient_with_finite_loss_is_skipped(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "optim.grad_clip=1.0", "engine.max_skip_share=1"))
    p0 = next(p for p in tr.model.parameters() if p.requires_grad)
    handle = p0.register_hook(lambda g: g * float("inf"))
    x, y = next(tr.loader)
    before = _params(tr.model)
    stats = tr.train_step(x, y)
    assert stats.get("skipped") and tr.skips.total == 1 and not math.isfinite(float(stats["grad_norm"]))
    assert all(torch.equal(a, b) for a, b in zip(before, _params(tr.model)))
    handle.remove()
    assert "loss" in tr.train_step(x, y)


EDM = (
    "diffusion.formulation=edm",
    "diffusion.prediction=x0",
    "diffusion.learn_sigma=false",
    "diffusion.weighting=none",
    "logging.sampler=heun",
)


def test_edm_sigma_density(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", *EDM, "diffusion.num_timesteps=50", "curriculum.pacing=none"))
    lo, hi = math.log(0.002), math.log(80.0)
    # vanilla pacing: sampled ln(sigma) follows EDM's N(P_mean, P_std^2) restricted to the cells
    w = tr.timesteps.weights().double()
    centres = (torch.arange(50, dtype=torch.float64) + 0.5) / 50 * (hi - lo) + lo
    mean = float((w * centres).sum() / w.sum())
    assert abs(mean - (-1.2)) < 0.05 and int(w.argmax()) == int((centres + 1.2).abs().argmin())


def test_edm_short_run_samples(tmp_path):
    summary = train(tiny(tmp_path / "run", *EDM, "logging.num_samples=10", "logging.sample_steps=3"))
    assert summary["step"] == 6 and math.isfinite(summary["loss"]) and "samples" in summary
    with pytest.raises(ValueError, match="diffusion.prediction 'eps' is not an edm target; valid choices: x0"):
        tiny(tmp_path / "r", *EDM, "diffusion.prediction=eps")
    with pytest.raises(ValueError, match="diffusion.sigma_min 0.002 must be < diffusion.sigma_max 0.001"):
        tiny(tmp_path / "r", *EDM, "diffusion.sigma_max=0.001")


def test_engine_selection(monkeypatch):
    from diffcurr_fast.train.engine import create_engine, unwrap

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    eng = create_engine("auto", "cpu")
    assert eng.kind == "single" and eng.world_size == 1 and eng.all_true(torch.tensor(True))
    assert not eng.all_true(torch.tensor(False)) and eng.gather_objects(3) == [3]
    with pytest.raises(ValueError, match=r"engine.kind 'ddp' needs the torchrun environment \(missing RANK"):
        create_engine("ddp", "cpu")
    with pytest.raises(ValueError, match="unknown engine kind 'horovod'; choose one of"):
        create_engine("horovod")
    with pytest.raises((ValueError, ImportError), match="engine.kind 'deepspeed' needs"):
        create_engine("deepspeed", "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="engine.device is 'cuda' but no CUDA device is available"):
            create_engine("single", "cuda")
    lin = torch.nn.Linear(2, 2)
    assert unwrap(lin) is lin


def test_optim_impl_apex_is_a_clear_error_without_nvidia_apex_and_uses_adamw_mode(monkeypatch):
    import sys
    import types

    from diffcurr_fast.optim.registry import build_optimizer
    from diffcurr_fast.runs.config import OptimConfig, TrainConfig

    params = torch.nn.Linear(3, 1)
    assert isinstance(
        build_optimizer(params, TrainConfig(optim=OptimConfig(impl="auto")), torch.device("cpu")), torch.optim.AdamW
    )
    monkeypatch.setitem(sys.modules, "apex", None)  # not importable
    monkeypatch.setitem(sys.modules, "apex.optimizers", None)
    with pytest.raises(ValueError, match="NVIDIA apex"):
        build_optimizer(params, TrainConfig(optim=OptimConfig(impl="apex")), torch.device("cpu"))
    seen = {}

    class FusedAdam(torch.optim.AdamW):  # stands in for apex.optimizers.FusedAdam
        def __init__(self, params, adam_w_mode, **kw):
            seen["adam_w_mode"] = adam_w_mode
            super().__init__(params, **kw)

    fake = types.ModuleType("apex.optimizers")
    fake.FusedAdam = FusedAdam
    monkeypatch.setitem(sys.modules, "apex", types.ModuleType("apex"))
    monkeypatch.setitem(sys.modules, "apex.optimizers", fake)
    with pytest.raises(ValueError, match="CUDA only"):
        build_optimizer(params, TrainConfig(optim=OptimConfig(impl="apex")), torch.device("cpu"))
    opt = build_optimizer(params, TrainConfig(optim=OptimConfig(impl="apex", lr=3e-4)), torch.device("cuda"))
    assert isinstance(opt, FusedAdam) and seen["adam_w_mode"] is True and opt.defaults["lr"] == 3e-4
    with pytest.raises(ValueError, match="impl"):
        load_config(None, ["optim.impl=fast"])
