import numpy as np
import pytest
import torch

from diffcurr_fast.eval.metrics import (
    conditional_accuracy,
    feature_statistics,
    frechet_distance,
    inception_score,
    knn_radii,
    load_statistics,
    precision_recall,
    save_statistics,
)


def _fd_eig(mu1, s1, mu2, s2):
    """Independent float64 Frechet distance: Tr sqrt(S1 S2) = sum sqrt(eig(S1^1/2 S2 S1^1/2))."""
    w, v = np.linalg.eigh(s1)
    r1 = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = r1 @ s2 @ r1
    ev = np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * np.sqrt(ev).sum())


def _spd(rng, d, n=None):
    x = rng.standard_normal((n or 3 * d + 5, d)) @ rng.standard_normal((d, d))
    return np.cov(x, rowvar=False).reshape(d, d)


@pytest.mark.parametrize("d", [1, 3, 17, 48])
def test_frechet_matches_eigen_reference(d):
    rng = np.random.default_rng(d)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    s1, s2 = _spd(rng, d), _spd(rng, d)
    ref = _fd_eig(mu1, s1, mu2, s2)
    assert frechet_distance(mu1, s1, mu2, s2) == pytest.approx(ref, rel=1e-8, abs=1e-8)
    # torch inputs (float32 too) give the same number up to float32 rounding of the inputs
    got_t = frechet_distance(torch.from_numpy(mu1), torch.from_numpy(s1), torch.from_numpy(mu2), torch.from_numpy(s2))
    assert got_t == pytest.approx(ref, rel=1e-8, abs=1e-8)
    got_f = frechet_distance(*(torch.from_numpy(a).float() for a in (mu1, s1, mu2, s2)))
    assert got_f == pytest.approx(ref, rel=1e-4, abs=1e-4)


def test_frechet_one_dimensional_closed_form():
    # d^2 = (m1 - m2)^2 + (sd1 - sd2)^2 for scalar Gaussians
    assert frechet_distance(1.5, 4.0, -0.5, 9.0) == pytest.approx(2.0**2 + (2.0 - 3.0) ** 2, rel=1e-12)
    assert frechet_distance([0.0, 0.0], np.eye(2), [0.0, 0.0], np.eye(2)) == pytest.approx(0.0, abs=1e-12)


def test_frechet_singular_covariance_uses_offset():
    rng = np.random.default_rng(0)
    d = 17
    # Rank-deficient covariances (fewer samples than dimensions), as with small sample sets.
    f1, f2 = rng.standard_normal((5, d)), rng.standard_normal((6, d))
    mu1, s1 = feature_statistics(f1)
    mu2, s2 = feature_statistics(f2)
    ref = _fd_eig(mu1, s1, mu2, s2)
    with np.errstate(all="ignore"):
        got = frechet_distance(mu1, s1, mu2, s2)
    assert np.isfinite(got)
    assert got == pytest.approx(ref, rel=1e-4, abs=1e-4)


def test_frechet_bad_input():
    with pytest.raises(ValueError, match="mu1 and mu2"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(4), np.eye(4))
    with pytest.raises(ValueError, match="sigma1 and sigma2"):
        frechet_distance(np.zeros(3), np.eye(3), np.zeros(3), np.eye(2))
    with pytest.raises(ValueError, match="NaN"):
        frechet_distance(np.array([np.nan]), np.eye(1), np.zeros(1), np.eye(1))


def test_conditional_accuracy_by_hand():
    """The share of samples whose most probable class is the label they were generated for: rows 0, 1 and 4 are
    right, row 2 is a tie that argmax gives to the lower class (0, not the requested 1), row 3 is wrong."""
    probs = np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.4, 0.4, 0.2], [0.5, 0.3, 0.2], [0.2, 0.5, 0.3]])
    labels = np.array([0, 2, 1, 2, 1])
    assert conditional_accuracy(probs, labels) == 3 / 5
    assert conditional_accuracy(torch.from_numpy(probs), torch.tensor([0, 2, 0, 0, 1])) == 1.0
    with pytest.raises(ValueError, match=r"must match, got shapes \(5, 3\) and \(4,\)"):
        conditional_accuracy(probs, labels[:4])
    with pytest.raises(ValueError, match="labels must be integers, got dtype float64"):
        conditional_accuracy(probs, labels.astype(float))
    with pytest.raises(ValueError, match="labels must be classes of the classifier, 0 to 2, got 0 to 3"):
        conditional_accuracy(probs, np.array([0, 3, 1, 2, 1]))


