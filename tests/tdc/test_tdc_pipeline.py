"""End-to-end TDC pipeline (``run_tdc``, ``diffcurr-fast tdc``, ``sample --bundle``) and the Trainer kwargs it uses."""

import argparse
import json

import pytest
import torch
import yaml
from conftest import set_args
from safetensors.torch import load_file

from diffcurr_fast import cli_sample
from diffcurr_fast.diffusion import Readout
from diffcurr_fast.models import DiT
from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint
from diffcurr_fast.runs.config import config_from_dict
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.runs.sampling import build_schedule, sample
from diffcurr_fast.runs.sections import TDCConfig
from diffcurr_fast.tdc import cli_tdc as tdc_cli
from diffcurr_fast.tdc.accounting import training_flops
from diffcurr_fast.tdc.experts import MultiExpertDenoiser
from diffcurr_fast.tdc.flops import dit_flops
from diffcurr_fast.tdc.pipeline import (
    format_accounting,
    load_bundle_with_config,
    run_tdc,
    stage2_config,
)
from diffcurr_fast.train.loop import Trainer

TINY = [
    "model.hidden_size=32",
    "model.depth=2",
    "model.num_heads=2",
    "diffusion.num_timesteps=40",
    "curriculum.num_clusters=4",
    "data.batch_size=17",
    "engine.max_steps=4",
    "engine.cpu_threads=1",
    "logging.progress=false",
    "logging.num_samples=3",
    "logging.sample_steps=4",
    "logging.log_every=2",
]
TINY_TDC = {
    "num_groups": 2,
    "budget_floor": 0.5,
    "rounds": 2,
    "candidates": 2,
    "recover_steps": 1,
    "search_batches": 1,
    "heldout_batches": 1,
    "importance_batches": 1,
    "finetune_steps": 3,
    "search_batch_size": 9,
}


def tiny_cfg(run_dir, *extra):
    return load_config(None, [*TINY, f"checkpoint.run_dir={run_dir}", *extra])


@pytest.fixture(scope="module")
def tdc_run(tmp_path_factory):
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    run = tmp_path_factory.mktemp("tdc") / "run"
    calls = []  # the timestep of every network evaluation of the bundle (only the grid samples it)
    forward = MultiExpertDenoiser.forward
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(MultiExpertDenoiser, "forward", lambda self, x, t, *a: calls.append(t) or forward(self, x, t, *a))
        out = run_tdc(tiny_cfg(run), TINY_TDC, run, verbose=False)
    out["grid_timesteps"] = calls
    yield run, out
    torch.set_num_threads(n)


def test_every_artefact_exists(tdc_run):
    run, out = tdc_run
    for rel in (
        "tdc.json",
        "accounting.json",
        "samples.png",
        "stage1/ema.safetensors",
        "stage1/samples.png",
        "bundle/bundle.json",
        "bundle/weights.safetensors",
        "bundle/train_config.json",
    ):
        assert (run / rel).is_file(), rel
    assert latest_checkpoint(run / "stage1") is not None
    for g in range(2):
        gd = run / f"group_{g}"
        assert (gd / "search.png").stat().st_size > 1000
        search = json.loads((gd / "search.json").read_text())
        assert len(search["history"]) == 2 and search["bank"]
        assert (gd / "finetune" / "ema.safetensors").is_file()
        assert latest_checkpoint(gd / "finetune") is not None
    assert out["bundle"] == str(run / "bundle") and len(out["groups"]) == 2


def test_bundle_loads_and_samples(tdc_run):
    run, _ = tdc_run
    multi, cfg = load_bundle_with_config(run / "bundle")
    assert [tuple(r) for r in multi.ranges][0][0] == 0 and multi.num_timesteps == 40
    assert cfg.model.hidden_size == 32 and cfg.diffusion.learn_sigma
    x = sample(
        multi,
        build_schedule(cfg),
        sampler="ddim",
        steps=5,
        labels=torch.tensor([0, 3, 9]),
        channels=1,
        size=8,
        num_classes=10,
        readout=Readout("eps", learn_sigma=True),
        cfg_scale=1.5,
        seed=1,
    )
    assert x.shape == (3, 1, 8, 8) and torch.isfinite(x).all()


def test_experts_meet_budgets_and_match_finetune_runs(tdc_run):
    run, _ = tdc_run
    meta = json.loads((run / "bundle" / "bundle.json").read_text())
    weights = load_file(str(run / "bundle" / "weights.safetensors"))
    for i, (grp, expert_cfg) in enumerate(zip(meta["groups"], meta["experts"], strict=True)):
        assert dit_flops(expert_cfg) <= grp["flops"] + 1e-6
        state = load_checkpoint(latest_checkpoint(run / f"group_{i}" / "finetune"))
        assert state["model_config"] == expert_cfg  # the heterogeneous expert can be rebuilt from its checkpoint
        assert state["step"] == 3
        for name, v in state["ema"]["module"].items():  # the bundle holds the fine-tuned EMA weights
            torch.testing.assert_close(weights[f"experts.{i}.{name}"], v, rtol=0, atol=0)
    assert meta["groups"][1]["ratio"] < 1.0 and dit_flops(meta["experts"][1]) < dit_flops(meta["experts"][0])


