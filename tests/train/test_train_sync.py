"""Host syncs inside the training step, the fused AdamW against the per-parameter loop, the host allocator setting.

A training step may read a value back to the host only where it means to: the finiteness vote of ``Engine.step``
(every rank steps or every rank skips). ``SyncCounter`` (conftest) is a ``TorchDispatchMode`` that records every
``aten._local_scalar_dense`` (``.item()``, ``bool()``, ``int()``, ``float()`` of a tensor) and every copy from a
device to the CPU. On a CUDA device any such read is a sync. On the CPU, where everything lives on the host, the
counter keeps apart what the host draws from its own CPU generator (the per-step noise seed: on CUDA too this is a
CPU tensor, no sync) from what the step computes on the batch: a read of the latter is what would stall a GPU.
"""

from __future__ import annotations

import sys

import pytest
import torch
from conftest import SyncCounter, assert_near_reference
from torch.utils._python_dispatch import _disable_current_modes

from diffcurr_fast.optim.registry import build_optimizer
from diffcurr_fast.runs.recipes import load_config
from diffcurr_fast.train.loop import Trainer


def _cfg(run_dir, *extra):
    return load_config(
        None,
        [
            f"checkpoint.run_dir={run_dir}",
            "optim.name=adamw",  # the device-side step is fused AdamW's (the demo ships Muon)
            "model.hidden_size=32",
            "model.depth=2",
            "model.num_heads=2",
            "diffusion.num_timesteps=60",
            "curriculum.num_clusters=4",
            "curriculum.eval_every=1000",
            "data.batch_size=8",
            "engine.max_steps=20",
            "logging.progress=false",
            "logging.num_samples=0",
            "logging.plots=false",
            "checkpoint.export_ema=false",
            *extra,
        ],
    )


def _count_step(tr: Trainer, x0, y) -> tuple[list, int]:
    """(syncs of one ``train_step``, finiteness votes taken): the vote runs outside the counter.

    The fused loss reads its upstream gradient back only for CPU tensors (to skip a pass, free there; on a GPU it
    never reads): that check is off here, so the step is counted as a GPU would run it.
    """
    loss_module = sys.modules["diffcurr_fast.ops.diffusion_loss"]
    saved, loss_module.CHECK_UPSTREAM_ON_CPU = loss_module.CHECK_UPSTREAM_ON_CPU, False
    try:
        return _count(tr, x0, y)
    finally:
        loss_module.CHECK_UPSTREAM_ON_CPU = saved


def _count(tr: Trainer, x0, y) -> tuple[list, int]:
    votes = []
    inner = tr.engine.all_true

    def vote(flag):
        votes.append(1)
        with _disable_current_modes():
            return inner(flag)

    tr.engine.all_true = vote
    counter = SyncCounter()
    with counter:
        tr.train_step(x0, y)
    tr.engine.all_true = inner
    return counter.syncs, len(votes)


FLOW = (
    "diffusion.formulation=flow",
    "diffusion.prediction=velocity",
    "diffusion.weighting=none",
    "logging.sampler=euler",
    "diffusion.learn_sigma=false",
)
EDM = (
    "diffusion.formulation=edm",
    "diffusion.prediction=x0",
    "diffusion.weighting=none",
    "logging.sampler=euler",
    "diffusion.learn_sigma=false",
)


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("diffusion.ops_backend=reference",),
        ("optim.grad_clip=1.0", "diffusion.weighting=min_snr"),
        ("optim.grad_accum_steps=2",),
        FLOW,
        EDM,
    ],
)
def test_train_step_reads_nothing_back_but_the_vote(tmp_path, extra):
    tr = Trainer(_cfg(tmp_path / "run", *extra))
    x0, y = next(tr.loader)
    tr.train_step(x0, y)  # first step: lazy initialisation (optimizer state, timestep weights)
    syncs, votes = _count_step(tr, x0, y)
    assert syncs == [], f"host syncs inside the training step: {syncs}"
    assert votes == 1


@pytest.mark.parametrize("extra", [(), ("optim.grad_clip=1.0", "optim.grad_accum_steps=2"), FLOW])
def test_device_side_step_reads_nothing_back(tmp_path, extra):
    """``engine.cuda_graphs``: not even the vote; the curriculum's window read-back is outside these steps."""
    tr = Trainer(_cfg(tmp_path / "run", "engine.cuda_graphs=true", *extra))
    x0, y = next(tr.loader)
    tr.train_step(x0, y)
    syncs, votes = _count_step(tr, x0, y)
    assert syncs == [] and votes == 0, f"host syncs inside the device-side step: {syncs}"


