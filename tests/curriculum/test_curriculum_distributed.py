import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from diffcurr_fast.curriculum.pacing import Curriculum

T = 29
CLUSTERS = [(0, 4), (4, 9), (9, 20), (20, 29)]
STEPS = 120
KW = dict(patience=3, ema=0.5, eval_every=4)


def rank_losses(rank: int) -> list[float]:
    if rank == 0:
        return [1.0] * STEPS  # a plateau: alone, rank 0 would unlock early
    # Rank 1 keeps improving for 40 steps, then plateaus.
    return [2.0 - 0.02 * min(s, 40) for s in range(STEPS)]


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        cur = Curriculum(CLUSTERS, T, **KW)
        for s, loss in enumerate(rank_losses(rank)):
            cur.observe(s, torch.tensor(loss))
        result = {"history": cur.history, "weights": cur.timestep_weights().tolist()}
        # A non-finite loss on one rank stops every rank at the same evaluation, naming the step.
        cur = Curriculum(CLUSTERS, T, **KW)
        try:
            for s in range(12):
                bad = rank == 1 and s == 5
                cur.observe(s, torch.tensor(float("nan") if bad else 1.0))
            result["error"] = None
        except ValueError as exc:
            result["error"] = str(exc)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
    finally:
        dist.destroy_process_group()


def test_two_rank_decisions_agree(tmp_path):
    mp.spawn(_worker, args=(2, str(tmp_path / "init"), str(tmp_path)), nprocs=2, join=True)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert results[0]["history"] == results[1]["history"]
    assert results[0]["weights"] == results[1]["weights"]

    # The shared decisions are those of the mean loss, not of either rank alone.
    mean = Curriculum(CLUSTERS, T, **KW)
    alone = Curriculum(CLUSTERS, T, **KW)
    for s, (a, b) in enumerate(zip(rank_losses(0), rank_losses(1))):
        mean.observe(s, (a + b) / 2)
        alone.observe(s, a)
    assert results[0]["history"] == mean.history
    assert alone.history != mean.history and len(mean.history) >= 1

    for r in results:
        assert r["error"] is not None and "step 5" in r["error"]