def test_accounting_matches_formula(tdc_run):
    run, out = tdc_run
    acc = json.loads((run / "accounting.json").read_text())
    meta = json.loads((run / "bundle" / "bundle.json").read_text())
    f = dit_flops(DiT.from_config(load_checkpoint(latest_checkpoint(run / "stage1"))["model_config"]))
    assert acc["base_flops_per_forward"] == f
    want = training_flops(f, [dit_flops(c) for c in meta["experts"]], 4, 3, 17)
    for key in ("stage1_flops", "stage2_flops", "tdc_flops", "single_model_flops", "ratio"):
        assert acc["training"][key] == pytest.approx(want[key], rel=1e-12)
    assert acc["training"]["ratio"] < 1.0  # the second expert is pruned
    assert acc["training"]["search_flops"] > 0
    assert acc["training"]["tdc_flops_with_search"] == pytest.approx(
        want["tdc_flops"] + acc["training"]["search_flops"]
    )
    s = acc["sampling"]["ddim4"]
    assert s["steps"] == 4 and s["cfg"] is True and s["flops_ratio"] > 1.0  # the demo samples with guidance 2
    assert sum(acc["sampling"]["ddpm40"]["steps_per_group"]) == 40
    assert out["accounting_data"] == acc
    text = format_accounting(acc)
    assert f"ratio {acc['training']['ratio']:.3f}" in text and "sampling ddim4" in text and "sampling ddpm40" in text


def test_grid_and_accounting_use_one_sampler(tdc_run):
    """The sampling accounting counts the network evaluations the grid's sampler made, group by group."""
    run, out = tdc_run
    multi, cfg = load_bundle_with_config(run / "bundle")
    grid = [t for t in out["grid_timesteps"] if t.numel() > 1]  # 3 guided samples: batches of 6
    probe = [t for t in out["grid_timesteps"] if t.numel() == 1]  # the accounting's one-image run of that sampler
    assert all(t.unique().numel() == 1 for t in grid)  # each evaluation is at one timestep
    visited = torch.cat([t.unique() for t in grid])
    assert torch.equal(torch.cat(probe), visited)
    acc = out["accounting_data"]["sampling"][f"{cfg.logging.sampler}{cfg.logging.sample_steps}"]
    assert acc["steps"] == len(grid) == 4
    assert torch.bincount(multi.group_index(visited), minlength=2).tolist() == acc["steps_per_group"]


def _sample_args(*argv):
    p = argparse.ArgumentParser()
    cli_sample.add_arguments(p)
    return p.parse_args(list(argv))


def test_sample_command_takes_bundle_and_pruned_checkpoint(tdc_run, tmp_path, capsys):
    run, _ = tdc_run
    out = tmp_path / "b.npz"
    assert (
        cli_sample.run(_sample_args("--bundle", str(run / "bundle"), "--steps", "4", "--num", "5", "--out", str(out)))
        == 0
    )
    assert f"from bundle {run / 'bundle'}" in capsys.readouterr().out
    import numpy as np

    z = np.load(out)
    assert z["arr_0"].shape == (5, 8, 8, 1) and z["arr_0"].dtype == np.uint8  # ADM layout
    png = tmp_path / "e.png"  # the pruned expert of group 1 alone, rebuilt from model_config in its checkpoint
    assert (
        cli_sample.run(
            _sample_args("--ckpt", str(run / "group_1" / "finetune"), "--steps", "4", "--num", "3", "--out", str(png))
        )
        == 0
    )
    assert png.stat().st_size > 100
    with pytest.raises(ValueError, match="--weights model is not available with --bundle"):
        cli_sample.run(_sample_args("--bundle", str(run / "bundle"), "--weights", "model", "--out", str(png) + ".png"))
    with pytest.raises(SystemExit):  # --ckpt and --bundle are exclusive
        _sample_args("--bundle", "a", "--ckpt", "b", "--out", "x.png")


# ---- Trainer kwargs --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lo, hi", [(0, 1), (5, 9), (31, 40)])
def test_trainer_timestep_range_restricts_t(tmp_path, lo, hi):
    cfg = tiny_cfg(tmp_path / "r", "curriculum.pacing=none", "logging.num_samples=0")
    tr = Trainer(cfg, timestep_range=(lo, hi))
    x0, y = next(tr.loader)
    ks = torch.cat([tr.train_step(x0, y)["k"] for _ in range(3)])
    assert ks.numel() == 51 and int(ks.min()) >= lo and int(ks.max()) < hi
    if hi - lo > 1:
        assert ks.unique().numel() > 1


