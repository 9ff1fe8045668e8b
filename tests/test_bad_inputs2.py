"""Bad inputs, round two: no user file replaced without --overwrite, no silent wrong result (duplicate recipe keys,
an unreachable LLM, a mostly-skipped run), unusable run directories and forced backends refused before anything is
written, one-line messages for eval and sample. docs/errors.md lists what each input gets."""

import json
import os

import numpy as np
import pytest
import torch
from conftest import TINY_SETS

from diffcurr_fast import cli
from diffcurr_fast.runs.recipes import load_config, read_recipe
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.preflight import check_run


def tiny(run_dir, *extra):
    return load_config(None, [f"checkpoint.run_dir={run_dir}", *TINY_SETS, *extra])


def _main(capsys, *argv):
    """(exit status, stderr) of ``diffcurr-fast ARGV``."""
    capsys.readouterr()
    rc = cli.main(list(argv))
    return rc, capsys.readouterr().err


# ---- run directories that cannot be created or written, forced backends: refused before anything is written ----
def test_run_dir_under_a_file_is_refused_by_dry_run_and_start(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    run = tmp_path / "notes.txt" / "run"
    for extra in (["--dry-run"], ["--set", "engine.max_steps=1"]):
        rc, err = _main(capsys, "train", "--run-dir", str(run), *extra)
        assert rc == 2 and "notes.txt' is a file, not a directory; choose another checkpoint.run_dir" in err, err
        assert "Traceback" not in err
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_run_dir_that_refuses_new_files_is_refused(tmp_path, capsys, monkeypatch):
    import tempfile

    def refuse(*a, **k):  # what /sys or a read-only mount answers (as root, os.access says yes there)
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(tempfile, "mkdtemp", refuse)
    rc, err = _main(capsys, "train", "--run-dir", str(tmp_path / "a" / "run"), "--dry-run")
    assert rc == 2 and "cannot be written" in err and "Operation not permitted" in err, err
    assert not (tmp_path / "a").exists()


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir("/sys/kernel"), reason="needs /sys as root")
def test_run_dir_under_sys_is_refused(capsys):
    rc, err = _main(capsys, "train", "--run-dir", "/sys/kernel/diffcurr_run", "--dry-run")
    assert rc == 2 and "cannot be written" in err, err


def test_writable_check_leaves_nothing(tmp_path):
    from diffcurr_fast.train.rundir import check_writable

    check_writable(tmp_path / "new" / "run")
    assert list(tmp_path.iterdir()) == []


def test_forced_ops_backend_is_checked_before_the_run(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("triton can run here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"DIFFCURR_OPS_BACKEND='triton' cannot run adaln_modulate_fwd on cpu"):
        check_run(tiny(tmp_path / "run"))
    rc, err = _main(capsys, "train", "--run-dir", str(tmp_path / "run"), "--set", "engine.max_steps=1")
    assert rc == 2 and "DIFFCURR_OPS_BACKEND='triton'" in err and not (tmp_path / "run").exists()
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "tritn")
    with pytest.raises(ValueError, match=r"DIFFCURR_OPS_BACKEND='tritn' is not an ops backend"):
        check_run(tiny(tmp_path / "run"))


def test_info_shows_the_backend_a_run_uses(monkeypatch):
    from diffcurr_fast import info

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "reference")
    src, rows = info.selected_backends()
    assert src == "DIFFCURR_OPS_BACKEND=reference"
    assert {r[2] for r in rows if r[0] == "cpu"} == {"reference"}
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "triton")
    _, rows = info.selected_backends()
    if not torch.cuda.is_available():
        assert all(r[2].startswith("none: backend 'triton' runs on CPU tensors only") for r in rows if r[0] == "cpu")
    assert "backends a run uses" in info.report()


# ---- recipes: duplicate keys at any depth, an empty recipe ---------------------------------------------------
@pytest.mark.parametrize(
    "text, match",
    [
        ("engine:\n  max_steps: 5\n  seed: 1\n  max_steps: 7\n", r"'engine.max_steps' at lines 2, 4"),
        ("engine:\n  max_steps: 5\noptim:\n  lr: 0.1\nengine:\n  seed: 3\n", r"'engine' at lines 1, 5"),
        ("data:\n  batch_size: 8\n  dataset: digits\n  batch_size: 8\n", r"'data.batch_size' at lines 2, 4"),
    ],
    ids=["key", "section", "same-value"],
)
def test_duplicate_recipe_keys_are_refused_with_their_lines(tmp_path, text, match):
    (tmp_path / "r.yaml").write_text(text)
    with pytest.raises(ValueError, match=r"sets a key more than once .*" + match):
        read_recipe(tmp_path / "r.yaml")


