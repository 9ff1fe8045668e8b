"""The run directory: --overwrite removes only what a run writes (training and TDC layouts), --resume of a missing
or finished run, metrics.jsonl cut to the resumed checkpoint, nothing written by a failed start, SIGINT/SIGTERM."""

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import set_args

from diffcurr_fast import cli
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train import cli_train
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.report import read_metrics
from diffcurr_fast.train.rundir import (
    TDC_LAYOUT,
    TRAIN_LAYOUT,
    check_run_dir,
    clear_run,
    open_run_dir,
    run_artifacts,
    truncate_metrics,
)

SETS = [
    "optim.name=adamw",  # the field's default (the demo ships Muon, which DeepSpeed refuses)
    "model.hidden_size=32",
    "model.depth=1",
    "model.num_heads=2",
    "diffusion.num_timesteps=40",
    "curriculum.num_clusters=4",
    "data.batch_size=17",
    "logging.progress=false",
    "logging.num_samples=0",
    "logging.plots=false",
    "logging.log_every=1",
    "checkpoint.keep_last=5",
]


def tiny(run_dir, *extra):
    return load_config(None, [f"checkpoint.run_dir={run_dir}", *SETS, *extra])


def _cli(*argv):
    p = argparse.ArgumentParser()
    cli_train.add_arguments(p)
    return cli_train.run(p.parse_args(set_args(*SETS) + list(argv)))


def _touch(root: Path, *names: str) -> None:
    """Files named ``names`` under ``root``; a run's config.yaml and tdc.json hold what a run writes there."""
    for n in names:
        (root / n).parent.mkdir(parents=True, exist_ok=True)
        text = {"config.yaml": "model: {}\ncheckpoint: {}\n", "tdc.json": '{"config": {}}'}.get(Path(n).name, n)
        (root / n).write_text(text)


# ---- item 7: --overwrite removes only what a run writes ------------------------------------------------------
def test_overwrite_keeps_user_files(tmp_path):
    run = tmp_path / "run"
    Trainer(tiny(run, "engine.max_steps=2", "checkpoint.every=1")).fit()
    _touch(run, "checkpoints/my_best_model.pt", "notes.txt", "tb/mine.txt")
    assert (run / "checkpoints" / "ckpt_00000002.pt").is_file()
    Trainer(tiny(run, "engine.max_steps=1"), overwrite=True).fit()
    assert (run / "checkpoints" / "my_best_model.pt").read_text() == "checkpoints/my_best_model.pt"
    assert (run / "notes.txt").is_file() and (run / "tb" / "mine.txt").is_file()
    ckpts = sorted(p.name for p in (run / "checkpoints").glob("ckpt_*.pt"))
    assert ckpts == ["ckpt_00000001.pt"]  # the old run's checkpoints are gone, the new one is there
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1]


def test_clear_train_layout_only_run_files(tmp_path):
    run = tmp_path / "r"
    _touch(
        run,
        "config.yaml",
        "metrics.jsonl",
        "samples.png",
        "ema.safetensors",
        "checkpoints/ckpt_00000005.pt",
        "checkpoints/ckpt_00000005.pt.tmp",
        "checkpoints/deepspeed/step_00000005/mp_rank_00_model_states.pt",
        "tb/events.out.tfevents.1.host",
    )
    _touch(run, "checkpoints/deepspeed/my.json", "checkpoints/ckpt_best.pt", "README")
    assert len(run_artifacts(run, TRAIN_LAYOUT)) == 8
    clear_run(run, TRAIN_LAYOUT)
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert left == ["README", "checkpoints/ckpt_best.pt", "checkpoints/deepspeed/my.json"]
    assert not (run / "tb").exists()  # emptied layout directories go, directories holding user files stay


