"""The checkpoint of a run as ``Checkpointer`` builds and restores it (train/state.py), part by part on hand-made
parts: every field of ``state_dict`` holds the value of its part (the model copied out, every rank's RNG streams and
data positions gathered, the log window's state, the training clock), ``load_state_dict`` gives each part back its
own field (this rank's entry of the gathered ones) and refuses an incompatible config, world size, post-hoc EMA or
data position with a message that names it, and ``save`` writes the state on rank 0 only."""

import random
from pathlib import Path

import pytest
import torch
from conftest import assert_same_state, tiny

from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.recipes import config_to_yaml
from diffcurr_fast.train import state as state_module
from diffcurr_fast.train.data import TrainBatches
from diffcurr_fast.train.engine import Engine
from diffcurr_fast.train.skips import NonFiniteLossError, Skips
from diffcurr_fast.train.state import Checkpointer, model_config_entry

pytestmark = pytest.mark.usefixtures("one_thread")


class Part:
    """A resumable part (EMA, curriculum, sampler, loader, log window): ``state_dict`` is ``value``, every
    ``load_state_dict`` is recorded."""

    def __init__(self, value):
        self.value, self.loaded = value, []

    def state_dict(self):
        return self.value

    def load_state_dict(self, state):
        self.loaded.append(state)


class Sharded(TrainBatches):
    """The sharded loader's batches, with a hand-set position."""

    def __init__(self, value):
        self.value, self.loaded = value, []

    def state_dict(self):
        return self.value

    def load_state_dict(self, state):
        self.loaded.append(state)


class Net(torch.nn.Linear):
    """A model that describes itself (``config()``), as a heterogeneous DiT does."""

    def __init__(self, seed: int):
        torch.manual_seed(seed)
        super().__init__(3, 2)

    def config(self):
        return {"widths": [3, 2]}


class Rank(Engine):
    """The single-process engine as rank ``rank`` of ``world``; records what the checkpointer asks of it. A gather
    returns this rank's object at its index and a stand-in at the others."""

    def __init__(self, rank: int = 0, world: int = 1):
        super().__init__("cpu")
        self.rank, self.world_size = rank, world
        self.calls = []

    def full_params(self, model, modify=False):
        self.calls.append(("full_params", model, modify))
        return super().full_params(model, modify)

    def optimizer_state(self, optimizer, run_dir, step):
        self.calls.append(("optimizer_state", run_dir, step))
        return super().optimizer_state(optimizer, run_dir, step)

    def load_optimizer_state(self, optimizer, state, run_dir):
        self.calls.append(("load_optimizer_state", run_dir))
        super().load_optimizer_state(optimizer, state, run_dir)

    def gather_objects(self, obj):
        return [obj if r == self.rank else f"rank {r}" for r in range(self.world_size)]

    def barrier(self):
        self.calls.append(("barrier",))


def _parts(run_dir, seed=0, rank=0, world=1, *sets, phema=True, loader=None):
    """The Checkpointer of a tiny run in ``run_dir`` on hand-made parts whose states carry ``seed``."""
    cfg = tiny(run_dir, "checkpoint.keep_last=2", *sets)
    model = Net(seed)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if seed:  # a momentum buffer to carry
        model(torch.ones(1, 3)).sum().backward()
        opt.step()
    skips = Skips(cfg, torch.device("cpu"), on_device=False)
    skips.total, skips.in_a_row, skips.first = seed, seed + 1, seed + 2
    return Checkpointer(
        cfg,
        Rank(rank, world),
        model=model,
        ema=Part({"ema": seed}),
        opt=opt,
        curriculum=Part({"curriculum": seed}),
        timesteps=Part({"timesteps": seed}),
        loader=Part({"position": seed}) if loader is None else loader,
        gen=torch.Generator().manual_seed(100 + seed),
        skips=skips,
        phema=Part({"phema": seed}) if phema else None,
    )