@pytest.mark.parametrize(
    "rng, extra, match",
    [
        ((5, 5), [], r"timestep_range \(5, 5\) must satisfy 0 <= lo < hi <= 40"),
        ((-1, 3), [], "0 <= lo < hi"),
        ((0, 41), [], "<= 40"),
        ("ab", [], "must be a \\(lo, hi\\) pair of ints"),
    ],
)
def test_trainer_timestep_range_errors(tmp_path, rng, extra, match):
    cfg = tiny_cfg(tmp_path / "r", "curriculum.pacing=none", *extra)
    with pytest.raises(ValueError, match=match):
        Trainer(cfg, timestep_range=rng)


def test_trainer_curriculum_inside_a_timestep_range(tmp_path):
    """A curriculum composes with a TDC range: its clusters partition [lo, hi) and unlock there, easiest first."""
    extra = ("curriculum.pacing=fixed", "curriculum.stage_iters=2", "curriculum.num_clusters=3")
    cfg = tiny_cfg(tmp_path / "r", *extra, "logging.num_samples=0")
    tr = Trainer(cfg, timestep_range=(10, 31))
    assert tr.curriculum.num_timesteps == 21
    x0, y = next(tr.loader)
    for step in range(6):
        lo, hi = (10 + v for v in tr.curriculum.clusters[tr.curriculum.unlocked_clusters[-1]])
        ks = tr.train_step(x0, y)["k"]
        assert int(ks.min()) >= 10 and int(ks.max()) < 31
        if step < 2:  # only the easiest (highest-t) cluster of the range is unlocked
            assert int(ks.min()) >= lo and hi == 31
    assert tr.curriculum.stage == 2


def test_trainer_trains_given_heterogeneous_model(tmp_path):
    cfg = tiny_cfg(tmp_path / "r", "engine.max_steps=2", "logging.num_samples=0", "logging.plots=false")
    model = DiT(
        input_size=8,
        in_channels=1,
        num_classes=10,
        hidden_size=32,
        depth=2,
        num_heads=2,
        patch_size=2,
        learn_sigma=True,
        num_timesteps=40,
        block_num_heads=[1, 2],
        block_mlp_hidden=[16, 40],
    )
    before = {k: v.clone() for k, v in model.state_dict().items()}
    tr = Trainer(cfg, model=model)
    assert tr.model is model
    tr.fit()
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    state = load_checkpoint(latest_checkpoint(tmp_path / "r"))
    assert state["model_config"]["block_mlp_hidden"] == [16, 40]
    rebuilt = DiT.from_config(state["model_config"])
    rebuilt.load_state_dict(state["model"])  # strict: the recorded config rebuilds the exact architecture
    assert Trainer(cfg, model=DiT.from_config(state["model_config"]), resume=True).step == 2


def test_trainer_rejects_mismatched_model(tmp_path):
    cfg = tiny_cfg(tmp_path / "r")
    bad = DiT(input_size=8, in_channels=1, num_classes=10, hidden_size=32, depth=1, num_heads=2, learn_sigma=False)
    with pytest.raises(ValueError, match="learn_sigma=False but the config needs True"):
        Trainer(cfg, model=bad)


# ---- options, config, CLI --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, match",
    [
        ({"budget_floor": 0.0}, r"tdc.budget_floor must lie in \(0.0, 1.0\], got 0.0"),
        ({"proposer": "random"}, "invalid value 'random' for tdc.proposer; valid choices: local, uniform, llm"),
        ({"proposer": "llm"}, "needs tdc.llm_url and tdc.llm_model"),
        ({"rounds": 0}, "tdc.rounds must be >= 1"),
        ({"recover_lr": float("inf")}, r"tdc.recover_lr must be a finite number, got inf"),
        ({"finetune_steps": 2.5}, "tdc.finetune_steps must be of type int, got 2.5"),
        ({"bogus": 1}, "unknown config key 'tdc.bogus'; valid keys of tdc: num_groups"),
        ({"group_method": "kmeans"}, "valid choices: db, uniform, snr, log_snr"),
        ({"num_groups": 1001}, r"tdc.num_groups \(1001\) must be <= diffusion.num_timesteps \(1000\)"),
    ],
)
def test_options_errors(data, match):
    with pytest.raises(ValueError, match=match):
        config_from_dict({"tdc": data})


