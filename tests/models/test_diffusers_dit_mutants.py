"""``models/diffusers_dit.py`` on its own, in-process and mostly without diffusers: the refusal reasons of
``diffusers_config`` and its fixed entries, ``export_dims`` on both folder layouts, the state-dict mapping's
edge cases (one block, no blocks, a missing / extra key, embedder copies, the null-label row) and
``read_diffusers_dir`` with safetensors and ``.bin`` weights (CPU mapping, weights-only unpickling) and its errors.
The end-to-end checks against diffusers itself are in ``tests/cli/test_diffusers_export.py``."""

import datetime
import io
import json
import pickle
import re
import zipfile

import pytest
import torch
from conftest import random_weights
from safetensors.torch import save_file

from diffcurr_fast.models import DiT
from diffcurr_fast.models.diffusers_dit import (
    diffusers_config,
    export_dims,
    from_diffusers_state,
    is_diffusers_dir,
    read_diffusers_dir,
    to_diffusers_state,
)

# the dimensions of a tiny DiT and the diffusers config written for it (hand-written from diffusers_config's rule)
DIMS = dict(input_size=8, in_channels=1, num_classes=10, patch_size=2, hidden_size=32, depth=1, num_heads=2)
DIFFUSERS = {
    "_class_name": "DiTTransformer2DModel",
    "num_attention_heads": 2,
    "attention_head_dim": 16,  # 32 // 2
    "in_channels": 1,
    "out_channels": 2,  # learn_sigma: 2 x 1
    "num_layers": 1,
    "dropout": 0.0,
    "norm_num_groups": 32,
    "attention_bias": True,
    "sample_size": 8,
    "patch_size": 2,
    "activation_fn": "gelu-approximate",
    "num_embeds_ada_norm": 10,
    "upcast_attention": False,
    "norm_type": "ada_norm_zero",
    "norm_elementwise_affine": False,
    "norm_eps": 1e-5,
}
NO_KEYS = "the diffusers DiT state dict has keys with no DiT counterpart: "


def _exact(message: str) -> str:
    return "^" + re.escape(message) + "$"


def _tiny(depth: int = 1, num_classes: int = 3, dropout: float = 0.1, seed: int = 0) -> DiT:
    """A tiny DiT with every trainable weight random (zero-initialised layers would hide a mix-up)."""
    model = DiT(
        input_size=4,
        patch_size=2,
        in_channels=1,
        hidden_size=32,
        depth=depth,
        num_heads=2,
        num_classes=num_classes,
        class_dropout_prob=dropout,
    )
    return random_weights(model, seed=seed)


def _diffusers_state(model: DiT) -> dict[str, torch.Tensor]:
    return to_diffusers_state(model.state_dict(), model.config())


