"""``export --to diffusers`` (diffcurr_fast/cli_export.py) pinned where its other tests leave it free: the command
line (usage, required ``--to``, the choices), which weights are written (EMA by default, ``--weights model``), the
printed line, ``diffcurr_fast.json`` byte for byte, every scheduler config field, the pipeline branch through the
CLI, the refusals' full messages, the temporary directory (its name, place, mode, cleanup) and strict loading.
Offline, tiny hand-made checkpoints (as tests/cli/test_diffusers_export.py); skipped without diffusers."""

import json
import os
import re
import shutil
import stat
import sys
from types import SimpleNamespace

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is not installed (pip install diffusers)")

from conftest import random_weights, save_tiny_vae, tiny_dit_overrides  # noqa: E402

from diffcurr_fast import cli, cli_export  # noqa: E402
from diffcurr_fast.cli_export import (  # noqa: E402
    export_diffusers,
    load_model,
    scheduler_config,
    to_diffusers_transformer,
)
from diffcurr_fast.models import DiT  # noqa: E402
from diffcurr_fast.runs.checkpoint import atomic_save  # noqa: E402
from diffcurr_fast.runs.recipes import load_config  # noqa: E402
from diffcurr_fast.runs.sampling import build_model, build_schedule  # noqa: E402


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def _checkpoint(tmp_path, *extra):
    """A checkpoint whose raw weights (seed 0) and EMA weights (seed 1) differ: (path, cfg, raw model, EMA model)."""
    cfg = load_config(None, tiny_dit_overrides(tmp_path / "run", *extra))
    raw, ema = random_weights(build_model(cfg), seed=0), random_weights(build_model(cfg), seed=1)
    path = atomic_save(
        {"config": cfg.to_dict(), "model": raw.state_dict(), "ema": {"module": ema.state_dict()}, "step": 1},
        tmp_path / "run" / "checkpoints" / "ckpt_00000001.pt",
    )
    return path, cfg, raw, ema


def _assert_transformer_is(out, model):
    """The exported transformer holds exactly ``model``'s weights."""
    net = diffusers.DiTTransformer2DModel.from_pretrained(out / "transformer")
    want = to_diffusers_transformer(model).state_dict()
    got = net.state_dict()
    assert list(got) == list(want)
    for k, v in want.items():
        assert torch.equal(got[k], v), k


def _assert_same_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k, v in sa.items():
        assert torch.equal(v, sb[k]), k


# --- the command line -------------------------------------------------------------------------------------------