def test_clear_tdc_layout_only_run_files(tmp_path):
    run = tmp_path / "tdc"
    written = [
        "tdc.json",
        "accounting.json",
        "samples.png",
        "stage1/config.yaml",
        "stage1/metrics.jsonl",
        "stage1/ema.safetensors",
        "stage1/checkpoints/ckpt_00000010.pt",
        "group_0/search.json",
        "group_0/search.png",
        "group_0/finetune/checkpoints/ckpt_00000004.pt",
        "group_0/finetune/config.yaml",
        "group_1/search.json",
        "bundle/bundle.json",
        "bundle/weights.safetensors",
        "bundle/train_config.json",
    ]
    mine = [
        "stage1/checkpoints/my_best_model.pt",
        "group_0/notes.md",
        "bundle/my_export.onnx",
        "plots/loss.png",
        "group_1/finetune/checkpoints/keep.pt",
    ]
    _touch(run, *written, *mine)
    assert sorted(str(p.relative_to(run)) for p in run_artifacts(run, TDC_LAYOUT)) == sorted(written)
    assert check_run_dir(run, TDC_LAYOUT, overwrite=True).mode == "overwrite"
    with pytest.raises(FileExistsError, match="not empty; pass --resume to continue it or --overwrite"):
        check_run_dir(run, TDC_LAYOUT)
    with pytest.raises(ValueError, match="cannot be resumed"):
        check_run_dir(run, TDC_LAYOUT, resume=True)
    open_run_dir(check_run_dir(run, TDC_LAYOUT, overwrite=True))
    left = sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())
    assert left == sorted(mine)
    assert not (run / "group_1" / "search.json").exists() and not (run / "stage1" / "config.yaml").exists()


def test_clear_does_not_follow_symlinks(tmp_path):
    outside = tmp_path / "outside"
    _touch(outside, "checkpoints/ckpt_00000001.pt")
    run = tmp_path / "run"
    run.mkdir()
    (run / "checkpoints").symlink_to(outside / "checkpoints")
    clear_run(run, TRAIN_LAYOUT)
    assert (outside / "checkpoints" / "ckpt_00000001.pt").is_file()


# ---- item 8 / 13: nothing is written before the run is known to start; --dry-run validates everything ---------
def test_failed_start_writes_nothing_and_rerun_works(tmp_path):
    run = tmp_path / "run"
    bad = tmp_path / "w.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(ValueError, match="model.init_from"):
        Trainer(tiny(run, "engine.max_steps=1", f"model.init_from={bad}"))
    assert not run.exists()
    with pytest.raises(FileNotFoundError, match="data.path .* does not exist"):
        Trainer(tiny(run, "data.dataset=npz", f"data.path={tmp_path / 'missing.npz'}"))
    assert not run.exists()
    Trainer(tiny(run, "engine.max_steps=1")).fit()  # the corrected rerun is not refused as "not empty"
    assert (run / "checkpoints" / "ckpt_00000001.pt").is_file()


def test_start_failing_on_its_first_batch_does_not_block_the_rerun(tmp_path):
    x = np.full((20, 1, 8, 8), np.nan, np.float32)
    d = tmp_path / "d"  # memory-mapped data fails only when the batch is read, after the start wrote config.yaml
    d.mkdir()
    np.save(d / "x.npy", x)
    np.save(d / "y.npy", np.arange(20) % 10)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="NaN or inf"):
        Trainer(tiny(run, "data.dataset=npz", f"data.path={d}", "engine.max_steps=2")).fit()
    assert sorted(p.name for p in run.iterdir()) == ["config.yaml", "metrics.jsonl"]
    np.save(d / "x.npy", np.zeros_like(x))
    Trainer(tiny(run, "data.dataset=npz", f"data.path={d}", "engine.max_steps=2")).fit()  # no --overwrite needed
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2]
    _touch(run, "mine.txt")  # anything more than a failed start's two files is still protected
    with pytest.raises(FileExistsError, match="not empty"):
        check_run_dir(run)


@pytest.mark.parametrize(
    "sets, match",
    [
        (["data.dataset=npz", "data.path=/nonexistent/d.npz"], "data.path '/nonexistent/d.npz' does not exist"),
        (["engine.kind=deepspeed", "engine.deepspeed_config=/nonexistent/ds.json"], "DeepSpeed config .* does not"),
        (["model.init_from=/nonexistent/w.pt"], "model.init_from '/nonexistent/w.pt' does not exist"),
    ],
)
def test_dry_run_is_full_validation(tmp_path, sets, match, capsys):
    with pytest.raises((FileNotFoundError, ValueError, ImportError), match=match):
        _cli("--dry-run", "--run-dir", str(tmp_path / "run"), *set_args(*sets))
    assert not (tmp_path / "run").exists()


def test_dry_run_reads_the_deepspeed_json(tmp_path):
    pytest.importorskip("deepspeed")
    ds = tmp_path / "ds.json"
    ds.write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        _cli("--dry-run", "--set", "engine.kind=deepspeed", "--set", f"engine.deepspeed_config={ds}")


def test_dry_run_checks_the_run_dir(tmp_path):
    run = tmp_path / "run"
    _touch(run, "x.txt")
    with pytest.raises(FileExistsError, match="not empty"):
        _cli("--dry-run", "--run-dir", str(run))
    with pytest.raises(FileNotFoundError, match="cannot resume"):
        _cli("--dry-run", "--resume", "--run-dir", str(tmp_path / "nope"))