def _folder(path, model: DiT, weights: str = "safetensors"):
    """A diffusers transformer folder of ``model`` written without diffusers: config.json and the weights."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(diffusers_config(model.config())))
    state = _diffusers_state(model)
    if weights == "safetensors":
        save_file(state, str(path / "diffusion_pytorch_model.safetensors"))
    else:
        torch.save(state, path / "diffusion_pytorch_model.bin")
    return path, state


# ---- diffusers_config --------------------------------------------------------------------------------------
def test_diffusers_config_of_a_plain_config_without_the_modern_keys():
    """A config of before the modern block (no norm / qk_norm / mlp / pos) is the plain DiT: every entry pinned."""
    assert diffusers_config({**DIMS, "mlp_ratio": 4.0, "learn_sigma": True}) == DIFFUSERS
    full = _tiny().config()  # every key present, at the release's values
    assert diffusers_config(full)["num_layers"] == 1 and diffusers_config(full)["dropout"] == 0.0


def test_diffusers_config_fixed_entries_are_diffusers_defaults():
    """The entries that do not come from our config are diffusers' own DiT defaults (the release's block)."""
    diffusers = pytest.importorskip("diffusers")
    import inspect

    sig = inspect.signature(diffusers.DiTTransformer2DModel.__init__).parameters
    fixed = ("dropout", "norm_num_groups", "attention_bias", "activation_fn", "upcast_attention", "norm_type")
    for name in (*fixed, "norm_elementwise_affine", "norm_eps"):
        assert DIFFUSERS[name] == sig[name].default, name


@pytest.mark.parametrize(
    "pruned",
    [{"block_num_heads": [2]}, {"block_mlp_hidden": [64]}, {"block_num_heads": [1], "block_mlp_hidden": [64]}],
)
def test_diffusers_config_refuses_a_model_pruned_in_heads_or_widths_alone(pruned):
    with pytest.raises(ValueError, match=r"it is pruned \(per-block heads or MLP widths\); diffusers' blocks"):
        diffusers_config({**_tiny().config(), **pruned})


def test_diffusers_config_names_every_reason_in_one_line():
    """All the reasons at once, in their order, joined by '; ' after the one prefix (the whole text pinned)."""
    config = {
        **_tiny().config(),
        "dtr": {"num_timesteps": 1000},
        "block_num_heads": [1],
        "sprint": True,
        "mlp_ratio": 3.0,
        "norm": "rmsnorm",
        "qk_norm": True,
        "mlp": "swiglu",
        "pos": "rope2d",
    }
    expected = (
        "this DiT cannot be written as a diffusers DiTTransformer2DModel: "
        "it uses Denoising Task Routing (model.dtr), which diffusers' DiT has no place for; "
        "it is pruned (per-block heads or MLP widths); diffusers' blocks are all the same width; "
        "it uses SPRINT (model.routing=sprint), whose fusion layer and [MASK] token diffusers' DiT has no place for; "
        "its model.mlp_ratio is 3.0 (diffusers' DiT feed-forward is 4x wide); "
        "it uses the modern block (model.norm=rmsnorm, model.qk_norm=true, model.mlp=swiglu, model.pos=rope2d), "
        "which diffusers' DiT has no equivalent for (it has LayerNorm, no QK-norm, a GELU feed-forward and the "
        "added sin-cos position embedding)"
    )
    with pytest.raises(ValueError, match=_exact(expected)):
        diffusers_config(config)


# ---- export_dims / is_diffusers_dir --------------------------------------------------------------------------
def _write_config(folder, config) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))


def test_export_dims_of_a_transformer_folder_and_of_a_pipeline(tmp_path):
    _write_config(tmp_path / "transformer_only", DIFFUSERS)
    _write_config(tmp_path / "pipe" / "transformer", DIFFUSERS)
    assert export_dims(tmp_path / "transformer_only") == DIMS
    assert export_dims(str(tmp_path / "pipe")) == DIMS


@pytest.mark.parametrize("labels", [{}, {"num_embeds_ada_norm": None}])
def test_export_dims_defaults_to_1000_classes(tmp_path, labels):
    """Without num_embeds_ada_norm (diffusers' default) the model has ImageNet's 1000 classes."""
    config = {k: v for k, v in DIFFUSERS.items() if k != "num_embeds_ada_norm"} | labels
    _write_config(tmp_path, config)
    assert export_dims(tmp_path) == {**DIMS, "num_classes": 1000}


@pytest.mark.parametrize(
    "config, why",
    [
        (DIFFUSERS | {"_class_name": "UNet2DModel"}, "its _class_name is 'UNet2DModel'"),  # every key, another class
        ({k: v for k, v in DIFFUSERS.items() if k != "_class_name"}, "its _class_name is None"),
        ({k: v for k, v in DIFFUSERS.items() if k != "num_layers"}, "it lacks num_layers"),  # the class, a key missing
        (
            {k: v for k, v in DIFFUSERS.items() if k not in ("sample_size", "attention_head_dim")},
            "it lacks sample_size, attention_head_dim",
        ),
        ([1, 2], "it is not a JSON object"),
    ],
)
def test_export_dims_refuses_what_is_not_a_dit_config(tmp_path, config, why):
    _write_config(tmp_path, config)
    cfg = tmp_path / "config.json"
    with pytest.raises(ValueError, match=_exact(f"{str(cfg)!r} does not describe a DiTTransformer2DModel ({why})")):
        export_dims(tmp_path)


def test_export_dims_and_read_diffusers_dir_name_a_config_that_is_not_json(tmp_path):
    (tmp_path / "config.json").write_text("{ not json")
    cfg = tmp_path / "config.json"
    expected = "^" + re.escape(f"diffusers config {str(cfg)!r} is not valid JSON (line 1, column 3")
    with pytest.raises(ValueError, match=expected):
        export_dims(tmp_path)
    with pytest.raises(ValueError, match=expected):
        read_diffusers_dir(tmp_path)


def test_is_diffusers_dir(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "file.json").write_text("{}")
    _write_config(tmp_path / "t", DIFFUSERS)
    _write_config(tmp_path / "pipe" / "transformer", DIFFUSERS)
    assert not is_diffusers_dir(tmp_path / "plain")  # a folder without config.json
    assert not is_diffusers_dir(tmp_path / "file.json")
    assert not is_diffusers_dir(tmp_path / "missing")
    assert is_diffusers_dir(tmp_path / "t") and is_diffusers_dir(str(tmp_path / "pipe"))


# ---- from_diffusers_state ----------------------------------------------------------------------------------
def test_one_block_model_maps_back_bitwise():
    model = _tiny(depth=1)
    own = model.state_dict()
    back = from_diffusers_state(_diffusers_state(model), own)
    assert back.keys() == own.keys()
    for k, v in own.items():
        assert torch.equal(back[k], v), k


def test_one_block_model_has_no_embedder_copies_to_compare():
    """With one block there is no copy to compare (block 0 is not compared with itself): a NaN in its embedder is
    carried over as any value is, not reported as a copy that differs."""
    model = _tiny(depth=1)
    state = _diffusers_state(model)
    state["transformer_blocks.0.norm1.emb.timestep_embedder.linear_1.bias"][0] = float("nan")
    back = from_diffusers_state(state, model.state_dict())
    assert torch.isnan(back["t_embedder.mlp.0.bias"][0])
    assert torch.equal(back["t_embedder.mlp.0.bias"][1:], model.state_dict()["t_embedder.mlp.0.bias"][1:])


def test_embedder_copies_with_nan_at_the_same_places_are_the_same_copy():
    """A NaN in every block's copy at the same place is one copy, carried over; a NaN in one copy only differs."""
    model = _tiny(depth=2)
    state = _diffusers_state(model)
    name = "norm1.emb.timestep_embedder.linear_1.bias"
    for i in (0, 1):
        state[f"transformer_blocks.{i}.{name}"][0] = float("nan")
    back = from_diffusers_state(state, model.state_dict())
    assert torch.isnan(back["t_embedder.mlp.0.bias"][0])
    state[f"transformer_blocks.1.{name}"][0] = 0.0
    with pytest.raises(ValueError, match=f"^transformer_blocks.1.{name} differs from block 0's copy"):
        from_diffusers_state(state, model.state_dict())


@pytest.mark.parametrize("state", [{}, {"pos_embed.proj.weight": torch.zeros(1)}])
def test_a_state_dict_without_blocks_is_refused(state):
    with pytest.raises(
        ValueError, match=_exact("not a DiTTransformer2DModel state dict: no transformer_blocks.* keys")
    ):
        from_diffusers_state(state, _tiny().state_dict())


def test_a_missing_key_is_named():
    model = _tiny(depth=1)
    state = _diffusers_state(model)
    del state["transformer_blocks.0.attn1.to_k.bias"]
    with pytest.raises(
        ValueError, match=_exact("the diffusers DiT state dict has no key 'transformer_blocks.0.attn1.to_k.bias'")
    ):
        from_diffusers_state(state, model.state_dict())


def test_embedder_copies_that_differ_are_refused_in_full():
    model = _tiny(depth=2)
    state = _diffusers_state(model)
    key = "transformer_blocks.1.norm1.emb.timestep_embedder.linear_1.bias"
    state[key] = state[key] + 1.0
    expected = (
        f"{key} differs from block 0's copy; the DiT release has one timestep / label embedder shared by all blocks, "
        "so this model does not map to it"
    )
    with pytest.raises(ValueError, match=_exact(expected)):
        from_diffusers_state(state, model.state_dict())


def test_refuses_to_drop_a_trained_null_label_row_in_full():
    trained = _tiny(num_classes=3, dropout=0.1)  # 3 classes + a trained (nonzero) null row
    plain = _tiny(num_classes=3, dropout=0.0)
    assert trained.y_embedder.embedding_table.weight[-1].any()
    expected = (
        "the diffusers DiT has a trained null-label row (it was trained with label dropout) and this model has none: "
        "set model.class_dropout_prob > 0 to keep it"
    )
    with pytest.raises(ValueError, match=_exact(expected)):
        from_diffusers_state(_diffusers_state(trained), plain.state_dict())


def test_without_a_label_table_of_its_own_the_table_is_taken_whole():
    """``own`` without a label table: the diffusers table is taken as it is, its all-zero last row kept. 32 classes
    + the null row at width 32: 33 rows, which is the width + 1 (a row count read off the wrong axis would drop
    the last row)."""
    model = _tiny(num_classes=32, dropout=0.1)
    with torch.no_grad():
        model.y_embedder.embedding_table.weight[-1].zero_()
    table = model.y_embedder.embedding_table.weight.detach().clone()
    assert table.shape == (33, 32)
    back = from_diffusers_state(_diffusers_state(model), {"pos_embed": model.state_dict()["pos_embed"]})
    assert torch.equal(back["y_embedder.embedding_table.weight"], table)


@pytest.mark.parametrize(
    "n, listed",
    [
        (1, "extra.a"),
        (3, "extra.a, extra.b, extra.c"),
        (4, "extra.a, extra.b, extra.c (+1 more)"),
        (6, "extra.a, extra.b, extra.c (+3 more)"),
    ],
)
def test_extra_keys_are_refused_naming_the_first_three(n, listed):
    model = _tiny(depth=1)
    state = _diffusers_state(model)
    for name in "fedcba"[-n:]:  # added out of order: the message lists them sorted
        state[f"extra.{name}"] = torch.zeros(1)
    with pytest.raises(ValueError, match=_exact(NO_KEYS + listed)):
        from_diffusers_state(state, model.state_dict())


# ---- read_diffusers_dir --------------------------------------------------------------------------------------
def _assert_state_equal(a, b) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].device.type == "cpu" and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("weights", ["safetensors", "bin"])
def test_read_diffusers_dir_reads_safetensors_and_bin(tmp_path, weights):
    model = _tiny(depth=2)
    folder, state = _folder(tmp_path / "pipe" / "transformer", model, weights)
    for where in (folder, tmp_path / "pipe"):
        got, config = read_diffusers_dir(where)
        assert config == diffusers_config(model.config())
        _assert_state_equal(got, state)


