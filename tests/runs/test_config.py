"""Training config: defaults, recipes, typed overrides, strict errors, YAML round trip, --dry-run."""

import argparse
import dataclasses
from pathlib import Path

import pytest
import yaml

from diffcurr_fast.models.routing import RoutingOptions
from diffcurr_fast.runs.config import SECTIONS, TrainConfig, config_from_dict, resume_mismatches, upgrade_saved
from diffcurr_fast.runs.recipes import config_to_yaml, load_config, parse_override
from diffcurr_fast.train import cli_train

ROOT = Path(__file__).resolve().parents[2]
# the papers' recipes (DiT, EDM, fast_dit_b2); fast_mnist5k is an arm of a committed study and is checked against it
# below, the demo has its own tests
RECIPES = sorted(
    p for p in (ROOT / "diffcurr_fast" / "recipes").glob("*.yaml") if p.stem not in ("fast_mnist5k", "demo")
)


def test_defaults_and_demo_validate():
    cfg = TrainConfig().validate()
    assert cfg.optim.lr == 1e-4 and cfg.optim.ema_decay == 0.9999 and cfg.curriculum.num_clusters == 20
    demo = load_config(None)
    assert demo.data.dataset == "digits" and demo.model.input_size == 8 and demo.curriculum.method == "snr"
    # the time-to-quality study's pick (diffcurr_fast/recipes/fast_mnist5k.yaml): uniform t with MinSNR-5, no curriculum
    assert demo.curriculum.pacing == "none" and demo.diffusion.weighting == "min_snr"
    assert demo.timesteps.sampler == "uniform"
    assert load_config("demo").to_dict() == demo.to_dict()  # the shipped recipe, by name


# What the demo resolved to when it was a dict in runs/config.py: every setting it made, and what auto chose.
DEMO_WAS = {
    "model": {
        "preset": "custom",
        "input_size": 8,
        "in_channels": 1,
        "num_classes": 10,
        "patch_size": 2,
        "hidden_size": 64,
        "depth": 4,
        "num_heads": 4,
        "fused_adaln": True,
    },
    "diffusion": {
        "num_timesteps": 1000,
        "beta_schedule": "cosine",
        "weighting": "min_snr",
        "min_snr_gamma": 5.0,
        "prediction": "eps",
        "learn_sigma": True,
    },
    "curriculum": {
        "pacing": "none",
        "method": "snr",
        "num_clusters": 10,
        "patience": 4,
        "eval_every": 10,
        "ema": 0.5,
        "min_delta": 0.02,
    },
    "data": {"dataset": "digits", "batch_size": 64},
    "optim": {
        "name": "muon",  # the winner of speedrun_optim on both datasets (docs/results); the former demo had AdamW
        "lr": 8e-3,  # the tuned MinSNR arm's pick (docs/results/speedrun_edge, and Muon's in speedrun_optim)
        "warmup_steps": 100,
        "schedule": "cosine",
        "min_lr": 1e-5,
        "grad_clip": 1.0,
        "ema_decay": 0.999,
    },
    "engine": {"max_steps": 2000, "cpu_threads": 2},  # 3,000 with AdamW: Muon's step costs about 2x on 2 threads
    "logging": {"log_every": 25, "num_samples": 100, "sample_steps": 100, "cfg_scale": 2.0, "sampler": "ddim"},
    "checkpoint": {"run_dir": "runs/demo", "every": 1000, "keep_last": 2},
}


def test_the_demo_recipe_is_the_former_embedded_demo():
    """The demo recipe resolves to what the embedded dict did: its settings over the defaults, exactly (floats
    typed as floats), with the label ``demo`` in config.yaml; its header is what ``recipes`` prints."""
    from diffcurr_fast.train import cli_recipes

    got = load_config(None).to_dict()
    want = TrainConfig().to_dict()
    for section, values in DEMO_WAS.items():
        want[section].update(values)
    want["eval"]["sampler"] = "ddim"
    want["optim"]["muon_momentum"] = 0.95  # the option of the optimizer it names, at its default
    assert got == want
    assert all(type(got["optim"][k]) is float for k in ("lr", "min_lr"))
    assert "  lr: 0.008  # demo\n" in config_to_yaml(load_config(None))
    summary = cli_recipes._summary(ROOT / "diffcurr_fast" / "recipes" / "demo.yaml")
    assert summary.startswith("The default run (`diffcurr-fast train` without a recipe") and len(summary) < 250


