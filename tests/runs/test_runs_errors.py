"""Bad inputs whose errors come from diffcurr_fast/runs/: non-finite weights are never saved, exported or sampled
(checkpoint.py), a corrupt newest checkpoint names the previous intact one (to resume from, or to sample), weights
that do not fit their checkpoint's config, a TDC run directory given as a checkpoint, recipes (recipes.py: malformed
YAML, duplicate keys, an empty recipe, paths relative to the recipe, shipped recipes by name), config checks
(config.py: data.path with the built-in dataset, the article in sampler errors), and guidance without a null label
(sampling.py). docs/errors.md lists what each input gets."""

import argparse
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import _main, _sample_args, tiny

from diffcurr_fast import cli_sample as sample_cli
from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.recipes import list_recipes, load_config, read_recipe, recipes_dir
from diffcurr_fast.train import cli_train
from diffcurr_fast.train.loop import Trainer


def test_nonfinite_weights_are_not_saved(tmp_path):
    run = tmp_path / "run"
    tr = Trainer(tiny(run, "engine.max_steps=2", "checkpoint.every=1", "checkpoint.export_ema=true"))
    tr.fit()
    with torch.no_grad():
        next(tr.model.parameters()).fill_(float("nan"))  # what optim.lr=inf does at step 1
    with pytest.raises(ck.NonFiniteWeightsError, match=r"refusing to save the checkpoint of step 2 \(model\): weight"):
        tr.save()
    assert ck.latest_checkpoint(run).name == "ckpt_00000002.pt"  # the intact one stays the newest
    assert torch.isfinite(
        ck.load_checkpoint(ck.latest_checkpoint(run))["model"][next(iter(tr.model.state_dict()))]
    ).all()
    with pytest.raises(ck.NonFiniteWeightsError, match="refusing to export"):
        ck.export_safetensors(tr.model.state_dict(), tmp_path / "e.safetensors", {})
    assert not (tmp_path / "e.safetensors").exists()


def test_nonfinite_checkpoint_is_not_sampled(trained, tmp_path):
    state = ck.load_checkpoint(ck.latest_checkpoint(trained))
    key = next(iter(state["ema"]["module"]))
    state["ema"]["module"][key] = torch.full_like(state["ema"]["module"][key], float("inf"))
    torch.save(state, tmp_path / "nan.pt")  # written around save_checkpoint, as an old version could have
    with pytest.raises(ck.NonFiniteWeightsError, match=f"weight '{key}' has .* non-finite"):
        sample_cli.run(
            _sample_args("--ckpt", str(tmp_path / "nan.pt"), "--out", str(tmp_path / "s.npz"), "--steps", "2")
        )
    assert not (tmp_path / "s.npz").exists()
    from diffcurr_fast.eval.evaluate import checkpoint_model

    with pytest.raises(ck.NonFiniteWeightsError):
        checkpoint_model(tmp_path / "nan.pt")


def test_corrupt_checkpoint_names_the_previous_intact_one(trained, tmp_path):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    newest = ck.latest_checkpoint(run)
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated by a full disk
    with pytest.raises(ValueError) as e:
        Trainer(tiny(run, "engine.max_steps=4", "checkpoint.every=1"), resume=True)
    msg = str(e.value)
    assert f"checkpoint '{newest}' is corrupt" in msg and "weights_only=False" not in msg
    assert "the previous checkpoint ckpt_00000001.pt is intact" in msg and "--resume" in msg
    newest.rename(tmp_path / "aside.pt")  # the advice works
    assert Trainer(tiny(run, "engine.max_steps=4", "checkpoint.every=1"), resume=True).step == 1


def test_data_path_with_digits_is_refused(tmp_path):
    with pytest.raises(ValueError, match="data.path '/does/not/exist' is set but data.dataset is 'digits'"):
        load_config(None, ["data.path=/does/not/exist"])


def test_sampler_errors_use_the_right_article():
    from diffcurr_fast.runs.sections import with_article

    assert (with_article("edm"), with_article("flow"), with_article("ddpm")) == ("an edm", "a flow", "a ddpm")

    with pytest.raises(ValueError, match="is not an edm target"):
        load_config(
            None,
            [
                "diffusion.formulation=edm",
                "diffusion.learn_sigma=false",
                "diffusion.prediction=eps",
                "logging.sampler=heun",
            ],
        )
    with pytest.raises(ValueError, match="'ddim' cannot sample an edm model"):
        load_config(
            None,
            [
                "diffusion.formulation=edm",
                "diffusion.learn_sigma=false",
                "diffusion.prediction=x0",
                "diffusion.weighting=none",
                "logging.sampler=ddim",
            ],
        )
    assert load_config(None).logging.sampler == "ddim"