def test_options_and_stage2_config(tmp_path):
    opts = config_from_dict({"tdc": {"budget_floor": 1, "finetune_steps": 7, "finetune_lr": 3e-4}}).tdc
    assert opts.budget_floor == 1.0 and isinstance(opts.budget_floor, float) and isinstance(opts, TDCConfig)
    base = tiny_cfg(tmp_path, "curriculum.pacing=patience", "optim.warmup_steps=50")
    base.tdc = opts
    cfg = stage2_config(base, tmp_path / "f")
    assert cfg.engine.max_steps == 7 and cfg.curriculum.pacing == "none" and cfg.optim.lr == 3e-4
    assert cfg.logging.num_samples == 0 and cfg.checkpoint.run_dir == str(tmp_path / "f")
    assert cfg.optim.warmup_steps == 0 and cfg.checkpoint.every == 7


@pytest.mark.parametrize(
    "extra, match",
    [
        (["tdc.num_groups=41"], r"tdc.num_groups \(41\) must be <= diffusion.num_timesteps \(40\)"),
        (["tdc.search_batches=200"], r"\(200 \+ 2\) batches of 17 need 3434 samples, the dataset has 1797"),
    ],
)
def test_run_tdc_rejects_unsupported(tmp_path, extra, match):
    """Refused up front: nothing is written and stage 1 does not train."""
    with pytest.raises(ValueError, match=match):
        run_tdc(tiny_cfg(tmp_path / "r", *extra), None, tmp_path / "r", verbose=False)
    assert not (tmp_path / "r").exists()


def test_overwrite_keeps_user_files_and_refuses_without_it(tmp_path):
    run = tmp_path / "run"
    run_tdc(tiny_cfg(run, "logging.num_samples=0"), {**TINY_TDC, "finetune_steps": 1}, run, verbose=False)
    (run / "notes.txt").write_text("keep")
    (run / "stage1" / "checkpoints" / "my_best_model.pt").write_text("keep")
    (run / "group_0" / "mine.txt").write_text("keep")
    with pytest.raises(FileExistsError, match="--overwrite"):
        run_tdc(tiny_cfg(run, "logging.num_samples=0"), {**TINY_TDC, "finetune_steps": 1}, run, verbose=False)
    run_tdc(
        tiny_cfg(run, "logging.num_samples=0"), {**TINY_TDC, "finetune_steps": 1}, run, overwrite=True, verbose=False
    )
    for rel in ("notes.txt", "stage1/checkpoints/my_best_model.pt", "group_0/mine.txt", "bundle/bundle.json"):
        assert (run / rel).is_file(), rel