def test_every_field_is_documented():
    for name, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.metadata.get("doc"), f"{name}.{f.name} has no doc"


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipes_load(recipe):
    cfg = load_config(recipe)
    # DiT recipes: batch 256, AdamW 1e-4 (Peebles & Xie); EDM's CIFAR-10 setting: batch 512, lr 1e-3 (Karras et al.)
    batch, lr = {"edm_cifar10": (512, 1e-3)}.get(recipe.stem, (256, 1e-4))
    assert cfg.data.batch_size == batch and cfg.optim.lr == pytest.approx(lr) and cfg.optim.weight_decay == 0.0
    assert cfg.model.preset.startswith("DiT-")
    assert load_config(recipe, ["engine.max_steps=7"]).engine.max_steps == 7


def test_fast_mnist5k_is_the_picked_muon_arm_of_the_optimizer_study(capsys, tmp_path):
    """The recipe fast_mnist5k is the arm that won the committed speedrun_optim_mnist5k study, minsnr_muon at the
    learning rate its trials picked (tuning.json), setting for setting, except what does not change what is trained
    (threads, progress bar, run dir, the inert curriculum pacing settings) and the study's rule that a diverged
    trial is a result (a recipe stops a diverging run), and it starts like any recipe."""
    import json

    from diffcurr_fast.objective import resolve_precision
    from diffcurr_fast.study.spec import arm_config, load_spec

    recipe = ROOT / "diffcurr_fast" / "recipes" / "fast_mnist5k.yaml"
    folder = ROOT / "docs" / "results" / "speedrun_optim_mnist5k"
    spec = load_spec(folder / "study.yaml")
    arm = next(a for a in spec.arms if a.name == "minsnr_muon")
    pick = json.loads((folder / "tuning.json").read_text())["minsnr_muon"]["pick"]
    assert pick == ["optim.lr=0.008"]
    arm = dataclasses.replace(arm, set=[*arm.set, *pick])
    got, want = load_config(recipe).to_dict(), arm_config(spec, arm, 0, "runs/fast_mnist5k").to_dict()
    skip = {
        ("engine", "cpu_threads"),
        ("engine", "max_nan_skips"),
        ("engine", "max_skip_share"),
        ("logging", "progress"),
        *(("curriculum", k) for k in ("patience", "eval_every", "ema", "min_delta")),
    }
    assert got["curriculum"]["pacing"] == "none" and got["optim"]["name"] == "muon"
    # the recipes' precision rule, auto, is the study's fp32 on the CPU it ran on
    assert resolve_precision(got["engine"].pop("precision"), "cpu") == want["engine"].pop("precision") == "fp32"
    for section, values in want.items():
        for key, value in values.items():
            if (section, key) not in skip:
                assert got[section][key] == value, (section, key, got[section][key], value)
    assert cli_train.run(_parse([str(recipe), "--dry-run", "--run-dir", str(tmp_path / "run")])) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["dataset"] == "mnist5k"
    assert not (tmp_path / "run").exists()


def test_there_are_recipes():
    names = {p.stem for p in RECIPES}
    assert {
        "dit_b2_vanilla",
        "dit_b2_curriculum",
        "dit_b2_curriculum_minsnr",
        "dit_b2_curriculum_dtr",
        "dit_l2",
        "dit_xl2",
        "fast_dit_b2",
    } <= names


