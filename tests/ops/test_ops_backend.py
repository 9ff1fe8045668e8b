"""Dispatch rules, torch.library registration (opcheck) and torch.compile of the fused ops."""

import warnings

import pytest
import torch
from conftest import op_backends

import diffcurr_fast.ops as ops
from diffcurr_fast.diffusion import DDPMSchedule
from diffcurr_fast.ops import _backend

CPU = torch.device("cpu")
SCHED = DDPMSchedule(1000)


def _cpu_backends(op: str) -> list[str]:
    return [b for b in ("reference", "cpu", "triton") if _backend.unavailable_reason(b, op, CPU) is None]


def test_auto_on_cpu_never_picks_triton(monkeypatch):
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    for op in ("q_sample", "diffusion_loss_fwd", "sample_timesteps", "adaln_modulate_fwd", "randn_like"):
        name = _backend.resolve(op, CPU)
        assert name in ("cpu", "reference")
        assert name == ("cpu" if _backend.unavailable_reason("cpu", op, CPU) is None else "reference")


def test_fallback_warns_once(monkeypatch):
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    monkeypatch.setattr(_backend, "_warned", set())
    monkeypatch.setattr(_backend, "_ext_has", lambda op, key: False)  # as if the extension lacked the op
    with pytest.warns(RuntimeWarning, match="falling back to the 'reference' backend"):
        assert _backend.unavailable_reason("cpu", "q_sample", CPU) is not None
        assert _backend.resolve("q_sample", CPU) == "reference"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.resolve("q_sample", CPU) == "reference"


