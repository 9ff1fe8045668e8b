"""Evaluation during training (train/evaluation.py): the conditional accuracy of the samples against the labels they
were generated for, on the run's own data only."""

import pytest
import torch

from diffcurr_fast.eval.features import digits_classifier, load_digits_data, single_thread
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.evaluation import Evaluator

pytestmark = pytest.mark.usefixtures("one_thread")


def _digits_in_turn(shift: int, n: int) -> torch.Tensor:
    """n held-out digits, image j of class (j + shift) % 10."""
    _, _, xte, yte = load_digits_data()
    first = [int((yte == c).nonzero()[k // 10]) for k, c in ((j, (j + shift) % 10) for j in range(n))]
    return xte[first]


def test_evaluation_scores_the_samples_against_the_labels_they_were_drawn_for(tmp_path, monkeypatch):
    cfg = load_config(None, [f"checkpoint.run_dir={tmp_path}", "logging.eval_every=1", "eval.num_samples=30"])
    ev = Evaluator(cfg, tmp_path)
    assert ev.labels().tolist() == [j % 10 for j in range(30)]
    model, _ = digits_classifier()
    for shift in (0, 3):
        images = _digits_in_turn(shift, 30)
        monkeypatch.setattr(ev, "sample", lambda *a, images=images: images)
        with torch.no_grad(), single_thread():
            want = float((model(images).argmax(1) == ev.labels()).double().mean())
        assert ev(5, None, None)["cond_acc"] == pytest.approx(want, abs=1e-12)
        assert want > 0.9 if shift == 0 else want < 0.2
    cfg.data.dataset = "npz"  # 8x8 images of other data: the digits classifier's classes are not its labels
    cfg.eval.reference = "digits"
    other = Evaluator(cfg, tmp_path / "other")
    monkeypatch.setattr(other, "sample", lambda *a: _digits_in_turn(0, 30))
    rec = other(5, None, None)
    assert "cond_acc" not in rec and rec["fd"] > 0
