"""Training loop: a short run end to end, fused loss vs reference, NaN policy, EMA math, LR schedule, run dir."""

import json
import math

import pytest
import torch

from diffcurr_fast.diffusion import hybrid_loss, loss_weights
from diffcurr_fast.ops import q_sample_coef
from diffcurr_fast.train.config import load_config
from diffcurr_fast.train.ema import EMA
from diffcurr_fast.train.loop import NonFiniteLossError, Trainer, lr_at, train


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tiny(run_dir, *extra):
    return load_config(
        None,
        [
            f"checkpoint.run_dir={run_dir}", "model.hidden_size=32", "model.depth=1", "model.num_heads=2",
            "diffusion.num_timesteps=60", "curriculum.num_clusters=4", "curriculum.patience=1",
            "curriculum.eval_every=2", "data.batch_size=17", "engine.max_steps=6", "logging.log_every=2",
            "logging.progress=false", "logging.num_samples=0", "logging.plots=false", "checkpoint.export_ema=false",
            "optim.warmup_steps=2", *extra,
        ],
    )  # fmt: skip


def test_short_run_writes_everything(tmp_path):
    run = tmp_path / "run"
    cfg = tiny(run, "engine.max_steps=8", "logging.num_samples=10", "logging.sample_steps=4", "logging.plots=true",
               "checkpoint.export_ema=true", "checkpoint.every=4", "curriculum.pacing=fixed",
               "curriculum.stage_iters=2")  # fmt: skip
    summary = train(cfg)
    assert summary["step"] == 8 and math.isfinite(summary["loss"]) and summary["nan_skips"] == 0
    for name in ("config.yaml", "metrics.jsonl", "samples.png", "cluster_loss.png", "curriculum.png",
                 "ema.safetensors"):  # fmt: skip
        assert (run / name).is_file(), name
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt_00000004.pt", "ckpt_00000008.pt"]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs] == [2, 4, 6, 8]
    assert all(math.isfinite(r["loss"]) and len(r["cluster_loss"]) == 4 for r in recs)
    assert [r["unlocked"] for r in recs] == [2, 3, 4, 4]  # fixed pacing: one unlock every 2 steps
    from safetensors.torch import load_file

    ema = load_file(str(run / "ema.safetensors"))
    assert "final_layer.linear.weight" in ema


@pytest.mark.parametrize("prediction", ["eps", "x0", "v"])
@pytest.mark.parametrize("weighting", ["none", "min_snr"])
@pytest.mark.parametrize("learn_sigma", [True, False])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_fused_loss_matches_reference(tmp_path, prediction, weighting, learn_sigma, batch):
    cfg = tiny(
        tmp_path / "r",
        f"diffusion.prediction={prediction}",
        f"diffusion.weighting={weighting}",
        f"diffusion.learn_sigma={str(learn_sigma).lower()}",
        "model.input_size=6",
        "model.patch_size=3",
    )
    x = torch.rand(batch, 1, 6, 6) * 2 - 1
    tr = Trainer(cfg, dataset=_Data(x.repeat(17, 1, 1, 1)))
    sched = tr.schedule
    assert sched.beta_schedule == "cosine" and sched.num_timesteps == 60
    x0 = x.double()
    t = torch.randint(0, 60, (batch,))
    noise = torch.randn_like(x0)
    x_t = sched.q_sample(x0, t, noise)
    out = torch.randn(batch, 2 if learn_sigma else 1, 6, 6, dtype=torch.float64)
    # reference in float64
    w = loss_weights(sched.snr(t), prediction, weighting, 5.0)
    ref_out = out.clone().requires_grad_(True)
    ref = hybrid_loss(sched, ref_out, x0, x_t, t, noise, learn_sigma, prediction, weights=w)["loss"]
    ref.sum().backward()
    got_out = out.float().requires_grad_(True)
    got = tr.per_sample_loss(got_out, x0.float(), x_t.float(), t, noise.float())
    got.sum().backward()
    assert got.shape == (batch,)
    torch.testing.assert_close(got.double(), ref.detach(), rtol=2e-4, atol=1e-5)
    torch.testing.assert_close(got_out.grad.double(), ref_out.grad, rtol=2e-4, atol=1e-6)


