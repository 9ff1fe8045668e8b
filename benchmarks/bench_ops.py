"""Benchmark the fused ops as a user of another diffusion codebase calls them, against what that user has.

Providers, side by side in one run and interleaved (every repetition times each provider once, in turn, so all
of them see the same machine and cache state):

- ``torch-eager``: the plain-torch step a script writes (gather sqrt(abar_t), a x0 + c eps, MinSNR-weighted MSE);
- ``compile(torch-eager)``: the same function under ``torch.compile`` (compile time excluded from the timings,
  printed separately as ``compile_s``);
- ``diffusers``: ``DDPMScheduler.add_noise`` + ``training_utils.compute_snr`` + the MinSNR MSE of diffusers'
  training scripts, when diffusers is installed;
- our backends available on the device (``cpu``: the C++ kernels; ``cuda``; ``triton`` on CUDA), called as
  ``ops.q_sample(x0, t, alphas_cumprod, ...)`` and ``ops.diffusion_loss(...)`` with their defaults;
- ``copy``: ``dst.copy_(src)`` of one tensor of the case's size, the bandwidth yardstick under the same conditions.

Every provider uses one schedule (diffusers' default DDPM ``alphas_cumprod`` when diffusers is installed, the same
linear schedule otherwise) and the losses are checked to agree before anything is timed.

Modes: ``given`` (the user's ``randn_like`` noise, drawn outside the timed region and passed to every provider) and
``seed`` (noise inside the step: plain torch draws ``randn_like`` in the timed region, ours regenerates Philox noise
in-kernel from a seed). Cases: ``full_loss_path`` (q_sample, then the loss: the model is excluded, but as in a step
it sits between them, so x_t is kept alive and the compiled provider compiles each half, as inductor does around the
model's own kernels), ``q_sample`` and ``diffusion_loss`` alone; passes ``fwd``, ``bwd`` (the forward untimed) and
``fwd+bwd``. Sizes: B in {8, 64, 256} at 4x32x32 and B=32 at 4x64x64. ``gbps`` counts the minimal bytes the case
must move (eps prediction: q_sample reads x0 and the noise and writes x_t; the loss reads pred and the noise and
writes the gradient; in-kernel noise is never read); ``pct_copy`` relates it to the ``copy`` row of the same
rotation. The DiT block ops (``--block B N D``) run at one size, and so do the modern block's ops
(``rmsnorm_modulate``, ``qk_norm_rope`` with heads of ``--head-dim`` channels on a square token grid, ``swiglu`` at
2/3 of the GELU width), each against its eager form in the model's own code, with a given upstream gradient. Token
routing's ops (``token_gather``, ``token_scatter``; ``--route BxTxKxD ...``, default DiT-S/2's 256 tokens at width
384, half kept, B=16, and a small
size) are timed as a routed span uses them: the output is materialised (no reduction after it, which inductor would
fuse into the gather instead of writing it), the backward gets a given upstream gradient, and the scatter's base
and src both need gradients; ``gbps`` counts the rows they must read and write. Freed host memory is retained
(``retain_host_memory``, as the trainer does): with glibc's defaults every provider maps its 4 MiB outputs again on
each call and pays ~1000 page faults for them, which swamps the kernels (``--glibc-malloc`` measures that). Rows go
to ``benchmarks/results/ops.csv``; ``ops.md`` is regenerated.

    python benchmarks/bench_ops.py                 # full run on CPU (a few minutes, most of it compiling)
    python benchmarks/bench_ops.py --quick         # smoke run: one small size, few repeats, no torch.compile
    python benchmarks/bench_ops.py --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

import diffcurr_fast.ops as ops  # noqa: E402
from diffcurr_fast.diffusion import DDPMSchedule  # noqa: E402
from diffcurr_fast.models.modern import RMS_EPS, apply_rope2d, rope2d_tables, swiglu_hidden  # noqa: E402
from diffcurr_fast.models.routing import draw_route  # noqa: E402
from diffcurr_fast.ops import _backend  # noqa: E402
from diffcurr_fast.train.host_memory import retain_host_memory  # noqa: E402

SEED = 20250101
SIZES = ((8, (4, 32, 32)), (64, (4, 32, 32)), (256, (4, 32, 32)), (32, (4, 64, 64)))
MODES = ("given", "seed")
PASSES = ("fwd", "bwd", "fwd+bwd")
LOSS_CASES = ("full_loss_path", "q_sample", "diffusion_loss")
BLOCK_CASES = ("randn", "sample_timesteps", "adaln_modulate", "gated_residual", "gelu_tanh")
MODERN_CASES = ("rmsnorm_modulate", "qk_norm_rope", "swiglu")  # the modern block's ops, at the --block size
ROUTE_CASES = ("token_gather", "token_scatter")
ROUTE_SIZES = ("16x256x128x384", "4x64x32x96")  # BxTxKxD: DiT-S/2 at 256 tokens, half kept; a small one
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COLUMNS = [
    "op",
    "mode",
    "pass",
    "provider",
    "size",
    "dtype",
    "median_ms",
    "p20_ms",
    "p80_ms",
    "gbps",
    "pct_copy",
    "x_vs_torch-eager",
    "x_vs_compile(torch-eager)",
    "compile_s",
]


class Provider:
    """``forward(leaf)`` returns the case's output (a scalar loss when differentiable); ``leaf`` is None or pred."""

    def __init__(self, forward: Callable, compiled: bool = False):
        self._forward, self.compiled, self.compile_s = forward, compiled, None

    def forward(self, leaf):
        if not self.compiled or self.compile_s is not None:
            return self._forward(leaf)
        t0 = time.perf_counter()  # the first call of a compiled provider compiles (its backward too, below)
        out = self._forward(leaf)
        if leaf is not None:
            self._forward(leaf.detach().clone().requires_grad_()).backward()
        self.compile_s = time.perf_counter() - t0
        return out