def test_the_state_of_a_step_holds_every_part_by_value(tmp_path):
    cp = _parts(tmp_path, seed=3)
    weights = {k: v.clone() for k, v in cp.model.state_dict().items()}
    rng = {"torch": torch.get_rng_state(), "gen": cp.gen.get_state(), "python": random.getstate()}
    s = cp.state_dict(7, 12.5)
    assert s.keys() == {
        "step",
        "config",
        "model_config",
        "model",
        "ema",
        "phema",
        "optimizer",
        "curriculum",
        "timesteps",
        "data",
        "rng",
        "nan_skips",
        "nan_skip_run",
        "log_window",
        "train_s",
        "world_size",
    }
    assert s["step"] == 7 and s["train_s"] == 12.5 and s["world_size"] == 1
    assert s["config"] == cp.cfg.to_dict() and s["model_config"] == {"widths": [3, 2]}
    assert_same_state(s["model"], weights)
    with torch.no_grad():  # a copy: training on after the checkpoint does not change it
        cp.model.weight.add_(1.0)
    assert_same_state(s["model"], weights)
    assert s["ema"] == {"ema": 3} and s["phema"] == {"phema": 3}
    assert s["curriculum"] == {"curriculum": 3} and s["timesteps"] == {"timesteps": 3}
    assert s["data"] == {"position": 3}
    assert_same_state(s["optimizer"], cp.opt.state_dict())
    assert len(s["optimizer"]["state"]) == 2  # the momentum buffers
    assert_same_state(s["rng"], [rng])
    assert s["nan_skips"] == 3 and s["nan_skip_run"] == [4, 5]
    assert s["log_window"] == {}  # no window open
    engine = cp.engine
    assert ("full_params", cp.model, False) in engine.calls
    assert ("optimizer_state", Path(tmp_path), 7) in engine.calls


def test_the_state_holds_the_open_log_windows_and_no_averages_for_a_run_that_keeps_none(tmp_path):
    cp = _parts(tmp_path, phema=False)
    cp.window = Part({"loss": 0.25, "applied": 2})
    s = cp.state_dict(1, 0.0)
    assert "phema" not in s and s["log_window"] == {"loss": 0.25, "applied": 2}


def test_every_ranks_rng_streams_and_sharded_data_position_are_gathered(tmp_path):
    cp = _parts(tmp_path, 0, 1, 2, loader=Sharded({"epoch": 4}))
    s = cp.state_dict(2, 1.0)
    assert s["world_size"] == 2
    assert s["data"] == {"kind": "sharded", "ranks": ["rank 0", {"epoch": 4}]}
    assert s["rng"][0] == "rank 0" and set(s["rng"][1]) == {"torch", "gen", "python"}
    assert torch.equal(s["rng"][1]["gen"], cp.gen.get_state())


def test_the_model_config_entry_is_there_only_for_a_model_that_describes_itself():
    assert model_config_entry(Net(0)) == {"model_config": {"widths": [3, 2]}}
    assert model_config_entry(torch.nn.Linear(1, 1)) == {}
    plain = torch.nn.Linear(1, 1)
    plain.config = {"not": "callable"}
    assert model_config_entry(plain) == {}


def test_a_resume_gives_every_part_its_own_state_back(tmp_path):
    saved = _parts(tmp_path, seed=3)
    saved.window = Part({"loss": 0.5, "applied": 1})
    s = saved.state_dict(7, 12.5)
    cp = _parts(tmp_path, seed=0)
    assert cp.window is None and cp.window_state == {}
    step, train_s = cp.load_state_dict(s)
    assert (step, train_s) == (7, 12.5)
    assert_same_state(cp.model.state_dict(), saved.model.state_dict())
    assert_same_state(cp.opt.state_dict(), saved.opt.state_dict())
    assert cp.ema.loaded == [{"ema": 3}] and cp.phema.loaded == [{"phema": 3}]
    assert cp.curriculum.loaded == [{"curriculum": 3}] and cp.timesteps.loaded == [{"timesteps": 3}]
    assert cp.loader.loaded == [{"position": 3}]
    assert (cp.skips.total, cp.skips.in_a_row, cp.skips.first) == (3, 4, 5)
    assert cp.window_state == {"loss": 0.5, "applied": 1}
    assert ("full_params", cp.model, True) in cp.engine.calls  # ZeRO-3: the written weights are kept
    assert ("load_optimizer_state", Path(tmp_path)) in cp.engine.calls


