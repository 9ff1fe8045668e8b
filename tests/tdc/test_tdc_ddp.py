"""TDC under torchrun: 2 CPU ranks over gloo run the whole pipeline; the spread search and the all-reduced importance
equal the single-process ones for the same base, and every rank ends with the same experts."""

import json
import textwrap

import pytest
import torch
from conftest import run_torchrun2

from diffcurr_fast.tdc.pipeline import load_bundle_with_config

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from diffcurr_fast.tdc import pipeline
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.engine import create_engine

    run_dir, out = sys.argv[1], sys.argv[2]
    cfg = load_config(None, [
        "model.hidden_size=32", "model.depth=2", "model.num_heads=2", "diffusion.num_timesteps=40",
        "data.batch_size=18", "engine.max_steps=4", "engine.cpu_threads=1", "engine.kind=ddp", "engine.device=cpu",
        "logging.progress=false", "logging.num_samples=2", "logging.sample_steps=3", "logging.log_every=2",
        f"checkpoint.run_dir={run_dir}"])
    tdc = {"num_groups": 2, "budget_floor": 0.5, "rounds": 2, "candidates": 3, "recover_steps": 2, "search_batches": 1,
           "heldout_batches": 1, "importance_batches": 2, "finetune_steps": 2, "search_batch_size": 9}
    engine = create_engine("ddp", "cpu")
    res = {"rank": engine.rank, "imp_equal": [], "banks": [], "ref_banks": [], "best_equal": []}
    real_imp, real_search, real_bundle = pipeline.importance_scores, pipeline.proxy_search, pipeline.bundle

    def imp(*a, **kw):  # the all-reduced scores vs one process scoring every batch
        got, ref = real_imp(*a, **kw), real_imp(*a, **{**kw, "engine": None})
        res["imp_equal"].append(all(torch.equal(u, v) for u, v in zip(got.heads + got.mlp, ref.heads + ref.mlp)))
        return got

    def search(*a, **kw):  # the spread search vs the single-process search of the same base and seed
        got = real_search(*a, **kw)
        ref = real_search(*a, **{**kw, "engine": None, "state_path": None, "log_path": None})
        res["banks"].append([[c.heads, c.mlp, c.score] for c in got.bank.entries])
        res["ref_banks"].append([[c.heads, c.mlp, c.score] for c in ref.bank.entries])
        sd, rd = got.model.state_dict(), ref.model.state_dict()
        res["best_equal"].append(sd.keys() == rd.keys() and all(torch.equal(sd[k], rd[k]) for k in sd))
        return got

    def bundle(*a, **kw):
        multi, o = real_bundle(*a, **kw)
        res["experts"] = torch.cat([p.detach().flatten() for p in multi.parameters()]).tolist()
        return multi, o

    pipeline.importance_scores, pipeline.proxy_search, pipeline.bundle = imp, search, bundle
    summary = pipeline.run_tdc(cfg, tdc, run_dir, engine=engine, verbose=False)
    res["search_s"] = [g["search_s"] for g in summary["groups"]]
    # expert parallel: the same stage 1, then group i searched and fine-tuned by rank i alone
    pipeline.importance_scores, pipeline.proxy_search = real_imp, real_search
    first = res["experts"]
    pipeline.run_tdc(cfg, {**tdc, "expert_parallel": True}, run_dir + "_ep", engine=engine, verbose=False)
    res["ep_experts"], res["experts"] = res["experts"], first
    with open(f"{out}.{engine.rank}.json", "w") as fh:
        json.dump(res, fh)
    engine.close()
    """
)


@pytest.fixture(scope="module")
def tdc_ddp_runs(tmp_path_factory):
    """One 2-rank launch: the data-parallel run into run/, then the expert-parallel one into run_ep/."""
    tmp = tmp_path_factory.mktemp("tdc_ddp")
    return run_torchrun2(tmp, SCRIPT, tmp / "run"), tmp / "run"


def test_tdc_two_ranks_gloo(tdc_ddp_runs):
    (r0, r1), run = tdc_ddp_runs
    assert r0["imp_equal"] == r1["imp_equal"] == [True, True]  # all-reduced importance == one process's
    assert r0["banks"] == r1["banks"] == r0["ref_banks"]  # same bank on every rank, == the 1-process search
    assert len(r0["banks"][1]) >= 4  # 2 rounds of up to 3 candidates spread 2 + 1 over the ranks (group 0: full F)
    assert r0["best_equal"] == r1["best_equal"] == [True, True]  # the best recovered weights too
    assert r0["experts"] == r1["experts"]  # data-parallel fine-tuning: identical experts on both ranks
    for name in (
        "tdc.json",
        "accounting.json",
        "samples.png",
        "bundle/bundle.json",
        "group_1/search.json",
        "group_1/expert.safetensors",
        "stage1/tdc_stage1.json",
    ):
        assert (run / name).is_file(), name
    bank = json.loads((run / "group_0" / "search.json").read_text())["bank"]
    assert [[e["heads"], e["mlp"], e["score"]] for e in bank] == r0["banks"][0]
    multi, _ = load_bundle_with_config(run / "bundle")
    flat = torch.cat([p.detach().flatten() for p in multi.parameters()])
    assert flat.tolist() == r0["experts"]  # the bundle rank 0 wrote holds those experts
    ckpt = torch.load(run / "group_0" / "finetune" / "checkpoints" / "ckpt_00000002.pt", weights_only=True)
    assert ckpt["world_size"] == 2  # each expert fine-tuned over both ranks


def test_tdc_expert_parallel_two_ranks(tdc_ddp_runs):
    """``tdc.expert_parallel``: rank i searches and fine-tunes group i alone; both ranks end with the same experts
    (the bundle's), and the searches equal the data-parallel run's (the search does not depend on the ranks)."""
    (r0, r1), run = tdc_ddp_runs
    ep = run.parent / "run_ep"
    assert r0["ep_experts"] == r1["ep_experts"] != r0["experts"]
    multi, _ = load_bundle_with_config(ep / "bundle")
    assert torch.cat([p.detach().flatten() for p in multi.parameters()]).tolist() == r0["ep_experts"]
    for g in range(2):
        ckpt = torch.load(ep / f"group_{g}" / "finetune" / "checkpoints" / "ckpt_00000002.pt", weights_only=True)
        assert ckpt["world_size"] == 1  # one rank per expert
        banks = [json.loads((d / f"group_{g}" / "search.json").read_text())["bank"] for d in (run, ep)]
        assert banks[0] == banks[1]


def test_single_engine_split_is_itself_and_checks_parts():
    from diffcurr_fast.train.engine import Engine

    e = Engine("cpu")
    assert e.split(1) is e and e.part == 0 and e.part_leaders(1) == [0]
    with pytest.raises(ValueError, match=r"parts must be an int in \[1, 1\]"):
        e.split(2)