class _Data(torch.utils.data.Dataset):
    def __init__(self, x):
        from diffcurr_fast.data.loader import ArrayDataset

        self.inner = ArrayDataset(x, torch.arange(len(x)) % 10)
        self.x, self.y = self.inner.x, self.inner.y

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, i):
        return self.inner[i]


def test_seeded_fused_noise_is_consistent(tmp_path):
    """q_sample(seed) and diffusion_loss(seed) see the same Philox noise: the loss equals the explicit-noise one."""
    from diffcurr_fast.ops import q_sample

    tr = Trainer(tiny(tmp_path / "r", "diffusion.learn_sigma=false"))
    x0 = torch.rand(3, 1, 8, 8) * 2 - 1
    t = torch.tensor([0, 30, 59])
    x_t, noise = q_sample(x0, t, tr.schedule, seed=1234, return_noise=True)
    out = torch.randn(3, 1, 8, 8)
    a = tr.per_sample_loss(out, x0, x_t, t, seed=1234)
    b = tr.per_sample_loss(out, x0, x_t, t, noise=noise)
    torch.testing.assert_close(a, b)


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def test_nan_policy_skip_counts_and_keeps_weights(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "engine.nan_policy=skip", "engine.max_nan_skips=2"))
    real = tr.per_sample_loss
    tr.per_sample_loss = lambda *a, **k: real(*a, **k) * float("nan")
    x, y = next(tr.loader)
    before, ema_before = _params(tr.model), _params(tr.ema.module)
    stats = tr.train_step(x, y)
    assert stats.get("skipped") and tr.nan_skips == 1 and tr.step == 1
    assert all(torch.equal(a, b) for a, b in zip(before, _params(tr.model)))
    assert all(torch.equal(a, b) for a, b in zip(ema_before, _params(tr.ema.module)))
    assert tr.curriculum.state_dict()["steps_seen"] == 0  # the curriculum never saw the bad loss
    tr.train_step(x, y)
    with pytest.raises(NonFiniteLossError, match="3 skipped so far, max_nan_skips=2"):
        tr.train_step(x, y)
    tr.per_sample_loss = real
    tr.train_step(x, y)  # a finite step still trains
    assert not all(torch.equal(a, b) for a, b in zip(before, _params(tr.model)))


def test_nan_policy_stop(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "engine.nan_policy=stop"))
    real = tr.per_sample_loss
    tr.per_sample_loss = lambda *a, **k: real(*a, **k) + float("inf")
    x, y = next(tr.loader)
    with pytest.raises(NonFiniteLossError, match="non-finite loss at step 0 \\(nan_policy='stop'"):
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


def test_lr_schedule(tmp_path):
    cfg = tiny(tmp_path / "r", "optim.lr=1.0", "optim.warmup_steps=4", "optim.schedule=cosine", "optim.min_lr=0.1",
               "engine.max_steps=14")  # fmt: skip
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
    with torch.no_grad(), tr.autocast():
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
    sets = ["model.hidden_size=32", "model.depth=1", "model.num_heads=2", "diffusion.num_timesteps=40",
            "curriculum.num_clusters=4", "data.batch_size=17", "engine.max_steps=2", "logging.num_samples=10",
            "logging.sample_steps=2", "logging.progress=false", "logging.plots=false"]  # fmt: skip
    argv = ["--run-dir", str(run)] + [a for s in sets for a in ("--set", s)]
    assert cli_train.run(p.parse_args(argv)) == 0
    out = capsys.readouterr()
    assert f"sample grid: {run / 'samples.png'}" in out.out and "done: 2 steps" in out.out
    assert "starting at step 0 of 2; single engine" in out.err
    with pytest.raises(FileExistsError):
        cli_train.run(p.parse_args(argv))
    assert cli_train.run(p.parse_args(argv + ["--resume", "--set", "engine.max_steps=3"])) == 0
    assert "resuming from" in capsys.readouterr().err