def test_a_resume_returns_the_step_as_an_int_and_the_clock_as_a_float(tmp_path):
    s = _parts(tmp_path).state_dict(5, 2.0)
    s["step"], s["train_s"] = torch.tensor(5), 3
    step, train_s = _parts(tmp_path).load_state_dict(s)
    assert type(step) is int and step == 5 and type(train_s) is float and train_s == 3.0


def test_a_checkpoint_older_than_the_sampler_window_and_clock_resumes_with_empty_ones(tmp_path):
    s = _parts(tmp_path, seed=2).state_dict(4, 9.0)
    for key in ("timesteps", "log_window", "train_s"):
        del s[key]
    cp = _parts(tmp_path)
    cp.window_state = {"stale": 1}
    step, train_s = cp.load_state_dict(s)
    assert (step, train_s) == (4, 0.0) and type(train_s) is float
    assert cp.timesteps.loaded == [{}] and cp.window_state == {}


def test_a_resume_continues_every_rng_stream_where_the_checkpoint_left_it(tmp_path):
    """torch's global RNG, the run's generator and Python's (its state as lists, as a checkpoint may hold it)."""
    cp = _parts(tmp_path)
    s = cp.state_dict(1, 0.0)
    expected = (torch.rand(4), torch.rand(4, generator=cp.gen), [random.random() for _ in range(4)])

    def as_lists(obj):
        return [as_lists(v) for v in obj] if isinstance(obj, tuple) else obj

    s["rng"][0]["python"] = as_lists(s["rng"][0]["python"])
    torch.manual_seed(999)
    random.seed(999)
    cp.gen.manual_seed(999)
    cp.load_state_dict(s)
    got = (torch.rand(4), torch.rand(4, generator=cp.gen), [random.random() for _ in range(4)])
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]) and got[2] == expected[2]


def test_each_rank_resumes_its_own_rng_streams_and_data_position(tmp_path):
    mine = _parts(tmp_path, 0, 1, 2, loader=Sharded({"epoch": 1})).state_dict(3, 1.0)
    seeded = torch.Generator().manual_seed(5).get_state()
    mine["rng"][0] = {"torch": seeded, "gen": seeded, "python": random.Random(5).getstate()}
    mine["data"]["ranks"][0] = {"epoch": 0}
    expected = torch.rand(3, generator=torch.Generator().set_state(mine["rng"][1]["torch"]))
    torch.manual_seed(1)
    cp = _parts(tmp_path, 0, 1, 2, loader=Sharded({"epoch": 9}))
    cp.load_state_dict(mine)
    assert cp.loader.loaded == [{"epoch": 1}]
    assert torch.equal(torch.rand(3), expected)


def test_a_sharded_loader_takes_a_position_kept_without_ranks_as_it_is(tmp_path):
    s = _parts(tmp_path).state_dict(3, 1.0)
    s["data"] = {"epoch": 2, "batch": 5}
    cp = _parts(tmp_path, loader=Sharded({"epoch": 0}))
    cp.load_state_dict(s)
    assert cp.loader.loaded == [{"epoch": 2, "batch": 5}]


def test_a_run_of_another_dataset_refuses_a_sharded_data_position(tmp_path):
    s = _parts(tmp_path, loader=Sharded({"epoch": 1})).state_dict(3, 1.0)
    cp = _parts(tmp_path)
    with pytest.raises(ValueError) as err:
        cp.load_state_dict(s)
    assert str(err.value) == (
        "cannot resume: the checkpoint's data position is of data.dataset latents/images, this run reads 'digits'"
    )
    assert cp.loader.loaded == []


