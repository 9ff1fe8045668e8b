"""Pinned behaviour of ``eval/features.py`` that the mutation run found untested (docs/mutation.md).

No classifier is trained here: the caches are written by hand (``torch.save`` of a seeded network's state dict) or
by a monkeypatched ``train_*_classifier`` that returns a seeded network at once, and ``DIFFCURR_FAST_CACHE`` points
at a tmp dir. ``_train_classifier`` itself runs on a 4-input linear model. The Inception extractor's weights are
not available offline, so ``load_fid_inception`` is replaced by a recorder. A device that is not the CPU is played
by ``meta`` (the model moves there; ``_forward`` is replaced by a spy that returns CPU tensors).

* the default cache directory and the cache file names (``<name>_classifier_v<version>.pt``)
* the load / retrain / refuse / overwrite rules of ``_cached_classifier`` through every public entry point
* the cache is read with ``weights_only=True`` (a pickle that runs code is refused, also under
  ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``) and mapped to the CPU (tensors saved from another device load)
* ``_train_classifier``: batch order drawn from its own seeded generator, Adam's first step of size ``lr``
* the default training settings, the two CNNs' sizes and the mnist5k CNN's "same" padding
* the extractors: device handling, batches of ``batch_size`` (default 256), one thread on the CPU only,
  and the digits ``convert`` path (channel mean, antialiased bilinear resize to 8x8) against PIL's resize rule
"""

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import RecordingClassifier

from diffcurr_fast.eval import features
from diffcurr_fast.eval.features import (
    DigitsCNN,
    DigitsExtractor,
    InceptionExtractor,
    Mnist5kExtractor,
    MnistCNN,
    default_cache_dir,
    digits_classifier,
    get_extractor,
    mnist5k_classifier,
)

# --- helpers -----------------------------------------------------------------------------------------------------


def _seeded(build, seed: int = 3):
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return build().eval()


def _write_cache(path, build, version: int, accuracy: float, seed: int = 3):
    """A cache file as ``_cached_classifier`` writes it; returns the network whose weights it holds."""
    model = _seeded(build, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"version": version, "accuracy": accuracy, "state_dict": model.state_dict()}, path)
    return model


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k].cpu(), sb[k].cpu()) for k in sa)


@pytest.fixture
def fake_training(monkeypatch, tmp_path):
    """Both ``train_*_classifier`` replaced by a seeded network with accuracy 0.25 (counted); the default cache in
    an empty tmp dir."""
    calls = {"digits": 0, "mnist5k": 0}

    def make(name, build):
        def train():
            calls[name] += 1
            return _seeded(build, seed=7), 0.25

        return train

    monkeypatch.setattr(features, "train_digits_classifier", make("digits", DigitsCNN))
    monkeypatch.setattr(features, "train_mnist5k_classifier", make("mnist5k", MnistCNN))
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path / "default"))
    return calls


def _refusal(name: str, path, version: int) -> str:
    return re.escape(
        f"--{name}-cache {str(path)!r} exists and is not a {name} classifier cache (version {version}); "
        "pass --overwrite to replace it, or name another file"
    )


# --- default cache directory and file names ------------------------------------------------------------------------


def test_default_cache_dir_is_the_variable_or_home_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("DIFFCURR_FAST_CACHE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "diffcurr_fast"
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path / "elsewhere"))
    assert default_cache_dir() == tmp_path / "elsewhere"


def test_default_caches_are_named_by_classifier_and_version(fake_training, tmp_path):
    model, acc = mnist5k_classifier()
    blob = torch.load(tmp_path / "default" / "mnist5k_classifier_v1.pt", weights_only=True)
    assert (blob["version"], blob["accuracy"], acc, fake_training["mnist5k"]) == (1, 0.25, 0.25, 1)
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == ["mnist5k_classifier_v1.pt"]
    again, acc2 = mnist5k_classifier()  # loaded: not trained again
    assert fake_training["mnist5k"] == 1 and acc2 == 0.25
    assert isinstance(again, MnistCNN) and not again.training and _same_weights(again, model)
    digits_classifier()
    assert sorted(p.name for p in (tmp_path / "default").iterdir()) == [
        "digits_classifier_v2.pt",
        "mnist5k_classifier_v1.pt",
    ]


