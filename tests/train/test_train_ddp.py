"""DDP with 2 CPU ranks over gloo, launched by torchrun: ranks stay in sync, checkpoint and resume work."""

import json
import os
import subprocess
import textwrap

import pytest
import torch
from conftest import TORCHRUN2

SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    torch.set_num_threads(1)
    from diffcurr_fast.runs.recipes import load_config
    from diffcurr_fast.train.engine import create_engine
    from diffcurr_fast.train.loop import Trainer

    run_dir, out, extra = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    base = extra + [f"checkpoint.run_dir={run_dir}", "model.hidden_size=32", "model.depth=1", "model.num_heads=2",
            "diffusion.num_timesteps=60", "curriculum.num_clusters=4", "curriculum.patience=1",
            "curriculum.eval_every=2", "data.batch_size=18", "logging.progress=false", "logging.num_samples=0",
            "logging.plots=false", "checkpoint.export_ema=false", "checkpoint.every=4", "engine.kind=ddp",
            "engine.device=cpu"]
    engine = create_engine("ddp", "cpu")
    tr = Trainer(load_config(None, base + ["engine.max_steps=4"]), engine)
    first = tr.fit()
    tr2 = Trainer(load_config(None, base + ["engine.max_steps=6"]), engine, resume=True)
    resumed_at = tr2.step
    tr2.fit()
    flat = torch.cat([p.detach().flatten() for p in tr2.model.parameters()])
    res = {"rank": engine.rank, "world": engine.world_size, "resumed_at": resumed_at, "first_step": first["step"],
           "local_batch": tr2.loader.local_batch, "params": flat.tolist(), "stage": tr2.curriculum.stage,
           "ema0": float(next(tr2.ema.module.parameters()).sum())}
    with open(f"{out}.{engine.rank}.json", "w") as fh:
        json.dump(res, fh)
    del tr, tr2  # their DDP reducers die before the process group is destroyed, not at interpreter exit
    engine.close()
    """
)


ROUTED = ["model.routing=tread", "model.routing_keep=0.5", "model.routing_start=0", "model.routing_end=1"]


@pytest.mark.slow
@pytest.mark.parametrize(
    "extra",
    [[], ROUTED, ["terms.use=[sra]"], ["terms.use=[contrastive, dispersive]", "terms.immiscible=true"]],
    ids=["plain", "routed", "sra", "batch-terms"],
)
def test_ddp_two_ranks_gloo(tmp_path, extra):
    """Also with token routing: each rank draws its own kept tokens, and the replicas stay identical; with the sra
    term: its projector (``model.term_heads``) is synchronised with the model, its teacher is each rank's EMA; and
    with the terms whose statistics are over the batch (contrastive negatives, dispersive pairs, the immiscible
    assignment): each rank's over its own micro-batch, nothing gathered, replicas identical."""
    script = tmp_path / "ddp_run.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        *TORCHRUN2,
        str(script),
        str(tmp_path / "run"),
        str(tmp_path / "res"),
        json.dumps(extra),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"res.{r}.json").read_text()) for r in (0, 1))
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert r0["first_step"] == 4 and r0["resumed_at"] == r1["resumed_at"] == 4 and r0["local_batch"] == 9
    assert r0["params"] == r1["params"]  # DDP keeps replicas identical
    assert r0["ema0"] == r1["ema0"] and r0["stage"] == r1["stage"]  # and the curriculum decides together
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "ckpt_00000006.pt", weights_only=True)
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2
    assert not torch.equal(ckpt["rng"][0]["gen"], ckpt["rng"][1]["gen"])  # ranks draw different t and noise