def _tdc_args(*argv):
    p = argparse.ArgumentParser()
    tdc_cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_cli_resolve_defaults_recipe_and_overrides(tmp_path, capsys):
    cfg, run_dir = tdc_cli.resolve(_tdc_args())
    opts = cfg.tdc
    assert (opts.num_groups, opts.budget_floor, opts.rounds, opts.candidates) == (3, 0.5, 2, 3)
    assert 100 <= cfg.engine.max_steps <= 1000 and cfg.curriculum.pacing == "none" and str(run_dir) == "runs/tdc"
    # the training demo with TDC_DEMO's changes, as it was resolved when it was a copy of the embedded dict
    want = load_config(None).to_dict()
    for section, values in {
        "optim": {"lr": 1e-3, "warmup_steps": 50, "schedule": "constant", "min_lr": 0.0, "ema_decay": 0.995},
        "engine": {"max_steps": 800},
        "logging": {"num_samples": 100, "sample_steps": 50, "progress": False},
        "checkpoint": {"run_dir": "runs/tdc", "every": 1000, "keep_last": 1},
        "tdc": {"recover_steps": 10, "finetune_steps": 200, "finetune_lr": 5e-4},
    }.items():
        want[section].update(values)
    want["tdc"].update(num_groups=3, budget_floor=0.5, rounds=2, candidates=3)
    assert cfg.to_dict() == want
    cfg, _ = tdc_cli.resolve(_tdc_args("--curriculum", "--set", "tdc.rounds=5", "--set", "optim.lr=2e-4"))
    assert cfg.curriculum.pacing == "patience" and cfg.tdc.rounds == 5 and cfg.optim.lr == 2e-4
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        "model: {hidden_size: 32, num_heads: 2}\ntdc: {num_groups: 4, budget_floor: 0.25, proposer: uniform}\n"
        "checkpoint: {run_dir: out/x}\n"
    )
    cfg, run_dir = tdc_cli.resolve(_tdc_args(str(recipe), "--set", "tdc.budget_floor=0.75", "--run-dir", "y"))
    opts = cfg.tdc
    assert cfg.model.hidden_size == 32 and (opts.num_groups, opts.budget_floor, opts.proposer) == (4, 0.75, "uniform")
    assert str(run_dir) == "y"
    assert tdc_cli.run(_tdc_args(str(recipe), "--dry-run")) == 0
    assert "num_groups: 4" in capsys.readouterr().out
    assert tdc_cli.run(_tdc_args("--help-config")) == 0
    assert "tdc:  # TDC training" in capsys.readouterr().out
    with pytest.raises(ValueError, match="unknown config section 'tdcx'"):
        tdc_cli.resolve(_tdc_args("--set", "tdcx.rounds=1"))
    with pytest.raises(ValueError, match="unknown config key 'tdc.round'; valid keys of tdc: num_groups"):
        tdc_cli.resolve(_tdc_args("--set", "tdc.round=1"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        tdc_cli.resolve(_tdc_args(str(tmp_path / "missing.yaml")))


def test_cli_refuses_existing_run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "tdc.json").write_text("{}")
    with pytest.raises(FileExistsError, match="not empty; pass .*--overwrite"):
        tdc_cli.run(_tdc_args("--run-dir", str(run), *set_args(*TINY)))


def test_curriculum_stage1_llm_proposer_and_overwrite(tmp_path):
    """Stage 1 with the difficulty curriculum, the llm proposer wired through the options (an unreachable endpoint:
    every request fails, is counted, and the local proposer fills the rounds), and --overwrite of an old run."""
    run = tmp_path / "run"
    (run / "group_5").mkdir(parents=True)
    (run / "accounting.json").write_text("{}")
    (run / "tdc.json").write_text('{"config": {}}')  # the record an old TDC run leaves (what --overwrite looks for)
    (run / "notes.txt").write_text("keep")
    cfg = tiny_cfg(
        run, "curriculum.pacing=patience", "curriculum.patience=1", "curriculum.eval_every=1", "logging.num_samples=0"
    )
    recipe = tmp_path / "recipe.yaml"  # a recipe path with a tdc: section; the options dict overrides it
    llm = {"proposer": "llm", "llm_url": "http://127.0.0.1:9/v1", "llm_model": "m", "llm_fallback": "local"}
    recipe.write_text(yaml.safe_dump({**cfg.to_dict(), "tdc": {**TINY_TDC, **llm, "rounds": 3}}))
    opts = {"rounds": 1}
    out = run_tdc(recipe, opts, run, overwrite=True, verbose=False)
    assert not (run / "group_5").exists() and (run / "notes.txt").read_text() == "keep"
    assert (run / "stage1" / "curriculum.png").is_file() and "samples" not in out
    for g in range(2):
        search = json.loads((run / f"group_{g}" / "search.json").read_text())
        assert search["rejected"]["llm_requests"] == 1 and search["rejected"]["llm_network_errors"] == 1
        assert {e["source"] for e in search["bank"]} == {"local"} and len(search["history"]) == 1
    assert load_bundle_with_config(run / "bundle")[0].num_timesteps == 40


def test_unreachable_llm_stops_the_command_with_one_line(tmp_path, capsys):
    """tdc.proposer=llm whose endpoint gives no reply, with the default tdc.llm_fallback (none): the command stops
    with one error line naming the endpoint and the fallback, exit 2, and no bundle."""
    from diffcurr_fast import cli

    llm = {"proposer": "llm", "llm_url": "http://127.0.0.1:9/v1", "llm_model": "m"}  # nothing listens on port 9
    tdc = {**TINY_TDC, **llm, "rounds": 1, "finetune_steps": 1}
    sets = [*TINY, "logging.num_samples=0", *(f"tdc.{k}={v}" for k, v in tdc.items())]
    capsys.readouterr()
    rc = cli.main(["tdc", "--run-dir", str(tmp_path / "run"), *set_args(*sets)])
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line.lower()]
    assert rc == 2 and len(errors) == 1, errors
    assert errors[0].startswith(
        "diffcurr-fast tdc: error: tdc.proposer 'llm': the endpoint http://127.0.0.1:9/v1/chat/completions gave no "
        "reply ("
    ), errors
    assert errors[0].endswith("or set tdc.llm_fallback=local to let the local proposer fill such rounds"), errors
    assert (tmp_path / "run" / "stage1").is_dir() and not (tmp_path / "run" / "bundle").exists()


def test_bundle_without_config_is_refused(tdc_run, tmp_path):
    import shutil

    run, _ = tdc_run
    shutil.copytree(run / "bundle", tmp_path / "b")
    (tmp_path / "b" / "train_config.json").unlink()
    with pytest.raises(ValueError, match="has no train_config.json"):
        load_bundle_with_config(tmp_path / "b")


