"""Bad inputs refused by the start's checks of a run (diffcurr_fast/train/: preflight.py, rundir.py, skips.py,
interrupt.py, report.py, cli_train.py, cli_recipes.py) before anything is written: backends asked for that cannot
run, an empty images folder, tensorboard missing, run directories that cannot be created or written, guidance
without a null label; a diverging run stops naming its first bad step; Ctrl-C during the grid; precision auto.
docs/errors.md lists what each input gets."""

import os
import re
import sys

import numpy as np
import pytest
import torch
from conftest import TINY_SETS, _main, set_args, tiny

from diffcurr_fast import cli
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.preflight import check_run


@pytest.mark.parametrize(
    "sets, match",
    [
        (["model.attn_backend=flash_attn"], "model.attn_backend 'flash_attn' cannot run here"),
        (["diffusion.ops_backend=cuda"], "diffusion.ops_backend 'cuda' cannot run on cpu"),
        (["diffusion.ops_backend=triton"], "diffusion.ops_backend 'triton' cannot run on cpu"),
        (["engine.device=cuda"], "engine.device is 'cuda' but no CUDA device is available"),
    ],
)
def test_backends_asked_for_are_checked_before_the_run(tmp_path, monkeypatch, sets, match):
    if torch.cuda.is_available():
        pytest.skip("the backends exist on this machine")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    cfg = tiny(tmp_path / "run", *sets)
    with pytest.raises(ValueError, match=match):
        check_run(cfg)
    with pytest.raises(ValueError, match=match):
        Trainer(cfg)
    assert not (tmp_path / "run").exists()


def test_available_backends_pass_the_check(tmp_path):
    from diffcurr_fast.ops import _backend

    assert check_run(tiny(tmp_path / "a", "diffusion.ops_backend=reference")).mode == "fresh"
    if _backend.unavailable_reason("cpu", "q_sample", torch.device("cpu")) is None:  # the C++ extension is built
        assert check_run(tiny(tmp_path / "b", "diffusion.ops_backend=cpu", "engine.device=cpu")).mode == "fresh"


def test_forced_ops_backend_is_checked_before_the_run(tmp_path, monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("triton can run here")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "triton")
    with pytest.raises(ValueError, match=r"DIFFCURR_OPS_BACKEND='triton' cannot run adaln_modulate_fwd on cpu"):
        check_run(tiny(tmp_path / "run"))
    with pytest.raises(ValueError, match=r"DIFFCURR_OPS_BACKEND='triton' cannot run rmsnorm_modulate_fwd on cpu"):
        check_run(tiny(tmp_path / "run", "model.norm=rmsnorm"))  # the modern block's ops are checked too
    rc, err = _main(capsys, "train", "--run-dir", str(tmp_path / "run"), "--set", "engine.max_steps=1")
    assert rc == 2 and "DIFFCURR_OPS_BACKEND='triton'" in err and not (tmp_path / "run").exists()
    monkeypatch.setenv("DIFFCURR_OPS_BACKEND", "tritn")
    with pytest.raises(ValueError, match=r"DIFFCURR_OPS_BACKEND='tritn' is not an ops backend"):
        check_run(tiny(tmp_path / "run"))


def test_empty_images_folder_is_named(tmp_path):
    (tmp_path / "imgs").mkdir()
    sets = ["data.dataset=images", f"data.path={tmp_path / 'imgs'}", "model.in_channels=3"]
    with pytest.raises(ValueError, match="has no class subdirectories"):
        check_run(tiny(tmp_path / "run", *sets))
    (tmp_path / "imgs" / "cat").mkdir()
    with pytest.raises(ValueError, match="holds no image files"):
        check_run(tiny(tmp_path / "run", *sets))