# --- load / retrain / refuse / overwrite -------------------------------------------------------------------------


def test_a_named_cache_is_loaded_from_that_file_and_made_with_its_folders(fake_training, tmp_path):
    cache = _write_cache(tmp_path / "m.pt", MnistCNN, version=1, accuracy=0.625)
    model, acc = mnist5k_classifier(tmp_path / "m.pt")
    assert acc == 0.625 and _same_weights(model, cache) and fake_training["mnist5k"] == 0
    # missing: trained and written there, folders included, nothing in the default cache dir
    path = tmp_path / "a" / "b" / "m.pt"
    model, acc = mnist5k_classifier(path)
    assert acc == 0.25 and fake_training["mnist5k"] == 1
    assert torch.load(path, weights_only=True)["accuracy"] == 0.25
    assert not (tmp_path / "default").exists()
    digits_path = tmp_path / "c" / "d" / "dg.pt"
    digits_classifier(digits_path)
    assert torch.load(digits_path, weights_only=True)["version"] == 2


def test_retrain_replaces_a_current_cache(fake_training, tmp_path):
    # the default caches, current: loaded, unless retrain
    default = tmp_path / "default"
    _write_cache(default / "digits_classifier_v2.pt", DigitsCNN, version=2, accuracy=0.875)
    _write_cache(default / "mnist5k_classifier_v1.pt", MnistCNN, version=1, accuracy=0.875)
    assert digits_classifier()[1] == 0.875 and mnist5k_classifier()[1] == 0.875
    assert fake_training == {"digits": 0, "mnist5k": 0}
    assert digits_classifier(retrain=True)[1] == 0.25 and mnist5k_classifier(retrain=True)[1] == 0.25
    assert fake_training == {"digits": 1, "mnist5k": 1}
    for name in ("digits_classifier_v2.pt", "mnist5k_classifier_v1.pt"):
        assert torch.load(default / name, weights_only=True)["accuracy"] == 0.25
    # a named current cache: retrained in place, with or without overwrite (it is ours, not a user's file)
    _write_cache(tmp_path / "d.pt", DigitsCNN, version=2, accuracy=0.875)
    assert digits_classifier(tmp_path / "d.pt", retrain=True, overwrite=True)[1] == 0.25
    assert fake_training["digits"] == 2 and torch.load(tmp_path / "d.pt", weights_only=True)["accuracy"] == 0.25
    _write_cache(tmp_path / "m.pt", MnistCNN, version=1, accuracy=0.875)
    assert mnist5k_classifier(tmp_path / "m.pt", retrain=True)[1] == 0.25
    assert fake_training["mnist5k"] == 2 and torch.load(tmp_path / "m.pt", weights_only=True)["accuracy"] == 0.25
    # a named stale cache (another version) is not current: refused unless overwrite, retrain or not
    _write_cache(tmp_path / "s.pt", DigitsCNN, version=1, accuracy=0.875)
    with pytest.raises(FileExistsError, match=_refusal("digits", tmp_path / "s.pt", 2)):
        digits_classifier(tmp_path / "s.pt", retrain=True)
    assert torch.load(tmp_path / "s.pt", weights_only=True)["accuracy"] == 0.875


def test_a_foreign_file_is_refused_unless_overwrite(fake_training, tmp_path):
    for name in ("d.pt", "m.pt", "e.pt", "g.pt"):
        (tmp_path / name).write_bytes(b"a user's file")
    with pytest.raises(FileExistsError, match=_refusal("digits", tmp_path / "d.pt", 2)):
        digits_classifier(tmp_path / "d.pt")
    with pytest.raises(FileExistsError, match=_refusal("mnist5k", tmp_path / "m.pt", 1)):
        mnist5k_classifier(tmp_path / "m.pt")
    with pytest.raises(FileExistsError, match=_refusal("digits", tmp_path / "e.pt", 2)):
        DigitsExtractor(tmp_path / "e.pt")
    with pytest.raises(FileExistsError, match=_refusal("digits", tmp_path / "g.pt", 2)):
        get_extractor("digits", digits_cache=tmp_path / "g.pt")
    assert fake_training["digits"] == 0 and (tmp_path / "d.pt").read_bytes() == b"a user's file"
    # overwrite: trained and replaced, through each entry point
    assert digits_classifier(tmp_path / "d.pt", overwrite=True)[1] == 0.25
    assert DigitsExtractor(tmp_path / "e.pt", overwrite=True).accuracy == 0.25
    assert get_extractor("digits", digits_cache=tmp_path / "g.pt", overwrite=True).accuracy == 0.25
    assert fake_training["digits"] == 3
    for name in ("d.pt", "e.pt", "g.pt"):
        assert torch.load(tmp_path / name, weights_only=True)["version"] == 2


