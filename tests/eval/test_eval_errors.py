"""Bad inputs of the eval command (diffcurr_fast/eval/): samples of another shape, files named by the user not
replaced without --overwrite, a missing reference named first, NaN samples, latents without --vae, the option's name
in its errors, unreadable .npz files and samples holding no images named in one line, outputs that cannot be written
refused before the work. docs/errors.md lists what each input gets."""

import argparse
import json

import numpy as np
import pytest
import torch
from conftest import _main

from diffcurr_fast import cli


def test_eval_refuses_mismatched_shapes(tmp_path, capsys):
    from diffcurr_fast.eval import cli_eval
    from diffcurr_fast.eval.features import EXTRACTORS

    assert cli_eval.EXTRACTORS == EXTRACTORS
    np.savez(tmp_path / "rgb.npz", arr_0=np.zeros((6, 16, 16, 3), np.uint8))
    p = argparse.ArgumentParser()
    cli_eval.add_arguments(p)
    base = ["--samples", str(tmp_path / "rgb.npz"), "--ref", "digits", "--digits-cache", str(tmp_path / "d.pt")]
    with pytest.raises(ValueError, match="takes 1x8x8 images, got 3x16x16; pass --convert"):
        cli_eval.run(p.parse_args(base))
    assert cli_eval.run(p.parse_args([*base, "--convert", "--json", str(tmp_path / "out" / "r.json")])) == 0
    assert "FD: " in capsys.readouterr().out
    assert "fd" in json.loads((tmp_path / "out" / "r.json").read_text())


@pytest.fixture(scope="module")
def digits_cache(tmp_path_factory):
    from diffcurr_fast.eval.features import digits_classifier

    path = tmp_path_factory.mktemp("digits") / "digits_classifier.pt"
    digits_classifier(path)
    return str(path)


@pytest.fixture
def samples(tmp_path):
    from diffcurr_fast.eval.features import load_digits_data

    _, _, xte, _ = load_digits_data()
    np.savez(tmp_path / "samples.npz", images=xte[:60].numpy())
    return str(tmp_path / "samples.npz")


@pytest.mark.parametrize("flag", ["--save-ref", "--json"])
def test_eval_does_not_replace_a_user_file(tmp_path, capsys, digits_cache, samples, flag):
    mine = tmp_path / "mine.npz"
    mine.write_text("my data")
    base = ["eval", "--samples", samples, "--ref", "digits", "--digits-cache", digits_cache]
    rc, err = _main(capsys, *base, flag, str(mine))
    assert rc == 2 and f"{flag} '{mine}' exists; pass --overwrite to replace it" in err, err
    assert mine.read_text() == "my data"
    assert _main(capsys, *base, flag, str(mine), "--overwrite")[0] == 0
    assert mine.read_bytes() != b"my data"
    if flag == "--json":
        assert json.loads(mine.read_text())["extractor"] == "digits"
    else:  # written under the exact name, atomically (np.savez of a name would add .npz)
        assert "mu" in np.load(mine).files and not (tmp_path / "mine.npz.tmp").exists()


def test_eval_takes_the_extractor_a_saved_reference_names(tmp_path, capsys, digits_cache, samples):
    """`eval --ref FILE` with a statistics file written by --save-ref uses the extractor the file records, without
    --extractor (it asked for Inception weights)."""
    ref = tmp_path / "ref.npz"
    base = ["--digits-cache", digits_cache]
    assert _main(capsys, "eval", "--ref", "digits", "--save-ref", str(ref), *base)[0] == 0
    capsys.readouterr()
    from diffcurr_fast import cli

    assert cli.main(["eval", "--samples", samples, "--ref", str(ref), *base]) == 0
    assert "extractor: digits" in capsys.readouterr().out


def test_eval_does_not_replace_a_file_named_as_digits_cache(tmp_path, capsys, samples):
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes")
    rc, err = _main(capsys, "eval", "--samples", samples, "--ref", "digits", "--digits-cache", str(notes))
    assert rc == 2 and "is not a digits classifier cache" in err and "--overwrite" in err, err
    assert notes.read_text() == "my notes"