def test_empty_recipe_is_refused(tmp_path, capsys):
    for i, text in enumerate(("", "# only a comment\n", "{}\n")):
        (tmp_path / f"e{i}.yaml").write_text(text)
        rc, err = _main(capsys, "train", str(tmp_path / f"e{i}.yaml"), "--dry-run")
        assert rc == 2 and "is empty" in err, err
    (tmp_path / "ok.yaml").write_text("engine:\n  max_steps: 5\n")  # a recipe of one key still reads
    assert read_recipe(tmp_path / "ok.yaml") == {"engine": {"max_steps": 5}}


def test_duplicate_study_spec_keys_are_refused(tmp_path):
    from diffcurr_fast.study.spec import load_spec

    (tmp_path / "s.yaml").write_text("name: a\nseeds: [0, 1]\nname: b\n")
    with pytest.raises(ValueError, match=r"study spec .* sets a key more than once .*'name' at lines 1, 3"):
        load_spec(tmp_path / "s.yaml")


# ---- eval: files named by the user are not replaced without --overwrite; one-line messages; --vae ------------
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


# ---- a run that skips more than a stated share of its steps stops, names the first bad step, exits non-zero ---
def test_mostly_skipped_run_stops_with_the_first_bad_step(tmp_path, capsys):
    run = tmp_path / "run"
    rc, err = _main(
        capsys,
        "train",
        "--run-dir",
        str(run),
        *(a for s in TINY_SETS for a in ("--set", s)),
        "--set",
        "engine.max_steps=15",
        "--set",
        "optim.lr=1e3",
        "--set",
        "optim.warmup_steps=0",
    )
    assert rc == 2, err
    line = next(v for v in err.splitlines() if "error:" in v)
    assert "more than engine.max_skip_share=0.05 of the 15 steps" in line and "lower optim.lr (now 1000)" in line
    assert "the first at step" in line and "Traceback" not in err
    assert "done:" not in capsys.readouterr().out


def test_skip_share_and_first_bad_step_are_counted(tmp_path):
    from diffcurr_fast.train.skips import NonFiniteLossError

    tr = Trainer(tiny(tmp_path / "r", "engine.max_steps=40", "engine.max_skip_share=0.1", "engine.max_nan_skips=3"))
    real = tr.objective
    x, y = next(tr.loader)
    tr.train_step(x, y)  # step 1 trains
    bad = lambda *a, **k: real(*a, **k) * float("nan")
    for _ in range(2):  # steps 2-3 skipped, step 4 trains: the count in a row starts again, the total does not
        tr.objective = bad
        tr.train_step(x, y)
    tr.objective = real
    tr.train_step(x, y)
    assert (tr.skips.total, tr.skips.in_a_row, tr.skips.first) == (2, 0, 2)
    tr.objective = bad
    tr.train_step(x, y)
    tr.train_step(x, y)  # 4 skipped of 40 allowed (share 0.1)
    assert tr.skips.total == 4
    state = tr.state_dict()
    with pytest.raises(
        NonFiniteLossError,
        match=r"at step 7: 5 step\(s\) skipped, the first at step 2 \(more than "
        r"engine.max_skip_share=0.1 of the 40 steps",
    ):
        tr.train_step(x, y)
    tr.load_state_dict(state)  # a resume keeps the counts
    assert (tr.skips.total, tr.skips.in_a_row, tr.skips.first) == (4, 2, 2)


# ---- sample: an --out under a file, the option's name in its errors, guidance without a null label -----------
@pytest.fixture(scope="module")
def no_dropout_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("nodrop") / "run"
    Trainer(tiny(run, "engine.max_steps=1", "model.class_dropout_prob=0")).fit()
    return run