def test_search_scores_on_the_training_objective(tmp_path, monkeypatch):
    """Importance, recovery and the proxy use the objective stage 1 trained (here MinSNR-1 on v prediction): the
    proxy of every candidate equals the held-out loss recomputed with that objective."""
    from diffcurr_fast.objective import batch_loss
    from diffcurr_fast.tdc import search
    from diffcurr_fast.timesteps.base import range_mask

    seen = []
    real = search.proxy_loss

    def spy(model, group, heldout, *, objective, seed=1234):
        value = real(model, group, heldout, objective=objective, seed=seed)
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            w = range_mask(objective.num_cells, (group.lo, group.hi)).weights()  # DDPM: t ~ U[group]
            again = sum(float(batch_loss(objective, model.eval(), x, y, w, gen)) for x, y in heldout)
        seen.append((objective.prediction, objective.weighting, objective.gamma, value, again / len(heldout)))
        return value

    monkeypatch.setattr(search, "proxy_loss", spy)
    cfg = tiny_cfg(
        tmp_path / "r",
        "diffusion.prediction=v",
        "diffusion.weighting=min_snr",
        "diffusion.min_snr_gamma=1",
        "logging.num_samples=0",
    )
    run_tdc(cfg, {**TINY_TDC, "finetune_steps": 1}, tmp_path / "r", verbose=False)
    assert seen and all(s[:3] == ("v", "min_snr", 1.0) for s in seen)
    for *_, value, again in seen:
        assert value == pytest.approx(again, rel=1e-6)


# ---- resume ----------------------------------------------------------------------------------------------------


def _bundle_weights(run):
    return load_file(str(run / "bundle" / "weights.safetensors"))


def _banks(run):
    return [json.loads((run / f"group_{g}" / "search.json").read_text())["bank"] for g in range(2)]


class _Crash(RuntimeError):
    pass


@pytest.mark.parametrize("where", ["after_group_0", "in_search_round_1"])
def test_killed_run_resumes_to_the_same_result(tdc_run, tmp_path, monkeypatch, where):
    """A run killed after group 0 (or during round 1 of group 1's search, after round 0's state was saved) and
    resumed with ``resume=True`` ends with the bundle and memory banks of the uninterrupted run; stage 1, group 0
    and the saved rounds are not redone."""
    from diffcurr_fast.tdc import pipeline, search

    ref_run, _ = tdc_run
    torch.set_num_threads(1)
    run = tmp_path / "run"
    calls = {"fit": 0, "search_group": [], "rounds": []}
    real_fit, real_group, real_stats = Trainer.fit, pipeline.search_group, search._round_stats

    def fit(self):
        calls["fit"] += 1
        return real_fit(self)

    def group(cfg, base, g, *a, **kw):
        calls["search_group"].append(g.index)
        if where == "after_group_0" and g.index == 1 and crash["on"]:
            raise _Crash
        return real_group(cfg, base, g, *a, **kw)

    def stats(r, *a):
        calls["rounds"].append(r)
        if where == "in_search_round_1" and r == 1 and len(calls["search_group"]) == 2 and crash["on"]:
            raise _Crash  # group 1, round 1: its round-0 state is on disk
        return real_stats(r, *a)

    crash = {"on": True}
    monkeypatch.setattr(Trainer, "fit", fit)
    monkeypatch.setattr(pipeline, "search_group", group)
    monkeypatch.setattr(search, "_round_stats", stats)
    with pytest.raises(_Crash):
        run_tdc(tiny_cfg(run), TINY_TDC, run, verbose=False)
    assert (run / "group_0" / "expert.safetensors").is_file() and not (run / "bundle").exists()
    with pytest.raises(FileExistsError, match="--resume"):
        run_tdc(tiny_cfg(run), TINY_TDC, run, verbose=False)
    with pytest.raises(ValueError, match="cannot resume the TDC run: its config differs: tdc.rounds"):
        run_tdc(tiny_cfg(run), {**TINY_TDC, "rounds": 3}, run, resume=True, verbose=False)
    crash["on"], fits = False, calls["fit"]
    calls.update(search_group=[], rounds=[])
    run_tdc(tiny_cfg(run), TINY_TDC, run, resume=True, verbose=False)
    assert calls["fit"] - fits == 1  # only group 1's fine-tune: stage 1 is loaded, not refit
    assert calls["search_group"] == [1]  # group 0 kept
    assert calls["rounds"] == ([0, 1] if where == "after_group_0" else [1])  # the saved round is not redone
    ref, got = _bundle_weights(ref_run), _bundle_weights(run)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    assert _banks(run) == _banks(ref_run)


# ---- formulations ----------------------------------------------------------------------------------------------