_UNPICKLED: list = []


def _record_unpickling(tag: str) -> str:
    _UNPICKLED.append(tag)
    return tag


class _RunsCodeWhenUnpickled:
    def __reduce__(self):
        return (_record_unpickling, ("ran",))


def test_a_cache_that_runs_code_when_unpickled_is_never_unpickled(fake_training, tmp_path, monkeypatch):
    # a "cache" with the right fields plus an object whose unpickling calls a function: weights_only refuses it,
    # even where the environment turns torch.load's default to full unpickling
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    path = tmp_path / "d.pt"
    sd = _seeded(DigitsCNN).state_dict()
    torch.save({"version": 2, "accuracy": 0.5, "state_dict": sd, "x": _RunsCodeWhenUnpickled()}, path)
    _UNPICKLED.clear()
    with pytest.raises(FileExistsError, match=_refusal("digits", path, 2)):
        digits_classifier(path)
    assert _UNPICKLED == [] and fake_training["digits"] == 0


def test_a_cache_saved_from_another_device_loads_on_the_cpu(fake_training, tmp_path, monkeypatch):
    # tensors tagged with a device this machine cannot restore (as a CUDA cache on a CPU-only machine): the cache
    # is mapped to the CPU and loads
    import torch.serialization as ts

    monkeypatch.setattr(ts, "_package_registry", list(ts._package_registry))
    elsewhere = {"on": True}
    ts.register_package(5, lambda storage: "elsewhere" if elsewhere["on"] else None, lambda storage, loc: None)
    model = _write_cache(tmp_path / "d.pt", DigitsCNN, version=2, accuracy=0.75)
    elsewhere["on"] = False
    with pytest.raises(RuntimeError, match="elsewhere"):
        torch.load(tmp_path / "d.pt", weights_only=True)  # the file really is tagged so
    loaded, acc = digits_classifier(tmp_path / "d.pt")
    assert acc == 0.75 and _same_weights(loaded, model) and fake_training["digits"] == 0


# --- training ----------------------------------------------------------------------------------------------------


def test_train_classifier_draws_the_batch_order_from_its_seed():
    gen = torch.Generator().manual_seed(1)
    xtr, ytr = torch.randn(70, 1, 2, 2, generator=gen), torch.randint(0, 3, (70,), generator=gen)
    xte, yte = torch.randn(5, 1, 2, 2, generator=gen), torch.randint(0, 3, (5,), generator=gen)
    torch.manual_seed(0)  # the global generator is elsewhere: the order comes from the seed alone
    model, _ = features._train_classifier(RecordingClassifier, (xtr, ytr), (xte, yte), epochs=2, seed=5, lr=1e-2)
    order = torch.Generator().manual_seed(5)
    perms = [torch.randperm(70, generator=order) for _ in range(2)]
    trained = [x for training, x in model.seen if training]
    assert [len(x) for x in trained] == [64, 6, 64, 6]
    for e in range(2):
        assert torch.equal(trained[2 * e], xtr[perms[e][:64]])
        assert torch.equal(trained[2 * e + 1], xtr[perms[e][64:]])


