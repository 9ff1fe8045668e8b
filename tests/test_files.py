"""Atomic JSON files: a failed write leaves the previous file whole."""

import json
import os

import pytest

from diffcurr_fast import _files
from diffcurr_fast._files import write_json


def test_write_json_replaces_whole_and_a_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "status.json"
    assert write_json({"a": 1}, path, indent=1) == path  # parents created
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json({"b": object()}, path)  # not JSON: nothing written
    assert json.loads(path.read_text()) == {"a": 1} and sorted(os.listdir(path.parent)) == ["status.json"]

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(_files.os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        write_json({"c": 2}, path)
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, whole


def test_a_truncated_safetensors_file_is_named_wherever_it_is_read(tmp_path):
    """init_from, a diffusers folder and a TDC bundle read a user's safetensors through one reader: a truncated,
    empty or foreign file is a ValueError that names it, never safetensors' own traceback."""
    import torch
    from safetensors.torch import save_file

    from diffcurr_fast._files import read_safetensors
    from diffcurr_fast.models.diffusers_dit import read_diffusers_dir
    from diffcurr_fast.tdc.experts import load_bundle
    from diffcurr_fast.train.data import load_init_weights

    good = tmp_path / "w.safetensors"
    save_file({"a": torch.arange(6.0)}, str(good))
    assert torch.equal(read_safetensors(good)["a"], torch.arange(6.0))
    bad = tmp_path / "cut.safetensors"
    bad.write_bytes(good.read_bytes()[:-5])
    empty = tmp_path / "empty.safetensors"
    empty.write_bytes(b"")
    for path in (bad, empty):
        with pytest.raises(ValueError, match=rf"^'{path}' is not a readable safetensors file \(.*\); it may be trunc"):
            read_safetensors(path)
    with pytest.raises(ValueError, match="cut.safetensors' is not a readable safetensors file"):
        load_init_weights(torch.nn.Linear(2, 3), bad)
    folder = tmp_path / "transformer"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "DiTTransformer2DModel"}))
    (folder / "diffusion_pytorch_model.safetensors").write_bytes(bad.read_bytes())
    with pytest.raises(ValueError, match="diffusion_pytorch_model.safetensors' is not a readable safetensors file"):
        read_diffusers_dir(folder)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    (bundle / "bundle.json").write_text(json.dumps({"format": "diffcurr_fast.tdc.bundle/1", "experts": []}))
    (bundle / "weights.safetensors").write_bytes(bad.read_bytes())
    with pytest.raises(ValueError, match="weights.safetensors' is not a readable safetensors file"):
        load_bundle(bundle)