def test_statistics_roundtrip(tmp_path):
    rng = np.random.default_rng(1)
    f = rng.standard_normal((23, 7))
    mu, sigma = feature_statistics(torch.from_numpy(f).float())
    np.testing.assert_allclose(mu, f.mean(0), atol=1e-6)
    np.testing.assert_allclose(sigma, np.cov(f, rowvar=False), atol=1e-5)
    save_statistics(tmp_path / "ref.npz", mu, sigma, extractor="digits")
    mu2, s2, meta = load_statistics(tmp_path / "ref.npz")
    np.testing.assert_array_equal(mu, mu2)
    np.testing.assert_array_equal(sigma, s2)
    assert meta == {"extractor": "digits"}
    with pytest.raises(ValueError, match=r"\(N, D\)"):
        feature_statistics(np.zeros((1, 3)))
    np.savez(tmp_path / "bad.npz", m=mu)
    with pytest.raises(ValueError, match="'mu' and 'sigma'"):
        load_statistics(tmp_path / "bad.npz")


def test_inception_score_known_cases():
    k = 7
    onehot = np.eye(k)[np.arange(70) % k]
    mean, std = inception_score(onehot, splits=10)
    assert mean == pytest.approx(k, rel=1e-9) and std == pytest.approx(0, abs=1e-9)
    same = np.tile(np.full(k, 1 / k), (30, 1))
    assert inception_score(same, splits=3)[0] == pytest.approx(1.0)
    # two classes with p(y|x) = (0.9, 0.1) / (0.1, 0.9) half each: IS = exp(KL((.9,.1) || (.5,.5)))
    p = np.array([[0.9, 0.1], [0.1, 0.9]] * 5)
    kl = 0.9 * np.log(0.9 / 0.5) + 0.1 * np.log(0.1 / 0.5)
    assert inception_score(p, splits=1)[0] == pytest.approx(np.exp(kl))
    with pytest.raises(ValueError, match="splits"):
        inception_score(onehot, splits=0)
    with pytest.raises(ValueError, match="softmax"):
        inception_score(onehot * 2, splits=1)


def test_precision_recall_hand_computed_1d():
    real = np.array([[0.0], [1.0], [2.0], [3.0], [10.0]])
    # k=3 radii: 3, 2, 2, 3, 9
    np.testing.assert_allclose(knn_radii(torch.from_numpy(real)).numpy(), [3, 2, 2, 3, 9])
    # 5 is inside 10's sphere (|5 - 10| <= 9), 2.5 inside 2's; 20 and -3.5 are outside every sphere
    fake = np.array([[5.0], [20.0], [-3.5], [2.5]])
    # fake k=3 radii: 15, 23.5, 23.5, 17.5 -> every real point is covered
    assert precision_recall(real, fake, k=3) == (pytest.approx(0.5), pytest.approx(1.0))


def test_precision_recall_identical_and_disjoint():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((17, 5))
    assert precision_recall(x, x.copy()) == (1.0, 1.0)
    assert precision_recall(x, x + 1000.0) == (0.0, 0.0)
    # half the fakes on the real manifold, half in a tight far cluster: precision exactly 1/2
    fake = np.concatenate([x[:8], 500.0 + 1e-3 * rng.standard_normal((8, 5))])
    assert precision_recall(x, fake)[0] == pytest.approx(0.5)


@pytest.mark.parametrize("n,m,d", [(17, 13, 5), (9, 21, 3)])
def test_precision_recall_bruteforce(n, m, d):
    rng = np.random.default_rng(n)
    real, fake = rng.standard_normal((n, d)), rng.standard_normal((m, d)) * 1.3 + 0.4

    def coverage(manifold, queries, k=3):
        radii = [sorted(np.linalg.norm(manifold - c, axis=1))[k] for c in manifold]
        hits = [any(np.linalg.norm(q - c) <= r for c, r in zip(manifold, radii)) for q in queries]
        return sum(hits) / len(queries)

    p, r = precision_recall(real, fake)
    assert p == pytest.approx(coverage(real, fake))
    assert r == pytest.approx(coverage(fake, real))
    with pytest.raises(ValueError, match="one D"):
        precision_recall(real, fake[:, :2])
    with pytest.raises(ValueError, match="k must be"):
        precision_recall(real[:3], fake, k=3)