def test_train_classifier_first_adam_step_has_size_lr():
    # one epoch of one batch: Adam's bias-corrected first step is lr * g / (|g| + eps) per weight
    gen = torch.Generator().manual_seed(2)
    xtr, ytr = torch.randn(10, 1, 2, 2, generator=gen), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1, 2, 0])
    build = lambda: torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(4, 3))
    model, _ = features._train_classifier(build, (xtr, ytr), (xtr[:2], ytr[:2]), epochs=1, seed=4, lr=1e-2)
    start = _seeded(build, seed=4).train()
    F.cross_entropy(start(xtr), ytr).backward()
    for p0, p1 in zip(start.parameters(), model.parameters()):
        g = p0.grad
        assert g.abs().min() > 1e-4  # every weight moves by (almost exactly) lr
        torch.testing.assert_close(p1.detach(), p0.detach() - 1e-2 * g / (g.abs() + 1e-8), rtol=0, atol=1e-6)


def _record_settings(monkeypatch) -> dict:
    got = {}

    def fake(build, train, heldout, epochs, seed, lr):
        got.update(build=build, epochs=epochs, seed=seed, lr=lr)
        return build(), 0.5

    monkeypatch.setattr(features, "_train_classifier", fake)
    return got


def test_default_training_settings(monkeypatch):
    got = _record_settings(monkeypatch)
    tiny = (torch.zeros(2, 1, 8, 8), torch.zeros(2, dtype=torch.long))
    monkeypatch.setattr(features, "load_digits_data", lambda seed: (*tiny, *tiny))
    features.train_digits_classifier()
    assert got == {"build": DigitsCNN, "epochs": 12, "seed": 0, "lr": 3e-3}
    tiny = (torch.zeros(2, 1, 28, 28), torch.zeros(2, dtype=torch.long))
    monkeypatch.setattr(features, "load_mnist5k_tensors", lambda split: tiny)
    features.train_mnist5k_classifier()
    assert got == {"build": MnistCNN, "epochs": 6, "seed": 0, "lr": 3e-3}


# --- the two CNNs ------------------------------------------------------------------------------------------------


def test_cnn_sizes():
    shapes = lambda m: {k: tuple(v.shape) for k, v in m.state_dict().items()}
    common = {
        "conv1.weight": (16, 1, 3, 3),
        "conv1.bias": (16,),
        "conv2.weight": (32, 16, 3, 3),
        "conv2.bias": (32,),
        "head.weight": (10, 64),
        "head.bias": (10,),
    }
    # 8x8 -> pool -> 4x4: 32 * 16 = 512 inputs; 28x28 -> 14x14 -> 7x7: 32 * 49 = 1568 inputs
    assert shapes(DigitsCNN()) == {**common, "proj.weight": (64, 512), "proj.bias": (64,)}
    assert shapes(MnistCNN()) == {**common, "proj.weight": (64, 1568), "proj.bias": (64,)}
    assert sum(p.numel() for p in DigitsCNN().parameters()) == 160 + 4640 + 32832 + 650
    assert sum(p.numel() for p in MnistCNN().parameters()) == 160 + 4640 + 100416 + 650


def test_mnist_cnn_features_use_same_padding():
    # written out: 3x3 convolutions with "same" zero padding (1), ReLU, 2x2 max pools, ReLU projection
    net = _seeded(MnistCNN)
    x = torch.rand(2, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1
    h = F.max_pool2d(F.relu(F.conv2d(x, net.conv1.weight, net.conv1.bias, padding=1)), 2)
    h = F.max_pool2d(F.relu(F.conv2d(h, net.conv2.weight, net.conv2.bias, padding=1)), 2)
    want = F.relu(h.flatten(1) @ net.proj.weight.T + net.proj.bias)
    with torch.no_grad():
        torch.testing.assert_close(net.features(x), want.detach(), rtol=0, atol=1e-5)


# --- extractors: devices, batches, threads -------------------------------------------------------------------------


@pytest.fixture
def caches(tmp_path, monkeypatch):
    """Current digits and mnist5k caches (accuracies 0.75 and 0.625) in files, the mnist5k one also as the default
    cache; training is refused."""

    def refuse():
        raise AssertionError("trained although a current cache exists")

    monkeypatch.setattr(features, "train_digits_classifier", refuse)
    monkeypatch.setattr(features, "train_mnist5k_classifier", refuse)
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path / "default"))
    _write_cache(tmp_path / "default" / "mnist5k_classifier_v1.pt", MnistCNN, version=1, accuracy=0.5, seed=9)
    return {
        "digits": (tmp_path / "d.pt", _write_cache(tmp_path / "d.pt", DigitsCNN, version=2, accuracy=0.75)),
        "mnist5k": (tmp_path / "m.pt", _write_cache(tmp_path / "m.pt", MnistCNN, version=1, accuracy=0.625)),
    }


