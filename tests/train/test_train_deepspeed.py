"""DeepSpeed ZeRO 1/2/3 with 2 CPU ranks over gloo: matches DDP step for step, EMA under ZeRO-3, exact resume.

One ``torchrun`` launch runs a tiny DiT for 4 optimizer steps (gradient accumulation 2, clipping on) under DDP as
the reference, then for each ZeRO stage 2 steps, a resume, and 2 more steps. ZeRO only re-partitions the same
fp32 arithmetic, so its losses, weights and EMA must equal DDP's to reduction-order rounding; a resume that lost
the (partitioned) AdamW moments would be off by about the learning rate. Then a NaN batch must be skipped on both
ranks without leaving gradients behind. The first launch JIT-builds DeepSpeed's shared-memory op (about a minute,
cached afterwards).
"""

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

deepspeed = pytest.importorskip("deepspeed", reason="deepspeed is not installed (pip install deepspeed)")

from conftest import TORCHRUN2  # noqa: E402

from diffcurr_fast.runs.recipes import load_config  # noqa: E402
from diffcurr_fast.train.engine import resolve_deepspeed_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import Trainer

    tmp, recipes, names = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
    base = ["optim.name=adamw",
            "model.hidden_size=36", "model.depth=2", "model.num_heads=3", "diffusion.num_timesteps=50",
            "curriculum.num_clusters=4", "curriculum.patience=1", "curriculum.eval_every=2", "data.batch_size=12",
            "optim.grad_accum_steps=2", "optim.grad_clip=0.05", "optim.lr=3e-3", "optim.warmup_steps=0",
            "optim.schedule=constant", "optim.ema_decay=0.9",
            "logging.progress=false", "logging.num_samples=0", "logging.plots=false", "logging.log_every=1",
            "checkpoint.export_ema=false", "checkpoint.every=2", "engine.device=cpu",
            "engine.max_skip_share=1"]  # the NaN step below is one of 4

    def flat(mod):
        return torch.cat([p.detach().float().flatten() for p in mod.parameters()]).tolist()

    def losses(run_dir):
        with open(f"{run_dir}/metrics.jsonl") as fh:
            return [json.loads(line)["loss"] for line in fh]

    res = {}
    ddp = create_engine("ddp", "cpu")
    tr = Trainer(load_config(None, base + [f"checkpoint.run_dir={tmp}/ddp", "engine.max_steps=4"]), ddp)
    tr.fit()
    res["ddp"] = {"params": flat(tr.model), "ema": flat(tr.ema.module), "losses": losses(f"{tmp}/ddp")}
    for name in names:
        eng = create_engine("deepspeed", "cpu")
        run = f"{tmp}/{name}"
        over = base + [f"checkpoint.run_dir={run}", "engine.kind=deepspeed",
                       f"engine.deepspeed_config={recipes}/{name}.json"]
        first = Trainer(load_config(None, over + ["engine.max_steps=2"]), eng)
        first.fit()
        tr = Trainer(load_config(None, over + ["engine.max_steps=4"]), eng, resume=True)
        resumed_at = tr.step
        tr.fit()
        with eng.full_params(tr.model):
            params = flat(tr.model)
        z3 = eng.stage == 3
        local = sum(p.ds_tensor.numel() for p in tr.model.parameters()) if z3 else None
        res[name] = {"params": params, "ema": flat(tr.ema.module), "losses": losses(run), "resumed_at": resumed_at,
                     "stage": eng.stage, "local_numel": local,
                     "numel": sum(p.ds_numel if z3 else p.numel() for p in tr.model.parameters())}
        # a non-finite step is skipped on every rank and leaves no gradient behind for the next one
        x0, y = next(tr.loader)
        stats = tr.train_step(torch.full_like(x0, float("nan")), y)
        with eng.full_params(tr.model):
            after_skip = flat(tr.model)
        tr.train_step(x0, y)
        with eng.full_params(tr.model):
            after_next = torch.tensor(flat(tr.model))
        res[name]["skip"] = {"skipped": bool(stats.get("skipped")), "unchanged": after_skip == params,
                             "finite": bool(torch.isfinite(after_next).all()),
                             "moved": float((after_next - torch.tensor(params)).abs().max())}
    with open(f"{tmp}/res.{ddp.rank}.json", "w") as fh:
        json.dump(res, fh)
    ddp.close()
    """
)


def _launch(tmp_path: Path, names: list[str]) -> tuple[dict, dict]:
    """Run SCRIPT on 2 ranks for the DeepSpeed configs ``names`` (the recipes' ds/<name>.json); per-rank results."""
    recipes = tmp_path / "ds"
    recipes.mkdir()
    for name in names:
        conf = json.loads((ROOT / "diffcurr_fast" / "recipes" / "ds" / f"{name}.json").read_text())
        if conf["zero_optimization"]["stage"] == 3:  # no parameter persistence: even this tiny model is partitioned
            conf["zero_optimization"]["stage3_param_persistence_threshold"] = 0
        (recipes / f"{name}.json").write_text(json.dumps(conf))
    script = tmp_path / "ds_run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        *TORCHRUN2,
        str(script),
        str(tmp_path),
        str(recipes),
        ",".join(names),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r0, r1 = (json.loads((tmp_path / f"res.{r}.json").read_text()) for r in (0, 1))
    ref = r0["ddp"]
    assert len(ref["losses"]) == 4 and all(torch.isfinite(torch.tensor(ref["losses"])))
    return r0, r1


def _check_against_ddp(r0: dict, r1: dict, name: str, stage: int) -> None:
    ref, a, b = r0["ddp"], r0[name], r1[name]
    assert a["stage"] == stage and a["resumed_at"] == 2
    assert a["params"] == b["params"] and a["ema"] == b["ema"]  # ranks agree on the full weights
    ls = torch.tensor(a["losses"])
    assert ls.shape == (4,) and torch.isfinite(ls).all()
    torch.testing.assert_close(
        ls, torch.tensor(ref["losses"]), rtol=1e-5, atol=1e-6, msg=lambda m: f"{name} losses vs DDP: {m}"
    )
    p, e = torch.tensor(a["params"]), torch.tensor(a["ema"])
    p_ref, e_ref = torch.tensor(ref["params"]), torch.tensor(ref["ema"])
    torch.testing.assert_close(p, p_ref, rtol=0, atol=2e-6, msg=lambda m: f"{name} weights after resume vs DDP: {m}")
    torch.testing.assert_close(e, e_ref, rtol=0, atol=2e-6, msg=lambda m: f"{name} EMA after resume vs DDP: {m}")
    assert (p - e).abs().max() > 1e-3  # the EMA lags the weights: it is a real average, not a copy
    for r in (a, b):
        sk = r["skip"]
        assert sk["skipped"] and sk["unchanged"] and sk["finite"] and sk["moved"] > 1e-4, (name, sk)


@pytest.mark.slow
def test_zero_stages_match_ddp_and_resume(tmp_path):
    r0, r1 = _launch(tmp_path, ["zero1", "zero2", "zero3"])
    for name, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3)):
        _check_against_ddp(r0, r1, name, stage)
    z3 = r0["zero3"]
    assert z3["local_numel"] * 2 >= z3["numel"] and z3["local_numel"] < z3["numel"]  # each rank holds ~half
    run = tmp_path / "zero3" / "checkpoints"
    tags = sorted(d.name for d in (run / "deepspeed").iterdir() if d.is_dir())
    assert tags == ["step_00000002", "step_00000004"]
    ck = torch.load(run / "ckpt_00000004.pt", weights_only=True)
    assert ck["optimizer"] == {"deepspeed_tag": "step_00000004", "zero_stage": 3}
    assert ck["model"]["x_embedder.proj.weight"].numel() > 0  # full (gathered) weights, not empty partitions


