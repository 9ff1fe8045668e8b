"""The Triton kernels' autotuning: keys cover every constexpr, the partial sums survive the timing runs, and the
warm-up tunes every launch ahead of the first step (in the interpreter, with the GPU's two candidate configs and
a stub timer that picks a different winner per key)."""

import inspect
import os

import pytest
import torch

triton = pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("one_thread")

if os.environ.get("TRITON_INTERPRET") != "1":  # conftest sets it before any kernel import
    pytest.skip("needs TRITON_INTERPRET=1 set before the kernels are imported", allow_module_level=True)

from diffcurr_fast.kernels import diffusion_loss as dl  # noqa: E402
from diffcurr_fast.kernels import philox, q_sample, warmup  # noqa: E402

KERNELS = {
    "q_sample": (q_sample, "_q_sample_fwd_kernel"),
    "diffusion_loss": (dl, "_diffusion_loss_fwd_kernel"),
    "philox_randn": (philox, "_philox_randn_fwd_kernel"),
}
GPU_CONFIGS = {  # the candidates the GPU tunes over (the interpreter gets one)
    "q_sample": philox.elementwise_configs(interpret=False),
    "diffusion_loss": dl._configs(interpret=False),
    "philox_randn": philox.elementwise_configs(interpret=False),
}


def _constexprs(kernel) -> set[str]:
    fn = kernel.fn
    while not inspect.isfunction(fn):
        fn = fn.fn
    return {n for n, p in inspect.signature(fn).parameters.items() if "constexpr" in str(p.annotation)}


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_autotune_key_covers_every_constexpr(name):
    module, attr = KERNELS[name]
    kernel = getattr(module, attr)
    tuned = {k for cfg in GPU_CONFIGS[name] for k in cfg.kwargs}
    assert _constexprs(kernel) - tuned <= set(kernel.keys), (name, kernel.keys)


class StubTimer:
    """do_bench for the autotuner: runs the candidate once, reports the next of ``times`` (one per candidate)."""

    def __init__(self, times):
        self.times, self.calls = list(times), 0

    def __call__(self, fn, quantiles=None):
        fn()
        t = self.times[self.calls % len(self.times)]
        self.calls += 1
        return [t, t, t]


def _retuned(monkeypatch, name, timer):
    """Replace the kernel by the same function under the GPU's candidates, its own key and reset_to_zero."""
    module, attr = KERNELS[name]
    real = getattr(module, attr)
    reset = real.reset_to_zero or None
    tuner = triton.autotune(GPU_CONFIGS[name], key=real.keys, reset_to_zero=reset, do_bench=timer)(real.fn)
    monkeypatch.setattr(module, attr, tuner)
    return tuner


def _reference_loss(pred, x0, noise, p, q, w):
    tgt = p.view(-1, 1) * x0.flatten(1).double() + q.view(-1, 1) * noise.flatten(1).double()
    d = pred.flatten(1).double() - tgt
    M = d.shape[1]
    return w.double() * d.square().mean(1), (w.view(-1, 1).double() * 2.0 / M * d).view(pred.shape)


def test_loss_autotuning_keeps_partial_sums_and_keys_on_constexprs(monkeypatch):
    # per key: candidate 1024 timed slower, 2048 faster (then the reverse): 2048 leaves half of the n_part slots
    # that 1024 wrote while being timed, which reset_to_zero must clear
    timer = StubTimer([2.0, 1.0, 1.0, 2.0])
    tuner = _retuned(monkeypatch, "diffusion_loss", timer)
    monkeypatch.setattr(dl, "MIN_BLOCK", 1024)
    g = torch.Generator().manual_seed(0)
    B, shape = 3, (4, 23, 29)  # M = 2668: three 1024-blocks, two 2048-blocks per sample
    pred, x0, noise = (torch.randn(B, *shape, generator=g) for _ in range(3))
    p, q, w = (torch.rand(B, generator=g) + 0.1 for _ in range(3))
    loss, grad = dl.diffusion_loss_fwd(pred, x0, noise, 0, p, q, w, with_grad=True)
    ref_loss, ref_grad = _reference_loss(pred, x0, noise, p, q, w)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-5, atol=1e-9)
    loss2, _ = dl.diffusion_loss_fwd(pred, x0, noise, 0, p, q, w, with_grad=False)  # another key: tuned again
    torch.testing.assert_close(loss2.double(), ref_loss, rtol=1e-5, atol=0)
    assert timer.calls == 4 and len(tuner.cache) == 2
    assert sorted(c.kwargs["BLOCK"] for c in tuner.cache.values()) == [1024, 2048]
    loss3, _ = dl.diffusion_loss_fwd(pred, x0, noise, 0, p, q, w, with_grad=False)  # cached: no timing
    assert timer.calls == 4 and torch.equal(loss3, loss2)


def test_q_sample_keys_on_the_noise_mode(monkeypatch):
    timer = StubTimer([2.0, 1.0, 1.0, 2.0])
    tuner = _retuned(monkeypatch, "q_sample", timer)
    g = torch.Generator().manual_seed(1)
    x0, noise = torch.randn(2, 5, 7, 11, generator=g), torch.randn(2, 5, 7, 11, generator=g)
    a, c = torch.rand(2, generator=g), torch.rand(2, generator=g)
    out = q_sample.q_sample_fwd(x0, a, c, noise, 0)
    torch.testing.assert_close(out, a.view(-1, 1, 1, 1) * x0 + c.view(-1, 1, 1, 1) * noise)
    q_sample.q_sample_fwd(x0, a, c, None, 0)
    assert timer.calls == 4 and len(tuner.cache) == 2


def test_warm_up_tunes_every_launch(monkeypatch):
    timers = {name: StubTimer([1.0, 2.0]) for name in KERNELS}
    tuners = {name: _retuned(monkeypatch, name, timers[name]) for name in KERNELS}
    monkeypatch.setattr(dl, "MIN_BLOCK", 1024)
    assert warmup.warm_up((2, 4, 8, 8), torch.float32, "cpu") == 7
    # q_sample: noise given or not; the loss: x gradient or not; the noise kernel: one size
    assert {n: len(t.cache) for n, t in tuners.items()} == {"q_sample": 2, "diffusion_loss": 4, "philox_randn": 1}
    calls = {n: t.calls for n, t in timers.items()}
    g = torch.Generator().manual_seed(2)
    x0, noise, pred = (torch.randn(2, 4, 8, 8, generator=g) for _ in range(3))
    p, q, w = (torch.rand(2, generator=g) for _ in range(3))
    for given in (None, noise):  # what a step launches afterwards: nothing left to time
        q_sample.q_sample_fwd(x0, p, q, given, 5)
        dl.diffusion_loss_fwd(pred, x0, given, 5, p, q, w, with_grad=True)
    assert {n: t.calls for n, t in timers.items()} == calls