def test_malformed_recipe_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  depth: 3\n   hidden_size: [\n")
    with pytest.raises(ValueError, match=r"bad\.yaml' is not valid YAML at line \d+, column \d+") as e:
        load_config(bad)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "text, match",
    [
        ("engine:\n  max_steps: 5\n  seed: 1\n  max_steps: 7\n", r"'engine.max_steps' at lines 2, 4"),
        ("engine:\n  max_steps: 5\noptim:\n  lr: 0.1\nengine:\n  seed: 3\n", r"'engine' at lines 1, 5"),
        ("data:\n  batch_size: 8\n  dataset: digits\n  batch_size: 8\n", r"'data.batch_size' at lines 2, 4"),
    ],
    ids=["key", "section", "same-value"],
)
def test_duplicate_recipe_keys_are_refused_with_their_lines(tmp_path, text, match):
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ValueError, match=r"sets a key more than once .*" + match):
        read_recipe(tmp_path / "r.yaml")


def test_empty_recipe_is_refused(tmp_path, capsys):
    for i, text in enumerate(("", "# only a comment\n", "{}\n")):
        (tmp_path / f"e{i}.yaml").write_text(text)
        rc, err = _main(capsys, "train", str(tmp_path / f"e{i}.yaml"), "--dry-run")
        assert rc == 2 and "is empty" in err, err
    (tmp_path / "ok.yaml").write_text("engine:\n  max_steps: 5\n")  # a recipe of one key still reads
    assert read_recipe(tmp_path / "ok.yaml") == {"engine": {"max_steps": 5}}


def test_recipe_paths_are_relative_to_the_recipe(tmp_path, monkeypatch):
    folder = tmp_path / "exp"
    (folder / "ds").mkdir(parents=True)
    (folder / "ds" / "z.json").write_text("{}")
    (folder / "w.pt").write_bytes(b"")
    (folder / "r.yaml").write_text(
        "engine:\n  kind: deepspeed\n  deepspeed_config: ds/z.json\n"
        "model:\n  init_from: w.pt\ncheckpoint:\n  run_dir: runs/x\n"
    )
    monkeypatch.chdir(tmp_path)
    cfg = load_config("exp/r.yaml")
    assert cfg.engine.deepspeed_config == str(Path("exp") / "ds" / "z.json")
    assert cfg.model.init_from == str(Path("exp") / "w.pt")
    assert cfg.checkpoint.run_dir == "runs/x"  # outputs stay relative to the current directory
    cfg = load_config("exp/r.yaml", ["engine.deepspeed_config=other.json"])  # --set: relative to the cwd
    assert cfg.engine.deepspeed_config == "other.json"


def test_shipped_recipes_by_name(tmp_path, monkeypatch, capsys):
    import importlib.util

    spec = importlib.util.find_spec("diffcurr_fast.recipes")  # package data of the installed package
    assert spec is not None and Path(list(spec.submodule_search_locations)[0]) == recipes_dir()
    assert (recipes_dir() / "ds" / "zero2.json").is_file()
    names = {p.stem for p in list_recipes()}
    assert {"dit_b2_curriculum", "dit_l2_zero2", "edm_cifar10"} <= names
    monkeypatch.chdir(tmp_path)  # away from the source tree
    cfg = load_config("dit_b2_curriculum")
    assert cfg.model.preset == "DiT-B/2" and cfg.curriculum.pacing == "patience"
    zero2 = load_config("dit_l2_zero2")
    assert Path(zero2.engine.deepspeed_config) == recipes_dir() / "ds" / "zero2.json"
    from diffcurr_fast.cli import main

    assert main(["recipes"]) == 0
    assert "dit_b2_curriculum" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="no shipped recipe of that name"):
        load_config("dit_b2_curriculm")
    from diffcurr_fast.data.latents import FastDiTLatentWriter

    # the dry run reads the data: one batch of 4x32x32 latents
    FastDiTLatentWriter(tmp_path / "lat").write(np.zeros((256, 4, 32, 32), np.float32), np.zeros(256, np.int64))
    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    args = p.parse_args(
        ["dit_b2_curriculum", "--dry-run", "--set", "data.dataset=latents", "--set", f"data.path={tmp_path / 'lat'}"]
    )
    assert cli_train.run(args) == 0