def test_fast_dit_b2_routes_as_tread_at_that_size():
    cfg = load_config(ROOT / "diffcurr_fast" / "recipes" / "fast_dit_b2.yaml")
    assert (cfg.model.preset, cfg.model.routing, cfg.model.routing_keep) == ("DiT-B/2", "tread", 0.5)
    assert RoutingOptions.of(cfg.model).span(cfg.model.depth) == (2, 10) and cfg.model.depth == 12
    assert (cfg.diffusion.weighting, cfg.diffusion.min_snr_gamma, cfg.optim.lr) == ("min_snr", 5.0, 1e-4)
    # the optimizer of the arm that shipped (speedrun_optim), at the official rate (Muon's update has AdamW's RMS)
    assert cfg.optim.name == "muon" and cfg.engine.kind != "deepspeed"


@pytest.mark.parametrize(
    "text, key, value",
    [
        ("optim.lr=1e-4", "optim.lr", 1e-4),
        ("optim.lr=3", "optim.lr", 3),
        ("engine.compile=true", "engine.compile", True),
        ("data.path=/x/y.npz", "data.path", "/x/y.npz"),
        ("model.preset=DiT-B/2", "model.preset", "DiT-B/2"),
    ],
)
def test_parse_override_types(text, key, value):
    k, v = parse_override(text)
    assert k == key and v == value and type(v) is type(value)


def test_overrides_apply_with_int_to_float_widening():
    cfg = load_config(None, ["optim.lr=3", "engine.max_steps=12", "diffusion.weighting=min_snr"])
    assert cfg.optim.lr == 3.0 and isinstance(cfg.optim.lr, float)
    assert cfg.engine.max_steps == 12 and cfg.diffusion.weighting == "min_snr"


@pytest.mark.parametrize(
    "override, match",
    [
        ("optim.lrr=1", r"unknown config key 'optim.lrr'; valid keys of optim: lr, "),
        ("optimizer.lr=1", r"unknown config section 'optimizer'.*valid sections: model, diffusion"),
        (
            "diffusion.prediction=score",
            r"invalid value 'score' for diffusion.prediction; valid choices: auto, eps, x0, v",
        ),
        ("engine.max_steps=1.5", r"engine.max_steps must be of type int"),
        ("engine.compile=1", r"engine.compile must be of type bool"),
        ("optim.lr=-1", r"optim.lr must be > 0.0, got -1.0"),
        ("optim.lr=.inf", r"optim.lr must be a finite number, got inf"),
        ("diffusion.min_snr_gamma=nan", r"diffusion.min_snr_gamma must be a finite number"),
        ("diffusion.P_mean=-inf", r"diffusion.P_mean must be a finite number"),
        ("curriculum.ema=1.0", r"curriculum.ema must lie in \[0.0, 1.0\)"),
        ("data.batch_size=0", r"data.batch_size must be >= 1"),
        ("lr=1", r"section.field"),
        ("optim.lr", r"section.field=value"),
    ],
)
def test_bad_overrides_name_the_key(override, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, [override])


def test_cross_field_rules():
    with pytest.raises(ValueError, match="stage_iters must be >= 1 when curriculum.pacing is 'fixed'"):
        load_config(None, ["curriculum.pacing=fixed"])
    with pytest.raises(ValueError, match="num_clusters .* must be <= diffusion.num_timesteps"):
        load_config(None, ["diffusion.num_timesteps=5"])
    with pytest.raises(ValueError, match="data.path is required"):
        load_config(None, ["data.dataset=npz"])
    with pytest.raises(ValueError, match=r"^diffusion.beta_schedule 'linear' needs diffusion.num_timesteps >= 20 "):
        load_config(None, ["diffusion.beta_schedule=linear", "diffusion.num_timesteps=10", "curriculum.num_clusters=2"])
    with pytest.raises(ValueError, match="^model: input_size 8 is not divisible by patch_size 3$"):
        load_config(None, ["model.patch_size=3"])  # the DiT's own check (models.dit.check_dims)