def test_a_resume_that_changes_a_locked_key_is_refused_naming_it(tmp_path):
    s = _parts(tmp_path, 0, 0, 1, "model.depth=2").state_dict(3, 1.0)
    cp = _parts(tmp_path, 0, 0, 1, "model.depth=3")
    with pytest.raises(ValueError) as err:
        cp.load_state_dict(s)
    assert str(err.value) == (
        "cannot resume: the checkpoint was trained with a different config: model.depth: checkpoint 2 vs now 3"
    )
    assert cp.ema.loaded == []


def test_a_refused_resume_names_the_locked_keys_edited_in_config_yaml(tmp_path):
    """Every difference is named, then the edits of config.yaml among them (an edited learning rate may change)."""
    s = _parts(tmp_path, 0, 0, 1, "model.depth=2", "model.num_heads=2", "optim.lr=0.001").state_dict(3, 1.0)
    now = _parts(tmp_path, 0, 0, 1, "model.depth=3", "model.num_heads=4", "optim.lr=0.002")
    (tmp_path / "config.yaml").write_text(config_to_yaml(now.cfg))
    with pytest.raises(ValueError) as err:
        now.load_state_dict(s)
    assert str(err.value) == (
        "cannot resume: the checkpoint was trained with a different config: model.depth: checkpoint 2 vs now 3; "
        "model.num_heads: checkpoint 2 vs now 4; config.yaml was changed after the checkpoint (model.depth: "
        "checkpoint 2, config.yaml 3; model.num_heads: checkpoint 2, config.yaml 4): a resume cannot change these, "
        "restore the checkpoint's values there or start a new run"
    )


def test_a_resume_on_another_number_of_ranks_is_refused(tmp_path):
    s = _parts(tmp_path, 0, 0, 2).state_dict(3, 1.0)
    cp = _parts(tmp_path, 0, 0, 1)
    with pytest.raises(ValueError) as err:
        cp.load_state_dict(s)
    assert str(err.value) == "cannot resume: the checkpoint was written by 2 ranks, this run has 1"
    assert cp.ema.loaded == []


def test_a_run_without_posthoc_ema_ignores_the_checkpoints_averages(tmp_path):
    s = _parts(tmp_path, seed=1).state_dict(3, 1.0)
    cp = _parts(tmp_path, phema=False)
    assert cp.load_state_dict(s) == (3, 1.0) and cp.ema.loaded == [{"ema": 1}]


def test_a_run_with_posthoc_ema_refuses_a_checkpoint_that_kept_none(tmp_path):
    s = _parts(tmp_path, phema=False).state_dict(3, 1.0)
    with pytest.raises(ValueError) as err:
        _parts(tmp_path).load_state_dict(s)
    assert str(err.value) == (
        "cannot resume: optim.phema_every is set but the checkpoint kept no post-hoc EMA averages (its run had "
        "optim.phema_every=0; they average the run from its first step); resume with optim.phema_every=0"
    )


def test_averages_of_other_sigma_rels_are_refused_naming_the_setting(tmp_path):
    s = _parts(tmp_path).state_dict(3, 1.0)
    cp = _parts(tmp_path)

    def refuse(state):
        raise ValueError("the checkpoint's sigma_rels are (0.05,)")

    cp.phema.load_state_dict = refuse
    with pytest.raises(ValueError) as err:
        cp.load_state_dict(s)
    assert str(err.value) == (
        "cannot resume: the checkpoint's sigma_rels are (0.05,); set optim.phema_sigma_rels to the checkpoint's"
    )
    assert err.value.__suppress_context__ and err.value.__cause__ is None


def test_rank_0_writes_the_checkpoint_and_keeps_the_last_ones(tmp_path):
    cp = _parts(tmp_path, seed=2)
    paths = [cp.save(step, float(step)) for step in (1, 2, 3)]
    assert paths == [tmp_path / ck.CKPT_DIR / ck.ckpt_name(s) for s in (1, 2, 3)]
    assert [s for s, _ in ck.list_checkpoints(tmp_path)] == [2, 3]  # checkpoint.keep_last=2
    assert cp.engine.calls.count(("barrier",)) == 3
    back = ck.load_checkpoint(paths[-1])
    assert back["step"] == 3 and back["train_s"] == 3.0 and back["ema"] == {"ema": 2}
    assert_same_state(back["model"], cp.model.state_dict())