def test_guidance_without_a_null_label_says_so(no_dropout_run, tmp_path, capsys):
    rc, err = _main(
        capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "s.npz"), "--cfg", "4", "--steps", "2"
    )
    assert rc == 2 and "trained without label dropout (model.class_dropout_prob=0); sample with --cfg 1" in err, err
    assert "y must lie in" not in err and not (tmp_path / "s.npz").exists()
    rc, _ = _main(capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "s.npz"), "--steps", "2")
    assert rc == 0  # without guidance it samples


def test_nonfinite_samples_name_the_batch():
    """A model with finite weights that still produces NaN (e.g. diverged activations) gets one line naming the
    batch, never a grid of NaN."""
    from diffcurr_fast.diffusion import DDPMSchedule, Readout
    from diffcurr_fast.runs.sampling import sample_batch

    class Diverged(torch.nn.Module):
        def forward(self, x, t, y):
            return torch.full_like(x, float("nan"))

    kw = dict(sampler="ddim", steps=3, channels=1, size=2, num_classes=2, readout=Readout("eps"))
    with pytest.raises(ValueError, match=r"^sampling produced NaN or inf values \(batch 3\); the model is not usable$"):
        sample_batch(Diverged(), DDPMSchedule(50), labels=torch.zeros(2, dtype=torch.long), batch=3, seed=0, **kw)


@pytest.mark.parametrize("text", ["2024", "on", "1e-3", "null x", "[a]"])
def test_a_path_given_with_set_is_taken_as_written(tmp_path, text):
    """A text field takes the override's text, not YAML's reading of it (a year is a folder, not an int; `on` is
    a folder, not True); numbers and bools keep YAML's reading in the fields of those types."""
    cfg = load_config(None, [f"checkpoint.run_dir={text}", "optim.lr=1e-3", "logging.progress=off"])
    assert cfg.checkpoint.run_dir == text and cfg.optim.lr == 1e-3 and cfg.logging.progress is False
    assert load_config(None, ["model.init_from="]).model.init_from == ""
    assert load_config(None, ["checkpoint.run_dir='2024'"]).checkpoint.run_dir == "2024"


def test_run_dir_flag_is_one_folder(tmp_path, capsys):
    """--run-dir "" (an unset shell variable) is refused, not replaced by the recipe's folder; --run-dir and --set
    checkpoint.run_dir naming two folders are refused; the same folder twice is fine."""
    from diffcurr_fast.runs.recipes import run_dir_overrides

    assert run_dir_overrides(["a.b=1"], None) == ["a.b=1"]
    assert run_dir_overrides(["checkpoint.run_dir=x"], "x") == ["checkpoint.run_dir=x", "checkpoint.run_dir=x"]
    for argv, line in (
        (["train", "--run-dir", "", "--dry-run"], "--run-dir is empty (an unset shell variable?)"),
        (["tdc", "--run-dir", " ", "--dry-run"], "--run-dir is empty (an unset shell variable?)"),
        (
            ["train", "--run-dir", str(tmp_path / "a"), "--set", f"checkpoint.run_dir={tmp_path / 'b'}", "--dry-run"],
            "name two folders; give one of them",
        ),
    ):
        rc, err = _main(capsys, *argv)
        assert rc == 2 and line in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def _refitted(trained, tmp_path, **model):
    """A copy of ``trained``'s newest checkpoint whose config (and recorded model_config) say ``model``: its weights
    no longer fit the model its config describes (an edited or mixed-up checkpoint)."""
    state = ck.load_checkpoint(ck.latest_checkpoint(trained))
    state["config"]["model"].update(model)
    state["model_config"].update(model)
    path = tmp_path / "refitted.pt"
    torch.save(state, path)
    return path