def _cpu_adam_built() -> bool:
    """DeepSpeed's cpu_adam op is pre-installed or already JIT-built (a first build takes minutes)."""
    from deepspeed.git_version_info import installed_ops
    from torch.utils.cpp_extension import _get_build_directory

    if installed_ops.get("cpu_adam"):
        return True
    return any(Path(_get_build_directory("cpu_adam", verbose=False)).glob("cpu_adam*.so"))


@pytest.mark.slow
@pytest.mark.skipif(
    not _cpu_adam_built(),
    reason="DeepSpeed's cpu_adam op is not built (its JIT build takes minutes); build it once with "
    "DS_BUILD_CPU_ADAM=1 pip install deepspeed, or by constructing deepspeed.ops.adam.DeepSpeedCPUAdam",
)
def test_zero2_offload_matches_ddp_and_resume(tmp_path):
    r0, r1 = _launch(tmp_path, ["zero2_offload"])
    _check_against_ddp(r0, r1, "zero2_offload", 2)


def _cfg(*extra: str):
    return load_config(
        None, ["optim.name=adamw", "data.batch_size=12", "optim.grad_accum_steps=2", "optim.grad_clip=1.5", *extra]
    )


def test_resolve_fills_auto_from_trainer():
    ds = json.loads((ROOT / "diffcurr_fast" / "recipes" / "ds" / "zero2.json").read_text())
    out = resolve_deepspeed_config(ds, _cfg("engine.precision=bf16"), world_size=3, device_type="cpu")
    assert out["train_batch_size"] == 12 and out["gradient_accumulation_steps"] == 2
    assert out["train_micro_batch_size_per_gpu"] == 2 and out["gradient_clipping"] == 1.5
    assert out["bf16"]["enabled"] is False  # bf16 weights need CUDA; CPU keeps fp32 with bf16 autocast
    assert resolve_deepspeed_config(ds, _cfg("engine.precision=bf16"), 3, "cuda")["bf16"]["enabled"] is True
    assert ds["train_batch_size"] == "auto"  # the input is not modified