def test_read_diffusers_dir_maps_bin_weights_saved_on_a_gpu_to_the_cpu(tmp_path):
    """A .bin written from CUDA tensors (its storages tagged cuda:0, made here by editing a CPU file's pickle)
    loads onto the CPU, with or without a GPU on this machine."""
    model = _tiny(depth=1)
    folder, state = _folder(tmp_path / "t", model, "bin")
    path = folder / "diffusion_pytorch_model.bin"
    src, buf = zipfile.ZipFile(path), io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith("data.pkl"):
                assert b"X\x03\x00\x00\x00cpu" in data
                data = data.replace(b"X\x03\x00\x00\x00cpu", b"X\x06\x00\x00\x00cuda:0")
            dst.writestr(info.filename, data)
    src.close()
    path.write_bytes(buf.getvalue())
    got, _ = read_diffusers_dir(folder)
    _assert_state_equal(got, state)


def test_read_diffusers_dir_unpickles_bin_weights_only(tmp_path, monkeypatch):
    """A .bin holding a non-tensor object is refused by the weights-only unpickler, also when the environment
    asks torch to load unsafely where a caller does not say (weights_only is passed explicitly)."""
    model = _tiny(depth=1)
    folder, state = _folder(tmp_path / "t", model, "bin")
    torch.save({**state, "when": datetime.date(2020, 1, 1)}, folder / "diffusion_pytorch_model.bin")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        read_diffusers_dir(folder)
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    with pytest.raises(pickle.UnpicklingError, match="Weights only load failed"):
        read_diffusers_dir(folder)