def test_weights_that_do_not_fit_their_config_are_one_line(trained, tmp_path, capsys):
    """A checkpoint whose weights do not fit its own config: one line naming the file, that its weights do not match
    its config, and the first mismatching key with its shapes (torch's load_state_dict traceback before)."""
    deeper = _refitted(trained, tmp_path, depth=2)
    rc, err = _main(capsys, "sample", "--ckpt", str(deeper), "--out", str(tmp_path / "s.npz"), "--steps", "2")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint '{deeper}' (ema weights): the weights do not match the model the checkpoint's config" in err
    assert "'blocks.1.attn.qkv.weight' is missing from the weights (10 keys missing)" in err
    wider = _refitted(trained, tmp_path, hidden_size=64)
    argv = ["--out", str(tmp_path / "s.npz"), "--weights", "model", "--steps", "2"]
    rc, err = _main(capsys, "sample", "--ckpt", str(wider), *argv)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "(model weights)" in err and "'pos_embed' is (1, 16, 32) in the weights but (1, 16, 64) in the model" in err
    assert not (tmp_path / "s.npz").exists()


def test_corrupt_newest_checkpoint_names_the_intact_one_to_sample(trained, tmp_path, capsys):
    """sample / eval --ckpt RUN with a truncated newest checkpoint name the earlier intact file to pass instead (as
    train --resume does), and that file samples."""
    import shutil

    from diffcurr_fast.eval.evaluate import checkpoint_model

    run = tmp_path / "run"
    shutil.copytree(trained, run)
    newest = ck.latest_checkpoint(run)
    newest.write_bytes(newest.read_bytes()[:1000])  # truncated by a full disk
    earlier = run / "checkpoints" / "ckpt_00000001.pt"
    rc, err = _main(capsys, "sample", "--ckpt", str(run), "--out", str(tmp_path / "s.npz"), "--steps", "2")
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert f"checkpoint '{newest}' is corrupt" in err and "weights_only=False" not in err
    assert f"the earlier checkpoint '{earlier}' of the run is intact: pass that file instead" in err
    with pytest.raises(ValueError, match=f"the earlier checkpoint '{earlier}' of the run is intact"):
        checkpoint_model(run)  # eval --ckpt
    rc, err = _main(capsys, "sample", "--ckpt", str(earlier), "--out", str(tmp_path / "s.npz"), "--steps", "2")
    assert rc == 0, err  # the advice works
    earlier.write_bytes(b"")  # no intact checkpoint left: nothing is named
    with pytest.raises(ValueError, match=r"is corrupt or not a weights-only torch file \(\w+\)$"):
        ck.load_checkpoint(newest)


def test_tdc_run_directory_points_to_its_bundle(tmp_path, capsys):
    """sample --ckpt of a TDC run directory (tdc.json, bundle/; no checkpoints/ of its own) says to sample its bundle
    with --bundle DIR/bundle, or, before the bundle is written, to pass the run of the base model or an expert."""
    run = tmp_path / "tdc"
    (run / "bundle").mkdir(parents=True)
    (run / "tdc.json").write_text("{}")
    rc, err = _main(capsys, "sample", "--ckpt", str(run), "--out", str(tmp_path / "s.npz"))
    assert rc == 2 and f"'{run}' is a TDC run directory, which holds no checkpoint of its own" in err, err
    assert "bundle (bundle/) is not written yet" in err and f"base model ('{run / 'stage1'}')" in err
    (run / "bundle" / "train_config.json").write_text("{}")
    rc, err = _main(capsys, "sample", "--ckpt", str(run), "--out", str(tmp_path / "s.npz"))
    assert rc == 2 and f"sample its multi-expert bundle with --bundle '{run / 'bundle'}'" in err, err
    assert len(err.strip().splitlines()) == 1
    rc, err = _main(capsys, "sample", "--bundle", str(run), "--out", str(tmp_path / "s.npz"))
    assert rc == 2 and f"is a TDC run directory: pass --bundle '{run / 'bundle'}'" in err, err


def test_a_stray_training_run_in_a_tdc_folder_is_not_sampled(trained, tmp_path, capsys):
    """sample --ckpt of a TDC run directory that also holds a training run (written beside tdc.json) is refused,
    pointing to --bundle and naming the stray checkpoint, instead of sampling that run as if it were the TDC run's."""
    import shutil

    run = tmp_path / "tdc"
    (run / "bundle").mkdir(parents=True)
    (run / "bundle" / "train_config.json").write_text("{}")
    (run / "tdc.json").write_text("{}")
    shutil.copytree(trained / "checkpoints", run / "checkpoints")
    rc, err = _main(capsys, "sample", "--ckpt", str(run), "--out", str(tmp_path / "s.npz"))
    assert rc == 2 and "is a TDC run directory, which holds no checkpoint of its own (its checkpoints/ holds a " in err
    assert f"pass '{run / 'checkpoints' / 'ckpt_00000002.pt'}' to sample it): sample its multi-expert bundle" in err
    assert not (tmp_path / "s.npz").exists()