@pytest.mark.parametrize(
    "patch, match",
    [
        ({"train_batch_size": 16}, "train_batch_size=16 disagrees"),
        ({"gradient_clipping": 1.0}, "gradient_clipping=1.0 disagrees"),
        ({"optimizer": {"type": "Adam"}}, "'optimizer' section"),
        ({"scheduler": {"type": "WarmupLR"}}, "'scheduler' section"),
        ({"fp16": {"enabled": True}}, "fp16 is not supported"),
        ({"bf16": {"enabled": True}}, "bf16.enabled=True disagrees"),
        ({"zero_optimization": {"stage": 4}}, "stage 4 is invalid"),
        ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme"}}}, "'nvme' is not supported"),
    ],
)
def test_resolve_rejects_conflicts(patch, match):
    ds = {**json.loads((ROOT / "diffcurr_fast" / "recipes" / "ds" / "zero1.json").read_text()), **patch}
    with pytest.raises(ValueError, match=match):
        resolve_deepspeed_config(ds, _cfg(), world_size=2, device_type="cpu")


def test_resolve_rejects_indivisible_batch():
    with pytest.raises(ValueError, match="not divisible by world size 5 x optim.grad_accum_steps 2"):
        resolve_deepspeed_config({}, _cfg(), world_size=5, device_type="cpu")


def test_config_requires_deepspeed_json():
    with pytest.raises(ValueError, match="engine.deepspeed_config is required"):
        load_config(None, ["optim.name=adamw", "engine.kind=deepspeed"])
    zero2 = "engine.deepspeed_config=diffcurr_fast/recipes/ds/zero2.json"
    cfg = load_config(None, ["optim.name=adamw", "engine.kind=deepspeed", zero2])
    assert cfg.engine.kind == "deepspeed"


def test_recipes_resolve():
    for name, stage in (("zero1", 1), ("zero2", 2), ("zero3", 3), ("zero2_offload", 2)):
        ds = json.loads((ROOT / "diffcurr_fast" / "recipes" / "ds" / f"{name}.json").read_text())
        out = resolve_deepspeed_config(ds, _cfg(), world_size=2, device_type="cuda")
        assert out["zero_optimization"]["stage"] == stage
    cfg = load_config(ROOT / "diffcurr_fast" / "recipes" / "dit_l2_zero2.yaml")
    # the recipe's relative path is relative to the recipe's folder, wherever the command runs
    assert (
        cfg.engine.kind == "deepspeed"
        and Path(cfg.engine.deepspeed_config) == ROOT / "diffcurr_fast" / "recipes" / "ds" / "zero2.json"
    )
    out = resolve_deepspeed_config(json.loads(Path(cfg.engine.deepspeed_config).read_text()), cfg, 8, "cuda")
    assert out["train_micro_batch_size_per_gpu"] * 8 * out["gradient_accumulation_steps"] == cfg.data.batch_size