CONTINUOUS = ["diffusion.learn_sigma=false", "diffusion.weighting=none"]
FORMULATIONS = {
    "ddpm_v_ddim": ["diffusion.prediction=v"],
    "ddpm_dtr": ["model.dtr=true"],  # DTR routes the residual width D, which pruning keeps whole
    "ddpm_x0_heun": ["diffusion.prediction=x0", "logging.sampler=heun"],  # the ODE sampler: fractional t
    "flow_euler": [*CONTINUOUS, "diffusion.formulation=flow", "diffusion.prediction=velocity", "logging.sampler=euler"],
    "flow_heun": [*CONTINUOUS, "diffusion.formulation=flow", "diffusion.prediction=velocity", "logging.sampler=heun"],
    "edm_heun": [*CONTINUOUS, "diffusion.formulation=edm", "diffusion.prediction=x0", "logging.sampler=heun"],
}


@pytest.mark.parametrize("name", list(FORMULATIONS))
def test_tdc_end_to_end_per_formulation(tmp_path, name):
    """TDC on the digits with each formulation's objective and samplers: groups are cell ranges of its difficulty
    axis, the bundle routes the network input time of every cell of a group (flow t, EDM c_noise, DDPM t) to that
    group's expert, the grid is sampled through the routing and the accounting counts the sampler's evaluations."""
    from diffcurr_fast.objective import Objective
    from diffcurr_fast.runs.sampling import build_schedule

    torch.set_num_threads(1)
    run = tmp_path / "run"
    cfg = tiny_cfg(run, *FORMULATIONS[name])
    out = run_tdc(cfg, {**TINY_TDC, "finetune_steps": 2}, run, verbose=False)
    multi, saved = load_bundle_with_config(run / "bundle")
    assert saved.diffusion.formulation == cfg.diffusion.formulation and (run / "samples.png").is_file()
    assert all((e.dtr is not None) == cfg.model.dtr and e.hidden_size == 32 for e in multi.experts)  # DTR kept
    groups = [g["group"] for g in out["groups"]]
    assert groups[0]["lo"] == 0 and groups[-1]["hi"] == 40 and len(groups) == 2
    assert groups[0]["snr_db_range"][0] > groups[1]["snr_db_range"][1]  # ascending noise: the first is the hardest
    objective = Objective.from_config(cfg, build_schedule(cfg))
    for g in groups:
        k = torch.arange(g["lo"], g["hi"]).repeat(4)  # every cell of the group, drawn 4 times
        t_in = objective.draw(k, torch.Generator().manual_seed(0)).t_in
        assert multi.group_index(t_in).tolist() == [g["index"]] * k.numel()
    acc = out["accounting_data"]["sampling"]
    key = f"{cfg.logging.sampler}{cfg.logging.sample_steps}"
    # 4 steps; EDM's Heun makes 2 evaluations per step but 1 on the last (to sigma = 0), the flow Heun 2 on each
    evals = {"ddpm_x0_heun": 7, "flow_heun": 8, "edm_heun": 7}.get(name, 4)
    assert acc[key]["steps"] == sum(acc[key]["steps_per_group"]) == evals
    assert (f"ddpm{cfg.diffusion.num_timesteps}" in acc) == (cfg.diffusion.formulation == "ddpm")


def test_input_edges_route_continuous_time_and_are_checked():
    experts = [DiT(input_size=8, in_channels=1, hidden_size=16, depth=1, num_heads=2, num_classes=3) for _ in range(2)]
    edges = torch.arange(5, dtype=torch.float64) / 4  # flow t, G = 4 cells; groups [0, 3), [3, 4)
    multi = MultiExpertDenoiser(experts, [(0, 3), (3, 4)], input_edges=edges)
    t = torch.tensor([0.0, 0.5, 0.7499, 0.75, 1.0])
    assert multi.group_index(t).tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(ValueError, match="input_edges must be 5 ascending values"):
        MultiExpertDenoiser(experts, [(0, 3), (3, 4)], input_edges=edges.flip(0))


def test_cli_resume_of_a_finished_run_redoes_only_the_bundle(tdc_run, tmp_path, monkeypatch, capsys):
    """``tdc --resume`` on a finished run (here a copy): stage 1 and every group are loaded, nothing trains or
    searches, and the bundle is rebuilt bit for bit; --resume and --overwrite exclude each other."""
    import shutil

    from diffcurr_fast.tdc import pipeline

    ref_run, _ = tdc_run
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    shutil.rmtree(run / "bundle")
    monkeypatch.setattr(Trainer, "fit", lambda self: pytest.fail("nothing should train"))
    monkeypatch.setattr(pipeline, "search_group", lambda *a, **k: pytest.fail("nothing should be searched"))
    recipe = tmp_path / "recipe.yaml"  # the fixture's run as a recipe
    recipe.write_text(yaml.safe_dump({**tiny_cfg(ref_run).to_dict(), "tdc": TINY_TDC}))
    torch.set_num_threads(1)
    assert tdc_cli.run(_tdc_args(str(recipe), "--run-dir", str(run), "--resume")) == 0
    assert "done: TDC run in" in capsys.readouterr().out
    ref, got = _bundle_weights(ref_run), _bundle_weights(run)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)
    with pytest.raises(SystemExit):
        _tdc_args("--resume", "--overwrite")