@pytest.mark.gpu
def test_cuda_bf16_step(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", "engine.device=cuda", "engine.precision=bf16"))
    assert tr.device.type == "cuda" and tr.opt.defaults.get("fused")
    x, y = next(tr.loader)
    stats = tr.train_step(x.cuda(), y.cuda())
    assert math.isfinite(float(stats["loss"]))


def test_metrics_writer_and_telemetry(tmp_path):
    import importlib.util

    from diffcurr_fast.train.report import MetricsWriter, gpu_stats, read_metrics

    has_tb = importlib.util.find_spec("tensorboard") is not None
    w = MetricsWriter(tmp_path, tensorboard=True)  # without tensorboard: the JSON lines alone, no error
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


FLOW = ("diffusion.formulation=flow", "diffusion.prediction=velocity", "diffusion.learn_sigma=false",
        "diffusion.weighting=none", "logging.sampler=euler")  # fmt: skip


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_flow_loss_matches_float64_reference(tmp_path, fused, batch):
    tr = Trainer(tiny(tmp_path / "r", *FLOW, f"diffusion.fused_ops={str(fused).lower()}"))
    x0 = torch.randn(batch, 1, 8, 8, dtype=torch.float64)
    noise = torch.randn_like(x0)
    t = torch.rand(batch, dtype=torch.float64)
    x_t = (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise
    out = torch.randn_like(x0)
    ref_out = out.clone().requires_grad_(True)
    ref = ((ref_out - (noise - x0)) ** 2).mean((1, 2, 3))  # velocity target eps - x0
    ref.sum().backward()
    got_out = out.float().requires_grad_(True)
    got = tr.per_sample_loss(got_out, x0.float(), x_t.float(), t.float(), noise.float())
    got.sum().backward()
    torch.testing.assert_close(got.double(), ref.detach(), rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got_out.grad.double(), ref_out.grad, rtol=2e-5, atol=1e-6)


def test_flow_forward_process_and_run(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", *FLOW, "diffusion.num_timesteps=50"))
    x0 = torch.randn(17, 1, 8, 8)
    k = torch.randint(0, 50, (17,))
    t, x_t, x_in, t_in = tr.forward_process(x0, k, None, seed=99)
    assert torch.equal(x_in, x_t) and torch.equal(t_in, t)
    assert t.dtype == torch.float32 and torch.equal(torch.floor(t.double() * 50).long(), k)  # t inside cell k
    _, noise = q_sample_coef(x0, 1.0 - t.double(), t.double(), seed=99, return_noise=True)
    torch.testing.assert_close(x_t, (1 - t.view(-1, 1, 1, 1)) * x0 + t.view(-1, 1, 1, 1) * noise)
    summary = train(tiny(tmp_path / "run", *FLOW, "logging.num_samples=10", "logging.sample_steps=3"))
    assert summary["step"] == 6 and math.isfinite(summary["loss"]) and "samples" in summary


@pytest.mark.parametrize(
    "extra, match",
    [
        (("diffusion.prediction=eps",), "diffusion.prediction='eps' is not supported with diffusion.formulation"),
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
    tr = Trainer(tiny(tmp_path / "r", "optim.grad_clip=1.0"))
    p0 = next(p for p in tr.model.parameters() if p.requires_grad)
    handle = p0.register_hook(lambda g: g * float("inf"))
    x, y = next(tr.loader)
    before = _params(tr.model)
    stats = tr.train_step(x, y)
    assert stats.get("skipped") and tr.nan_skips == 1 and not math.isfinite(float(stats["grad_norm"]))
    assert all(torch.equal(a, b) for a, b in zip(before, _params(tr.model)))
    handle.remove()
    assert "loss" in tr.train_step(x, y)


EDM = ("diffusion.formulation=edm", "diffusion.prediction=x0", "diffusion.learn_sigma=false",
       "diffusion.weighting=none", "logging.sampler=heun")  # fmt: skip


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_edm_loss_matches_float64_reference(tmp_path, fused, batch):
    """lambda(sigma) |c_skip x + c_out F - x0|^2 (EDM Eq. 2, 7, Table 1) in float64, outputs and gradients."""
    tr = Trainer(tiny(tmp_path / "r", *EDM, f"diffusion.fused_ops={str(fused).lower()}"))
    x0 = torch.randn(batch, 1, 8, 8, dtype=torch.float64) * 0.5
    noise = torch.randn_like(x0)
    sigma = torch.exp(torch.randn(batch, dtype=torch.float64) * 1.2 - 1.2)
    s = sigma.view(-1, 1, 1, 1)
    x_t = x0 + s * noise
    out = torch.randn_like(x0)
    ref_out = out.clone().requires_grad_(True)
    sd = 0.5
    den = sd**2 / (s**2 + sd**2) * x_t + s * sd / (s**2 + sd**2).sqrt() * ref_out
    ref = (sigma**2 + sd**2) / (sigma * sd) ** 2 * ((den - x0) ** 2).mean((1, 2, 3))
    ref.sum().backward()
    got_out = out.float().requires_grad_(True)
    got = tr.per_sample_loss(got_out, x0.float(), x_t.float(), sigma.float(), noise.float())
    got.sum().backward()
    torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_out.grad.double(), ref_out.grad, rtol=1e-4, atol=1e-6)


def test_edm_forward_process_and_sigma_density(tmp_path):
    tr = Trainer(tiny(tmp_path / "r", *EDM, "diffusion.num_timesteps=50", "curriculum.pacing=none"))
    x0 = torch.randn(17, 1, 8, 8)
    k = torch.randint(0, 50, (17,))
    sigma, x_t, x_in, t_in = tr.forward_process(x0, k, None, seed=5)
    lo, hi = math.log(0.002), math.log(80.0)
    cell = torch.floor((sigma.double().log() - lo) / (hi - lo) * 50).long()
    assert torch.equal(cell.clamp(0, 49), k)
    _, noise = q_sample_coef(x0, torch.ones(17), sigma.double(), seed=5, return_noise=True)
    torch.testing.assert_close(x_t, x0 + sigma.view(-1, 1, 1, 1) * noise)
    torch.testing.assert_close(x_in, x_t / (sigma.view(-1, 1, 1, 1) ** 2 + 0.25).sqrt())
    torch.testing.assert_close(t_in, sigma.log() / 4)
    # vanilla pacing: sampled ln(sigma) follows EDM's N(P_mean, P_std^2) restricted to the cells
    w = tr._timestep_weights().double()
    centres = (torch.arange(50, dtype=torch.float64) + 0.5) / 50 * (hi - lo) + lo
    mean = float((w * centres).sum() / w.sum())
    assert abs(mean - (-1.2)) < 0.05 and int(w.argmax()) == int((centres + 1.2).abs().argmin())


def test_edm_short_run_samples(tmp_path):
    summary = train(tiny(tmp_path / "run", *EDM, "logging.num_samples=10", "logging.sample_steps=3"))
    assert summary["step"] == 6 and math.isfinite(summary["loss"]) and "samples" in summary
    with pytest.raises(
        ValueError, match="diffusion.prediction='eps' is not supported with diffusion.formulation 'edm'"
    ):
        tiny(tmp_path / "r", *EDM, "diffusion.prediction=eps")
    with pytest.raises(ValueError, match="diffusion.sigma_max must lie in"):
        tiny(tmp_path / "r", *EDM, "diffusion.sigma_max=0.001")


def test_engine_selection(monkeypatch):
    from diffcurr_fast.train.engine import create_engine, unwrap

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    eng = create_engine("auto", "cpu")
    assert eng.kind == "single" and eng.world_size == 1 and eng.all_true(torch.tensor(True))
    assert not eng.all_true(torch.tensor(False)) and eng.gather_objects(3) == [3]
    with pytest.raises(ValueError, match="engine.kind 'ddp' needs the torchrun environment; missing RANK"):
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