def _schedule(device: torch.device):
    """(alphas_cumprod as float32 on device, a diffusers DDPMScheduler or None)."""
    try:
        from diffusers import DDPMScheduler
    except ImportError:
        return DDPMSchedule(1000).alphas_cumprod.float().to(device), None
    sch = DDPMScheduler(num_train_timesteps=1000)
    return sch.alphas_cumprod.float().to(device), sch


def loss_path_cases(
    args, B, shape, mode, device, dtype, backends
) -> tuple[dict[str, dict[str, Provider]], torch.Tensor]:
    """(providers of the full loss path, q_sample and diffusion_loss at one size and noise mode; x0)."""
    abar, scheduler = _schedule(device)
    gamma, pred_kind = args.gamma, args.prediction
    g = torch.Generator(device).manual_seed(0)
    x0 = torch.randn(B, *shape, device=device, generator=g).to(dtype)
    noise_given = torch.randn(B, *shape, device=device, generator=g).to(dtype)
    t = torch.randint(0, abar.shape[0], (B,), device=device, generator=g)
    dims = list(range(1, x0.ndim))
    bshape = (-1,) + (1,) * len(shape)
    seeded = mode == "seed"

    def user_noise(x):  # the user's noise: drawn in the timed region only in the seed mode
        return torch.randn_like(x) if seeded else noise_given

    def torch_q(x0, noise):
        ab = abar[t]
        return ab.sqrt().view(bshape) * x0 + (1 - ab).sqrt().view(bshape) * noise

    def torch_loss(pred, x0, noise):
        ab = abar[t]
        snr = ab / (1 - ab)
        base = torch.clamp(snr, max=gamma)
        if pred_kind == "eps":
            target, w = noise, base / snr
        elif pred_kind == "x0":
            target, w = x0, base
        else:
            target, w = ab.sqrt().view(bshape) * noise - (1 - ab).sqrt().view(bshape) * x0, base / (snr + 1)
        return (((pred.float() - target.float()) ** 2).mean(dim=dims) * w).mean()

    def torch_q_step():
        noise = user_noise(x0)
        return torch_q(x0, noise), noise

    def full_path(q_step, loss):
        """q_sample, then the loss: in a step the model sits between them, so neither half fuses into the other,
        and x_t stays alive (the model reads it and keeps it for its backward) until the provider's next call."""
        kept = []

        def full(pred):
            x_t, noise = q_step()
            kept[:] = [x_t]
            return loss(pred, x0, noise)

        return full

    plain = {
        "full_loss_path": full_path(torch_q_step, torch_loss),
        "q_sample": lambda pred: torch_q_step()[0],
        "diffusion_loss": lambda pred: torch_loss(pred, x0, noise_given),
    }
    cases: dict[str, dict[str, Provider]] = {c: {"torch-eager": Provider(f)} for c, f in plain.items()}
    if not args.no_compile:  # the cases share compiled functions: one graph each per size and mode
        q_step, loss = torch.compile(torch_q_step, dynamic=False), torch.compile(torch_loss, dynamic=False)
        # alone, q_sample with drawn noise must not write the noise out as the step's second output
        q_alone = torch.compile(plain["q_sample"], dynamic=False) if seeded else (lambda pred: q_step()[0])
        compiled = {
            "full_loss_path": full_path(q_step, loss),
            "q_sample": q_alone,
            "diffusion_loss": lambda pred: loss(pred, x0, noise_given),
        }
        for c in LOSS_CASES:
            cases[c]["compile(torch-eager)"] = Provider(compiled[c], compiled=True)
    if scheduler is not None and pred_kind in ("eps", "v"):
        from diffusers.training_utils import compute_snr

        def diff_loss(pred, x0, noise):
            snr = compute_snr(scheduler, t)
            w = torch.stack([snr, gamma * torch.ones_like(t)], dim=1).min(dim=1)[0]
            if pred_kind == "eps":
                target, w = noise, w / snr
            else:
                target, w = scheduler.get_velocity(x0, noise, t), w / (snr + 1)
            loss = torch.nn.functional.mse_loss(pred.float(), target.float(), reduction="none")
            return (loss.mean(dim=dims) * w).mean()

        def diff_q_step():
            noise = user_noise(x0)
            return scheduler.add_noise(x0, noise, t), noise

        cases["full_loss_path"]["diffusers"] = Provider(full_path(diff_q_step, diff_loss))
        cases["q_sample"]["diffusers"] = Provider(lambda pred: scheduler.add_noise(x0, user_noise(x0), t))
        cases["diffusion_loss"]["diffusers"] = Provider(lambda pred: diff_loss(pred, x0, noise_given))
    for b in backends:
        noise = None if seeded else noise_given
        seed = SEED if seeded else None

        def our_q_step(b=b, noise=noise, seed=seed):
            return ops.q_sample(x0, t, abar, noise, seed=seed, backend=b), noise

        def our_loss(pred, x0=x0, noise=noise, b=b, seed=seed):
            kw = dict(prediction=pred_kind, weighting="min_snr", gamma=gamma, seed=seed, backend=b)
            return ops.diffusion_loss(pred, x0, noise, t, abar, **kw)

        cases["full_loss_path"][b] = Provider(full_path(our_q_step, our_loss))
        cases["q_sample"][b] = Provider(lambda pred, q=our_q_step: q()[0])
        # the loss alone with in-kernel noise regenerates it; given noise reads the user's tensor
        cases["diffusion_loss"][b] = Provider(our_loss)
    return cases, x0


