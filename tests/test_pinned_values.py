"""Values that only show up across ranks, at an exact bound, or in a metric's value.

Each test pins one behaviour that a realistic one-line change broke without any other test noticing: the default
stop vote, the open range bounds of the config, the partition of sample batches over ranks, the seeds of the TDC
recovery, the scale of the evaluation's reference, and the weights the logged evaluation scores.
"""

import dataclasses
import json
import signal
import time
import typing

import numpy as np
import pytest
import torch

from diffcurr_fast.options import INF, hints
from diffcurr_fast.runs import config as config_mod
from diffcurr_fast.runs.config import TrainConfig
from diffcurr_fast.runs.recipes import load_config


@pytest.fixture
def _shared_cache(one_thread, tmp_path_factory, monkeypatch):
    # the digits classifier cache is shared by the tests of this file (trained once, in a few seconds)
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


# ---- the stop vote ---------------------------------------------------------------------------------------------
def test_stop_vote_defaults_to_sigterm_and_a_sigterm_stop_exits_143():
    from diffcurr_fast.train.interrupt import StopRequest, TrainingInterrupted

    quiet = StopRequest()  # a rank stopped by another rank's vote received nothing itself
    assert quiet.signum is None and quiet.vote_signal() == signal.SIGTERM
    assert TrainingInterrupted(quiet.vote_signal(), 3, None).exit_code == 143
    with StopRequest() as got:  # a rank that received the signal reports it
        signal.raise_signal(signal.SIGINT)
        assert got.vote_signal() == signal.SIGINT
    assert TrainingInterrupted(signal.SIGINT, 3, None).exit_code == 130


def test_a_repeated_signal_stops_at_once_only_after_the_grace(monkeypatch):
    from pathlib import Path

    from diffcurr_fast.train import interrupt
    from diffcurr_fast.train.interrupt import REPEAT_GRACE_S, StopRequest, TrainingInterrupted

    with StopRequest() as req:  # the same signal twice at once (a launcher forwarding it): still a checkpointed stop
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert req.signum == signal.SIGTERM
        now = req._first + REPEAT_GRACE_S + 0.5  # asked again after the grace: stop now, without a checkpoint
        monkeypatch.setattr(interrupt.time, "monotonic", lambda: now)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGTERM)
    stopped = TrainingInterrupted(signal.SIGTERM, 5, Path("ckpt_00000005.pt"))
    assert str(stopped) == "SIGTERM received: stopped at step 5, checkpoint ckpt_00000005.pt"


# ---- config range bounds, generated from the field metadata ------------------------------------------------------
def _bounds() -> list[tuple[str, str, float, bool]]:
    """(section.field, end, bound, open) for every finite end of every field declared with a range."""
    out = []
    cfg = TrainConfig()
    for sec in dataclasses.fields(cfg):
        for f in dataclasses.fields(getattr(cfg, sec.name)):
            rng = f.metadata.get("range")
            if rng is None:
                continue
            lo, hi, lo_open, hi_open = rng
            for end, bound, is_open in (("lo", lo, lo_open), ("hi", hi, hi_open)):
                if abs(bound) != INF:
                    out.append((f"{sec.name}.{f.name}", end, bound, is_open))
    return out


BOUNDS = _bounds()


def _typed(key: str, bound: float):
    """``bound`` as a value of the field's type (an int field gets an int; a list field, a list of the one item)."""
    sec, name = key.split(".")
    tp = hints(type(getattr(TrainConfig(), sec)))[name]
    if typing.get_origin(tp) is list:
        return [_typed_as(typing.get_args(tp)[0], bound)]
    return _typed_as(tp, bound)


def _typed_as(tp, bound: float):
    return int(bound) if int in getattr(tp, "__args__", (tp,)) and float(bound).is_integer() else float(bound)