def test_sample_out_under_a_file_is_one_line(no_dropout_run, tmp_path, capsys):
    (tmp_path / "x.npz").write_bytes(b"mine")
    rc, err = _main(capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "x.npz" / "y.npz"))
    assert rc == 2 and "x.npz' is a file, not a directory; choose another --out" in err, err
    assert (tmp_path / "x.npz").read_bytes() == b"mine"
    rc, err = _main(
        capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "s.npz"), "--num-samples", "0"
    )
    assert rc == 2 and "--num-samples must be >= 1, got 0" in err, err


def test_guidance_without_a_null_label_says_so(no_dropout_run, tmp_path, capsys):
    rc, err = _main(
        capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "s.npz"), "--cfg", "4", "--steps", "2"
    )
    assert rc == 2 and "trained without label dropout (model.class_dropout_prob=0); sample with --cfg 1" in err, err
    assert "y must lie in" not in err and not (tmp_path / "s.npz").exists()
    rc, _ = _main(capsys, "sample", "--ckpt", str(no_dropout_run), "--out", str(tmp_path / "s.npz"), "--steps", "2")
    assert rc == 0  # without guidance it samples


@pytest.mark.parametrize(
    "sets, fix",
    [
        (["logging.num_samples=4", "logging.cfg_scale=2"], "set logging.cfg_scale=1, or"),
        (["logging.eval_every=1", "eval.cfg_scale=1.5"], "set eval.cfg_scale=1, or"),
        (
            ["logging.num_samples=4", "logging.eval_every=1", "eval.cfg_scale=3"],
            "set logging.cfg_scale=1 and eval.cfg_scale=1, or",
        ),
    ],
)
def test_training_guidance_without_a_null_label_is_refused_before_the_run(tmp_path, capsys, sets, fix):
    """The end-of-run grid (logging.cfg_scale, the demo's 2) and the evaluations (eval.cfg_scale) of a model trained
    without label dropout could not guide: refused by the start's checks (also --dry-run), not after training."""
    run = tmp_path / "run"
    for extra in (["--dry-run"], []):
        rc, err = _main(capsys, "train", "--run-dir", str(run), *extra, *_sets("model.class_dropout_prob=0", *sets))
        assert rc == 2 and len(err.strip().splitlines()) == 1, err
        assert "classifier-free guidance needs the null label, which model.class_dropout_prob=0 does not train" in err
        assert f"{fix} model.class_dropout_prob > 0" in err, err
        assert not run.exists()  # nothing written
    fixed = [*sets, "logging.cfg_scale=1", "eval.cfg_scale=1"]
    assert (
        _main(capsys, "train", "--run-dir", str(run), "--dry-run", *_sets("model.class_dropout_prob=0", *fixed))[0] == 0
    )
    assert _main(capsys, "train", "--run-dir", str(run), "--dry-run", *_sets(*sets))[0] == 0  # the default dropout 0.1
    from diffcurr_fast.runs.config import config_from_dict
    from diffcurr_fast.train.preflight import check_guidance

    # no grid (logging.num_samples 0 in SETS; a latent model gets none) and no evaluations: nothing to refuse
    check_guidance(tiny(run, "model.class_dropout_prob=0", "logging.cfg_scale=2"))
    check_guidance(tiny(run, "model.class_dropout_prob=0", "logging.num_samples=4", "model.in_channels=4"))
    # a rule of the run, not of the config: a checkpoint's config that breaks it still loads (to sample with cfg 1)
    bad = tiny(run, "model.class_dropout_prob=0", "logging.num_samples=4", "logging.cfg_scale=2")
    assert config_from_dict(bad.to_dict()).logging.cfg_scale == 2


def test_eval_names_the_num_samples_option(no_dropout_run, capsys):
    from diffcurr_fast.eval.evaluate import samples_from_checkpoint

    for flag in ("--num-samples", "--num"):
        rc, err = _main(capsys, "eval", "--ckpt", str(no_dropout_run), flag, "1", "--ref", "digits")
        assert rc == 2 and "--num-samples must be >= 2 to evaluate, got 1" in err, err
    with pytest.raises(ValueError, match="^--num-samples must be >= 2 to evaluate, got 0$"):
        samples_from_checkpoint(no_dropout_run, 0)
    rc, err = _main(capsys, "eval", "--ckpt", str(no_dropout_run), "--batch-size", "0", "--ref", "digits")
    assert rc == 2 and "--batch-size must be a positive int, got 0" in err, err


