"""Defaults that follow the formulation (``auto``) and the later source winning (a preset or a formulation given
as an override replaces what the recipe or the demo chose), with the resolved config recording each field's source
and describing the model that is built."""

import pytest
import torch
import yaml

from diffcurr_fast.diffusion import build_formulation
from diffcurr_fast.runs.config import config_from_dict
from diffcurr_fast.runs.recipes import config_to_yaml, list_recipes, load_config
from diffcurr_fast.runs.sampling import build_model

SOURCES = [None, *[p.name for p in list_recipes()]]  # None: the demo
FORMULATIONS = ["ddpm", "flow", "edm"]


def _comment(text: str, section: str, key: str) -> tuple[object, str]:
    """(value, comment) of ``section.key`` in a config.yaml text."""
    sec = ""
    for line in text.splitlines():
        if not line.startswith(" "):
            sec = line.rstrip(":")
        elif sec == section and line.strip().startswith(f"{key}:"):
            body, _, comment = line.partition("  # ")
            return yaml.safe_load(body.strip())[key], comment
    raise KeyError(f"{section}.{key}")


@pytest.mark.parametrize("formulation", FORMULATIONS)
@pytest.mark.parametrize("recipe", SOURCES)
def test_every_recipe_runs_under_each_formulation_with_one_override(recipe, formulation, tmp_path):
    cfg = load_config(recipe, [f"diffusion.formulation={formulation}"])
    d = cfg.diffusion
    own = {"ddpm": ("eps", True, "ddim"), "flow": ("velocity", False, "heun"), "edm": ("x0", False, "heun")}
    pred, sigma, sampler = own[formulation]
    assert d.formulation == formulation and d.prediction == pred and d.learn_sigma is sigma
    if formulation != "ddpm":
        assert d.weighting == "none" and not cfg.model.dtr
    if cfg.logging.sampler != sampler:  # a recipe's explicit sampler stays when it applies
        assert (formulation, cfg.logging.sampler) == ("ddpm", "heun"), (recipe, cfg.logging.sampler)
    with torch.device("meta"):  # the full-size recipes build without allocating their weights
        model = build_model(cfg)
    assert model.out_channels == cfg.model.in_channels * (2 if sigma else 1)
    assert (
        type(build_formulation(d)).__name__
        == {"ddpm": "DDPMSchedule", "flow": "FlowFormulation", "edm": "EDMFormulation"}[formulation]
    )
    again = config_from_dict(yaml.safe_load(config_to_yaml(cfg)))  # config.yaml reads back to the same config
    assert again.to_dict() == cfg.to_dict()


def test_demo_config_yaml_says_what_auto_resolved_to():
    text = config_to_yaml(load_config(None, []))
    assert _comment(text, "diffusion", "prediction") == ("eps", "auto: diffusion.formulation 'ddpm' (default)")
    assert _comment(text, "diffusion", "learn_sigma")[0] is True
    assert _comment(text, "logging", "sampler") == ("ddim", "auto: diffusion.formulation 'ddpm' (default)")
    assert _comment(text, "diffusion", "weighting") == ("min_snr", "demo")
    flow = config_to_yaml(load_config(None, ["diffusion.formulation=flow"]))
    assert _comment(flow, "diffusion", "weighting") == (
        "none",
        "auto: diffusion.formulation 'flow' (--set); 'min_snr' (demo) does not apply to flow",
    )


@pytest.mark.parametrize(
    "overrides, match",
    [
        (
            ["diffusion.formulation=flow", "diffusion.weighting=min_snr"],
            "diffusion.weighting='min_snr' is not supported with diffusion.formulation 'flow'; use 'none'",
        ),
        (["diffusion.formulation=edm", "diffusion.prediction=eps"], "'eps' is not an edm target; valid choices: x0"),
        (["diffusion.formulation=flow", "logging.sampler=ddim"], "logging.sampler 'ddim' cannot sample a flow model"),
        (["diffusion.formulation=flow", "diffusion.learn_sigma=true"], "diffusion.learn_sigma=True is not supported"),
    ],
)
def test_an_explicit_invalid_combination_is_still_an_error(overrides, match):
    with pytest.raises(ValueError, match=match):
        load_config(None, overrides)
    with pytest.raises(ValueError, match=match):  # the other order in the same list
        load_config(None, overrides[::-1])