def test_tensorboard_missing_is_an_error(tmp_path, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec  # tensorboard hidden, whether it is installed or not
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    with pytest.raises(ImportError, match="logging.tensorboard is true but tensorboard is not installed"):
        check_run(tiny(tmp_path / "run", "logging.tensorboard=true"))
    from diffcurr_fast.train.report import MetricsWriter

    with pytest.raises(ImportError, match="tensorboard is not installed"):
        MetricsWriter(tmp_path, tensorboard=True)


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


def test_mostly_skipped_run_stops_with_the_first_bad_step(tmp_path, capsys):
    run = tmp_path / "run"
    rc, err = _main(
        capsys,
        "train",
        "--run-dir",
        str(run),
        *set_args(*TINY_SETS),
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


def test_a_run_that_fails_at_its_first_step_blames_the_data_not_the_learning_rate(tmp_path, capsys):
    """data.scale=1e30: the initial model's loss is already non-finite, so no learning rate could cause it; the line
    names the data and data.scale, not optim.lr."""
    sets = [*TINY_SETS, "engine.max_steps=15", "data.scale=1e30"]
    rc, err = _main(capsys, "train", "--run-dir", str(tmp_path / "run"), *set_args(*sets))
    line = next(v for v in err.splitlines() if "error:" in v)
    assert rc == 2 and "the first at step 1 " in line, err
    assert line.endswith("check the data and data.scale (now 1e+30; the model sees data.scale x the data)")
    assert "optim.lr" not in line


def test_the_advice_names_the_data_only_when_the_first_step_failed():
    """Step 1's loss is the initial model's: a non-finite one is the data's; from step 2 on, an update came first."""
    from diffcurr_fast.train.skips import Skips

    s = Skips(tiny("unused", "data.scale=3", "optim.lr=1e-3"), torch.device("cpu"), on_device=False)
    s.total = s.in_a_row = 2
    s.first = 1
    assert str(s._error(2, 2, 2)).endswith(
        "check the data and data.scale (now 3; the model sees data.scale x the data)"
    )
    s.first = 2
    assert str(s._error(3, 2, 2)).endswith("the run diverges: lower optim.lr (now 0.001) or set optim.grad_clip")


def test_data_of_exactly_one_batch_is_enough():
    from diffcurr_fast.train.data import check_data

    check_data(tiny("unused", "data.batch_size=1797"))  # all 1,797 digits: one batch
    with pytest.raises(ValueError, match="has 1797 samples, fewer than one batch of data.batch_size 1798"):
        check_data(tiny("unused", "data.batch_size=1798"))


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


def _sets(*extra):
    return set_args(*TINY_SETS, *extra)


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


def _late_inputs(tmp) -> dict[str, tuple[list[str], str]]:
    """Inputs that a real start refuses only when it reads them (the data, the weights, the launcher, the
    optimizer) or, before, only at the first evaluation: --set overrides and the line each gets."""
    import json
    from pathlib import Path

    from diffcurr_fast.models.diffusers_dit import diffusers_config

    tmp = Path(tmp)
    (tmp / "junk.pt").write_text("junk")
    good = tmp / "good.pt"
    torch.save({"w": torch.zeros(3)}, good)
    (tmp / "short.pt").write_bytes(good.read_bytes()[:40])
    np.savez(tmp / "weights.npz", w=np.zeros(3))
    np.savez(tmp / "inception_stats.npz", mu=np.zeros(2), sigma=np.eye(2))  # no extractor key: inception's
    (tmp / "garbage.npz").write_text("garbage")
    broken = tmp / "diffusers_broken"
    broken.mkdir()
    (broken / "config.json").write_text("{ not json")
    empty = tmp / "diffusers_empty"
    empty.mkdir()
    dims = dict(input_size=8, in_channels=1, num_classes=10, patch_size=2, hidden_size=32, depth=1, num_heads=2)
    (empty / "config.json").write_text(json.dumps(diffusers_config({**dims, "mlp_ratio": 4.0, "learn_sigma": True})))
    (tmp / "folder").mkdir()
    ev = ["logging.eval_every=5"]
    return {
        "init_from a plain folder": ([f"model.init_from={tmp / 'folder'}"], "is a folder but not a diffusers DiT"),
        "reference missing": (
            [*ev, "eval.reference=nonexistent.npz"],
            "eval.reference 'nonexistent.npz' does not exist",
        ),
        "reference garbage": (
            [*ev, f"eval.reference={tmp / 'garbage.npz'}"],
            "eval.reference .* is not a readable .npz",
        ),
        "reference of another extractor": (
            [*ev, f"eval.reference={tmp / 'inception_stats.npz'}"],
            "holds 'inception' statistics but eval.features is 'digits'; set eval.features=inception",
        ),
        "reference of other images": ([*ev, "eval.reference=mnist5k"], "eval.reference 'mnist5k' holds 1x28x28 images"),
        "init_from junk": ([f"model.init_from={tmp / 'junk.pt'}"], "model.init_from .*junk.pt' is corrupt"),
        "init_from truncated": ([f"model.init_from={tmp / 'short.pt'}"], "model.init_from .*short.pt' is corrupt"),
        "init_from npz": ([f"model.init_from={tmp / 'weights.npz'}"], "model.init_from .*weights.npz' is corrupt"),
        "init_from foreign": (
            [f"model.init_from={good}"],
            "model.init_from .*good.pt' does not fit the model: .* missing",
        ),
        "init_from broken diffusers": (
            [f"model.init_from={broken}"],
            "diffusers_broken/config.json' is not valid JSON",
        ),
        "init_from diffusers without weights": ([f"model.init_from={empty}"], "diffusers_empty' holds no weights"),
        "data smaller than a batch": (["data.batch_size=2048"], "'digits' has 1797 samples, fewer than one batch"),
        "ddp outside torchrun": (["engine.kind=ddp"], r"engine.kind 'ddp' needs the torchrun environment \(missing"),
        "apex missing": (["optim.impl=apex"], "optim.impl=apex needs NVIDIA apex"),
    }


LATE_CASES = [
    "init_from a plain folder",
    "reference missing",
    "reference garbage",
    "reference of another extractor",
    "reference of other images",
    "init_from junk",
    "init_from truncated",
    "init_from npz",
    "init_from foreign",
    "init_from broken diffusers",
    "init_from diffusers without weights",
    "data smaller than a batch",
    "ddp outside torchrun",
    "apex missing",
]


@pytest.mark.parametrize("case", LATE_CASES)
def test_dry_run_refuses_what_the_start_refuses(tmp_path, capsys, monkeypatch, case):
    """--dry-run runs every check of a real start: the evaluation's reference before the first evaluation, the
    initial weights, the data against one batch, the launcher and the optimizer, each one line, nothing written."""
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.chdir(tmp_path)
    sets, line = _late_inputs(tmp_path)[case]
    run = tmp_path / "run"
    argv = set_args(*TINY_SETS, *sets)
    for extra in (["--dry-run"], []):
        rc, err = _main(capsys, "train", "--run-dir", str(run), *extra, *argv)
        assert rc == 2 and err.count("\n") == 1, err
        assert re.search(line, err), err
        assert not run.exists()


@pytest.mark.parametrize(
    "sets, match",
    [
        (
            ["optim.name=schedule_free", "optim.schedule=cosine"],
            r"^optim.name=schedule_free replaces the learning-rate decay by its average of the iterates; "
            r"optim.schedule=cosine would decay it too: set optim.schedule=constant",
        ),
        (["optim.name=muon", "optim.impl=apex"], r"^optim.impl=apex picks AdamW's kernel .*optim.name=muon steps with"),
        (["optim.name=schedule_free", "optim.schedule=constant", "optim.impl=apex"], r"^optim.impl=apex picks"),
        (
            ["optim.name=muon", "engine.kind=deepspeed", "engine.deepspeed_config=ds.json"],
            r"^optim.name=muon does not run under engine.kind=deepspeed: DeepSpeed hands the optimizer flat partitions",
        ),
        (
            [
                "optim.name=schedule_free",
                "optim.schedule=constant",
                "engine.kind=deepspeed",
                "engine.deepspeed_config=x",
            ],
            r"^optim.name=schedule_free does not run under engine.kind=deepspeed",
        ),
        (
            ["optim.name=muon", "engine.cuda_graphs=true"],
            r"^engine.cuda_graphs skips a non-finite step on the device through torch's fused AdamW, which "
            r"optim.name=muon does not step with",
        ),
    ],
    ids=["schedule_free-cosine", "muon-apex", "schedule_free-apex", "muon-zero", "schedule_free-zero", "muon-graphs"],
)
def test_optimizer_combinations_that_cannot_run_are_refused_before_the_run(tmp_path, capsys, sets, match):
    """The start's checks refuse them (the optimizers' rules, ``optim/``): one line, nothing written; the DeepSpeed
    cases were tried on 2 gloo ranks (ZeRO-1/2: Muon raises on the flat partitions, schedule-free's switch to x leaves
    the model's weights as they were)."""
    with pytest.raises(ValueError, match=match):
        check_run(tiny(tmp_path / "run", *sets))
    argv = set_args(*TINY_SETS, *sets)
    rc, err = _main(capsys, "train", "--run-dir", str(tmp_path / "run"), *argv)
    assert rc == 2 and err.count("\n") == 1 and re.search(match[1:], err), err
    if "engine.kind=deepspeed" not in sets:  # a DeepSpeed engine needs its launcher before the trainer checks
        with pytest.raises(ValueError, match=match):
            Trainer(tiny(tmp_path / "run", *sets))
    assert not (tmp_path / "run").exists()


def test_schedule_free_without_its_package_names_the_extra(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "schedulefree", None)  # not importable
    sets = ["optim.name=schedule_free", "optim.schedule=constant"]
    with pytest.raises(ImportError, match=r"^optim.name=schedule_free needs the schedulefree package: pip install"):
        check_run(tiny(tmp_path / "run", *sets))
    argv = set_args(*TINY_SETS, *sets)
    rc, err = _main(capsys, "train", "--run-dir", str(tmp_path / "run"), "--dry-run", *argv)
    assert rc == 2 and err.count("\n") == 1 and "'diffcurr-fast[schedulefree]'" in err, err
    assert not (tmp_path / "run").exists()


def test_muon_needs_the_blocks_of_a_dit():
    from diffcurr_fast.optim.registry import build_optimizer

    with pytest.raises(ValueError, match=r"^optim.name=muon found no block matrices in the Linear \(model.blocks\)"):
        build_optimizer(torch.nn.Linear(3, 2), tiny("unused", "optim.name=muon"), torch.device("cpu"))


def test_train_refuses_a_tdc_folder(tmp_path, capsys):
    """`train` (also with --overwrite) on a TDC run's folder is refused: it would write a training run beside
    tdc.json, which `sample --ckpt` would then take for the TDC run's. Nothing is written or removed."""
    import json

    tdc = tmp_path / "tdc"
    (tdc / "stage1").mkdir(parents=True)
    (tdc / "tdc.json").write_text(json.dumps({"config": {"model": {}}}))  # as a TDC run writes it; no samples.png
    before = sorted(str(p.relative_to(tdc)) for p in tdc.rglob("*"))
    for extra in (["--overwrite"], [], ["--dry-run", "--overwrite"]):
        rc, err = _main(capsys, "train", "--run-dir", str(tdc), *extra, *_sets("engine.max_steps=1"))
        assert rc == 2 and "holds a TDC run (tdc.json): a training run there would be written beside it; use " in err
        assert "`diffcurr-fast tdc --overwrite` to replace the TDC run, or choose another run directory" in err, err
        assert sorted(str(p.relative_to(tdc)) for p in tdc.rglob("*")) == before