def test_recipe_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim:\n  learning_rate: 0.1\n")
    with pytest.raises(ValueError, match="unknown config key 'optim.learning_rate'"):
        load_config(bad)
    bad.write_text("optim: 3\n")
    with pytest.raises(ValueError, match="section 'optim' must be a mapping"):
        load_config(bad)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["optim.lr=2e-4", "curriculum.pacing=adaptive"])
    path = tmp_path / "c.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(path).to_dict() == cfg.to_dict()
    assert list(yaml.safe_load(config_to_yaml(cfg))) == list(SECTIONS)


def test_resume_mismatches_lists_locked_keys():
    adamw = ["optim.name=adamw"]  # the field's default (the demo ships muon), as a checkpoint from before it
    a = load_config(None, adamw)
    b = config_from_dict({"model": {"hidden_size": 32}, "optim": {"lr": 0.5}}, base=load_config(None, adamw))
    diffs = resume_mismatches(a.to_dict(), b)
    assert len(diffs) == 1 and diffs[0].startswith("model.hidden_size")
    # the batches and the RNG streams derive from the batch size and the seed: a resume names them, in one line each
    c = config_from_dict({"engine": {"seed": 7}, "data": {"batch_size": 32}}, base=a)
    assert (a.engine.seed, a.data.batch_size) == (0, 64) and c is not a  # the base is not changed
    assert resume_mismatches(a.to_dict(), c) == [
        "data.batch_size: checkpoint 64 vs now 32",
        "engine.seed: checkpoint 0 vs now 7",
    ]
    # a checkpoint written before a key existed (model.routing*) holds its default
    saved = a.to_dict()
    for key in ("routing", "routing_keep", "routing_start", "routing_end", "routing_until"):
        saved["model"].pop(key, None)  # the unused options are not written (to_dict); the switch is
    assert resume_mismatches(saved, a) == []
    routed = config_from_dict({"model": {"routing": "tread", "depth": 6}}, base=load_config(None, adamw))
    assert "model.routing: checkpoint 'none' vs now 'tread'" in resume_mismatches(saved, routed)
    # the optimizer's state is of its kind: a resume keeps optim.name (a checkpoint from before it: adamw)
    muon = config_from_dict({"optim": {"name": "muon"}}, base=load_config(None, adamw))
    assert resume_mismatches(a.to_dict(), muon) == ["optim.name: checkpoint 'adamw' vs now 'muon'"]
    del saved["optim"]["name"]
    assert resume_mismatches(saved, a) == [] and resume_mismatches(saved, muon) != []


def _parse(argv):
    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    return p.parse_args(argv)


def test_dry_run_prints_resolved_yaml(capsys, tmp_path):
    rc = cli_train.run(_parse(["--dry-run", "--set", "engine.max_steps=5", "--run-dir", str(tmp_path / "r")]))
    assert rc == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["engine"]["max_steps"] == 5 and printed["checkpoint"]["run_dir"] == str(tmp_path / "r")
    assert not (tmp_path / "r").exists()


def _stub_data(recipe: Path, root: Path) -> str:
    """The smallest data the dry run accepts for the recipe's data.dataset (npz / latents / images): one batch of
    zeros of the model's shape (the dry run opens the data and counts it against one batch)."""
    import numpy as np

    cfg = yaml.safe_load(recipe.read_text())
    kind, batch, m = cfg["data"]["dataset"], cfg["data"]["batch_size"], cfg["model"]
    shape = (batch, m.get("in_channels", 1), m["input_size"], m["input_size"])
    d = root / kind
    if kind == "images":
        from PIL import Image

        (d / "cls").mkdir(parents=True)
        for i in range(batch):
            Image.new("RGB", (4, 4)).save(d / "cls" / f"{i}.png")
    elif kind == "npz":
        d.mkdir()
        np.save(d / "x.npy", np.zeros(shape, np.float32))
        np.save(d / "y.npy", np.zeros(batch, np.int64))
    else:
        from diffcurr_fast.data.latents import FastDiTLatentWriter

        FastDiTLatentWriter(d).write(np.zeros(shape, np.float32), np.zeros(batch, np.int64))
    return str(d)