def test_extractors_load_their_cache_onto_the_device(caches):
    ext = Mnist5kExtractor(caches["mnist5k"][0])  # the named file, not the default cache; on the CPU by default
    assert ext.accuracy == 0.625 and _same_weights(ext.model, caches["mnist5k"][1])
    assert ext.device == torch.device("cpu")
    for ext in (DigitsExtractor(caches["digits"][0], device="meta"), Mnist5kExtractor(caches["mnist5k"][0], "meta")):
        assert ext.device == torch.device("meta")
        assert {p.device.type for p in ext.model.parameters()} == {"meta"}
    ext = get_extractor("mnist5k", device="meta")  # the default cache
    assert ext.accuracy == 0.5 and {p.device.type for p in ext.model.parameters()} == {"meta"}


def _spy(ext, shape_out: tuple[int, int] | None = None) -> list:
    """Records (batch shape, device type, torch threads) of each ``_forward``; with ``shape_out`` it returns zeros
    (features, logits) on the CPU instead of running the model."""
    seen, forward = [], ext._forward

    def spy(x):
        seen.append((tuple(x.shape), x.device.type, torch.get_num_threads()))
        if shape_out is None:
            return forward(x)
        return torch.zeros(len(x), shape_out[0]), torch.zeros(len(x), shape_out[1])

    ext._forward = spy
    return seen