def modern_cases(args, device, dtype, backends):
    """(providers of the modern block's ops at the --block size, their leaves, the elements each case counts).

    Each eager form is the modern block's own (``models/modern.py``, ``models/dit.py``): RMSNorm (F.rms_norm in
    float32) then the modulation; q and k unbound from one qkv projection (their views, as the attention reads them),
    RMS-normalised with their weights, then rotated by ``apply_rope2d`` with the 2-D tables of a square token grid
    (N must be a square); silu(a) * b on the halves of the SwiGLU projection, 2/3 of the GELU width. The leaves are x,
    the qkv projection and the SwiGLU projection; heads of ``--head-dim`` channels. As the routing ops, each output is
    materialised (no reduction after it) and the backward gets a given upstream gradient (``_SeedGrad``)."""
    Bn, N, D = args.block
    heads = max(1, D // args.head_dim)
    dh = D // heads
    grid = int(round(N**0.5))
    if grid * grid != N or dh % 4:
        raise SystemExit(f"--block {Bn} {N} {D}: qk_norm_rope needs a square token count and a head dim divisible by 4")
    g = torch.Generator(device).manual_seed(4)
    shift, scale = (0.1 * torch.randn(Bn, D, device=device, generator=g).to(dtype) for _ in range(2))
    wq, wk = (1 + 0.1 * torch.randn(dh, device=device, generator=g) for _ in range(2))
    cos, sin = rope2d_tables(grid, dh, device=device)
    hidden = swiglu_hidden(4 * D)

    def rms_eager(x):
        h = torch.nn.functional.rms_norm(x.float(), (D,), eps=RMS_EPS).to(x.dtype)
        return h * (1 + scale[:, None, :]) + shift[:, None, :]

    def split(qkv):
        q, k, _ = qkv.reshape(Bn, N, 3, heads, dh).permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, Dh) each
        return q, k

    def qk_eager(qkv):
        q, k = split(qkv)
        q = torch.nn.functional.rms_norm(q.float(), (dh,), wq, RMS_EPS).to(q.dtype)
        k = torch.nn.functional.rms_norm(k.float(), (dh,), wk, RMS_EPS).to(k.dtype)
        return apply_rope2d(q, cos, sin), apply_rope2d(k, cos, sin)

    def swiglu_eager(h):
        a, b = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(a) * b

    plain = {"rmsnorm_modulate": {"torch-eager": rms_eager}, "qk_norm_rope": {"torch-eager": qk_eager}}
    plain["swiglu"] = {"torch-eager": swiglu_eager}
    if not args.no_compile:
        for fns in plain.values():
            fns["compile(torch-eager)"] = torch.compile(fns["torch-eager"], dynamic=False)
    for b in backends:
        plain["rmsnorm_modulate"][b] = lambda x, b=b: ops.rmsnorm_modulate(x, shift, scale, eps=RMS_EPS, backend=b)
        plain["qk_norm_rope"][b] = lambda qkv, b=b: ops.qk_norm_rope(qkv, heads, wq, wk, cos, sin, backend=b)[:2]
        plain["swiglu"][b] = lambda h, b=b: ops.swiglu(h, backend=b)
    leaves = {
        "rmsnorm_modulate": torch.randn(Bn, N, D, device=device, generator=g).to(dtype),
        "qk_norm_rope": torch.randn(Bn, N, 3 * D, device=device, generator=g).to(dtype),
        "swiglu": 2 * torch.randn(Bn, N, 2 * hidden, device=device, generator=g).to(dtype),
    }
    width = {"rmsnorm_modulate": D, "qk_norm_rope": D, "swiglu": hidden}
    upstream = {c: torch.randn(Bn, N, w, device=device, generator=g).to(dtype) for c, w in width.items()}
    gq = upstream["qk_norm_rope"].view(Bn, heads, N, dh)

    def timed(case, fn):
        if case == "qk_norm_rope":
            return lambda leaf: sum(_SeedGrad.apply(o, gq) for o in fn(leaf))
        return lambda leaf: _SeedGrad.apply(fn(leaf), upstream[case])

    cases = {
        c: {n: Provider(timed(c, f), compiled=n.startswith("compile")) for n, f in fns.items()}
        for c, fns in plain.items()
    }
    outputs = {c: {n: (lambda f=f, c=c: f(leaves[c])) for n, f in fns.items()} for c, fns in plain.items()}
    numel = {"rmsnorm_modulate": Bn * N * D, "qk_norm_rope": 2 * Bn * N * D, "swiglu": Bn * N * hidden}
    return cases, leaves, numel, outputs