@pytest.mark.parametrize("recipe", RECIPES, ids=[p.stem for p in RECIPES])
def test_recipes_dry_run(recipe, capsys, tmp_path):
    """Every shipped recipe passes the dry run's checks. One sized for GPUs (DiT-XL/2 at batch 256 on one device)
    that this machine's memory cannot hold passes all the others and is refused by the size check, the last one."""
    import torch

    from diffcurr_fast.runs.resources import device_memory, training_memory

    data = _stub_data(recipe, tmp_path)
    argv = [str(recipe), "--dry-run", "--set", f"data.path={data}", "--run-dir", str(tmp_path / "run")]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # engine.device auto
    if training_memory(load_config(str(recipe)), 1, device).total > device_memory(device)[0]:
        with pytest.raises(ValueError, match=r"^this needs at least .* use a smaller model"):
            cli_train.run(_parse(argv))
        return
    assert cli_train.run(_parse(argv)) == 0
    assert yaml.safe_load(capsys.readouterr().out)["model"]["preset"].startswith("DiT-")
    assert not (tmp_path / "run").exists()


def test_help_config_lists_keys(capsys):
    assert cli_train.run(_parse(["--help-config"])) == 0
    out = capsys.readouterr().out
    assert "curriculum:" in out and "nan_policy" in out and "one of skip, stop" in out


def test_preset_fills_dimensions_and_a_contradiction_is_an_error(tmp_path):
    """The resolved config is the model that is built: a preset fills the dimensions left unset."""
    from diffcurr_fast.runs.sampling import build_model

    cfg = config_from_dict({"model": {"preset": "DiT-S/8", "input_size": 16}})
    m = cfg.model
    assert (m.patch_size, m.hidden_size, m.depth, m.num_heads) == (8, 384, 12, 6)
    net = build_model(cfg)
    assert len(net.blocks) == 12 and net.x_embedder.proj.out_channels == 384
    again = config_from_dict(cfg.to_dict())  # config.yaml reloads to the same model
    assert again.to_dict() == cfg.to_dict()
    with pytest.raises(ValueError, match=r"model.depth=1 contradicts model.preset 'DiT-S/8' \(depth 12\)"):
        config_from_dict({"model": {"preset": "DiT-S/8", "depth": 1, "input_size": 16}})
    swapped = config_from_dict({"model": {"preset": "DiT-L/2"}})  # another preset over a resolved one
    from diffcurr_fast.runs.config import set_key

    set_key(swapped, "model.preset", "DiT-B/4")
    assert swapped.validate().model.hidden_size == 768 and swapped.model.patch_size == 4
    dims = load_config(
        None,
        [
            "model.preset=DiT-S/2",
            "model.patch_size=null",
            "model.hidden_size=null",
            "model.depth=null",
            "model.num_heads=null",
        ],
    ).model
    assert (dims.patch_size, dims.hidden_size, dims.depth) == (2, 384, 12)
    zero2 = load_config("dit_l2_zero2").model
    assert (zero2.hidden_size, zero2.depth, zero2.num_heads) == (1024, 24, 16)  # DiT-L/2 (was 128, 6)