def test_the_bounds_are_found():
    keys = {(k, end) for k, end, _, is_open in BOUNDS if is_open}
    assert {("diffusion.sigma_min", "lo"), ("model.mlp_ratio", "lo"), ("optim.beta2", "hi")} <= keys
    assert len(keys) >= 15 and len(BOUNDS) > 60


@pytest.mark.parametrize("key, end, bound, is_open", BOUNDS, ids=[f"{k}-{e}" for k, e, _, _ in BOUNDS])
def test_every_range_bound_is_open_or_closed_as_declared(key, end, bound, is_open):
    value = _typed(key, bound)
    if is_open:
        with pytest.raises(ValueError, match=rf"^{key} must"):
            config_mod.set_key(TrainConfig(), key, value)
    else:
        cfg = TrainConfig()
        config_mod.set_key(cfg, key, value)  # the closed end itself is valid
        assert getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1]) == value


def test_validate_names_the_field_of_a_wrong_type_set_in_code():
    cfg = TrainConfig()
    cfg.optim.lr = "fast"  # not through load_config: validate() is the one check
    with pytest.raises(ValueError, match=r"^optim\.lr must be of type float, got 'fast' \(str\)$"):
        cfg.validate()


# ---- sample sharding ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
def test_batch_slices_of_all_ranks_partition_the_samples(world):
    from diffcurr_fast.runs.sampling import batch_slices

    for num in range(0, 30):
        for batch_size in range(1, 9):
            got = [batch_slices(num, batch_size, rank, world) for rank in range(world)]
            if world == 1:  # the defaults: one process draws every batch
                assert batch_slices(num, batch_size) == got[0]
            batches = sorted(b for part in got for b, _ in part)
            assert batches == list(range(-(-num // batch_size))), (num, batch_size, world)
            idx = sorted(i for part in got for _, sl in part for i in range(num)[sl])
            assert idx == list(range(num)), (num, batch_size, world)  # each sample exactly once
            for part in got:  # batch b holds samples b * batch_size ..., the seed of batch b depends on b only
                for b, sl in part:
                    assert sl.start == b * batch_size and sl.stop == min(num, (b + 1) * batch_size)


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "4"])
def test_batch_slices_refuses_a_batch_size_that_is_not_a_positive_int(bad):
    from diffcurr_fast.runs.sampling import batch_slices

    with pytest.raises(ValueError, match=r"^--batch-size must be a positive int, got "):
        batch_slices(10, bad)


def test_grid_sampler_is_the_logging_sampler_with_at_most_T_steps():
    from diffcurr_fast.runs.sampling import grid_sampler

    assert grid_sampler(load_config(None, ["logging.sampler=ddpm", "logging.sample_steps=25"])) == ("ddpm", 25)
    capped = load_config(None, ["logging.sampler=ddim", "logging.sample_steps=50", "diffusion.num_timesteps=40"])
    assert grid_sampler(capped) == ("ddim", 40)  # TDC's sampling accounting and the grid visit the same steps


# ---- TDC recovery seeds ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [7, 2**62 + 1])  # a large seed: the mod 2^63 of the documented function matters
def test_tdc_recovery_seeds_are_the_documented_function_of_seed_round_candidate(monkeypatch, seed):
    from diffcurr_fast.diffusion import DDPMSchedule
    from diffcurr_fast.models import DiT
    from diffcurr_fast.tdc import search as search_mod
    from diffcurr_fast.tdc.flops import dit_flops
    from diffcurr_fast.tdc.grouping import make_groups
    from diffcurr_fast.tdc.proposers import LocalProposer
    from diffcurr_fast.tdc.prune import importance_scores
    from diffcurr_fast.tdc.search import proxy_search

    model = DiT(
        input_size=4,
        patch_size=2,
        in_channels=1,
        hidden_size=12,
        depth=2,
        num_heads=3,
        mlp_ratio=2.0,
        num_classes=3,
        num_timesteps=40,
        attn_backend="math",
    ).eval()
    s = DDPMSchedule(40)
    group = make_groups(s, 2, 0.5, dit_flops(model))[1]
    g = torch.Generator().manual_seed(1)
    train = [(torch.randn(3, 1, 4, 4, generator=g), torch.randint(0, 3, (3,), generator=g))]
    imp = importance_scores(model, "taylor", objective=s, group=group, batches=train)
    seen = []
    real = search_mod.recover

    def spy(*a, **k):
        seen.append((k["seed"], torch.initial_seed()))
        return real(*a, **k)

    monkeypatch.setattr(search_mod, "recover", spy)
    proxy_search(
        model,
        group,
        group.flops,
        train,
        train,
        objective=s,
        importance=imp,
        proposer=LocalProposer(),
        rounds=2,
        candidates_per_round=2,
        recover_steps=1,
        seed=seed,
    )
    # docs/tdc.md: candidate j of round r recovers on t and noise from seed + r (every candidate of a round sees the
    # same draws) and label dropout from ((seed * 1000003 + r) * 1009 + j) mod 2^63
    want = [(seed + r, ((seed * 1_000_003 + r) * 1009 + j) % 2**63) for r in range(2) for j in range(2)]
    assert seen == want
    assert seen[0][0] != seen[2][0]  # two rounds recover on different draws


# ---- the evaluation's reference and the weights it scores ---------------------------------------------------------
def test_evaluator_reference_from_training_data_undoes_data_scale(tmp_path, _shared_cache):
    from diffcurr_fast.eval.evaluate import reference_from_images
    from diffcurr_fast.train.evaluation import REFERENCE_FILE, Evaluator

    g = torch.Generator().manual_seed(0)
    images = torch.rand(40, 1, 8, 8, generator=g) * 2 - 1  # (N, 1, 8, 8) in [-1, 1]
    dataset = [(0.5 * x, 0) for x in images]  # the model sees scale x the images
    cfg = TrainConfig()
    cfg.data.dataset, cfg.data.scale, cfg.eval.num_reference = "npz", 0.5, 32
    ev = Evaluator(cfg, tmp_path, dataset)
    want = reference_from_images(images[:32], ev.extractor, "expected")
    assert ev.reference.count == 32 and ev.reference.source == "training data (32 images)"
    np.testing.assert_array_equal(ev.reference.mu, want.mu)
    np.testing.assert_array_equal(ev.reference.sigma, want.sigma)
    assert (tmp_path / REFERENCE_FILE).is_file()


def test_evaluator_reference_of_a_builtin_dataset_needs_no_dataset(tmp_path, _shared_cache):
    from diffcurr_fast.eval.evaluate import load_reference
    from diffcurr_fast.train.evaluation import REFERENCE_FILE, Evaluator

    ev = Evaluator(TrainConfig(), tmp_path)  # digits: the built-in reference, no dataset given
    want = load_reference("digits", ev.extractor)
    assert ev.reference.source == want.source and ev.reference.count == 1797
    np.testing.assert_array_equal(ev.reference.mu, want.mu)
    assert sorted(p.name for p in tmp_path.iterdir()) == [REFERENCE_FILE]  # cached for the run, nothing else left
    cfg = TrainConfig()
    cfg.data.dataset = "npz"  # a dataset without a built-in reference, and none given
    with pytest.raises(ValueError, match=r"^eval\.reference is empty and no training dataset was given"):
        Evaluator(cfg, tmp_path / "other")


def test_eval_every_1_evaluates_after_every_step():
    from diffcurr_fast.train.evaluation import eval_due

    cfg = load_config(None, ["logging.eval_every=1", "engine.max_steps=5"])
    assert [eval_due(s, cfg) for s in range(1, 6)] == [True] * 5


def test_evaluator_builds_its_extractor_from_the_eval_section(tmp_path, monkeypatch, _shared_cache):
    from diffcurr_fast.eval.features import get_extractor
    from diffcurr_fast.train import evaluation

    asked = []

    def spy(features, **kw):  # the inception network needs real weights: build the digits one, record the call
        asked.append((features, kw))
        return get_extractor("digits", device=kw["device"])

    monkeypatch.setattr(evaluation, "get_extractor", spy)
    weights = tmp_path / "pt_inception.pth"
    cfg = load_config(None, ["eval.features=inception", f"eval.inception_weights={weights}"])
    evaluation.Evaluator(cfg, tmp_path, device="cpu")
    assert asked == [("inception", {"inception_weights": str(weights), "device": torch.device("cpu")})]


def test_logged_fd_is_the_ema_weights_fd(tmp_path, _shared_cache):
    from diffcurr_fast.runs.checkpoint import latest_checkpoint, load_checkpoint
    from diffcurr_fast.runs.sampling import build_model, build_schedule
    from diffcurr_fast.train.evaluation import Evaluator
    from diffcurr_fast.train.loop import train

    run = tmp_path / "run"
    sets = [
        "model.hidden_size=32",
        "model.depth=1",
        "model.num_heads=2",
        "diffusion.num_timesteps=60",
        "curriculum.num_clusters=4",
        "data.batch_size=16",
        "logging.progress=false",
        "logging.num_samples=0",
        "logging.plots=false",
        "checkpoint.export_ema=false",
        "eval.num_samples=16",
        "eval.steps=3",
        "eval.seed=5",
        "engine.cpu_threads=1",
        "optim.lr=3e-3",
        "engine.max_steps=3",
        "logging.eval_every=3",
        f"checkpoint.run_dir={run}",
    ]
    cfg = load_config(None, sets)
    train(cfg)
    logged = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r.get("eval")]
    assert [r["step"] for r in logged] == [3]
    state = load_checkpoint(latest_checkpoint(run))
    assert state["step"] == 3
    fds = {}
    for name, sd in (("ema", state["ema"]["module"]), ("model", state["model"])):
        model = build_model(cfg)
        model.load_state_dict(sd)
        t0 = time.perf_counter()
        rec = Evaluator(cfg, run)(3, model, build_schedule(cfg))
        wall = time.perf_counter() - t0
        assert {"step", "eval", "fd", "is", "is_std", "extractor", "eval_s"} <= set(rec) and rec["step"] == 3
        assert 0 < rec["eval_s"] <= wall  # the evaluation's own time, which the time axis leaves out
        fds[name] = rec["fd"]
    assert fds["ema"] == logged[0]["fd"]  # exactly: the same weights, seed and reference
    assert fds["model"] != fds["ema"]  # the raw weights score differently, so the check can fail