def test_train_cli_accepts_launcher_local_rank():
    """The deepspeed launcher puts --local_rank=N right after the module, before the subcommand (one declaration,
    in the top-level parser; the rank itself is read from LOCAL_RANK)."""
    from diffcurr_fast.cli import build_parser

    argv = ["--local_rank=3", "train", "diffcurr_fast/recipes/dit_l2_zero2.yaml"]
    args = build_parser(argv).parse_args(argv)
    assert args.local_rank == 3 and args.recipe == "diffcurr_fast/recipes/dit_l2_zero2.yaml"
    argv = ["--local-rank", "1", "train"]
    assert build_parser(argv).parse_args(argv).local_rank == 1


def test_engine_needs_launcher_environment(monkeypatch):
    from diffcurr_fast.train.engine import create_engine

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match="engine.kind 'deepspeed' needs the deepspeed or torchrun launcher .*RANK"):
        create_engine("deepspeed", "cpu")


@pytest.mark.parametrize("batch", [6, 34])
def test_grad_accumulation_equals_full_batch(tmp_path, batch):
    """The engine-level micro-batch loop: 2 micro-batches give the full-batch step (same t; the objective here is
    noise-free, since each micro-batch draws its own Philox noise stream)."""
    from diffcurr_fast.train.engine import Engine
    from diffcurr_fast.train.loop import Trainer

    out = {}
    for acc in (1, 2):
        over = [
            "model.hidden_size=20",
            "model.depth=1",
            "model.num_heads=2",
            "model.class_dropout_prob=0.0",
            "logging.cfg_scale=1",  # no null label: the end-of-run grid without guidance
            "diffusion.num_timesteps=40",
            "curriculum.num_clusters=4",
            f"data.batch_size={batch}",
            f"optim.grad_accum_steps={acc}",
            "optim.grad_clip=0.3",
            "optim.warmup_steps=0",
            f"checkpoint.run_dir={tmp_path}/a{acc}",
        ]
        tr = Trainer(load_config(None, over), Engine("cpu"))
        tr.objective = lambda net, x, y, k, seed, generator, **_: ((net(x, k, y)[:, :1] - x) ** 2).mean((1, 2, 3))
        for _ in range(2):
            x0, y = next(tr.loader)
            stats = tr.train_step(x0, y)
        out[acc] = (torch.cat([p.detach().flatten() for p in tr.model.parameters()]), stats)
    (p1, s1), (p2, s2) = out[1], out[2]
    torch.testing.assert_close(s2["loss"], s1["loss"], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(s2["grad_norm"], s1["grad_norm"], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(p2, p1, rtol=0, atol=1e-6)
    assert torch.equal(s1["k"], s2["k"])
    with pytest.raises(ValueError, match="not divisible by the world size 1 x optim.grad_accum_steps 4"):
        Trainer(
            load_config(None, over + ["optim.grad_accum_steps=4", "data.batch_size=6"]), Engine("cpu"), overwrite=True
        )


def test_deepspeed_engine_uses_no_private_state():
    """A non-finite step is skipped through DeepSpeed's public behaviour (its overflow check, was_step_applied,
    zero_grad), never by rewriting the ZeRO optimizer's private fields (which break on an upgrade)."""
    import inspect
    import re

    from diffcurr_fast.train.engine import DeepSpeedEngine

    src = inspect.getsource(DeepSpeedEngine)
    assert "skip_step" not in src and "was_step_applied" in src
    private = re.findall(r"\.optimizer\.\w+|micro_step_id|averaged_gradients|all_grad_tensors|reset_cpu_buffers", src)
    assert not private, private