def test_export_usage_line(capsys, monkeypatch):
    """The names of the positionals (RUN|CKPT, OUT: docs/training.md's usage and the messages' "choose another
    OUT"), --to required with one choice, --weights' two choices."""
    monkeypatch.setenv("COLUMNS", "200")  # one usage line
    with pytest.raises(SystemExit) as info:
        cli.main(["export", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == (
        "usage: diffcurr-fast export [-h] --to {diffusers} [--weights {ema,model}] [--vae DIR] [--overwrite] "
        "RUN|CKPT OUT"
    )
    positionals = out.split("positional arguments:")[1].split("options:")[0]
    assert [line.split()[0] for line in positionals.strip().splitlines()] == ["RUN|CKPT", "OUT"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["export", "nowhere.pt", "out"], "the following arguments are required: --to"),
        (["export", "nowhere.pt", "--to", "onnx", "out"], "argument --to: invalid choice: 'onnx'"),
        (["export", "nowhere.pt", "--to", "diffusers", "out", "--weights", "last"], "invalid choice: 'last'"),
    ],
)
def test_export_argument_errors(argv, message, capsys):
    """argparse refuses these before any file is read (exit 2), not the export after it."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_default_ema_and_printed_line(tmp_path, capsys):
    path, cfg, raw, ema = _checkpoint(tmp_path)
    out = tmp_path / "export"
    assert cli.main(["export", str(tmp_path / "run"), "--to", "diffusers", str(out)]) == 0
    assert capsys.readouterr().out == f"wrote DiTTransformer2DModel + DDIMScheduler to {out}\n"
    _assert_transformer_is(out, ema)
    assert json.loads((out / "diffcurr_fast.json").read_text())["weights"] == "ema"


@pytest.mark.parametrize("weights", ["ema", "model"])
def test_cli_weights_choice_is_written(tmp_path, capsys, weights):
    path, cfg, raw, ema = _checkpoint(tmp_path)
    out = tmp_path / "export"
    assert cli.main(["export", str(path), "--to", "diffusers", str(out), "--weights", weights]) == 0, (
        capsys.readouterr().err
    )
    _assert_transformer_is(out, ema if weights == "ema" else raw)
    assert json.loads((out / "diffcurr_fast.json").read_text())["weights"] == weights


def test_load_model_default_is_ema(tmp_path):
    path, cfg, raw, ema = _checkpoint(tmp_path)
    model, cfg2, p = load_model(str(tmp_path / "run"))
    assert p == path and cfg2.to_dict() == cfg.to_dict()
    _assert_same_weights(model, ema)
    _assert_same_weights(load_model(str(path), "model")[0], raw)


# --- what export_diffusers writes ---------------------------------------------------------------------------------


def test_export_default_weights_and_info_file(tmp_path):
    """Called without ``weights``: the EMA weights, and diffcurr_fast.json exactly (keys, values, one-space indent)."""
    path, cfg, raw, ema = _checkpoint(tmp_path)
    out = tmp_path / "export"
    res = export_diffusers(str(tmp_path / "run"), out)
    assert res == {"out": out, "scheduler": "DDIMScheduler", "pipeline": False}
    _assert_transformer_is(out, ema)
    info = {
        "checkpoint": str(path),
        "weights": "ema",
        "formulation": "ddpm",
        "prediction": "eps",
        "num_classes": 7,
        "data_scale": 1.0,
    }
    assert (out / "diffcurr_fast.json").read_text() == json.dumps(info, indent=1)
    assert (out / "diffcurr_fast.json").read_text().startswith('{\n "checkpoint": ')
    assert sorted(p.name for p in out.iterdir()) == ["diffcurr_fast.json", "scheduler", "transformer"]


def test_ddpm_scheduler_config_every_field(tmp_path):
    path, cfg, _, _ = _checkpoint(tmp_path, "diffusion.prediction=v")
    name, conf = scheduler_config(cfg)
    fields = {
        "num_train_timesteps": 60,
        "prediction_type": "v_prediction",
        "clip_sample": True,
        "clip_sample_range": 1.0,
        "set_alpha_to_one": True,
        "steps_offset": 0,
        "timestep_spacing": "leading",
    }
    assert name == "DDIMScheduler"
    assert conf == {**fields, "trained_betas": build_schedule(cfg).betas.tolist()}
    out = tmp_path / "export"
    export_diffusers(str(path), out)
    written = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert written["_class_name"] == "DDIMScheduler"
    assert {k: written[k] for k in fields} == fields


def test_flow_scheduler_config_every_field(tmp_path):
    path, cfg, _, _ = _checkpoint(tmp_path, "diffusion.formulation=flow")
    assert scheduler_config(cfg) == ("FlowMatchEulerDiscreteScheduler", {"num_train_timesteps": 60, "shift": 1.0})
    out = tmp_path / "export"
    assert export_diffusers(str(path), out)["scheduler"] == "FlowMatchEulerDiscreteScheduler"
    written = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert (written["_class_name"], written["num_train_timesteps"], written["shift"]) == (
        "FlowMatchEulerDiscreteScheduler",
        60,
        1.0,
    )


def test_edm_scheduler_config_every_field(tmp_path):
    path, cfg, _, _ = _checkpoint(
        tmp_path, "diffusion.formulation=edm", "diffusion.sigma_min=0.01", "diffusion.sigma_max=20.0"
    )
    conf = {
        "sigma_min": 0.01,
        "sigma_max": 20.0,
        "sigma_data": 0.5,
        "sigma_schedule": "karras",
        "rho": 7.0,
        "prediction_type": "epsilon",
        "final_sigmas_type": "zero",
    }
    assert scheduler_config(cfg) == ("EDMEulerScheduler", conf)
    out = tmp_path / "export"
    export_diffusers(str(path), out)
    written = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert written["_class_name"] == "EDMEulerScheduler"
    assert {k: written[k] for k in conf} == conf


def test_scheduler_config_names_an_unknown_formulation():
    cfg = SimpleNamespace(diffusion=SimpleNamespace(formulation="sde"))
    with pytest.raises(ValueError, match=r"^diffusion\.formulation 'sde' has no diffusers scheduler$"):
        scheduler_config(cfg)


@pytest.fixture(scope="module")
def vae_dir(tmp_path_factory):
    return save_tiny_vae(tmp_path_factory.mktemp("vae") / "tiny-vae", levels=2, sample_size=12)


def test_cli_vae_writes_a_pipeline(tmp_path, vae_dir, capsys):
    """``--vae`` through the command line: a whole DiTPipeline (model_index.json, the VAE scaled by data.scale)."""
    (tmp_path / "lat").mkdir()
    path, cfg, _, _ = _checkpoint(
        tmp_path, "model.in_channels=4", "data.dataset=npz", f"data.path={tmp_path / 'lat'}", "data.scale=0.5"
    )
    out = tmp_path / "pipe"
    assert cli.main(["export", str(path), "--to", "diffusers", str(out), "--vae", str(vae_dir)]) == 0, (
        capsys.readouterr().err
    )
    assert capsys.readouterr().out == f"wrote DiTPipeline to {out}\n"
    index = json.loads((out / "model_index.json").read_text())
    assert index["_class_name"] == "DiTPipeline"
    assert index["transformer"] == ["diffusers", "DiTTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["scheduler"] == ["diffusers", "DDIMScheduler"]
    assert json.loads((out / "vae" / "config.json").read_text())["scaling_factor"] == 0.5
    assert json.loads((out / "diffcurr_fast.json").read_text())["data_scale"] == 0.5


# --- refusals -----------------------------------------------------------------------------------------------------


def test_existing_out_refused_with_its_path(tmp_path, capsys):
    path, _, _, _ = _checkpoint(tmp_path)
    other = tmp_path / "mine"
    other.mkdir()
    want = f"{str(other)!r} exists; pass --overwrite to replace it (a previous export only)"
    with pytest.raises(FileExistsError, match=f"^{re.escape(want)}$"):
        export_diffusers(str(path), other)
    want = (
        f"{str(other)!r} exists and is not a diffusers export (no transformer/config.json); "
        "--overwrite replaces only a previous export: choose another OUT"
    )
    with pytest.raises(FileExistsError, match=f"^{re.escape(want)}$"):
        export_diffusers(str(path), other, overwrite=True)
    # a previous export, without overwrite (the default): refused too, left as it was
    out = tmp_path / "export"
    export_diffusers(str(path), out)
    (out / "diffcurr_fast.json").write_text("{}")
    with pytest.raises(FileExistsError, match="exists; pass --overwrite"):
        export_diffusers(str(path), out)
    assert (out / "diffcurr_fast.json").read_text() == "{}"


def test_out_under_a_file_names_out(tmp_path, capsys):
    path, _, _, _ = _checkpoint(tmp_path)
    (tmp_path / "a.txt").write_text("x")
    out = tmp_path / "a.txt" / "out"
    assert cli.main(["export", str(path), "--to", "diffusers", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"diffcurr-fast export: error: OUT {str(out)!r} cannot be created: {str(tmp_path / 'a.txt')!r} is a file, "
        "not a directory; choose another OUT\n"
    )


def test_missing_diffusers_is_one_line_with_the_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # `import diffusers` raises ImportError
    assert cli.main(["export", str(tmp_path / "x.pt"), "--to", "diffusers", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == (
        "diffcurr-fast export: error: export --to diffusers needs diffusers: pip install 'diffcurr-fast[diffusers]'\n"
    )


def test_transformer_is_loaded_strictly(monkeypatch):
    """A converted state that misses a key is an error, not a transformer with that weight left at its init."""
    from diffcurr_fast.models import diffusers_dit

    real = diffusers_dit.to_diffusers_state

    def lossy(sd, config):
        d = dict(real(sd, config))
        d.pop("proj_out_2.bias")
        return d

    model = random_weights(DiT(input_size=4, patch_size=2, in_channels=1, hidden_size=32, depth=1, num_heads=2), seed=0)
    monkeypatch.setattr(diffusers_dit, "to_diffusers_state", lossy)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"proj_out_2\.bias\""):
        to_diffusers_transformer(model)


# --- the temporary directory --------------------------------------------------------------------------------------


def test_out_parents_are_created(tmp_path):
    path, _, _, _ = _checkpoint(tmp_path)
    out = tmp_path / "a" / "b" / "export"
    export_diffusers(str(path), out)
    assert (out / "transformer" / "config.json").is_file()


def test_written_in_a_hidden_sibling_then_moved(tmp_path, monkeypatch):
    """The export is written whole in ``.<OUT name>.*`` next to OUT (same file system: the rename is atomic)."""
    path, _, _, _ = _checkpoint(tmp_path)
    out = tmp_path / "sub" / "export"
    seen = []
    real = cli_export.write_json

    def spy(data, where, **kw):
        seen.append(where.parent)
        return real(data, where, **kw)

    monkeypatch.setattr(cli_export, "write_json", spy)
    export_diffusers(str(path), out)
    [tmp] = seen
    assert tmp.parent == out.parent and tmp.name.startswith(".export.") and tmp.name != ".export."
    assert not tmp.exists() and sorted(p.name for p in out.parent.iterdir()) == ["export"]


def test_export_directory_mode_follows_the_umask(tmp_path):
    path, _, _, _ = _checkpoint(tmp_path)
    old = os.umask(0o027)
    try:
        export_diffusers(str(path), tmp_path / "export")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "export").stat().st_mode) == 0o750  # 0o777 & ~0o027, not mkdtemp's 0o700


def test_a_failed_write_leaves_nothing_and_raises_its_error(tmp_path, monkeypatch):
    path, _, _, _ = _checkpoint(tmp_path)

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(cli_export, "write_json", full)
    with pytest.raises(OSError, match="No space left on device") as info:
        export_diffusers(str(path), tmp_path / "out")
    assert info.value.errno == 28
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]  # neither OUT nor a .out.* temporary


def test_a_cleanup_that_cannot_complete_does_not_hide_the_error(tmp_path, monkeypatch):
    """The temporary is removed best-effort: already gone (or not removable), the write's own error still comes."""
    path, _, _, _ = _checkpoint(tmp_path)

    class WriteFailed(Exception):
        pass

    def vanish(data, where, **k):
        shutil.rmtree(where.parent)
        raise WriteFailed("the write failed")

    monkeypatch.setattr(cli_export, "write_json", vanish)
    with pytest.raises(WriteFailed, match="^the write failed$"):
        export_diffusers(str(path), tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]