def test_thread_counts_beyond_the_machine_are_refused_by_every_command(trained, tmp_path, capsys, monkeypatch):
    """Every command's --threads (and train's engine.cpu_threads) has one bound, relative to the CPUs this process
    may use (4 per CPU), checked before anything is read or drawn: `sample --threads 100000` segfaulted inside torch
    and 10000 started 20,000 threads. The bound itself is accepted."""
    from diffcurr_fast.runs import threads

    monkeypatch.setattr(threads, "usable_cpus", lambda: 2)
    assert threads.max_threads() == 8 and threads.check_threads(8) == 8
    line = "is more than 8 (4 per CPU; this process may use 2): more threads than CPUs only compete for them; use at"
    spec = tmp_path / "spec.yaml"
    spec.write_text("name: s\nseeds: [0]\neval_every: 1\narms: [{name: a}]\n")
    for argv in (
        ["sample", "--ckpt", str(trained), "--out", str(tmp_path / "s.npz"), "--threads", "9"],
        ["eval", "--ckpt", str(trained), "--ref", "digits", "--threads", "100000"],
        ["analyze", "clusters", "-T", "40", "-N", "4", "--threads", "9", "--out", str(tmp_path / "a")],
        ["study", str(spec), "--out", str(tmp_path / "st"), "--threads", "9"],
        ["train", "--dry-run", "--run-dir", str(tmp_path / "r"), "--set", "engine.cpu_threads=9"],
    ):
        rc, err = _main(capsys, *argv)
        assert rc == 2 and line in err and len(err.strip().splitlines()) == 1, (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["spec.yaml"]  # nothing written


def test_sizes_beyond_the_machine_are_refused_before_allocation(trained, tmp_path, capsys, monkeypatch):
    """train (and --dry-run), sample and eval estimate the memory of what they are about to build (a lower bound:
    parameters with their gradients, optimizer state and EMA, and the activations) and refuse one above the
    device's memory in one line with the estimate, instead of the allocator's traceback; nothing is written. On a
    GPU the GPU's memory is the bound."""
    from diffcurr_fast.runs import resources
    from diffcurr_fast.runs.sampling import build_model

    cfg = tiny(tmp_path / "r")
    assert resources.count_params(cfg) == sum(p.numel() for p in build_model(cfg).parameters())
    est = resources.training_memory(cfg, 1, torch.device("cpu"))
    t, d = (cfg.model.input_size // cfg.model.patch_size) ** 2, cfg.model.hidden_size
    assert est.param_bytes == 16 * est.params and est.activation_bytes == 16 * cfg.model.depth * t * d * 8 * 4
    line = "error: this needs at least "
    for argv in (
        ["train", "--dry-run", "--run-dir", str(tmp_path / "r"), "--set", "model.hidden_size=1000000"],
        ["train", "--run-dir", str(tmp_path / "r"), "--set", "model.hidden_size=1000000"],
        ["sample", "--ckpt", str(trained), "--out", str(tmp_path / "s.npz"), "--steps", "4"]
        + ["--num-samples", "1000000000", "--batch-size", "1000000000"],
        [
            "eval",
            "--ckpt",
            str(trained),
            "--ref",
            "digits",
            "--num-samples",
            "1000000000",
            "--batch-size",
            "1000000000",
        ],
    ):
        rc, err = _main(capsys, *argv)
        assert rc == 2 and line in err and "more than the " in err and "of this machine's memory" in err, err
        assert len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
    monkeypatch.setattr(resources, "device_memory", lambda device: (2**30, "GPU Test-1"))  # a 1 GiB GPU
    big = tiny(tmp_path / "r", "model.hidden_size=2048", "model.num_heads=16", "model.depth=4")
    n = sum(p.numel() for p in build_model(big).parameters())
    with pytest.raises(ValueError) as refused:
        resources.check_fits(resources.training_memory(big, 1, torch.device("cpu")), "cuda", "use a smaller model")
    gib = (16 * n + 16 * 4 * 16 * 2048 * 8 * 4) / 2**30  # parameters; 16 samples x 4 blocks x 16 tokens x D, fp32
    assert str(refused.value) == (
        f"this needs at least {gib:.3g} GiB of memory ({n:,} parameters: {16 * n / 2**30:.3g} GiB; activations for 16 "
        "samples per micro-batch: 64 MiB), more than the 1 GiB of GPU Test-1; use a smaller model"
    )


@pytest.mark.parametrize(
    "sets, match",
    [
        (
            ["model.routing_keep=0.25"],
            r"^model.routing_keep \(--set\) is an option of 'routing', which this run does not use: it applies only "
            r"when model.routing turns it on \(model.routing is 'none'\), or drop model.routing_keep$",
        ),
        (
            ["terms.sra_weight=0.2"],
            r"^terms.sra_weight \(--set\) is an option of 'sra', which this run does not use: terms.use \[\] does not "
            r"list 'sra'; add it to terms.use, or drop terms.sra_weight$",
        ),
        (
            ["diffusion.sigma_data=1.0"],
            r"^diffusion.sigma_data \(--set\) is an option of 'edm', .*diffusion.formulation is 'ddpm'; set "
            r"diffusion.formulation=edm",
        ),
        (
            ["timesteps.lognormal_std=1.0"],
            r"^timesteps.lognormal_std \(--set\) is an option of 'lognormal', .*set timesteps.sampler=lognormal",
        ),
        (["optim.muon_momentum=0.9"], r"^optim.muon_momentum \(--set\) is an option of 'muon', .*optim.name=muon"),
    ],
)
def test_an_option_of_a_component_the_run_does_not_use_is_refused(tmp_path, sets, match):
    with pytest.raises(ValueError, match=match):
        tiny(tmp_path, *sets)


def test_an_option_the_recipe_set_yields_to_a_later_switch(tmp_path):
    """The recipe's option of a component that a --set turns off yields (as a formulation override's ``auto``
    fields do): the demo's cosine betas under --set diffusion.formulation=flow; the same option given after the
    switch is refused."""
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model:\n  routing: tread\n  routing_keep: 0.25\n  depth: 6\n")
    cfg = load_config(recipe, ["model.routing=none"])
    assert cfg.model.routing == "none" and "routing_keep" not in cfg.to_dict()["model"]
    assert load_config(None, ["diffusion.formulation=flow"]).diffusion.formulation == "flow"
    with pytest.raises(ValueError, match=r"model.routing_keep \(--set\) is an option of 'routing'"):
        load_config(recipe, ["model.routing=none", "model.routing_keep=0.75"])


def test_a_key_given_twice_on_the_command_line_is_refused(tmp_path, capsys):
    rc, err = _main(capsys, "train", "--dry-run", "--run-dir", str(tmp_path), "--set", "optim.lr=1e-3",
                    "--set", "optim.lr=2e-3")  # fmt: skip
    assert rc == 2 and err.strip().splitlines()[-1] == (
        "diffcurr-fast train: error: --set 'optim.lr=1e-3' and --set 'optim.lr=2e-3' set optim.lr twice (only one "
        "would count); keep one"
    )
    rc, err = _main(capsys, "tdc", "--run-dir", str(tmp_path / "t"), "--set", "tdc.rounds=1", "--set", "tdc.rounds=2")
    assert rc == 2 and "set tdc.rounds twice (only one would count); keep one" in err
    assert not (tmp_path / "t").exists()


def test_an_mlp_of_no_width_and_a_term_name_that_is_a_switch_are_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^model.mlp_ratio 0.01 gives the MLP int\(32 x 0.01\) = 0 hidden units"):
        tiny(tmp_path, "model.mlp_ratio=0.01")
    with pytest.raises(ValueError, match=r"^model.mlp swiglu with model.mlp_ratio 0.04 gives the SwiGLU 0 hidden"):
        tiny(tmp_path, "model.mlp=swiglu", "model.mlp_ratio=0.04")
    with pytest.raises(
        ValueError,
        match=r"^terms.use lists 'immiscible', which adds no loss and is not a term: it is the switch "
        r"terms.immiscible=true; drop it from terms.use$",
    ):
        tiny(tmp_path, "terms.use=[immiscible]")


def test_a_routing_span_the_model_cannot_hold_names_a_span_that_fits(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"^model.routing spans blocks \[2, 0\) .* \(0 <= start < end <= depth\); e.g. model.routing_start=0 "
        r"model.routing_end=2$",
    ):
        tiny(tmp_path, "model.routing=tread", "model.depth=2")
    cfg = tiny(tmp_path, "model.routing=tread", "model.depth=2", "model.routing_start=0", "model.routing_end=2")
    assert cfg.model.routing == "tread"