def test_sampler_errors_use_the_right_article():
    from diffcurr_fast.runs.config import with_article

    assert (with_article("edm"), with_article("flow"), with_article("ddpm")) == ("an edm", "a flow", "a ddpm")

    with pytest.raises(ValueError, match="is not an edm target"):
        load_config(
            None,
            [
                "diffusion.formulation=edm",
                "diffusion.learn_sigma=false",
                "diffusion.prediction=eps",
                "logging.sampler=heun",
            ],
        )
    with pytest.raises(ValueError, match="'ddim' cannot sample an edm model"):
        load_config(
            None,
            [
                "diffusion.formulation=edm",
                "diffusion.learn_sigma=false",
                "diffusion.prediction=x0",
                "diffusion.weighting=none",
                "logging.sampler=ddim",
            ],
        )
    assert load_config(None).logging.sampler == "ddim"


# ---- the end-of-run grid: a progress bar, Ctrl-C honoured, and a word when there can be no grid ---------------
def _sets(*extra):
    return [a for s in (*TINY_SETS, *extra) for a in ("--set", s)]


def test_grid_shows_progress_and_a_latent_model_says_why_no_grid(tmp_path, capsys):
    rc, err = _main(
        capsys,
        "train",
        "--run-dir",
        str(tmp_path / "a"),
        *_sets("engine.max_steps=1", "logging.num_samples=4", "logging.sample_steps=3", "logging.progress=true"),
    )
    assert rc == 0 and (tmp_path / "a" / "samples.png").is_file()
    assert any("ddim" in line and "3/3" in line for line in err.replace("\r", "\n").splitlines()), err
    x = np.random.default_rng(0).standard_normal((32, 4, 8, 8)).astype(np.float32)
    np.savez(tmp_path / "lat.npz", x=x, y=np.arange(32) % 10)
    capsys.readouterr()
    rc = cli.main(
        [
            "train",
            "--run-dir",
            str(tmp_path / "b"),
            *_sets(
                "engine.max_steps=1",
                "logging.num_samples=4",
                "data.dataset=npz",
                f"data.path={tmp_path / 'lat.npz'}",
                "model.in_channels=4",
            ),
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "sample grid: none (the model makes 4-channel latents, not images" in out, out
    assert not (tmp_path / "b" / "samples.png").exists()


@pytest.mark.parametrize("name, code", [("SIGINT", 130), ("SIGTERM", 143)])
def test_ctrl_c_during_the_grid_stops_it(tmp_path, name, code):
    import signal

    from diffcurr_fast.train.interrupt import GridInterrupted

    signum = getattr(signal, name)
    before = signal.getsignal(signum)
    tr = Trainer(tiny(tmp_path / "r", "engine.max_steps=2", "logging.num_samples=4", "logging.sample_steps=20"))
    calls = []

    def interrupt(module, args):  # the user presses Ctrl-C (or a scheduler sends SIGTERM) while the grid is drawn
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signum)

    tr.ema.module.register_forward_pre_hook(interrupt)
    with pytest.raises(
        GridInterrupted, match=f"{name} received during the end-of-run sample grid: training finished at step 2"
    ) as info:
        tr.fit()
    assert info.value.exit_code == code and len(calls) == 2  # stopped at the next network call
    assert (
        not (tmp_path / "r" / "samples.png").exists() and (tmp_path / "r" / "checkpoints" / "ckpt_00000002.pt").exists()
    )
    assert signal.getsignal(signum) is before  # the handlers are restored


# ---- precision auto: the shipped recipes train in bf16 on a GPU that has it, fp32 on CPU ----------------------
def test_precision_auto_is_fp32_on_cpu_and_recipes_use_it():
    from diffcurr_fast.objective import Objective, resolve_precision
    from diffcurr_fast.runs.recipes import list_recipes
    from diffcurr_fast.train.engine import resolve_deepspeed_config

    assert resolve_precision("auto", "cpu") == "fp32" and resolve_precision("bf16", "cpu") == "bf16"
    assert resolve_precision("fp32", "cuda") == "fp32"
    want = "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
    assert resolve_precision("auto", "cuda") == want
    x = torch.ones(2, 2)
    for precision, dtype in (("auto", torch.float32), ("bf16", torch.bfloat16), ("fp32", torch.float32)):
        cfg = load_config(None, [f"engine.precision={precision}"])
        with Objective.from_config(cfg).autocast(torch.device("cpu")):
            assert (x @ x).dtype == dtype, precision  # auto: no bf16 autocast on CPU
    ds = resolve_deepspeed_config({}, load_config(None, ["engine.precision=auto"]), world_size=1, device_type="cpu")
    assert ds["bf16"]["enabled"] is False
    for r in list_recipes():
        if r.stem != "demo":  # the CPU demo keeps fp32 everywhere
            assert load_config(r).engine.precision == "auto", r.name


def test_start_line_states_the_precision_and_bf16_on_cpu_warns_once(tmp_path, capsys):
    import warnings

    from diffcurr_fast.train.preflight import BF16_ON_CPU

    rc, err = _main(
        capsys, "train", "--run-dir", str(tmp_path / "a"), *_sets("engine.max_steps=1", "engine.precision=auto")
    )
    assert rc == 0 and "device cpu, precision fp32 (auto); run dir" in err, err  # the recipes' auto, resolved
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("default")  # as a plain `diffcurr-fast train` shows warnings
        rc, err = _main(
            capsys, "train", "--run-dir", str(tmp_path / "b"), *_sets("engine.max_steps=1", "engine.precision=bf16")
        )
    assert rc == 0 and "device cpu, precision bf16; run dir" in err, err
    bf16 = [str(w.message) for w in seen if "engine.precision 'bf16' on a CPU" in str(w.message)]
    assert bf16 == [BF16_ON_CPU], bf16  # once, though the start's checks run twice (command and trainer)
    assert "about 12x slower than fp32" in BF16_ON_CPU and "set engine.precision=auto" in BF16_ON_CPU
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for precision in ("auto", "fp32"):
            rc, _ = _main(
                capsys, "train", "--run-dir", str(tmp_path / "c"), "--dry-run", *_sets(f"engine.precision={precision}")
            )
            assert rc == 0
    assert not [w for w in seen if "bf16" in str(w.message)]  # auto on a CPU is fp32: no warning


def test_every_test_docs_errors_names_exists():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    named = set(re.findall(r"`(test_\w+)`", (root / "docs" / "errors.md").read_text()))
    defined = {
        m for f in root.joinpath("tests").glob("test_*.py") for m in re.findall(r"def (test_\w+)", f.read_text())
    }
    assert len(named) > 40 and not named - defined, sorted(named - defined)


# ---- small ones ---------------------------------------------------------------------------------------------
def test_recipes_lists_whole_first_sentences(capsys, tmp_path):
    from diffcurr_fast.runs.recipes import list_recipes
    from diffcurr_fast.train import cli_recipes

    rc, _ = _main(capsys, "recipes")
    capsys.readouterr()
    cli.main(["recipes"])
    out = " ".join(capsys.readouterr().out.split())  # the wrapping undone
    assert rc == 0
    for r in list_recipes():
        summary = cli_recipes._summary(r)
        assert summary.endswith(".") and summary.count("(") == summary.count(")"), (r.name, summary)
        assert f"{r.stem} {summary}" in out, r.name
    (tmp_path / "r.yaml").write_text(
        "# EDM (Karras et al. 2022, e.g. Table 1) on CIFAR-10.\n# More. Text.\nengine:\n  max_steps: 1\n"
    )
    assert cli_recipes._summary(tmp_path / "r.yaml") == "EDM (Karras et al. 2022, e.g. Table 1) on CIFAR-10."


def test_study_cluster_plot_of_an_untrained_cluster_warns_nothing(tmp_path):
    import warnings

    from diffcurr_fast.study.report import plot_cluster_loss
    from diffcurr_fast.study.runner import run_dir_of
    from diffcurr_fast.study.spec import spec_from_dict

    spec = spec_from_dict(
        {"name": "s", "seeds": [0, 1], "metric": "fd", "reference": "a", "eval_every": 1, "arms": [{"name": "a"}]}
    )
    for seed, losses in ((0, [0.5, None, 0.25]), (1, [0.7, None, 0.35])):  # cluster 1 never unlocked
        rd = run_dir_of(tmp_path, "a", seed)
        rd.mkdir(parents=True)
        (rd / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.4, "cluster_loss": losses}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" was one
        plot_cluster_loss(spec, tmp_path, tmp_path / "c.png")
    assert (tmp_path / "c.png").is_file()