def test_eval_missing_reference_is_named_first(tmp_path, capsys, samples):
    rc, err = _main(capsys, "eval", "--samples", samples, "--ref", str(tmp_path / "nope.npz"))  # inception default
    assert rc == 2 and "--ref" in err and "nope.npz' not found" in err and "inception-weights" not in err, err


def test_eval_nan_samples_name_the_file_and_sample(tmp_path, capsys, digits_cache):
    x = np.zeros((5, 1, 8, 8), np.float32)
    x[3, 0, 2, 2] = np.nan
    np.savez(tmp_path / "nan.npz", images=x)
    rc, err = _main(
        capsys, "eval", "--samples", str(tmp_path / "nan.npz"), "--ref", "digits", "--digits-cache", digits_cache
    )
    assert rc == 2 and "nan.npz: sample 3 of 'images' holds NaN or inf values" in err, err


class _FakeVAE(torch.nn.Module):
    """decode(z) = tanh(mean of the channels), 8x8 images from 8x8 latents (the shape the digits extractor takes)."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(()))

    def decode(self, z):
        return torch.tanh(self.w * z.mean(1, keepdim=True))  # (N, 1, h, w)


def test_eval_vae_decodes_latents_and_their_absence_is_named(tmp_path, capsys, digits_cache, monkeypatch):
    from diffcurr_fast.data import extract

    z = torch.randn(40, 4, 8, 8, generator=torch.Generator().manual_seed(0)) * 300  # a latent model's 'x'
    np.savez(tmp_path / "lat.npz", x=z.numpy(), y=np.arange(40) % 10)
    base = ["eval", "--samples", str(tmp_path / "lat.npz"), "--ref", "digits", "--digits-cache", digits_cache]
    rc, err = _main(capsys, *base)
    assert rc == 2 and "4-channel latents" in err and "--vae DIR" in err, err
    np.savez(tmp_path / "lat1.npz", x=z[:, :1].numpy())  # one channel, far outside [-1, 1]
    rc, err = _main(
        capsys, "eval", "--samples", str(tmp_path / "lat1.npz"), "--ref", "digits", "--digits-cache", digits_cache
    )
    assert rc == 2 and "must be in [-1, 1]" in err and "--vae" in err, err
    seen = {}
    monkeypatch.setattr(extract, "load_decoder", lambda path, device: seen.setdefault(path, _FakeVAE()))
    capsys.readouterr()
    assert cli.main([*base, "--vae", "my_vae", "--json", str(tmp_path / "r.json")]) == 0
    assert "my_vae" in seen and "decoded 40 latents" in capsys.readouterr().out
    got = json.loads((tmp_path / "r.json").read_text())
    from diffcurr_fast.eval.evaluate import evaluate, load_reference
    from diffcurr_fast.eval.features import get_extractor

    ext = get_extractor("digits", digits_cache=digits_cache)
    want = evaluate(torch.tanh(z.mean(1, keepdim=True)), load_reference("digits", ext), ext)
    assert got["fd"] == pytest.approx(want.fd, rel=1e-6)  # the decoded images are what was evaluated


def test_eval_names_the_num_samples_option(no_dropout_run, capsys):
    from diffcurr_fast.eval.evaluate import check_draw

    for flag in ("--num-samples", "--num"):
        rc, err = _main(capsys, "eval", "--ckpt", str(no_dropout_run), flag, "1", "--ref", "digits")
        assert rc == 2 and "--num-samples must be >= 2 to evaluate, got 1" in err, err
    with pytest.raises(ValueError, match="^--num-samples must be >= 2 to evaluate, got 0$"):
        check_draw(0, 64)
    rc, err = _main(capsys, "eval", "--ckpt", str(no_dropout_run), "--batch-size", "0", "--ref", "digits")
    assert rc == 2 and "--batch-size must be a positive int, got 0" in err, err


def _bad_npz(tmp_path, kind):
    """A samples file cut in half (``truncated``) or bytes that are no archive (``garbage``: numpy reads them as a
    pickle and advises ``allow_pickle``)."""
    np.savez(tmp_path / "whole.npz", images=np.zeros((4, 1, 8, 8), np.float32))
    data = (tmp_path / "whole.npz").read_bytes()
    path = tmp_path / f"{kind}.npz"
    path.write_bytes(data[: len(data) // 2] if kind == "truncated" else b"not an archive " * 8)
    return str(path)


@pytest.mark.parametrize("kind", ["truncated", "garbage"])
def test_eval_unreadable_npz_is_named_in_one_line(tmp_path, capsys, digits_cache, samples, kind):
    from diffcurr_fast.eval.metrics import load_statistics

    bad = _bad_npz(tmp_path, kind)
    for flag, args in (("--samples", [bad, "--ref", "digits"]), ("--ref", [samples, "--ref", bad])):
        rc, err = _main(capsys, "eval", "--samples", *args, "--extractor", "digits", "--digits-cache", digits_cache)
        assert rc == 2 and f"{flag} '{bad}' is not a readable .npz file" in err, err
        assert len(err.strip().splitlines()) == 1 and "allow_pickle" not in err and "Traceback" not in err, err
    with pytest.raises(ValueError, match=r"^reference statistics '.*\.npz' is not a readable \.npz file") as exc:
        load_statistics(bad)
    assert "allow_pickle" not in str(exc.value)


@pytest.mark.parametrize("key", ["images", "arr_0"])
def test_eval_of_no_images_names_the_array(tmp_path, capsys, digits_cache, key):
    shape = (0, 1, 8, 8) if key == "images" else (0, 8, 8, 1)
    np.savez(tmp_path / "none.npz", **{key: np.zeros(shape, np.float32 if key == "images" else np.uint8)})
    for args in (["--samples", str(tmp_path / "none.npz"), "--ref", "digits"], ["--ref", str(tmp_path / "none.npz")]):
        rc, err = _main(
            capsys,
            "eval",
            *args,
            "--extractor",
            "digits",
            "--digits-cache",
            digits_cache,
            "--save-ref",
            str(tmp_path / "r.npz"),
            "--overwrite",
        )
        assert rc == 2 and f"none.npz: '{key}' holds no images (shape {shape})" in err, err


@pytest.mark.parametrize("flag", ["--json", "--save-ref"])
def test_eval_unwritable_output_is_refused_before_the_work(tmp_path, capsys, monkeypatch, samples, flag):
    from diffcurr_fast import _files
    from diffcurr_fast.eval import evaluate

    def no_work(*args, **kwargs):
        raise AssertionError("the reference was computed before the output was checked")

    monkeypatch.setattr(evaluate, "load_reference", no_work)
    (tmp_path / "notes.txt").write_text("mine")
    base = ["eval", "--samples", samples, "--ref", "digits", flag]
    rc, err = _main(capsys, *base, str(tmp_path / "notes.txt" / "out"))
    assert rc == 2 and f"{flag} '{tmp_path / 'notes.txt' / 'out'}' cannot be created" in err, err
    assert "is a file, not a directory; choose another" in err

    def refuse(*args, **kwargs):  # a read-only folder (the tests run as root, which permissions do not stop)
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_files.tempfile, "mkdtemp", refuse)
    rc, err = _main(capsys, *base, str(tmp_path / "ro" / "out"))
    assert rc == 2 and "cannot be written" in err and "refuses new files (Permission denied)" in err, err


@pytest.mark.parametrize(
    "labels, match",
    [
        (np.arange(5), r"'y' must hold one integer label >= 0 per sample \(6,\), got int64 \(5,\)"),
        (np.arange(6) + 0.5, r"'y' must hold one integer label >= 0 per sample \(6,\), got float64 \(6,\)"),
        (np.arange(6) - 1, r"'y' must hold one integer label >= 0 per sample"),
        (np.array([0, 1, 2, 3, 4, 12]), "labels must be classes of the classifier, 0 to 9, got 0 to 12"),
    ],
)
def test_eval_samples_labels_that_do_not_fit_are_named(tmp_path, capsys, digits_cache, labels, match):
    import re

    np.savez(tmp_path / "s.npz", x=np.zeros((6, 1, 8, 8), np.float32), y=labels)
    rc, err = _main(
        capsys, "eval", "--samples", str(tmp_path / "s.npz"), "--ref", "digits", "--digits-cache", digits_cache
    )
    assert rc == 2 and re.search(match, err) and len(err.strip().splitlines()) == 1, err