# ---- items 10 and 11: resume ------------------------------------------------------------------------------
def test_resume_truncates_metrics_to_the_checkpoint(tmp_path):
    run = tmp_path / "run"
    Trainer(tiny(run, "engine.max_steps=6", "checkpoint.every=3")).fit()
    (run / "checkpoints" / "ckpt_00000006.pt").unlink()  # killed after logging steps 4-6, before their checkpoint
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "lo')  # and a torn last line
    tr = Trainer(tiny(run, "engine.max_steps=6", "checkpoint.every=3"), resume=True)
    assert tr.step == 3
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    tr.fit()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]


def test_truncate_metrics_unit(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in (10, 20, 30, 40)))
    assert truncate_metrics(p, 20) == 2
    assert [r["step"] for r in read_metrics(p)] == [10, 20]
    assert truncate_metrics(p, 20) == 0 and truncate_metrics(tmp_path / "none.jsonl", 5) == 0


def test_resume_of_missing_dir_is_one_line_and_nonzero(tmp_path, capsys):
    from diffcurr_fast.cli import main

    rc = main(["train", "--resume", "--run-dir", str(tmp_path / "nope"), "--set", "engine.max_steps=1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "cannot resume: run directory" in err
    assert not (tmp_path / "nope").exists()


def test_resume_of_finished_run_changes_nothing(tmp_path, capsys):
    run = tmp_path / "run"
    assert _cli("--run-dir", str(run), "--set", "engine.max_steps=2", "--set", "checkpoint.export_ema=true") == 0
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert _cli("--run-dir", str(run), "--set", "engine.max_steps=2", "--resume") == 0
    out = capsys.readouterr().out
    assert "already finished (checkpoint at step 2, engine.max_steps 2); nothing to do" in out and "nan" not in out
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()} == before
    tr = Trainer(tiny(run, "engine.max_steps=2"), resume=True)  # the library path: fit() writes nothing either
    assert tr.fit()["finished"] is True
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in run.rglob("*") if p.is_file()} == before


def test_ema_export_mode_is_0644(tmp_path):
    run = tmp_path / "run"
    old = os.umask(0o022)
    try:
        Trainer(tiny(run, "engine.max_steps=1", "checkpoint.export_ema=true")).fit()
    finally:
        os.umask(old)
    assert (run / "ema.safetensors").stat().st_mode & 0o777 == 0o644
    assert (run / "metrics.jsonl").stat().st_mode & 0o777 == 0o644