def test_the_other_ranks_take_part_in_a_save_but_write_nothing(tmp_path):
    cp = _parts(tmp_path, 0, 1, 2)
    assert cp.save(1, 1.0) is None and ck.list_checkpoints(tmp_path) == []
    assert ("barrier",) in cp.engine.calls and ("optimizer_state", Path(tmp_path), 1) in cp.engine.calls


def test_a_save_after_a_broken_skip_rule_raises_and_writes_nothing(tmp_path):
    """Counted on the device, the rule broken since the last read stops the run at its save."""
    cp = _parts(tmp_path)
    cp.skips.counts = torch.tensor([3, 2, 2, 2, 3, 2, 2])
    with pytest.raises(NonFiniteLossError, match="at step 3"):
        cp.save(3, 1.0)
    assert ck.list_checkpoints(tmp_path) == []


def test_nested_lists_become_tuples():
    assert state_module._to_tuple([1, [2, (3, [4])], "ab"]) == (1, (2, (3, (4,))), "ab")
    assert state_module._to_tuple(5) == 5


@pytest.fixture
def fake_cuda_rng(monkeypatch):
    """torch.cuda's RNG state calls, recorded (no GPU needed): the state of a device is ``[device index]``."""
    calls = []

    def get_rng_state(device="cuda"):
        calls.append(("get", device))
        return torch.tensor([torch.device(device).index or 0], dtype=torch.uint8)

    def set_rng_state(state, device="cuda"):
        calls.append(("set", state.tolist(), device))

    monkeypatch.setattr(torch.cuda, "get_rng_state", get_rng_state)
    monkeypatch.setattr(torch.cuda, "set_rng_state", set_rng_state)
    return calls


def test_a_gpu_rank_keeps_and_resumes_its_own_devices_cuda_stream(tmp_path, fake_cuda_rng):
    saved = _parts(tmp_path, 0, 1, 2)
    saved.engine.device = torch.device("cuda", 1)
    s = saved.state_dict(3, 1.0)
    assert torch.equal(s["rng"][1]["cuda"], torch.tensor([1], dtype=torch.uint8))
    assert fake_cuda_rng == [("get", torch.device("cuda", 1))]
    s["rng"][0] = {**s["rng"][1], "cuda": torch.tensor([0], dtype=torch.uint8)}
    cp = _parts(tmp_path, 0, 1, 2)
    cp.engine.device = torch.device("cuda", 1)
    cp.load_state_dict(s)
    assert fake_cuda_rng[1:] == [("set", [1], torch.device("cuda", 1))]


def test_a_cpu_run_keeps_no_cuda_stream_and_ignores_a_checkpoints(tmp_path, fake_cuda_rng):
    s = _parts(tmp_path).state_dict(3, 1.0)
    assert set(s["rng"][0]) == {"torch", "gen", "python"}
    s["rng"][0]["cuda"] = torch.tensor([0], dtype=torch.uint8)  # written on a GPU
    _parts(tmp_path).load_state_dict(s)
    assert fake_cuda_rng == []


def test_a_gpu_run_resumes_a_cpu_checkpoint_without_a_cuda_stream(tmp_path, fake_cuda_rng):
    s = _parts(tmp_path).state_dict(3, 1.0)
    cp = _parts(tmp_path)
    cp.engine.device = torch.device("cuda", 0)
    cp.load_state_dict(s)
    assert fake_cuda_rng == []


def test_skips_counted_on_the_device_resume_at_the_checkpoints_step(tmp_path):
    s = _parts(tmp_path, seed=3).state_dict(7, 1.0)
    cp = _parts(tmp_path)
    cp.skips = Skips(cp.cfg, torch.device("cpu"), on_device=True)
    cp.load_state_dict(s)
    assert cp.skips.counts.tolist() == [7, 3, 4, 5, 0, 0, 0]  # steps seen, skipped, in a row, the first skipped