def test_an_invalid_combination_within_one_recipe_is_an_error(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("diffusion:\n  formulation: flow\n  weighting: min_snr\n")
    with pytest.raises(ValueError, match="diffusion.weighting='min_snr' is not supported"):
        load_config(p)
    # the recipe's formulation and a later explicit choice that does not fit it: the later choice is kept, so error
    p.write_text("diffusion:\n  formulation: flow\n")
    with pytest.raises(ValueError, match="'eps' is not a flow target"):
        load_config(p, ["diffusion.prediction=eps"])


def _dims(model) -> tuple[int, int, int, int]:
    c = model.config()
    return c["patch_size"], c["hidden_size"], c["depth"], c["num_heads"]


def test_a_preset_override_replaces_the_demo_dimensions_and_records_it():
    cfg = load_config(None, ["model.preset=DiT-S/8", "model.input_size=16"])
    model = build_model(cfg)
    assert _dims(model) == (8, 384, 12, 6)
    text = config_to_yaml(cfg)
    for key, want in zip(("patch_size", "hidden_size", "depth", "num_heads"), _dims(model)):
        assert _comment(text, "model", key) == (want, "model.preset 'DiT-S/8' (--set)")
    assert _comment(text, "model", "in_channels") == (1, "demo")  # not a preset dimension: the demo's
    assert _comment(text, "model", "input_size") == (16, "--set")


@pytest.mark.parametrize("recipe", SOURCES)
def test_one_preset_override_switches_the_model_of_every_recipe(recipe):
    """The done-when of switching presets: one ``--set model.preset=X`` (X not the recipe's own) gives X's
    dimensions, config.yaml says the override set them and reads back to the model that is built."""
    from diffcurr_fast.models.dit import DIT_PRESETS

    own = load_config(recipe, [])
    size = own.model.input_size
    preset = next(n for n, d in DIT_PRESETS.items() if n != own.model.preset and size % d["patch_size"] == 0)
    cfg = load_config(recipe, [f"model.preset={preset}"])
    with torch.device("meta"):  # the full-size recipes build without allocating their weights
        model = build_model(cfg)
    want = DIT_PRESETS[preset]
    assert _dims(model) == (want["patch_size"], want["hidden_size"], want["depth"], want["num_heads"])
    assert _dims(model) != _dims(_meta_model(own))  # the override changed the model
    text = config_to_yaml(cfg)
    assert _comment(text, "model", "preset") == (preset, "--set")
    for key in ("patch_size", "hidden_size", "depth", "num_heads"):
        assert _comment(text, "model", key) == (want[key], f"model.preset {preset!r} (--set)"), key
    again = config_from_dict(yaml.safe_load(text))  # the written config describes the built model
    assert again.to_dict() == cfg.to_dict()
    assert _dims(_meta_model(again)) == _dims(model) and again.model.input_size == size


def _meta_model(cfg):
    with torch.device("meta"):
        return build_model(cfg)


def test_a_preset_override_replaces_a_recipe_preset_and_custom_goes_back():
    cfg = load_config("dit_b2_curriculum", ["model.preset=DiT-S/4"])
    with torch.device("meta"):
        assert _dims(build_model(cfg)) == (4, 384, 12, 6)
    sources = cfg.sources()
    assert sources["model.depth"] == "model.preset 'DiT-S/4' (--set)" and sources["model.preset"] == "--set"
    custom = load_config("dit_b2_curriculum", ["model.preset=custom", "model.depth=3", "model.hidden_size=96"])
    with torch.device("meta"):
        assert _dims(build_model(custom)) == (2, 96, 3, 4)  # the rest are the custom defaults
    text = config_to_yaml(custom)
    assert _comment(text, "model", "depth") == (3, "--set")
    assert _comment(text, "model", "num_heads") == (4, "custom default")


def test_a_contradiction_within_one_source_is_still_an_error(tmp_path):
    with pytest.raises(
        ValueError,
        match=r"model.depth=4 contradicts model.preset 'DiT-S/8' \(depth 12\) in the "
        r"same or a later source \(--set\)",
    ):
        load_config(None, ["model.preset=DiT-S/8", "model.depth=4"])
    p = tmp_path / "r.yaml"
    p.write_text("model:\n  preset: DiT-S/8\n  depth: 4\n")
    with pytest.raises(ValueError, match=r"model.depth=4 contradicts model.preset 'DiT-S/8' .*\(recipe r.yaml\)"):
        load_config(p)
    with pytest.raises(ValueError, match=r"model.depth=3 contradicts model.preset 'DiT-B/2'"):  # a later dimension
        load_config("dit_b2_curriculum", ["model.depth=3"])


def test_the_written_run_config_is_the_built_model(tmp_path):
    """A run started with a preset override: its config.yaml reads back to the model it trains."""
    from diffcurr_fast.train.loop import Trainer

    run = tmp_path / "run"
    cfg = load_config(
        None, [f"checkpoint.run_dir={run}", "model.preset=DiT-S/8", "model.hidden_size=null", "logging.progress=false"]
    )
    tr = Trainer(cfg)  # writes config.yaml before the first step
    text = (run / "config.yaml").read_text()
    built = tr.model.config()
    for key in ("patch_size", "hidden_size", "depth", "num_heads"):
        assert _comment(text, "model", key) == (built[key], "model.preset 'DiT-S/8' (--set)")
    assert (built["depth"], built["hidden_size"]) == (12, 384) and len(tr.model.blocks) == 12
    assert config_from_dict(yaml.safe_load(text)).to_dict() == cfg.to_dict()


def _tiny_checkpoint(path, formulation):
    """A random-weight checkpoint of a tiny demo model trained with ``formulation``."""
    from diffcurr_fast.runs.checkpoint import atomic_save

    tiny = ["model.hidden_size=16", "model.depth=1", "model.num_heads=2", "diffusion.num_timesteps=20"]
    cfg = load_config(None, [f"diffusion.formulation={formulation}", *tiny, "curriculum.num_clusters=2"])
    sd = build_model(cfg).state_dict()
    return atomic_save({"config": cfg.to_dict(), "model": sd, "ema": {"module": sd}, "step": 1}, path)


@pytest.mark.parametrize("formulation, sampler", [("ddpm", "ddim"), ("flow", "heun"), ("edm", "heun")])
def test_sample_command_defaults_to_the_formulations_sampler(tmp_path, capsys, formulation, sampler):
    import argparse

    from diffcurr_fast import cli_sample

    ckpt = _tiny_checkpoint(tmp_path / "c.pt", formulation)
    p = argparse.ArgumentParser()
    cli_sample.add_arguments(p)
    out = tmp_path / "s.npz"
    assert cli_sample.run(p.parse_args(["--ckpt", str(ckpt), "--steps", "2", "--num", "3", "--out", str(out)])) == 0
    assert f"wrote 3 samples ({sampler}, 2 steps" in capsys.readouterr().out


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory):
    from diffcurr_fast.eval.features import digits_classifier

    path = tmp_path_factory.mktemp("digits") / "digits_classifier.pt"
    digits_classifier(path)
    return str(path)