def test_auto_on_a_cuda_device_prefers_cuda_then_triton_then_reference(monkeypatch):
    """The order that tests/ops/test_ops_gpu.py sees on a GPU, with what is available set by hand."""
    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    monkeypatch.setattr(_backend, "_warned", set())
    cuda = torch.device("cuda")
    monkeypatch.setattr(_backend, "_ext_error", lambda: None)
    monkeypatch.setattr(_backend, "_ext_has", lambda op, key: True)
    monkeypatch.setattr(_backend, "_triton_error", lambda: None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _backend.resolve("q_sample", cuda) == "cuda"
    monkeypatch.setattr(_backend, "_ext_has", lambda op, key: key != "CUDA")  # an extension built for the CPU only
    with pytest.warns(
        RuntimeWarning, match=r"falling back to the 'triton' backend on cuda \(diffcurr_fast._C was built"
    ):
        assert _backend.resolve("q_sample", cuda) == "triton"
    monkeypatch.setattr(_backend, "_triton_error", lambda: "triton is not installed")
    with pytest.warns(RuntimeWarning, match=r"'reference' backend on cuda \(.*; triton is not installed\)"):
        assert _backend.resolve("adaln_modulate_fwd", cuda) == "reference"
    assert _backend.resolve("q_sample", torch.device("meta")) == "reference"


def test_explicit_backend_unavailable_raises(monkeypatch):
    monkeypatch.setattr(_backend, "_ext_has", lambda op, key: False)
    with pytest.raises(RuntimeError, match="'cpu' requested"):
        _backend.resolve("q_sample", CPU, "cpu")
    with pytest.raises(RuntimeError, match="'cuda' requested.*CUDA tensors"):
        _backend.resolve("q_sample", CPU, "cuda")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        _backend.resolve("q_sample", CPU, "triton")


def test_env_var_forces_backend(monkeypatch):
    monkeypatch.setenv(_backend.ENV_VAR, "reference")
    assert _backend.resolve("q_sample", CPU) == "reference"
    monkeypatch.setenv(_backend.ENV_VAR, "cuda")
    with pytest.raises(RuntimeError, match="'cuda' requested"):
        _backend.resolve("q_sample", CPU)
    monkeypatch.setenv(_backend.ENV_VAR, "turbo")
    with pytest.raises(ValueError, match="turbo"):
        _backend.resolve("q_sample", CPU)
    x0 = torch.randn(2, 3)
    with pytest.raises(ValueError, match="turbo"):
        ops.q_sample(x0, torch.tensor([1, 2]), SCHED, seed=0)


def test_missing_extension_is_handled(monkeypatch):
    monkeypatch.setattr(_backend, "_ext_error", lambda: "the C++ extension diffcurr_fast._C is not importable")
    assert "cpu" not in _backend.available_backends("q_sample", CPU)
    with pytest.raises(RuntimeError, match="not importable"):
        _backend.resolve("q_sample", CPU, "cpu")


# ---- opcheck: schema, fake tensors, autograd registration, AOT dispatch ------------------------------------
def _opcheck_cases(backend: str):
    B, M = 3, 10
    x0, noise, pred = torch.randn(B, 2, 5), torch.randn(B, 2, 5), torch.randn(B, 2, 5, requires_grad=True)
    a, c = torch.rand(B), torch.rand(B)
    x = torch.randn(B, 4, 6, requires_grad=True)
    shift, scale, gate = (torch.randn(B, 6, requires_grad=True) for _ in range(3))
    y = torch.randn(B, 4, 6, requires_grad=True)
    _, mean, rstd = torch.ops.diffcurr_fast.adaln_modulate(x.detach(), shift.detach(), scale.detach(), 1e-6, backend)
    return [
        (torch.ops.diffcurr_fast.randn.default, (7, [3, M], CPU, backend)),
        *_forward_cases(backend, x0, noise, pred.detach(), a, c),
        (torch.ops.diffcurr_fast.sample_timesteps.default, (torch.rand(12), 5, 3, backend)),
        (torch.ops.diffcurr_fast.adaln_modulate.default, (x, shift, scale, 1e-6, backend)),
        (
            torch.ops.diffcurr_fast.adaln_modulate_backward.default,
            (torch.randn(B, 4, 6), x.detach(), scale.detach(), mean, rstd, backend),
        ),
        (torch.ops.diffcurr_fast.gated_residual.default, (x, gate, y, backend)),
        (
            torch.ops.diffcurr_fast.gated_residual_backward.default,
            (torch.randn(B, 4, 6), gate.detach(), y.detach(), backend),
        ),
    ]


def _forward_cases(backend, x0, noise, pred, a, c):
    """q_sample and the loss forward: the raw C++ kernels for 'cpu' (called directly by the public ops, with a
    fake registered for torch.compile), the forward-only custom ops for 'reference' and 'triton'."""
    if backend == "cpu":
        raw = torch.ops.diffcurr_fast_C
        return [
            (raw.q_sample.default, (x0, a, c, noise, 0)),
            (raw.q_sample.default, (x0, a, c, None, 5)),
            (raw.diffusion_loss_fwd.default, (pred, x0, noise, 0, a, c, c, True, 0.25)),
            (raw.diffusion_loss_fwd.default, (pred, x0, None, 9, torch.zeros_like(a), c, c, True, 1.0)),
        ]
    return [
        (torch.ops.diffcurr_fast.q_sample.default, (x0, a, c, noise, 0, backend)),
        (torch.ops.diffcurr_fast.q_sample.default, (x0, a, c, None, 5, backend)),
        (torch.ops.diffcurr_fast.diffusion_loss.default, (pred, x0, noise, 0, a, c, c, True, 0.25, backend)),
        (torch.ops.diffcurr_fast.diffusion_loss.default, (pred, x0, None, 9, a, c, c, False, 1.0, backend)),
    ]


@pytest.mark.parametrize("backend", op_backends("reference", "cpu", "triton"))
def test_opcheck(backend):
    if _backend.unavailable_reason(backend, "q_sample", CPU) is not None:
        pytest.skip(_backend.unavailable_reason(backend, "q_sample", CPU))
    ops_to_check = _opcheck_cases(backend)
    tests = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    if backend == "triton":
        tests = ("test_schema", "test_autograd_registration", "test_faketensor")  # interpreter: keep it short
    for op, args in ops_to_check:
        torch.library.opcheck(op, args, test_utils=tests)


# ---- torch.compile ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", op_backends("reference", "cpu"))
def test_compile_fullgraph_training_step(backend):
    if backend not in _cpu_backends("diffusion_loss_fwd"):
        pytest.skip(_backend.unavailable_reason(backend, "diffusion_loss_fwd", CPU))
    sched = DDPMSchedule(1000)
    x0 = torch.randn(3, 2, 4, 5)
    t = torch.tensor([0, 411, 999])

    def step(x0, t, wgt):
        xt = ops.q_sample(x0, t, sched, seed=1234, backend=backend)
        pred = xt * wgt  # (B, C, H, W): a stand-in for the model
        return ops.diffusion_loss(
            pred, x0, None, t, sched, prediction="v", weighting="min_snr", seed=1234, backend=backend
        )

    def step_coef(x0, s, wgt):
        xt = ops.q_sample_coef(x0, 1 - s, s, seed=99, backend=backend)  # flow / SiT
        return ops.diffusion_loss_coef(xt * wgt, x0, None, -1.0, 1.0, None, seed=99, backend=backend)

    def block(x, mod):
        shift, scale, gate = mod.chunk(3, dim=1)
        return ops.gated_residual(x, gate, ops.adaln_modulate(x, shift, scale, backend=backend), backend=backend)

    def draw(w):
        return ops.sample_timesteps(16, w, seed=4, validate=False, return_importance=True, backend=backend)

    cases = [
        (step, (x0, t, torch.randn(2, 4, 5, requires_grad=True))),
        (step_coef, (x0, torch.rand(3), torch.randn(2, 4, 5, requires_grad=True))),
        (block, (torch.randn(2, 3, 10, requires_grad=True), torch.randn(2, 30, requires_grad=True))),
        (draw, (torch.rand(50),)),
    ]
    for fn, args in cases:
        eager = fn(*args)  # also builds the schedule tables the compiled graph reads
        compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")(*args)
        for e, c in zip(
            eager if isinstance(eager, tuple) else (eager,), compiled if isinstance(compiled, tuple) else (compiled,)
        ):
            torch.testing.assert_close(c, e)
        if eager.requires_grad if isinstance(eager, torch.Tensor) else False:
            leaves = [a for a in args if a.requires_grad]
            ge = torch.autograd.grad(eager.sum(), leaves)
            gc = torch.autograd.grad(compiled.sum(), leaves)
            for a, b in zip(ge, gc):
                torch.testing.assert_close(a, b)


def test_compile_inductor_loss_path():
    sched = DDPMSchedule(1000)
    x0 = torch.randn(3, 37)
    t = torch.tensor([3, 500, 998])

    def step(x0, t, w):
        xt = ops.q_sample(x0, t, sched, seed=5)
        return ops.diffusion_loss(xt * w, x0, None, t, sched, weighting="min_snr", seed=5)

    w = torch.randn(37, requires_grad=True)
    eager = step(x0, t, w)
    (ge,) = torch.autograd.grad(eager, w)
    compiled = torch.compile(step, fullgraph=True)(x0, t, w)
    (gc,) = torch.autograd.grad(compiled, w)
    torch.testing.assert_close(compiled, eager)
    torch.testing.assert_close(gc, ge)


@pytest.mark.parametrize("schedule", ["DDPMSchedule", "alphas_cumprod"])
@pytest.mark.parametrize("noise_mode", ["given", "seed"])
def test_compiled_training_step_with_a_model(noise_mode, schedule):
    # forward process, a model and the loss compiled by inductor as one graph with its backward (fullgraph=True
    # fails on any graph break); the compiled loss and gradients match eager. The schedule is ours, or a plain
    # float32 alphas_cumprod tensor as a diffusers user holds it (its table is built inside the graph).
    if "cpu" not in _cpu_backends("diffusion_loss_fwd"):
        pytest.skip(_backend.unavailable_reason("cpu", "diffusion_loss_fwd", CPU))
    torch.manual_seed(0)
    sched = DDPMSchedule(1000)
    if schedule == "alphas_cumprod":
        sched = sched.alphas_cumprod.float()
    net = torch.nn.Sequential(torch.nn.Conv2d(2, 8, 3, padding=1), torch.nn.GELU(), torch.nn.Conv2d(8, 2, 1))
    x0, t = torch.randn(5, 2, 6, 7), torch.tensor([0, 10, 300, 871, 999])
    noise = torch.randn_like(x0) if noise_mode == "given" else None
    seed = None if noise is not None else 77

    def step(x0, t):
        xt = ops.q_sample(x0, t, sched, noise, seed=seed, validate=False)
        pred = net(xt)  # (B, C, H, W)
        return ops.diffusion_loss(
            pred, x0, noise, t, sched, prediction="eps", weighting="min_snr", seed=seed, validate=False
        )

    eager = step(x0, t)
    eager.backward()
    ge = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    compiled = torch.compile(step, fullgraph=True)(x0, t)
    compiled.backward()
    torch.testing.assert_close(compiled, eager)
    for p, g in zip(net.parameters(), ge):
        torch.testing.assert_close(p.grad, g)


@pytest.mark.parametrize("noise_mode", ["given", "seed"])
def test_compiled_ops_hand_inductor_their_definition_with_given_noise(noise_mode):
    # under torch.compile with the noise given, q_sample and the loss trace their plain-torch definition (inductor
    # fuses it with the model's kernels); with in-kernel Philox noise the graph calls the C++ kernels
    if "cpu" not in _cpu_backends("diffusion_loss_fwd"):
        pytest.skip(_backend.unavailable_reason("cpu", "diffusion_loss_fwd", CPU))
    sched = DDPMSchedule(1000)
    x0, t = torch.randn(3, 2, 5), torch.tensor([1, 500, 999])
    noise, seed = (torch.randn_like(x0), None) if noise_mode == "given" else (None, 8)
    w = torch.randn(2, 5, requires_grad=True)

    def step(x0, t, w):
        xt = ops.q_sample(x0, t, sched, noise, seed=seed, validate=False)
        return ops.diffusion_loss(xt * w, x0, noise, t, sched, weighting="min_snr", seed=seed, validate=False)

    eager = step(x0, t, w)
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(step, fullgraph=True, backend=record)(x0, t, w)
    torch.testing.assert_close(compiled, eager)
    targets = " ".join(str(n.target) for gm in graphs for n in gm.graph.nodes)
    assert ("diffcurr_fast_C" in targets or "autograd_function_apply" in targets) == (noise_mode == "seed"), targets


def test_compiled_step_checks_a_tensor_schedule_in_the_graph():
    # the range check of an alphas_cumprod tensor runs inside the compiled graph (no host read), and still fails
    def step(x0, t, abar):
        return ops.q_sample(x0, t, abar, seed=3, validate=False)

    x0, t = torch.randn(4, 9), torch.tensor([0, 1, 2, 3])
    fn = torch.compile(step, fullgraph=True)
    torch.testing.assert_close(fn(x0, t, torch.linspace(0.9, 0.1, 10)), step(x0, t, torch.linspace(0.9, 0.1, 10)))
    with pytest.raises(RuntimeError, match="alphas_cumprod values must be finite"):
        fn(x0, t, torch.linspace(1.5, 0.1, 10))


# ---- a fused DiT block compiles as one graph on every branch of the dispatch ------------------------------
def _capture_only(graphs):
    """A torch.compile backend that records each graph and never runs it (the stubbed kernels cannot run here)."""

    def backend(gm, example_inputs):
        graphs.append(gm)
        (out,) = [n for n in gm.graph.nodes if n.op == "output"]
        values = [torch.zeros(v.meta["example_value"].shape) for v in out.args[0]]  # the graph's outputs, as zeros
        return lambda *args: values

    return backend


@pytest.mark.parametrize("modern", [False, True], ids=["dit", "modern"])
@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-autocast"])
@pytest.mark.parametrize("name", ["reference", "cpu", "triton", "cuda"])
def test_fused_dit_block_compiles_fullgraph_on_every_branch(monkeypatch, name, mixed, modern):
    # The block's ops resolve their backend while traced; each resolved name is forced with a stub (a CUDA-present
    # machine resolves 'cuda', and with mixed dtypes gated_residual then asks whether Triton can take them), so
    # every branch is traced here, on CPU. Any availability check that runs inside the trace (an import, a cache
    # lookup) is a graph break, which fullgraph=True turns into an error.
    from diffcurr_fast.models.dit import DiTBlock

    monkeypatch.delenv(_backend.ENV_VAR, raising=False)
    monkeypatch.setattr(_backend, "resolve", lambda op, device, backend=None: name)
    from diffcurr_fast.models.modern import rope2d_tables

    torch._dynamo.reset()  # each case compiles DiTBlock.forward anew: past dynamo's recompile limit otherwise
    options = dict(norm="rmsnorm", qk_norm=True, mlp="swiglu") if modern else {}
    block = DiTBlock(16, 2, mlp_ratio=2.0, fused_adaln=True, **options)
    x, c = torch.randn(2, 4, 16), torch.randn(2, 16)
    rope = rope2d_tables(2, 8) if modern else None  # the modern block's 2-D rotation of a 2x2 token grid
    graphs: list = []
    compiled = torch.compile(block, fullgraph=True, backend=_capture_only(graphs))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
        compiled(x, c, None, rope)
    assert len(graphs) == 1
