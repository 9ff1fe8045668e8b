"""Logs stay true after a resume: TensorBoard events (read back with TensorBoard's own reader) hold each step once,
as metrics.jsonl does; wandb continues the same run (offline mode), and a missing package is a clean error."""

import importlib.machinery
import sys
import types

import pytest
import torch

from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.loop import train
from diffcurr_fast.train.report import WANDB_ID, read_metrics


def _cfg(run, *extra):
    return load_config(
        None,
        [
            f"checkpoint.run_dir={run}",
            "model.hidden_size=32",
            "model.depth=1",
            "model.num_heads=2",
            "diffusion.num_timesteps=40",
            "curriculum.num_clusters=4",
            "data.batch_size=8",
            "engine.max_steps=6",
            "logging.log_every=1",
            "checkpoint.every=4",
            "checkpoint.keep_last=5",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
            "checkpoint.export_ema=false",
            "engine.cpu_threads=1",
            *extra,
        ],
    )


def _crash_after_step_6(run):
    """The state an interrupted run leaves: steps 5 and 6 logged, its last checkpoint at step 4."""
    (run / "checkpoints" / "ckpt_00000006.pt").unlink()


def test_tensorboard_after_resume_holds_each_step_once(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard is not installed (pip install tensorboard)")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    train(_cfg(run, "logging.tensorboard=true"))
    _crash_after_step_6(run)
    train(_cfg(run, "logging.tensorboard=true"), resume=True)
    assert len(list((run / "tb").glob("events.out.tfevents.*"))) == 2  # the resumed run wrote its own file
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    events = acc.Scalars("loss")
    assert [e.step for e in events] == [1, 2, 3, 4, 5, 6]
    jsonl = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl")}
    assert sorted(jsonl) == [1, 2, 3, 4, 5, 6]
    for e in events:  # the events of steps 5 and 6 are the resumed run's, as in metrics.jsonl
        assert e.value == pytest.approx(jsonl[e.step], rel=1e-6)


def test_missing_wandb_is_a_clean_error_naming_the_extra(tmp_path, monkeypatch):
    import importlib.util

    from diffcurr_fast.train.preflight import check_run

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ImportError, match=r"logging.wandb is true but wandb is not installed"):
        check_run(_cfg(tmp_path / "run", "logging.wandb=true"))  # the start's checks: nothing is written
    assert not (tmp_path / "run").exists()
    monkeypatch.setattr(importlib.util, "find_spec", real)
    with pytest.raises(
        ImportError,
        match=r"logging.wandb is true but wandb is not installed: pip install "
        r"'diffcurr-fast\[wandb\]', or set logging.wandb=false",
    ):
        train(_cfg(tmp_path / "run", "logging.wandb=true"))


class _StandInWandb(types.ModuleType):
    """A ``wandb`` module that records what the trainer asks of it: ``init``'s arguments, ``log``'s scalars and
    steps, ``finish``."""

    def __init__(self):
        super().__init__("wandb")
        self.__spec__ = importlib.machinery.ModuleSpec("wandb", None)
        self.inits, self.logged, self.finished = [], [], 0

    def init(self, **kw):
        self.inits.append(kw)
        return self

    def log(self, scalars, step):
        self.logged.append((step, scalars))

    def finish(self):
        self.finished += 1


def test_a_resumed_run_continues_the_same_wandb_run_and_logs_each_step_once(tmp_path, monkeypatch):
    """What the trainer asks of wandb (a stand-in module): the resumed run initialises the run of the id kept in
    the run directory, with resume allowed and the config's project and mode, and logs the steps after its
    checkpoint; every record's finite scalars, nothing else."""
    wandb = _StandInWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run = tmp_path / "run"
    sets = ("logging.wandb=true", "logging.wandb_project=p")
    train(_cfg(run, *sets))
    run_id = (run / WANDB_ID).read_text().strip()
    _crash_after_step_6(run)
    train(_cfg(run, *sets), resume=True)
    assert [kw["id"] for kw in wandb.inits] == [run_id, run_id] and wandb.finished == 2
    for kw in wandb.inits:
        assert (kw["dir"], kw["resume"], kw["name"], kw["project"], kw["mode"]) == (
            str(run),
            "allow",
            "run",
            "p",
            "offline",
        )
        assert kw["config"]["logging"]["wandb"] is True
    assert [step for step, _ in wandb.logged] == [1, 2, 3, 4, 5, 6, 5, 6]
    jsonl = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
    for step, scalars in wandb.logged[-2:]:  # the resumed run's records
        want = {k: v for k, v in jsonl[step].items() if k != "step" and type(v) in (int, float)}
        assert scalars == want and "loss" in scalars and "cluster_loss" not in scalars


def test_wandb_offline_resume_continues_the_same_run(tmp_path, monkeypatch):
    """The same with wandb itself: each attempt's offline files, for ``wandb sync``, under the run's id."""
    pytest.importorskip("wandb", reason="wandb is not installed (pip install 'diffcurr-fast[wandb]')")
    for k in ("WANDB_API_KEY", "WANDB_BASE_URL", "WANDB_MODE", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb-cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))
    run = tmp_path / "run"
    n = torch.get_num_threads()
    train(_cfg(run, "logging.wandb=true"))
    run_id = (run / WANDB_ID).read_text().strip()
    first = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    _crash_after_step_6(run)
    train(_cfg(run, "logging.wandb=true"), resume=True)
    torch.set_num_threads(n)
    assert (run / WANDB_ID).read_text().strip() == run_id
    runs = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(first) == 1 and len(runs) == 2 and all(r.endswith(f"-{run_id}") for r in runs)
    for r in runs:  # each holds its run's log for `wandb sync`
        assert list((run / "wandb" / r).glob("run-*.wandb"))