@pytest.mark.parametrize("formulation, sampler", [("ddpm", "ddim"), ("flow", "heun"), ("edm", "heun")])
def test_eval_command_defaults_to_the_formulations_sampler(tmp_path, capsys, digits_cache, formulation, sampler):
    """``eval --ckpt`` without --sampler samples a flow or EDM model with its own sampler (ddim cannot), resolved
    as ``sample`` resolves it; the images are those of that sampler."""
    from diffcurr_fast import cli
    from diffcurr_fast.eval.evaluate import checkpoint_model, samples_from_model

    ckpt = _tiny_checkpoint(tmp_path / "c.pt", formulation)
    argv = ["eval", "--ckpt", str(ckpt), "--num-samples", "4", "--steps", "2", "--batch-size", "3"]
    argv += ["--ref", "digits", "--digits-cache", digits_cache, "--json", str(tmp_path / "m.json")]
    capsys.readouterr()
    assert cli.main(argv) == 0, capsys.readouterr().err
    assert f"sampled 4 images from {ckpt} ({sampler}, 2 steps)" in capsys.readouterr().out
    model, cfg = checkpoint_model(ckpt)
    auto = samples_from_model(model, cfg, 4, steps=2, batch_size=3)  # the library's default is auto too
    torch.testing.assert_close(auto, samples_from_model(model, cfg, 4, sampler=sampler, steps=2, batch_size=3))


def test_init_from_a_diffusers_export_takes_its_dimensions(tmp_path):
    """model.init_from a diffusers folder gives the model its export's dimensions, as a preset does: over the demo's
    (an earlier source), not over a contradicting value of the same source, which is one line naming both."""
    import json

    from diffcurr_fast.models.diffusers_dit import diffusers_config
    from diffcurr_fast.runs.recipes import load_config

    exp = tmp_path / "export"
    exp.mkdir()
    dims = dict(input_size=8, in_channels=1, num_classes=10, patch_size=2, hidden_size=48, depth=3, num_heads=3)
    (exp / "config.json").write_text(json.dumps(diffusers_config({**dims, "mlp_ratio": 4.0, "learn_sigma": True})))
    cfg = load_config(None, [f"model.init_from={exp}"])  # the demo: depth 4, width 64, 4 heads
    assert {k: getattr(cfg.model, k) for k in dims} == dims
    assert cfg.sources()["model.depth"] == f"model.init_from {str(exp)!r} (its config.json)"
    assert load_config(None, [f"model.init_from={exp}", "model.depth=3"]).model.depth == 3  # agrees: fine
    with pytest.raises(ValueError, match=r"^model.depth=5 \(--set\) contradicts model.init_from .*, whose config.json"):
        load_config(None, [f"model.init_from={exp}", "model.depth=5"])
    pipeline = tmp_path / "pipe"
    (pipeline / "transformer").mkdir(parents=True)
    (pipeline / "transformer" / "config.json").write_text((exp / "config.json").read_text())
    assert load_config(None, [f"model.init_from={pipeline}"]).model.hidden_size == 48  # a DiTPipeline folder
    plain = tmp_path / "w.pt"
    plain.write_bytes(b"")
    assert load_config(None, [f"model.init_from={plain}"]).model.hidden_size == 64  # a weights file: the recipe's