def test_cli_resume_takes_the_runs_own_config(tdc_run, tmp_path, monkeypatch, capsys):
    """``tdc --run-dir RUN --resume`` without the recipe or the original --set values continues from the config the
    run recorded in tdc.json (as ``train --resume`` does from config.yaml), with --set on top: a locked change is
    still refused."""
    import shutil

    from diffcurr_fast.tdc import pipeline

    ref_run, _ = tdc_run
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    shutil.rmtree(run / "bundle")
    monkeypatch.setattr(Trainer, "fit", lambda self: pytest.fail("nothing should train"))
    monkeypatch.setattr(pipeline, "search_group", lambda *a, **k: pytest.fail("nothing should be searched"))
    torch.set_num_threads(1)
    with pytest.raises(ValueError, match="cannot resume the TDC run: its config differs: tdc.rounds"):
        tdc_cli.run(_tdc_args("--run-dir", str(run), "--resume", "--set", "tdc.rounds=5"))
    assert tdc_cli.run(_tdc_args("--run-dir", str(run), "--resume")) == 0
    assert "done: TDC run in" in capsys.readouterr().out
    ref, got = _bundle_weights(ref_run), _bundle_weights(run)
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


def test_resume_of_a_moved_run_names_where_it_is_now(tmp_path):
    import shutil

    old, new = tmp_path / "old" / "run", tmp_path / "new" / "run"
    opts = {**TINY_TDC, "rounds": 1}
    run_tdc(tiny_cfg(old, "logging.num_samples=0"), opts, old, verbose=False)
    (old / "bundle" / "weights.safetensors").unlink()  # as if killed while writing the bundle
    new.parent.mkdir()
    shutil.move(old, new)
    out = run_tdc(tiny_cfg(new, "logging.num_samples=0"), opts, new, verbose=False, resume=True)
    text = json.dumps({k: v for k, v in out.items() if k != "accounting_data"})
    assert str(tmp_path / "old") not in text, text  # every path printed is where the run is now
    assert out["stage1"]["run_dir"] == str(new / "stage1")
    assert [g["finetune_dir"] for g in out["groups"]] == [str(new / f"group_{i}" / "finetune") for i in range(2)]
    assert (new / "bundle" / "weights.safetensors").is_file()


def test_study_evaluates_the_bundle_at_the_base_models_sampling_flops(tdc_run, tmp_path, monkeypatch):
    """A study's tdc arm evaluates the bundle twice: at ``eval.steps`` and at the most steps whose multi-expert
    FLOPs stay within the base model's at ``eval.steps`` (checked by hand against the accounting)."""
    import shutil

    from diffcurr_fast.study import runner
    from diffcurr_fast.tdc.accounting import sampling_flops
    from diffcurr_fast.tdc.pipeline import equal_sampling_steps, visited_times

    ref_run, _ = tdc_run
    run = tmp_path / "run"
    shutil.copytree(ref_run, run)
    monkeypatch.setattr(Trainer, "fit", lambda self: pytest.fail("nothing should train"))
    evals = ["eval.num_samples=20", "eval.steps=10", "eval.sampler=ddim", "eval.features=digits"]
    cfg = config_from_dict({**tiny_cfg(ref_run, *evals).to_dict(), "tdc": TINY_TDC})
    torch.set_num_threads(1)
    out = runner._run_tdc(cfg, run)
    multi, bcfg = load_bundle_with_config(run / "bundle")
    base_f = json.loads((run / "accounting.json").read_text())["base_flops_per_forward"]
    schedule = build_schedule(bcfg)

    def cost(n):
        return sampling_flops(multi, base_f, visited_times(multi, schedule, bcfg, "cpu", "ddim", n))

    eq = out["equal_sampling"]
    n = eq["sampling_steps"]
    assert cost(10)["base_flops_per_image"] == pytest.approx(10 * base_f)  # the budget: the base model at 10
    assert n > 10  # the experts are smaller than the base model (k = 0.5), so more steps fit
    assert cost(n)["multi_expert_flops_per_image"] <= 10 * base_f < cost(n + 1)["multi_expert_flops_per_image"]
    assert eq["sampling"]["multi_expert_flops_per_image"] == cost(n)["multi_expert_flops_per_image"]
    assert equal_sampling_steps(multi, schedule, bcfg, base_f, "ddim", 10)[0] == n
    assert eq["fd"] != out["final"]["fd"] and out["final"]["step"] == eq["step"]  # two evaluations of one bundle
    assert json.loads((run / "bundle_eval_equal_sampling.json").read_text())["sampling_steps"] == n