def block_cases(args, device, dtype, backends) -> dict[str, dict[str, Provider]]:
    """Providers of the other ops (Philox noise, timestep sampling, the DiT block ops, the MLP's tanh-GELU) at one
    size."""
    B, shape = 256, (4, 32, 32)
    Bn, N, D = args.block
    g = torch.Generator(device).manual_seed(1)
    weights = torch.rand(1000, device=device, generator=g)
    shift, scale, gate = (0.1 * torch.randn(Bn, D, device=device, generator=g).to(dtype) for _ in range(3))
    xb = torch.randn(Bn, N, D, device=device, generator=g).to(dtype)

    def adaln(x):
        return torch.nn.functional.layer_norm(x, (D,), eps=1e-6) * (1 + scale[:, None, :]) + shift[:, None, :]

    plain = {
        "randn": lambda leaf: torch.randn(B, *shape, device=device, dtype=dtype),
        "sample_timesteps": lambda leaf: torch.multinomial(weights, B, replacement=True),
        "adaln_modulate": lambda x: adaln(x).float().sum(),
        "gated_residual": lambda y: (xb + gate[:, None, :] * y).float().sum(),
        "gelu_tanh": lambda h: torch.nn.functional.gelu(h, approximate="tanh").float().sum(),
    }
    cases = {c: {"torch-eager": Provider(f)} for c, f in plain.items()}
    if not args.no_compile:
        for c, f in plain.items():
            cases[c]["compile(torch-eager)"] = Provider(torch.compile(f, dynamic=False), compiled=True)
    for b in backends:
        cases["randn"][b] = Provider(lambda leaf, b=b: ops.philox_randn(SEED, (B, *shape), device, backend=b))
        cases["sample_timesteps"][b] = Provider(
            lambda leaf, b=b: ops.sample_timesteps(B, weights, seed=SEED, validate=False, backend=b)
        )
        cases["adaln_modulate"][b] = Provider(
            lambda x, b=b: ops.adaln_modulate(x, shift, scale, backend=b).float().sum()
        )
        cases["gated_residual"][b] = Provider(lambda y, b=b: ops.gated_residual(xb, gate, y, backend=b).float().sum())
        if b == "cpu":  # elsewhere gelu_tanh is torch's own kernel
            cases["gelu_tanh"][b] = Provider(lambda h: ops.gelu_tanh(h, backend="cpu").float().sum())
    leaves = {"adaln_modulate": xb, "gated_residual": torch.randn_like(xb), "gelu_tanh": 3 * torch.randn_like(xb)}
    numel = {"randn": B * 4096, "sample_timesteps": B, **{c: xb.numel() for c in leaves}}
    return cases, leaves, numel


class _SeedGrad(torch.autograd.Function):
    """A scalar whose backward hands ``grad`` to ``out``: ``.backward()`` on it runs the op's backward with a given
    upstream gradient, and its forward makes no pass over ``out`` (a sum would add one, and under torch.compile
    inductor would fuse it into the gather and never write the output that the routed blocks read)."""

    @staticmethod
    def forward(ctx, out, grad):
        ctx.grad = grad
        return out.new_zeros(())

    @staticmethod
    def backward(ctx, _):
        return ctx.grad, None


def route_cases(args, size, device, dtype, backends):
    """(providers of token_gather and token_scatter at one size, their leaves, their plain outputs per provider
    for the agreement check). The scatter's leaf is base; src needs a gradient too (both do in a routed span)."""
    B, T, K, D = size
    g = torch.Generator(device).manual_seed(2)
    x = torch.randn(B, T, D, device=device, generator=g).to(dtype)
    src = torch.randn(B, K, D, device=device, generator=g).to(dtype).requires_grad_()
    grads = {
        "token_gather": torch.randn(B, K, D, device=device, generator=g).to(dtype),
        "token_scatter": torch.randn(B, T, D, device=device, generator=g).to(dtype),
    }
    idx = draw_route(B, T, K, torch.Generator().manual_seed(3), device)  # (B, K) sorted, as the trainer draws it

    def gather_ref(x):
        return ops.token_gather_ref(x, idx)

    def scatter_ref(base, src):
        return ops.token_scatter_ref(base, idx, src)

    plain = {"token_gather": {"torch-eager": gather_ref}, "token_scatter": {"torch-eager": scatter_ref}}
    if not args.no_compile:
        plain["token_gather"]["compile(torch-eager)"] = torch.compile(gather_ref, dynamic=False)
        plain["token_scatter"]["compile(torch-eager)"] = torch.compile(scatter_ref, dynamic=False)
    for b in backends:
        plain["token_gather"][b] = lambda x, b=b: ops.token_gather(x, idx, backend=b)
        plain["token_scatter"][b] = lambda base, src, b=b: ops.token_scatter(base, idx, src, backend=b)

    def timed(case, fn):
        if case == "token_gather":
            return lambda leaf: _SeedGrad.apply(fn(leaf), grads[case])

        def scatter(leaf):
            src.grad = None
            return _SeedGrad.apply(fn(leaf, src), grads[case])

        return scatter

    cases = {
        c: {n: Provider(timed(c, f), compiled=n.startswith("compile")) for n, f in fns.items()}
        for c, fns in plain.items()
    }
    outputs = {
        "token_gather": {n: (lambda f=f: f(x)) for n, f in plain["token_gather"].items()},
        "token_scatter": {n: (lambda f=f: f(x, src.detach())) for n, f in plain["token_scatter"].items()},
    }
    return cases, {c: x for c in ROUTE_CASES}, outputs


