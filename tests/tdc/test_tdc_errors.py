"""Bad inputs of TDC (diffcurr_fast/tdc/): groups checked before stage 1 (preflight.py), a bundle with non-finite
weights is not saved (experts.py). docs/errors.md lists what each input gets."""

import os

import pytest
import torch
from conftest import tiny

from diffcurr_fast.runs import checkpoint as ck


def test_tdc_groups_checked_before_training(tmp_path):
    from diffcurr_fast.runs.sections import TDCConfig
    from diffcurr_fast.tdc.preflight import check_groups, check_tdc_run

    cfg = tiny(tmp_path / "x", "curriculum.pacing=none")
    with pytest.raises(ValueError, match=r"tdc.num_groups must be an int in \[1, 40\]"):
        check_tdc_run(cfg, TDCConfig(num_groups=2000), tmp_path / "tdc")
    assert not (tmp_path / "tdc").exists()
    assert [hi - lo > 0 for lo, hi in check_groups(cfg, 3)] == [True] * 3
    (tmp_path / "tdc").mkdir()
    (tmp_path / "tdc" / "tdc.json").write_text('{"config": {}}')  # what a TDC run writes first
    with pytest.raises(FileExistsError, match="not empty"):
        check_tdc_run(cfg, TDCConfig(num_groups=3), tmp_path / "tdc")
    assert check_tdc_run(cfg, TDCConfig(num_groups=3), tmp_path / "tdc", overwrite=True).mode == "overwrite"
    # guidance without a null label: refused before stage 1, as train refuses it
    nodrop = tiny(tmp_path / "y", "curriculum.pacing=none", "model.class_dropout_prob=0", "logging.num_samples=4")
    with pytest.raises(ValueError, match="classifier-free guidance needs the null label"):
        check_tdc_run(nodrop, TDCConfig(num_groups=3), tmp_path / "tdc2")
    assert not (tmp_path / "tdc2").exists()
    sra = tiny(tmp_path / "z", "curriculum.pacing=none", "terms.use=[sra]")
    with pytest.raises(ValueError, match="terms.use 'sra' trains a projector attached to the model"):
        check_tdc_run(sra, TDCConfig(num_groups=3), tmp_path / "tdc3")
    assert not (tmp_path / "tdc3").exists()
    sprint = tiny(
        tmp_path / "v", "curriculum.pacing=none", "model.routing=sprint", "model.routing_start=0", "model.routing_end=1"
    )
    with pytest.raises(ValueError, match="model.routing 'sprint': TDC's pruning does not know SPRINT's fusion layer"):
        check_tdc_run(sprint, TDCConfig(num_groups=3), tmp_path / "tdc5")
    assert not (tmp_path / "tdc5").exists()
    swiglu = tiny(tmp_path / "w", "curriculum.pacing=none", "model.mlp=swiglu")
    with pytest.raises(ValueError, match="model.mlp 'swiglu': TDC's pruning removes hidden units of the GELU MLP"):
        check_tdc_run(swiglu, TDCConfig(num_groups=3), tmp_path / "tdc4")


def test_bundle_weights_finite_and_readable(tmp_path):
    from diffcurr_fast.models import DiT
    from diffcurr_fast.tdc.experts import MultiExpertDenoiser, load_bundle, save_bundle

    experts = [
        DiT(
            input_size=8,
            in_channels=1,
            patch_size=4,
            hidden_size=16,
            depth=1,
            num_heads=2,
            num_classes=10,
            num_timesteps=40,
        )
        for _ in range(2)
    ]
    multi = MultiExpertDenoiser(experts, [(0, 20), (20, 40)])
    old = os.umask(0o022)
    try:
        save_bundle(multi, tmp_path / "b")
    finally:
        os.umask(old)
    assert (tmp_path / "b" / "weights.safetensors").stat().st_mode & 0o777 == 0o644
    load_bundle(tmp_path / "b")
    with torch.no_grad():
        next(experts[1].parameters()).fill_(float("nan"))
    with pytest.raises(ck.NonFiniteWeightsError, match="experts.1."):
        save_bundle(multi, tmp_path / "c")