class _Batched:
    """A dataset read in whole batches (``batch``), as the built-in ones are; reading it item by item fails."""

    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        raise AssertionError("a dataset with batch() is read in one batch")

    def batch(self, idx: list[int]):
        return torch.stack([self.items[i][0] for i in idx]), torch.tensor([self.items[i][1] for i in idx])


def test_dataset_images_undo_the_scale_clamp_and_read_either_kind_of_dataset():
    from diffcurr_fast.train.evaluation import _dataset_images

    g = torch.Generator().manual_seed(3)
    seen = (torch.rand(12, 1, 4, 4, generator=g, dtype=torch.float64) - 0.5) * 1.2  # what the model sees
    seen[0, 0, 0, :2] = torch.tensor([0.75, -0.75], dtype=torch.float64)  # outside [-1, 1] once divided by 0.5
    items = [(x, i % 3) for i, x in enumerate(seen)]
    want = (seen[:10] / 0.5).clamp(-1, 1).float()
    assert float(want.abs().max()) == 1.0 and float((seen[:10] / 0.5).abs().max()) == 1.5
    for dataset in (items, _Batched(items)):
        got = _dataset_images(dataset, 10, 0.5)
        assert got.dtype == torch.float32 and got.shape == (10, 1, 4, 4)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert _dataset_images(items, 50, 0.5).shape[0] == 12  # at most the dataset