@pytest.mark.parametrize("name", ["digits", "mnist5k"])
def test_extractor_batches_on_one_cpu_thread(caches, name):
    path, _ = caches[name]
    ext = DigitsExtractor(path) if name == "digits" else Mnist5kExtractor(path)
    shape = (1, 8, 8) if name == "digits" else (1, 28, 28)
    images = torch.rand(257, *shape, generator=torch.Generator().manual_seed(0)) * 2 - 1
    torch.set_num_threads(2)  # the conftest fixture restores the count
    seen = _spy(ext)
    f, p = ext(images)  # default batches of 256
    assert seen == [((256, *shape), "cpu", 1), ((1, *shape), "cpu", 1)]
    assert f.shape == (257, 64) and p.shape == (257, 10) and torch.get_num_threads() == 2
    seen.clear()
    f3, p3 = ext(images[:7], batch_size=3)
    assert seen == [((3, *shape), "cpu", 1), ((3, *shape), "cpu", 1), ((1, *shape), "cpu", 1)]
    np.testing.assert_allclose(f3, f[:7], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name", ["digits", "mnist5k"])
def test_extractor_on_another_device_keeps_the_threads(caches, name):
    path, _ = caches[name]
    ext = DigitsExtractor(path, device="meta") if name == "digits" else Mnist5kExtractor(path, device="meta")
    shape = (1, 8, 8) if name == "digits" else (1, 28, 28)
    torch.set_num_threads(2)
    seen = _spy(ext, (64, 10))
    f, p = ext(torch.zeros(7, *shape), batch_size=3)
    assert seen == [((3, *shape), "meta", 2), ((3, *shape), "meta", 2), ((1, *shape), "meta", 2)]
    assert f.shape == (7, 64) and np.array_equal(p, np.full((7, 10), 0.1))
    seen.clear()
    ext(torch.zeros(257, *shape))
    assert [s[0][0] for s in seen] == [256, 1]


# --- the digits extractor's convert path and the shape errors --------------------------------------------------


def _antialiased_bilinear(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) weights of PIL's antialiased bilinear resize (triangle filter widened by the downscale)."""
    scale = n_in / n_out
    support, inv = (scale, 1 / scale) if scale > 1 else (1.0, 1.0)
    w = np.zeros((n_out, n_in))
    for i in range(n_out):
        c = (i + 0.5) * scale
        for j in range(max(int(c - support + 0.5), 0), min(int(c + support + 0.5), n_in)):
            w[i, j] = max(0.0, 1 - abs((j - c + 0.5) * inv))
        w[i] /= w[i].sum()
    return w


def test_antialiased_weights_by_hand():
    # 16 -> 8: the triangle of half-width 2 gives 1/8 [1, 3, 3, 1], cut and renormalised at the edges (3, 3, 1)/7
    w = _antialiased_bilinear(16, 8)
    assert np.allclose(w[0, :3], [3 / 7, 3 / 7, 1 / 7]) and np.allclose(w[3, 5:9], [1 / 8, 3 / 8, 3 / 8, 1 / 8])
    assert np.allclose(w[7, 13:], [1 / 7, 3 / 7, 3 / 7]) and np.allclose(w.sum(1), 1)
    assert np.array_equal(_antialiased_bilinear(8, 8), np.eye(8))
    assert np.array_equal(_antialiased_bilinear(1, 8), np.ones((8, 1)))


@pytest.mark.parametrize("shape", [(3, 16, 16), (2, 8, 8), (3, 1, 8), (1, 9, 8), (1, 8, 9), (1, 28, 28)])
def test_digits_convert_averages_channels_and_resizes_antialiased(caches, shape):
    path, model = caches["digits"]
    ext = DigitsExtractor(path, convert=True)
    images = torch.rand(2, *shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 2 - 1
    _, h, w = shape
    gray = images.mean(1).numpy()  # (2, H, W)
    small = np.einsum("ij,njk,lk->nil", _antialiased_bilinear(h, 8), gray, _antialiased_bilinear(w, 8))
    with torch.no_grad():
        want = model.features(torch.from_numpy(small).float()[:, None]).double().numpy()
    f, _ = ext(images.float())
    np.testing.assert_allclose(f, want, rtol=0, atol=1e-5)


def test_shape_errors_name_the_way_out(caches):
    digits = get_extractor("digits", digits_cache=caches["digits"][0])  # convert is off by default
    with pytest.raises(ValueError) as err:
        digits(torch.zeros(1, 3, 16, 16))
    assert str(err.value) == (
        "the digits extractor takes 1x8x8 images, got 3x16x16; pass --convert to average the channels and resize "
        "to 8x8 (or use --extractor inception)"
    )
    with pytest.raises(ValueError) as err:
        Mnist5kExtractor(caches["mnist5k"][0])(torch.zeros(1, 1, 8, 8))
    assert str(err.value) == (
        "the mnist5k extractor takes 1x28x28 images, got 1x8x8 (use --extractor inception for other images)"
    )


# --- the Inception extractor (weights replaced by a recorder) ---------------------------------------------------


class _StubInception(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)[:, :1].expand(-1, 2048) * torch.ones(2048)  # (N, 2048)

    def logits(self, f: torch.Tensor) -> torch.Tensor:
        return f[:, :1008] * 0  # (N, 1008)


def test_inception_extractor_arguments(monkeypatch, tmp_path):
    calls = []

    def load(weights, device):
        calls.append((weights, device))
        return _StubInception()

    monkeypatch.setattr(features, "load_fid_inception", load)
    ext = InceptionExtractor(tmp_path / "w.pth")
    assert ext.device == torch.device("cpu") and isinstance(ext.model, _StubInception)
    assert len(calls) == 1 and calls[0][0] == tmp_path / "w.pth"
    assert isinstance(calls[0][1], torch.device) and calls[0][1] == torch.device("cpu")
    f, p = ext(torch.full((3, 3, 4, 4), 0.5), batch_size=2)
    assert np.array_equal(f, np.full((3, 2048), 0.5)) and np.array_equal(p, np.full((3, 1008), 1 / 1008))
    calls.clear()
    ext = InceptionExtractor("w.pth", device="meta")
    assert ext.device == torch.device("meta") and calls == [("w.pth", torch.device("meta"))]
    calls.clear()
    ext = get_extractor("inception", inception_weights="x.pth", device="meta")
    assert isinstance(ext, InceptionExtractor) and calls == [("x.pth", torch.device("meta"))]
    with pytest.raises(ValueError) as err:
        get_extractor("inception")
    assert str(err.value) == (
        "the inception extractor needs --inception-weights PATH (pytorch-fid's "
        "pt_inception-2015-12-05-6726825d.pth); it is never downloaded"
    )
