import numpy as np
import pytest
import torch

from diffcurr_fast.eval import cli_eval
from diffcurr_fast.eval.evaluate import evaluate, load_images, load_reference
from diffcurr_fast.eval.features import (
    DIGITS_LABEL,
    DigitsExtractor,
    digits_classifier,
    get_extractor,
    load_digits_data,
    single_thread,
)
from diffcurr_fast.eval.inception import FIDInceptionV3, load_fid_inception
from diffcurr_fast.eval.metrics import frechet_distance


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory):
    path = tmp_path_factory.mktemp("digits") / "digits_classifier.pt"
    model, acc = digits_classifier(path)
    return path, model, acc


def test_digits_classifier_accuracy_and_cache(digits_cache):
    path, model, acc = digits_cache
    assert acc > 0.9
    assert path.is_file()
    again, acc2 = digits_classifier(path)  # loaded from the cache, not retrained
    assert acc2 == acc
    for a, b in zip(model.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    _, _, xte, yte = load_digits_data()
    with torch.no_grad():
        assert float((again(xte).argmax(1) == yte).float().mean()) == pytest.approx(acc)


def test_digits_features_separate_classes(digits_cache):
    path, _, _ = digits_cache
    ext = DigitsExtractor(path)
    assert ext.label == DIGITS_LABEL == "digits-classifier features: not Inception FID"
    xtr, ytr, xte, yte = load_digits_data()
    ftr, _ = ext(xtr)
    fte, probs = ext(xte, batch_size=17)
    assert ftr.shape == (len(xtr), 64) and probs.shape == (len(xte), 10)
    # nearest class mean (computed on train features) classifies held-out features
    means = np.stack([ftr[ytr.numpy() == c].mean(0) for c in range(10)])
    pred = np.linalg.norm(fte[:, None] - means[None], axis=2).argmin(1)
    assert (pred == yte.numpy()).mean() > 0.9
    # between-class spread dominates within-class spread
    within = np.mean([ftr[ytr.numpy() == c].var(0).sum() for c in range(10)])
    between = means.var(0).sum()
    assert between > within
    # RGB and larger images are refused; only when asked (convert) are they averaged and resized to 8x8
    rgb = torch.nn.functional.interpolate(xte[:3], size=(16, 16), mode="nearest").expand(-1, 3, -1, -1)
    with pytest.raises(ValueError, match="takes 1x8x8 images, got 3x16x16; pass --convert"):
        ext(rgb)
    f_rgb, _ = DigitsExtractor(path, convert=True)(rgb)
    assert f_rgb.shape == (3, 64)
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        ext(xte[:2] * 3)


def test_digits_fd_orders_sample_quality(digits_cache):
    path, _, _ = digits_cache
    ext = get_extractor("digits", digits_cache=path)
    ref = load_reference("digits", ext)
    assert ref.count == 1797 and ref.extractor == "digits"
    _, _, xte, _ = load_digits_data()
    good = evaluate(xte, ref, ext, splits=5)
    noise = evaluate(torch.rand(len(xte), 1, 8, 8) * 2 - 1, ref, ext, splits=5)
    assert good.fd < noise.fd / 5
    assert good.inception_score > noise.inception_score
    assert good.precision > 0.9 and good.recall > 0.5
    assert noise.precision < good.precision
    # FD agrees with frechet_distance on the features directly
    f, _ = ext(xte)
    assert good.fd == pytest.approx(frechet_distance(f.mean(0), np.cov(f, rowvar=False), ref.mu, ref.sigma))


def test_eval_cli(digits_cache, tmp_path, capsys):
    path, _, _ = digits_cache
    _, _, xte, _ = load_digits_data()
    np.savez(tmp_path / "samples.npz", images=xte[:100].numpy())
    import argparse

    parser = argparse.ArgumentParser()
    cli_eval.add_arguments(parser)
    base = ["--extractor", "digits", "--digits-cache", str(path)]
    args = parser.parse_args(["--ref", "digits", "--save-ref", str(tmp_path / "ref.npz"), *base])
    assert cli_eval.run(args) == 0
    args = parser.parse_args(
        [
            "--samples",
            str(tmp_path / "samples.npz"),
            "--ref",
            str(tmp_path / "ref.npz"),
            "--json",
            str(tmp_path / "r.json"),
        ]
        + base
    )
    assert cli_eval.run(args) == 0
    out = capsys.readouterr().out
    assert "extractor: digits (digits-classifier features: not Inception FID)" in out
    assert "FD: " in out and "IS: " in out and "precision: " in out
    assert (tmp_path / "r.json").is_file()
    # statistics made with one extractor are refused for another
    ext = get_extractor("digits", digits_cache=path)
    ext.name = "inception"
    with pytest.raises(ValueError, match="'digits' statistics"):
        load_reference(str(tmp_path / "ref.npz"), ext)
    # ADM-style uint8 samples load to [-1, 1]
    np.savez(tmp_path / "adm.npz", arr_0=np.full((2, 4, 4, 3), 255, np.uint8))
    assert torch.equal(load_images(tmp_path / "adm.npz"), torch.ones(2, 3, 4, 4))
    np.savez(tmp_path / "bad.npz", images=np.full((2, 1, 4, 4), 3.0, np.float32))
    with pytest.raises(ValueError, match=r"\[-1, 1\]"):
        load_images(tmp_path / "bad.npz")
    with pytest.raises(ValueError, match="extractor must be one of"):
        get_extractor("clip")


def test_eval_cli_reads_the_samples_labels_and_scores_the_conditional_accuracy(digits_cache, tmp_path, capsys):
    """Samples that carry their labels (``y`` beside ``images`` / ``x``, ``arr_1`` beside ``arr_0``) get the
    classifier's accuracy against them; the digits test images with their true labels score what the classifier
    scores on them, and shifted labels score what it gives the shifted classes; converted images, or a file without
    labels, get none."""
    import argparse
    import json

    path, model, _ = digits_cache
    _, _, xte, yte = load_digits_data()
    x, y = xte[:100], yte[:100]
    with torch.no_grad(), single_thread():
        pred = model(x).argmax(1)
    parser = argparse.ArgumentParser()
    cli_eval.add_arguments(parser)
    base = ["--ref", "digits", "--extractor", "digits", "--digits-cache", str(path), "--splits", "2"]
    for name, labels in (("true", y), ("shifted", (y + 1) % 10)):
        np.savez(tmp_path / f"{name}.npz", x=x.numpy(), y=labels.numpy())
        out_json = tmp_path / f"{name}.json"
        assert (
            cli_eval.run(
                parser.parse_args([*base, "--samples", str(tmp_path / f"{name}.npz"), "--json", str(out_json)])
            )
            == 0
        )
        want = float((pred == labels).double().mean())
        assert json.loads(out_json.read_text())["cond_acc"] == pytest.approx(want, abs=1e-12)
        assert f"conditional accuracy: {want:.4f} (the digits classifier's class" in capsys.readouterr().out
    assert json.loads((tmp_path / "true.json").read_text())["cond_acc"] > 0.9
    assert json.loads((tmp_path / "shifted.json").read_text())["cond_acc"] < 0.1
    np.savez(
        tmp_path / "adm.npz",
        arr_0=((x.permute(0, 2, 3, 1) + 1) * 127.5).round().numpy().astype(np.uint8),
        arr_1=y.numpy(),
    )
    assert cli_eval.run(parser.parse_args([*base, "--samples", str(tmp_path / "adm.npz")])) == 0
    assert "conditional accuracy: 0.9" in capsys.readouterr().out
    np.savez(tmp_path / "big.npz", images=np.zeros((4, 1, 16, 16), np.float32), y=np.arange(4))
    assert cli_eval.run(parser.parse_args([*base, "--samples", str(tmp_path / "big.npz"), "--convert"])) == 0
    assert (
        "conditional accuracy: n/a (the images were converted to the digits classifier's input"
        in capsys.readouterr().out
    )
    np.savez(tmp_path / "plain.npz", images=x.numpy())
    assert cli_eval.run(parser.parse_args([*base, "--samples", str(tmp_path / "plain.npz")])) == 0
    assert "conditional accuracy" not in capsys.readouterr().out


def test_fid_inception_structure_and_loading(tmp_path):
    net = FIDInceptionV3()
    # torchvision's Inception3 has 27,161,264 parameters; without the auxiliary head (3,326,696) and with a
    # 1008-way classifier (+8 * 2049) that is 23,850,960, the size of the pytorch-fid network.
    assert sum(p.numel() for p in net.parameters()) == 27_161_264 - 3_326_696 + 8 * 2049
    assert net.fc.weight.shape == (1008, 2048)
    assert net.Mixed_7b.pool == "avg" and net.Mixed_7c.pool == "max"
    # a state dict with torchvision's module names loads strictly
    with torch.no_grad():
        for m in net.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                m.running_mean.normal_()
                m.running_var.uniform_(0.5, 1.5)
    state = {k: v for k, v in net.state_dict().items() if not k.endswith("num_batches_tracked")}
    torch.save(state, tmp_path / "w.pth")
    loaded = load_fid_inception(tmp_path / "w.pth")
    assert not loaded.training
    for a, b in zip(loaded.state_dict().items(), net.state_dict().items()):
        assert a[0] == b[0] and (a[0].endswith("num_batches_tracked") or torch.equal(a[1], b[1]))
    with torch.no_grad(), single_thread():
        out = loaded(torch.rand(1, 1, 75, 75) * 2 - 1, resize=False)  # grayscale is repeated to RGB
    assert out.shape == (1, 2048) and torch.isfinite(out).all()
    torch.save({"conv.weight": torch.zeros(1)}, tmp_path / "other.pth")
    with pytest.raises(ValueError, match="not the FID Inception weights"):
        load_fid_inception(tmp_path / "other.pth")
    with pytest.raises(FileNotFoundError, match="never downloaded|nothing is downloaded"):
        load_fid_inception(tmp_path / "missing.pth")
    with pytest.raises(ValueError, match="--inception-weights"):
        get_extractor("inception")


def test_eval_cli_from_checkpoint(digits_cache, tmp_path, capsys):
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train import loop as train_loop

    path, _, _ = digits_cache
    run = tmp_path / "run"
    overrides = [
        f"checkpoint.run_dir={run}",
        "model.hidden_size=32",
        "model.depth=1",
        "model.num_heads=2",
        "diffusion.num_timesteps=40",
        "curriculum.num_clusters=4",
        "data.batch_size=17",
        "engine.max_steps=2",
        "logging.progress=false",
        "logging.num_samples=0",
        "logging.plots=false",
    ]
    with single_thread():
        train_loop.train(load_config(None, overrides))
    import argparse

    parser = argparse.ArgumentParser()
    cli_eval.add_arguments(parser)
    argv = ["--ckpt", str(run), "--num", "12", "--steps", "3", "--splits", "2", "--ref", "digits"]
    args = parser.parse_args(
        argv + ["--extractor", "digits", "--digits-cache", str(path), "--json", str(tmp_path / "m.json")]
    )
    with single_thread():
        assert cli_eval.run(args) == 0
    out = capsys.readouterr().out
    assert "sampled 12 images" in out and "extractor: digits (digits-classifier features: not Inception FID)" in out
    import json

    got = json.loads((tmp_path / "m.json").read_text())
    from diffcurr_fast.eval.evaluate import checkpoint_model, evaluate, load_reference, samples_from_model
    from diffcurr_fast.eval.features import get_extractor

    with single_thread():  # the same evaluation, step by step
        model, cfg = checkpoint_model(str(run), weights=args.weights, device=args.device)
        images = samples_from_model(
            model, cfg, 12, sampler=args.sampler, steps=3, cfg_scale=args.cfg, seed=args.seed, device=args.device
        )
        extractor = get_extractor("digits", digits_cache=str(path), device=args.device)
        want = evaluate(images, load_reference("digits", extractor), extractor, splits=2, k=args.k)
    assert images.shape[0] == 12 and got["num_samples"] == 12
    assert got["fd"] == pytest.approx(want.fd, rel=1e-6) and got["fd"] > 0
    assert got["inception_score"] == pytest.approx(want.inception_score, rel=1e-6) and got["inception_score"] >= 1
    assert f"FD: {want.fd:.4f}" in out
    # the checkpoint's samples were drawn for the classes in turn, and the model learnt the digits' labels
    labels = torch.arange(12) % 10
    assert got["cond_acc"] == pytest.approx(
        evaluate(images, load_reference("digits", extractor), extractor, splits=2, labels=labels).cond_acc
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--ckpt", str(run), "--samples", "x.npz"])