# ---- item 9: SIGINT / SIGTERM ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sig, repeat", [(signal.SIGINT, None), (signal.SIGTERM, None), (signal.SIGINT, signal.SIGTERM)]
)
def test_signal_checkpoints_and_prints_resume_command(tmp_path, sig, repeat):
    run = tmp_path / "run"
    argv = [
        sys.executable,
        "-m",
        "diffcurr_fast.cli",
        "train",
        "--run-dir",
        str(run),
        *set_args(*SETS),
        "--set",
        "engine.max_steps=100000",
        "--set",
        "checkpoint.every=100000",
        "--set",
        "engine.cpu_threads=1",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").stat().st_size):
        time.sleep(0.2)
    proc.send_signal(sig)
    if repeat is not None:  # a launcher forwarding the signal (deepspeed: SIGTERM right after the terminal's SIGINT)
        proc.send_signal(repeat)
    out, err = proc.communicate(timeout=120)
    # a repeat that lands after the run has stopped (handlers restored) ends the process by its default action
    assert proc.returncode == 128 + int(sig) or (repeat is not None and proc.returncode == -int(repeat)), err
    assert "Traceback" not in err
    ckpts = sorted((run / "checkpoints").glob("ckpt_*.pt"))
    assert len(ckpts) == 1
    step = int(ckpts[0].stem.split("_")[1])
    assert f"{signal.Signals(sig).name} received: stopped at step {step}" in err
    assert "resume with (under the same launcher): diffcurr-fast train --set" in err and err.rstrip().endswith(
        "--resume"
    )
    tr = Trainer(tiny(run, "engine.max_steps=100000"), resume=True)
    assert tr.step == step


def test_overwrite_removes_only_a_runs_files_and_says_which(tmp_path, capsys):
    """A folder that was never a run (a user's config.yaml, metrics.jsonl, samples.png) is refused by --overwrite,
    and so is a folder of another kind of run whose files it would remove (train on a TDC folder); a run's own
    files are removed and named."""
    user = tmp_path / "myproj"
    _touch(user, "metrics.jsonl", "samples.png")
    (user / "config.yaml").write_text("learning_rate: 0.1\n")  # the user's, not a run's
    for layout, kind in ((TRAIN_LAYOUT, "training run"), (TDC_LAYOUT, "TDC run")):
        with pytest.raises(FileExistsError, match=f"holds no {kind} .* choose another run directory"):
            check_run_dir(user, layout, overwrite=True)
    assert sorted(p.name for p in user.iterdir()) == ["config.yaml", "metrics.jsonl", "samples.png"]
    tdc = tmp_path / "tdc"
    _touch(tdc, "tdc.json", "samples.png", "stage1/config.yaml")
    with pytest.raises(FileExistsError, match=r"holds a TDC run \(tdc.json\): a training run there would be"):
        check_run_dir(tdc, TRAIN_LAYOUT, overwrite=True)
    train = tmp_path / "train"
    _touch(train, "config.yaml", "metrics.jsonl", "checkpoints/ckpt_00000002.pt", "notes.md")
    assert run_artifacts(train, TDC_LAYOUT) == []  # a TDC start there would remove nothing: allowed
    open_run_dir(check_run_dir(train, TRAIN_LAYOUT, overwrite=True))
    out = capsys.readouterr().out
    assert "--overwrite: removed the previous training run's files in" in out
    assert "config.yaml, metrics.jsonl, checkpoints/ckpt_00000002.pt, checkpoints" in out
    assert sorted(p.name for p in train.iterdir()) == ["notes.md"]


def test_resume_starts_from_the_runs_own_config_and_keeps_the_one_it_changes(tmp_path, capsys):
    """`train --run-dir RUN --resume` without a recipe continues from RUN/config.yaml (the original --set values
    need not be repeated; --set changes go on top of it). A resume that changes the config keeps the previous file
    as config_until_step<N>.yaml, says what changed, and --overwrite removes that record with the run."""
    from conftest import TINY_SETS, _main

    run = tmp_path / "run"
    sets = set_args(*TINY_SETS, "engine.max_steps=2", "optim.lr=1e-3")
    assert _main(capsys, "train", "--run-dir", str(run), *sets)[0] == 0
    first = (run / "config.yaml").read_text()
    capsys.readouterr()
    rc = cli.main(["train", "--run-dir", str(run), "--resume", "--set", "engine.max_steps=3", "--set", "optim.lr=5e-4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "resume: the config changed (optim.lr: 0.001 -> 0.0005; engine.max_steps: 2 -> 3)" in out, out
    assert (run / "config_until_step00000002.yaml").read_text() == first
    now = yaml.safe_load((run / "config.yaml").read_text())
    assert now["optim"]["lr"] == 5e-4 and now["model"]["hidden_size"] == 32  # TINY_SETS kept from the run
    rc = cli.main(["train", "--run-dir", str(run), "--resume", "--set", "engine.max_steps=4"])
    assert rc == 0 and "config_until_step00000003.yaml" in capsys.readouterr().out
    assert sorted(p.name for p in run.glob("config*.yaml")) == [
        "config.yaml",
        "config_until_step00000002.yaml",
        "config_until_step00000003.yaml",
    ]
    # a second resume from the same checkpoint (step 4 was not reached: killed, say) keeps the first record of it
    kept = (run / "config_until_step00000003.yaml").read_text()
    for p in (run / "checkpoints").glob("ckpt_00000004.pt"):
        p.unlink()
    rc = cli.main(["train", "--run-dir", str(run), "--resume", "--set", "engine.max_steps=5"])
    assert rc == 0 and (run / "config_until_step00000003.yaml").read_text() == kept
    assert _main(capsys, "train", "--run-dir", str(run), "--overwrite", *sets)[0] == 0
    assert sorted(p.name for p in run.glob("config*.yaml")) == ["config.yaml"]


@pytest.mark.slow  # 40 starts: about 3 s of CPU a round, nearly all of it the winner's imports
def test_two_starts_at_once_never_both_write(tmp_path):
    """Two `train` commands started at once on the same new run directory, 20 times: one trains, the other is
    refused (by the directory's lock, before it imports torch, or as a non-empty folder when it came after), and the
    folder holds one whole run: every step once, at the winner's learning rate, its config.yaml."""
    data = tmp_path / "d.npz"  # a tiny .npz: no scikit-learn import, so a start costs little more than torch's
    rng = np.random.default_rng(0)
    np.savez(data, x=rng.uniform(-1, 1, (32, 1, 8, 8)).astype(np.float32), y=np.arange(32) % 10)
    sets = [*SETS, "engine.max_steps=2", "engine.cpu_threads=1", "checkpoint.export_ema=false"]
    sets += ["data.dataset=npz", f"data.path={data}", "data.batch_size=16"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for i in range(20):
        run = tmp_path / f"run{i}"
        lrs = ("0.001", "0.002")
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "diffcurr_fast.cli", "train", "--run-dir", str(run)]
                + set_args(*sets, f"optim.lr={lr}"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            for lr in lrs
        ]
        outs = [p.communicate(timeout=300) for p in procs]
        rcs = [p.returncode for p in procs]
        assert sorted(rcs) == [0, 2], (rcs, outs)
        won = rcs.index(0)
        refused = outs[1 - won][1]
        assert "is in use by another command" in refused or "is not empty" in refused, refused
        assert "Traceback" not in refused
        records = read_metrics(run / "metrics.jsonl")
        assert [r["step"] for r in records if "loss" in r] == [1, 2], records
        assert yaml.safe_load((run / "config.yaml").read_text())["optim"]["lr"] == float(lrs[won])
        assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["ckpt_00000002.pt"]
        assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.yaml", "metrics.jsonl"]  # no lock


def test_a_hand_edited_config_yaml_is_said_and_never_recorded_as_trained(tmp_path, capsys):
    """`--resume` compares the run's config.yaml with its checkpoint's config: a hand edit is said key by key, an
    allowed one (optim.lr) applies from the checkpoint's step on and the record keeps the value the steps before
    trained with; a locked one (model.hidden_size) is refused naming the edit; a missing config.yaml is named and the
    checkpoint's own config is used."""
    from conftest import TINY_SETS, _main

    run = tmp_path / "run"
    sets = [a for s in [*TINY_SETS, "engine.max_steps=2", "optim.lr=1e-3"] for a in ("--set", s)]
    assert _main(capsys, "train", "--run-dir", str(run), *sets)[0] == 0
    path = run / "config.yaml"
    path.write_text(path.read_text().replace("lr: 0.001", "lr: 5e-4"))  # by hand, as YAML lets one write it
    capsys.readouterr()
    assert cli.main(["train", "--run-dir", str(run), "--resume", "--set", "engine.max_steps=3"]) == 0
    out = capsys.readouterr().out
    assert "resume: config.yaml differs from the config of the checkpoint at step 2 (edited by hand" in out, out
    assert "optim.lr: checkpoint 0.001, config.yaml 0.0005; steps up to 2 trained with the checkpoint's values" in out
    assert "resume: the config changed (optim.lr: 0.001 -> 0.0005; engine.max_steps: 2 -> 3)" in out, out
    record = yaml.safe_load((run / "config_until_step00000002.yaml").read_text())
    assert record["optim"]["lr"] == 1e-3 and record["engine"]["max_steps"] == 2  # what steps 1-2 trained with
    assert yaml.safe_load(path.read_text())["optim"]["lr"] == 5e-4
    path.write_text(path.read_text().replace("hidden_size: 32", "hidden_size: 48"))
    rc, err = _main(capsys, "train", "--run-dir", str(run), "--resume", "--set", "engine.max_steps=4")
    assert rc == 2 and "model.hidden_size: checkpoint 32 vs now 48; config.yaml was changed after the " in err
    assert "(model.hidden_size: checkpoint 32, config.yaml 48): a resume cannot change these" in err, err
    path.unlink()
    rc, err = _main(capsys, "train", "--run-dir", str(run), "--resume", "--set", "engine.max_steps=4")
    assert rc == 0 and f"'{path}' is missing; resuming with the config stored in '" in err, err
    assert "ckpt_00000003.pt'" in err
    now = yaml.safe_load(path.read_text())
    assert now["model"]["hidden_size"] == 32 and now["optim"]["lr"] == 5e-4 and now["engine"]["max_steps"] == 4


def test_another_ranks_write_probe_is_not_a_run_file(tmp_path):
    """Under DDP every rank checks the run directory; rank 0 has created it (its lock) while another rank's writability
    probe, a folder it removes at once, may be in it: that is not a file of a run."""
    from diffcurr_fast._files import WRITE_PROBE
    from diffcurr_fast.train.rundir import TRAIN_LAYOUT, check_run_dir

    run = tmp_path / "run"
    (run / f"{WRITE_PROBE}abc").mkdir(parents=True)
    assert check_run_dir(run, TRAIN_LAYOUT).mode == "fresh"
    (run / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="is not empty"):
        check_run_dir(run, TRAIN_LAYOUT)