def test_tdc_section_is_part_of_the_config(tmp_path, capsys):
    """The TDC options are the ``tdc`` section: --set, YAML, --help-config, strict keys, validation."""
    cfg = load_config(None, ["tdc.num_groups=4", "tdc.budget_floor=1", "tdc.proposer=uniform"])
    tdc = cfg.tdc
    assert (tdc.num_groups, tdc.budget_floor, tdc.proposer) == (4, 1.0, "uniform") and isinstance(
        tdc.budget_floor, float
    )
    recipe = tmp_path / "r.yaml"
    recipe.write_text("tdc:\n  num_groups: 5\n  recover_lr: 3e-4\n")
    assert (load_config(recipe).tdc.num_groups, load_config(recipe).tdc.recover_lr) == (5, 3e-4)
    assert yaml.safe_load(config_to_yaml(cfg))["tdc"]["num_groups"] == 4
    for override, match in [
        ("tdc.groups=2", r"unknown config key 'tdc.groups'; valid keys of tdc: num_groups, budget_floor, "),
        ("tdc.k=0.5", r"unknown config key 'tdc.k' \(renamed tdc.budget_floor\); valid keys of tdc: num_groups, "),
        ("diffusion.fused_ops=false", r"unknown config key 'diffusion.fused_ops'; valid keys of diffusion: "),
        ("tdc.proposer=genetic", r"invalid value 'genetic' for tdc.proposer; valid choices: local, uniform, llm"),
        ("tdc.num_groups=0", r"tdc.num_groups must be >= 1"),
        ("tdc.num_groups=1001", r"tdc.num_groups \(1001\) must be <= diffusion.num_timesteps \(1000\)"),
        ("tdc.budget_floor=1.5", r"tdc.budget_floor must lie in \(0.0, 1.0\]"),
        ("tdc.finetune_lr=-1", r"tdc.finetune_lr must be >= 0, got -1"),
        ("tdc.proposer=llm", r"tdc.proposer 'llm' needs tdc.llm_url and tdc.llm_model"),
    ]:
        with pytest.raises(ValueError, match=match):
            load_config(None, [override])
    assert cli_train.run(_parse(["--help-config"])) == 0
    out = capsys.readouterr().out
    assert "tdc:" in out and "num_groups: 3" in out and "one of local, uniform, llm" in out


def test_a_saved_config_of_an_earlier_version_loads(tmp_path):
    """Checkpoints, tdc.json and bundles written before diffusion.fused_ops was removed and tdc.k renamed read back:
    the removed key is dropped, the renamed one read under its new name; recipes and --set get the error."""
    import torch

    from diffcurr_fast.runs.checkpoint import load_checkpoint, save_checkpoint

    cfg = load_config(None, ["tdc.budget_floor=0.25"])
    old = cfg.to_dict()
    old["diffusion"]["fused_ops"] = None  # what every config saved before held
    old["tdc"]["k"] = old["tdc"].pop("budget_floor")
    with pytest.raises(ValueError, match="unknown config key"):
        config_from_dict(old)
    assert config_from_dict(upgrade_saved(old)).to_dict() == cfg.to_dict()
    assert "fused_ops" in old["diffusion"] and "k" in old["tdc"]  # the saved dict itself is left as it was
    assert resume_mismatches(old, cfg) == []
    path = save_checkpoint(tmp_path, 1, {"model": {}, "config": old})
    assert torch.load(path, weights_only=True)["config"] == old
    state = load_checkpoint(path)  # what sample, export, eval --ckpt and --resume read
    assert state["config"] == cfg.to_dict() and config_from_dict(state["config"]).tdc.budget_floor == 0.25


@pytest.mark.parametrize(
    "sets, line",
    [
        (["model.patch_size=3"], "model: input_size 8 is not divisible by patch_size 3"),
        (["model.num_heads=3"], "model: hidden_size 64 is not divisible by num_heads 3"),
        (
            ["model.hidden_size=66", "model.num_heads=2"],
            "model: hidden_size must be a multiple of 4 for the 2-D sin-cos",
        ),
    ],
)
def test_dimensions_the_dit_cannot_take_are_one_line_at_dry_run(sets, line, capsys, tmp_path):
    """The DiT's own dimension check (``models.dit.check_dims``) runs when the config resolves, so a dry run (and a
    real start, which resolves it first) stops with its one line, nothing written."""
    from diffcurr_fast.cli import main

    argv = ["train", "--dry-run", "--run-dir", str(tmp_path / "run")]
    assert main([*argv, *(a for s in sets for a in ("--set", s))]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"diffcurr-fast train: error: {line}") and "\n" not in err, err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("channels, ok", [(1, True), (3, True), (4, False), (2, False)])