def route_passes(case: str, pass_: str, kept: float) -> float:
    """Rows of a (B, T, D) tensor the routing op must read and write (kept = K / T): the gather reads and writes K
    rows and its backward reads K and writes T; the scatter reads T (K from src) and writes T, its backward reads T
    and writes T + K."""
    fwd, bwd = {"token_gather": (2 * kept, kept + 1), "token_scatter": (2.0, 2 + kept)}[case]
    return {"fwd": fwd, "bwd": bwd, "fwd+bwd": fwd + bwd}[pass_]


def minimal_passes(case: str, pass_: str, mode: str, prediction: str) -> int:
    """Tensor-sized memory passes the case cannot avoid (eps: the loss never needs x0; seeded noise is not read)."""
    noise = 0 if mode == "seed" else 1
    q = 2 + noise  # read x0 (and the noise), write x_t
    loss_in = 1 + (prediction != "eps") + (noise if prediction != "x0" else 0)  # pred, x0 unless eps, the noise
    loss = {"fwd": loss_in, "bwd": 1, "fwd+bwd": loss_in + 1}[pass_]  # + the gradient write
    block = {
        "randn": {"fwd": 1},
        "sample_timesteps": {"fwd": 0},
        "adaln_modulate": {"fwd": 2, "bwd": 3, "fwd+bwd": 5},
        "gated_residual": {"fwd": 3, "bwd": 3, "fwd+bwd": 6},
        "gelu_tanh": {"fwd": 2, "bwd": 3, "fwd+bwd": 5},
        "rmsnorm_modulate": {"fwd": 2, "bwd": 3, "fwd+bwd": 5},
        "qk_norm_rope": {"fwd": 2, "bwd": 3, "fwd+bwd": 5},  # of q and k together
        "swiglu": {"fwd": 3, "bwd": 5, "fwd+bwd": 8},  # of the output's size: x is twice as large
    }
    if case == "q_sample":
        return q
    if case == "diffusion_loss":
        return loss
    if case == "full_loss_path":
        return loss + (q if pass_ != "bwd" else 0)
    return block[case][pass_]


def run_rotation(providers: dict[str, Provider], leaf0, pass_, copy_numel, device, reps, warmup):
    """Interleaved timings: {provider: [seconds]} with ``copy`` (dst.copy_(src) of copy_numel floats) included."""
    src = torch.randn(copy_numel, device=device)
    dst = torch.empty_like(src)
    steps: dict[str, tuple[Callable, Callable | None]] = {"copy": (lambda _: dst.copy_(src), None)}
    for name, prov in providers.items():
        if leaf0 is None:
            steps[name] = ((lambda _, f=prov.forward: f(None)), None)
            continue
        leaf = leaf0.detach().clone().requires_grad_()

        def fwd(_, f=prov.forward, leaf=leaf):
            leaf.grad = None
            return f(leaf)

        def setup(f=prov.forward, leaf=leaf):
            leaf.grad = None
            return f(leaf)

        def both(_, f=prov.forward, leaf=leaf):
            leaf.grad = None
            f(leaf).backward()

        steps[name] = {
            "fwd": (fwd, None),
            "bwd": ((lambda out: out.backward()), setup),
            "fwd+bwd": (both, None),
        }[pass_]
    for run, setup in steps.values():  # the first call compiles (timed apart by Provider), then warmup
        for _ in range(1 + warmup):
            run(setup() if setup else None)
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(reps):
        for name, (run, setup) in steps.items():
            state = setup() if setup else None
            common.synchronize(device)
            t0 = time.perf_counter()
            run(state)
            common.synchronize(device)
            times[name].append(time.perf_counter() - t0)
    return times


def check_agreement(providers: dict[str, Provider], leaf0, case: str) -> str | None:
    """None when every provider's output matches torch-eager (losses; x_t in the given mode), else a message."""
    if leaf0 is None and case != "q_sample":
        return None
    ref = providers["torch-eager"].forward(leaf0)
    for name, prov in providers.items():
        out = prov.forward(leaf0)
        if case == "q_sample" and out.shape != ref.shape:
            return f"{name}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
        if not torch.allclose(out.float(), ref.float(), rtol=2e-3, atol=1e-5):
            return f"{name}: {out.float().flatten()[:3].tolist()} != torch-eager {ref.float().flatten()[:3].tolist()}"
    return None


def _outputs_agree(got, want) -> bool:
    """Outputs (a tensor or a tuple of them) equal to torch-eager's up to float32 rounding of the fused arithmetic."""
    got, want = (got, want) if isinstance(want, tuple) else ((got,), (want,))
    return all(torch.allclose(a.float(), b.float(), rtol=2e-3, atol=2e-3) for a, b in zip(got, want))