def test_read_diffusers_dir_without_config(tmp_path):
    (tmp_path / "empty").mkdir()
    where = str(tmp_path / "empty")
    with pytest.raises(
        FileNotFoundError, match=_exact(f"{where!r} is not a diffusers model directory (no config.json)")
    ):
        read_diffusers_dir(where)


@pytest.mark.parametrize("config, named", [({"_class_name": "UNet2DModel"}, "'UNet2DModel'"), ([1], "None")])
def test_read_diffusers_dir_of_another_class(tmp_path, config, named):
    _write_config(tmp_path, config)
    cfg = tmp_path / "config.json"
    with pytest.raises(ValueError, match=_exact(f"{str(cfg)!r} describes a {named}, not a DiTTransformer2DModel")):
        read_diffusers_dir(tmp_path)


def test_read_diffusers_dir_without_weights(tmp_path):
    _write_config(tmp_path / "transformer", DIFFUSERS)
    (tmp_path / "transformer" / "diffusion_pytorch_model.fp16.safetensors").write_bytes(b"")  # a variant: not read
    expected = (
        f"{str(tmp_path / 'transformer')!r} holds no weights (diffusion_pytorch_model.safetensors or "
        "diffusion_pytorch_model.bin); sharded or variant files are not read"
    )
    with pytest.raises(FileNotFoundError, match=_exact(expected)):
        read_diffusers_dir(tmp_path)


def test_read_diffusers_dir_names_a_truncated_safetensors_file(tmp_path):
    """safetensors weights go through our reader, whose error names the file (safetensors' own does not)."""
    folder, _ = _folder(tmp_path / "t", _tiny(depth=1))
    path = folder / "diffusion_pytorch_model.safetensors"
    path.write_bytes(path.read_bytes()[:-5])
    with pytest.raises(ValueError, match="^" + re.escape(f"{str(path)!r} is not a readable safetensors file (")):
        read_diffusers_dir(folder)