def test_evaluation_during_training_needs_images(channels, ok, tmp_path):
    """A latent run with logging.eval_every is refused when the config loads (and so at --dry-run), never at its
    first evaluation; 0 turns evaluation off and the same run is valid."""
    sets = ["data.dataset=npz", f"data.path={tmp_path / 'x.npz'}", f"model.in_channels={channels}"]
    if ok:  # 3x8x8: not digits, so the digits classifier does not score it (below); inception does
        features = [] if channels == 1 else ["eval.features=inception", "eval.inception_weights=w.pth"]
        load_config(None, [*sets, "logging.eval_every=5", *features])
        return
    line = rf"^logging.eval_every needs images \(model.in_channels 1 or 3\), got {channels} "
    with pytest.raises(ValueError, match=line):
        load_config(None, [*sets, "logging.eval_every=5"])
    load_config(None, [*sets, "logging.eval_every=0"])


@pytest.mark.parametrize(
    "sets, takes, fix",
    [
        (["eval.features=mnist5k"], "1x28x28 images, but this model makes 1x8x8 .data.dataset 'digits'.", "digits"),
        (["model.in_channels=3"], "1x8x8 images, but this model makes 3x8x8 .data.dataset .digits..", "inception"),
        (
            ["data.dataset=mnist5k", "model.input_size=28"],
            "1x8x8 images, but this model makes 1x28x28 .data.dataset .mnist5k..",
            "mnist5k",
        ),
    ],
)
def test_evaluation_features_must_score_the_models_images(sets, takes, fix, tmp_path):
    """The classifier extractors score their own data's shape (evaluation during training does not resize): a
    mismatch is refused when the config loads, naming the extractor that fits, not at the first evaluation."""
    with pytest.raises(ValueError, match=rf"^eval.features '\w+' scores {takes}; set eval.features={fix}"):
        load_config(None, [*sets, "logging.eval_every=5"])
    load_config(None, [*sets, "logging.eval_every=0"])


def test_configs_saved_in_each_earlier_layout_load(tmp_path):
    """Each layout a saved config had: every key of every component written (before the options moved beside their
    components, a ``to_dict`` held the options of unused ones too, some at non-default values a recipe left); no
    ``terms`` section (before the training terms); no ``optim.name`` (before the optimizer choice). A saved config
    is a record: it loads (``config.yaml`` on resume, a checkpoint's config), and its unused options are not written
    again; the same dict given as a request is refused."""
    from diffcurr_fast.runs.checkpoint import load_checkpoint, save_checkpoint
    from diffcurr_fast.runs.recipes import load_run_config

    cfg = load_config(None, ["optim.name=adamw"])  # a config from before optim.name holds its default, adamw
    full = cfg.to_dict()
    full["model"].update(routing_keep=0.25, routing_start=1, routing_end=3, routing_until=0)
    full["diffusion"].update(sigma_data=1.0, P_mean=-1.2, P_std=1.2, sigma_min=0.002, sigma_max=80.0)
    full["timesteps"].update(lognormal_mean=0.5, anuts_every=20)
    full["terms"].update(sra_weight=0.75, repa_encoder="")
    with pytest.raises(ValueError, match="is an option of"):
        config_from_dict(full)
    assert config_from_dict(full, record=True).to_dict() == cfg.to_dict()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump(full))
    assert load_run_config(tmp_path / "run" / "config.yaml").to_dict() == cfg.to_dict()
    assert resume_mismatches(full, cfg) == []
    no_terms = {sec: dict(v) for sec, v in cfg.to_dict().items() if sec != "terms"}
    del no_terms["optim"]["name"]
    path = save_checkpoint(tmp_path, 1, {"model": {}, "config": no_terms})
    state = load_checkpoint(path)
    assert config_from_dict(state["config"], record=True).to_dict() == cfg.to_dict()
    assert resume_mismatches(no_terms, cfg) == []