def test_sync_counter_sees_a_read_of_the_step(tmp_path):
    """The counter fails the step when something in it reads a value back (here: the model's input range check)."""
    tr = Trainer(_cfg(tmp_path / "run"))
    x0, y = next(tr.loader)
    tr.model.check_values = True
    syncs, _ = _count_step(tr, x0, y)
    assert len(syncs) >= 1 and syncs[0][0] == "aten._local_scalar_dense.default"
    counter = SyncCounter()
    with counter:
        seed = int(torch.randint(0, 10, (1,), generator=torch.Generator().manual_seed(0)))  # a host draw
        loss = (x0 * 2).sum()
        float(loss)  # a read of a computed value
    assert 0 <= seed < 10 and counter.syncs == [("aten._local_scalar_dense.default", ())]
    counter = SyncCounter()
    with counter:
        tr.formulation.check_t(tr.train_step(x0, y)["k"])  # DDPM's range check reads t back with .tolist()
    assert ("tolist", (2,)) in counter.syncs  # torch.stack([t.min(), t.max()]).tolist()


def test_trusted_t_skips_only_the_range_checks():
    from diffcurr_fast.diffusion import DDPMSchedule
    from diffcurr_fast.diffusion.axis import t_trusted, trusted_t

    s = DDPMSchedule(1000)
    with pytest.raises(ValueError, match="out of range"):
        s.check_t(torch.tensor([1000]))
    with trusted_t():
        assert t_trusted()
        assert s.check_t(torch.tensor([3])).dtype == torch.int64
        with pytest.raises(ValueError, match="integer tensor"):
            s.check_t(torch.tensor([0.5]))
    assert not t_trusted()


def test_fused_adamw_matches_the_per_parameter_loop():
    """The trainer's AdamW (fused, also on CPU) and torch's float32 per-parameter loop, each against the loop in
    float64: two float32 update paths round differently by CPU and vector width, so neither is the other's oracle."""
    from diffcurr_fast.runs.config import OptimConfig, TrainConfig

    torch.manual_seed(0)
    shapes = [(37, 5), (64,), (3, 3, 2, 2), (1,)]
    exact = [torch.randn(s, dtype=torch.float64, requires_grad=True) for s in shapes]
    loop = [p.detach().float().requires_grad_() for p in exact]
    holder = torch.nn.ParameterList([p.detach().float() for p in exact])
    ours = list(holder)
    o = OptimConfig(lr=1e-3, weight_decay=0.05, beta1=0.9, beta2=0.99, eps=1e-8)
    kw = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay, foreach=False)
    opt_exact, opt_loop = torch.optim.AdamW(exact, **kw), torch.optim.AdamW(loop, **kw)
    opt = build_optimizer(holder, TrainConfig(optim=o), torch.device("cpu"))
    assert opt.defaults["fused"]
    for _ in range(30):
        grads = [torch.randn(s) for s in shapes]
        for p, q, r, g in zip(exact, loop, ours, grads):
            p.grad, q.grad, r.grad = g.double(), g.clone(), g.clone()
        for o_ in (opt_exact, opt_loop, opt):
            o_.step()
    # float32 rounds each update into the weights: measured (AMD EPYC, AVX-512) up to 3.8e-7 relative to a tensor
    # for both paths; a wrong decay or bias correction moves them by about lr = 1e-3 per step
    for name, params, optim in (("loop", loop, opt_loop), ("fused", ours, opt)):
        for i, (p, q) in enumerate(zip(exact, params)):
            assert_near_reference(q, p, 2e-6, f"{name} param {i}")
        for i, (a, b) in enumerate(zip(opt_exact.state.values(), optim.state.values())):
            assert_near_reference(b["exp_avg"], a["exp_avg"], 2e-6, f"{name} exp_avg {i}")
            assert_near_reference(b["exp_avg_sq"], a["exp_avg_sq"], 2e-6, f"{name} exp_avg_sq {i}")
            assert float(b["step"]) == float(a["step"]) == 30


def test_retain_host_memory_is_idempotent_and_keeps_pages():
    import platform
    import resource

    from diffcurr_fast.train.host_memory import retain_host_memory

    ok = retain_host_memory()
    assert retain_host_memory() is ok
    if not (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"):
        assert ok is False
        return
    assert ok is True

    def touch():
        a = torch.empty(3 * 2**20)  # 12 MiB: glibc would mmap it afresh
        a.fill_(1.0)
        del a

    for _ in range(3):
        touch()
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    touch()
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0 < 500  # 3072 pages if they were mapped anew


def test_dit_forward_compiles_as_one_graph():
    """``engine.compile`` compiles the model for real: no graph break (the flash-attn import used to be one inside
    the block loop, and dynamo then ran the whole forward eager)."""
    from diffcurr_fast.models.dit import DiT

    torch._dynamo.reset()
    model = DiT(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2, num_classes=10)
    model.check_values = False
    x, t, y = torch.randn(3, 1, 8, 8), torch.tensor([0, 5, 9]), torch.tensor([1, 2, 3])
    explanation = torch._dynamo.explain(model)(x, t, y)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