def _backends(device: torch.device, with_reference: bool) -> list[str]:
    names = [
        b for b in ("cuda", "triton", "cpu") if _backend.unavailable_reason(b, "diffusion_loss_fwd", device) is None
    ]
    names = [b for b in names if not (b == "triton" and device.type == "cpu")]  # the interpreter is no fast path
    return names + (["reference"] if with_reference else [])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--dtype", default="fp32", choices=tuple(DTYPES))
    parser.add_argument("--quick", action="store_true", help="smoke run: B=8 at 4x16x16, few repeats, no compile")
    parser.add_argument("--sizes", nargs="+", default=None, metavar="BxCxHxW", help="e.g. 256x4x32x32 32x4x64x64")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--prediction", default="eps", choices=("eps", "x0", "v"))
    parser.add_argument("--gamma", type=float, default=5.0, help="MinSNR gamma")
    parser.add_argument("--block", type=int, nargs=3, default=[32, 256, 384], help="B N D of the DiT block ops")
    parser.add_argument(
        "--route", nargs="+", default=None, metavar="BxTxKxD", help=f"token routing sizes (default {ROUTE_SIZES})"
    )
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument(
        "--head-dim", type=int, default=64, help="channels per head of qk_norm_rope at the --block width (default 64)"
    )
    parser.add_argument(
        "--ops", nargs="*", default=None, help=f"subset of {LOSS_CASES + BLOCK_CASES + MODERN_CASES + ROUTE_CASES}"
    )
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile provider")
    parser.add_argument("--compile", action="store_true", help="keep the torch.compile provider with --quick")
    parser.add_argument("--reference", action="store_true", help="add our reference backend (a slow oracle)")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument(
        "--glibc-malloc",
        action="store_true",
        help="keep glibc's default malloc settings: it unmaps freed 4 MiB blocks, so every provider faults its "
        "outputs in again on each call (slower and noisier for all); by default freed memory is retained, "
        "as the trainer does",
    )
    parser.add_argument(
        "--copy-mib",
        type=int,
        default=None,
        help="size of the large-buffer copy that measures the memory bandwidth (default 512 MiB, 32 with --quick)",
    )
    parser.add_argument("--out", type=Path, default=common.RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda requested but CUDA is not available")
    dtype = DTYPES[args.dtype]
    if args.sizes:
        try:
            sizes = [(int(s.split("x")[0]), tuple(int(v) for v in s.split("x")[1:])) for s in args.sizes]
        except ValueError:
            sizes = []
        if not sizes or any(B < 1 or not shape or min(shape) < 1 for B, shape in sizes):
            parser.error(f"--sizes takes positive BxCxHxW values such as 256x4x32x32, got {args.sizes}")
    else:
        sizes = [(8, (4, 16, 16))] if args.quick else list(SIZES)
    route_args = args.route or (ROUTE_SIZES[1:] if args.quick else ROUTE_SIZES)
    try:
        route_sizes = [tuple(int(v) for v in r.split("x")) for r in route_args]
    except ValueError:
        route_sizes = []
    if not route_sizes or any(len(r) != 4 or min(r) < 1 or r[2] > r[1] for r in route_sizes):
        parser.error(f"--route takes BxTxKxD values with 1 <= K <= T such as 16x256x128x384, got {args.route}")
    if args.quick:
        args.block = [4, 64, 96]
        args.no_compile = args.no_compile or not args.compile
    reps = args.reps or (5 if args.quick else 30)
    warmup = args.warmup or (2 if args.quick else 5)
    every = LOSS_CASES + BLOCK_CASES + MODERN_CASES + ROUTE_CASES
    wanted = set(args.ops) if args.ops else set(every)
    unknown = wanted - set(every)
    if unknown:
        parser.error(f"unknown ops {sorted(unknown)}; choose from {every}")
    warnings.simplefilter("ignore", RuntimeWarning)
    backends = _backends(device, args.reference)
    info = common.run_info(device)
    info["host_memory"] = "glibc default" if args.glibc_malloc or not retain_host_memory() else "retained"
    dram = common.copy_bandwidth(device, nbytes=(args.copy_mib or (32 if args.quick else 512)) * 2**20)
    print(
        f"{info['machine']} | torch {info['torch']} | {info['git_rev']} | {args.dtype} | large-buffer copy "
        f"{dram:.1f} GB/s | host memory {info['host_memory']} | backends {', '.join(backends)}"
    )
    run_id = time.strftime("%Y%m%d-%H%M%S")
    rows: list[dict[str, object]] = []
    csv_path = args.out / "ops.csv"
    # one graph per (function, size, mode, dtype): the full sweep needs more entries than dynamo's default limit,
    # past which it would silently run eager
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    elem = torch.finfo(dtype).bits // 8

    def record(case, mode, pass_, size, times, providers, numel, passes=None):
        """Append the rotation's rows to the CSV at once (a time-out later keeps them) and print them."""
        new: list[dict[str, object]] = []
        passes = minimal_passes(case, pass_, mode, args.prediction) if passes is None else passes
        nbytes = passes * numel * elem
        copy_med = common.percentiles(times["copy"])[0]
        copy_gbps = 2 * numel * 4 / copy_med / 1e9
        meds = {n: common.percentiles(v)[0] for n, v in times.items()}
        for name, ts in times.items():
            if name == "copy":
                continue
            med, p20, p80 = common.percentiles(ts)
            gbps = nbytes / med / 1e9 if nbytes else None
            row = {
                **info,
                "run_id": run_id,
                "device": device.type,
                "op": case,
                "mode": mode,
                "pass": pass_,
                "provider": name,
                "size": size,
                "dtype": args.dtype,
                "median_ms": f"{med * 1e3:.4f}",
                "p20_ms": f"{p20 * 1e3:.4f}",
                "p80_ms": f"{p80 * 1e3:.4f}",
                "gbps": f"{gbps:.2f}" if gbps else "",
                "copy_gbps": f"{copy_gbps:.2f}",
                "pct_copy": f"{100 * gbps / copy_gbps:.1f}" if gbps else "",
                "x_vs_torch-eager": f"{meds['torch-eager'] / med:.2f}",
                "x_vs_compile(torch-eager)": f"{meds['compile(torch-eager)'] / med:.2f}"
                if "compile(torch-eager)" in meds
                else "",
                "compile_s": f"{providers[name].compile_s:.1f}" if providers[name].compile_s else "",
                "dram_copy_gbps": f"{dram:.2f}",
                "quick": int(args.quick),
            }
            new.append(row)
            print(
                f"  {case:15s} {mode:5s} {pass_:8s} {name:21s} {med * 1e3:9.3f} ms [{p20 * 1e3:.3f}, "
                f"{p80 * 1e3:.3f}] {row['gbps'] or '-':>7} GB/s {row['pct_copy'] or '-':>6}% copy  "
                f"x{row['x_vs_torch-eager']} eager  x{row['x_vs_compile(torch-eager)'] or '-'} compile"
                + (f"  (compile {row['compile_s']} s)" if row["compile_s"] else "")
            )
        common.append_csv(csv_path, new)
        rows.extend(new)

    for B, shape in sizes:
        size = f"B={B} x {'x'.join(map(str, shape))}"
        for mode in args.modes:
            cases, x0 = loss_path_cases(args, B, shape, mode, device, dtype, backends)
            print(f"{size}, {mode} noise (copy yardstick: {x0.numel() * elem / 2**20:.1f} MiB)")
            for case in LOSS_CASES:
                if case not in wanted:
                    continue
                providers = cases[case]
                leaf = None if case == "q_sample" else torch.randn_like(x0)
                if mode == "given":  # with noise drawn inside, each provider draws its own by design
                    bad = check_agreement(providers, leaf if leaf is None else leaf.detach().requires_grad_(), case)
                    if bad:
                        print(f"  {case}: providers disagree, not timed: {bad}")
                        continue
                for pass_ in ("fwd",) if leaf is None else PASSES:
                    times = run_rotation(providers, leaf, pass_, x0.numel(), device, reps, warmup)
                    record(case, mode, pass_, size, times, providers, x0.numel())
    if wanted & set(BLOCK_CASES):
        cases, leaves, numel = block_cases(args, device, dtype, backends)
        print(f"other ops (block {'x'.join(map(str, args.block))})")
        for case in BLOCK_CASES:
            if case not in wanted:
                continue
            leaf = leaves.get(case)
            for pass_ in ("fwd",) if leaf is None else PASSES:
                times = run_rotation(cases[case], leaf, pass_, numel[case], device, reps, warmup)
                record(
                    case,
                    "-",
                    pass_,
                    "x".join(map(str, args.block)) if leaf is not None else "B=256 x 4x32x32",
                    times,
                    cases[case],
                    numel[case],
                )
    if wanted & set(MODERN_CASES):
        cases, leaves, numel, outputs = modern_cases(args, device, dtype, backends)
        print(f"modern block ops (block {'x'.join(map(str, args.block))}, heads of {args.head_dim})")
        for case in MODERN_CASES:
            if case not in wanted:
                continue
            want = outputs[case]["torch-eager"]()
            bad = [n for n, f in outputs[case].items() if not _outputs_agree(f(), want)]
            if bad:
                print(f"  {case}: providers disagree with torch-eager, not timed: {bad}")
                continue
            for pass_ in PASSES:
                times = run_rotation(cases[case], leaves[case], pass_, numel[case], device, reps, warmup)
                record(case, "-", pass_, "x".join(map(str, args.block)), times, cases[case], numel[case])
    for size in route_sizes:
        if not wanted & set(ROUTE_CASES):
            break
        B, T, K, D = size
        cases, leaves, outputs = route_cases(args, size, device, dtype, backends)
        label = f"B={B} T={T} K={K} D={D}"
        print(f"token routing {label}")
        for case in ROUTE_CASES:
            if case not in wanted:
                continue
            want = outputs[case]["torch-eager"]()
            bad = [n for n, f in outputs[case].items() if not torch.equal(f(), want)]  # row copies: exact
            if bad:
                print(f"  {case}: providers disagree with torch-eager, not timed: {bad}")
                continue
            for pass_ in PASSES:
                times = run_rotation(cases[case], leaves[case], pass_, B * T * D, device, reps, warmup)
                record(case, "-", pass_, label, times, cases[case], B * T * D, route_passes(case, pass_, K / T))
    write_markdown(csv_path, args.out / "ops.md")
    print_targets(rows)
    return 0


def print_targets(rows: list[dict[str, object]]) -> None:
    """The issues' targets on this run's rows: met or not, with the ratio."""
    for r in rows:  # the modern block's ops: forward + backward at least as fast as torch.compile of the eager form
        if r["op"] in MODERN_CASES and r["pass"] == "fwd+bwd" and r["provider"] in ("cpu", "cuda", "triton"):
            comp = r["x_vs_compile(torch-eager)"]
            goal = f"  [>= 1.0x compile: {'met' if float(comp) >= 1.0 else 'NOT met'}]" if comp else ""
            print(
                f"target {r['op']} {r['size']} fwd+bwd {r['provider']}: x{comp or '-'} compile, "
                f"x{r['x_vs_torch-eager']} eager, {r['pct_copy']}% copy{goal}"
            )
    for r in rows:  # token routing: ours at least 1.3x torch.compile of the reference at DiT-S/2's size
        if r["op"] in ROUTE_CASES and r["provider"] in ("cpu", "cuda", "triton") and r["x_vs_compile(torch-eager)"]:
            comp = float(r["x_vs_compile(torch-eager)"])
            goal = "  [>= 1.3x compile: " + ("met" if comp >= 1.3 else "NOT met") + "]"
            print(
                f"target {r['op']} {r['size']} {r['pass']} {r['provider']}: x{comp:.2f} compile, "
                f"x{r['x_vs_torch-eager']} eager{goal if r['size'] == 'B=16 T=256 K=128 D=384' else ''}"
            )
    ours = [r for r in rows if r["provider"] in ("cpu", "cuda", "triton") and r["op"] == "full_loss_path"]
    for r in ours:
        if r["pass"] != "fwd+bwd":
            continue
        comp, eager, pct = r["x_vs_compile(torch-eager)"], float(r["x_vs_torch-eager"]), r["pct_copy"]
        line = (
            f"target {r['size']} {r['mode']} {r['provider']}: x{comp or '-'} compile, x{eager:.2f} eager, {pct}% copy"
        )
        if r["size"] == "B=256 x 4x32x32" and comp:
            met = float(comp) >= 1.3 and (r["mode"] != "given" or float(pct) >= 70.0)
            goal = ">= 1.3x compile" + (" and >= 70% copy" if r["mode"] == "given" else "")
            line += f"  [{goal}: {'met' if met else 'NOT met'}]"
        if r["size"].startswith("B=8 "):
            line += f"  [not slower than eager: {'met' if eager >= 1.0 else 'NOT met'}]"
        print(line)


def write_markdown(csv_path: Path, md_path: Path) -> None:
    """Regenerate ``md_path`` from the CSV: per (machine, device, dtype), each op's rows of its latest run (a run of
    some ops, ``--ops``, replaces only their rows)."""
    rows = [r for r in common.read_csv(csv_path) if "pass" in r and r.get("pass")]
    latest: dict[tuple[str, str, str, str], str] = {}
    for r in rows:
        key = (r["machine"], r["device"], r.get("dtype", "fp32"), r["op"])
        latest[key] = max(latest.get(key, ""), r["run_id"])
    parts = [
        "# Fused ops benchmark",
        "",
        "Generated by `benchmarks/bench_ops.py` from `ops.csv` (each op's latest run per machine, device and dtype).",
        "Providers are interleaved in one run: plain torch eager, `torch.compile` of the same plain torch (compile",
        "time in `compile_s`, excluded from the timings), diffusers' own step, and our backends. `given`: the user's",
        "noise tensor; `seed`: noise inside the step (plain torch's `randn_like` is timed, ours is regenerated",
        "in-kernel). `full_loss_path` keeps x_t alive and compiles q_sample and the loss apart (a model sits between",
        "them in a step). The token-routing ops write their output (no reduction after it) and take a given upstream",
        "gradient. `gbps` counts the minimal bytes the case must move; `pct_copy` relates it to `dst.copy_(src)` of",
        "one tensor of the same size timed in the same rotation. `x_vs_*` are speedups (higher is better).",
    ]
    for machine, device, dtype in sorted({k[:3] for k in latest}):
        sel = [
            r
            for r in rows
            if (r["machine"], r["device"], r.get("dtype", "fp32")) == (machine, device, dtype)
            and r["run_id"] == latest[(machine, device, dtype, r["op"])]
        ]
        parts += ["", f"## {machine} ({device}, {dtype})", ""]
        for run_id in sorted({r["run_id"] for r in sel}):
            run = [r for r in sel if r["run_id"] == run_id]
            first, names = run[0], ", ".join(dict.fromkeys(r["op"] for r in run))
            parts.append(
                f"- Run {run_id} ({names}): {first['date']}, torch {first['torch']}, git {first['git_rev']}, "
                f"large-buffer copy {first.get('dram_copy_gbps', '?')} GB/s, host memory "
                f"{first.get('host_memory', 'glibc default')}{' (quick run)' if first.get('quick') == '1' else ''}."
            )
        parts += ["", common.markdown_table(sel, COLUMNS)]
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text("\n".join(parts) + "\n", encoding="utf-8")


if __name__ == "__main__":
    raise SystemExit(main())
