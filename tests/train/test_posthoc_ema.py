"""Post-hoc EMA (EDM2, Karras et al. 2024): the sigma_rel <-> gamma relation, the power-function average against its
definition written out in float64, the reconstruction of an unseen EMA length from snapshots, and a run that keeps
snapshots: its training numbers unchanged, its resume exact, and `sample` / `eval --ema-length` on it."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from conftest import _main, _sample_args, assert_resumed_state, tiny
from safetensors.torch import load_file

from diffcurr_fast import cli_sample
from diffcurr_fast.eval.evaluate import checkpoint_model
from diffcurr_fast.optim.registry import PHEMA_SIGMA_REL_MAX
from diffcurr_fast.runs import checkpoint as ck
from diffcurr_fast.runs.posthoc_ema import (
    gamma_to_sigma_rel,
    list_snapshots,
    power_beta,
    reconstruct,
    remove_snapshots_after,
    sigma_rel_to_gamma,
    snapshot_path,
    solve_coefficients,
    write_snapshot,
)
from diffcurr_fast.train.ema import PowerEMA
from diffcurr_fast.train.loop import Trainer
from diffcurr_fast.train.rundir import clear_run


# ---- sigma_rel and gamma (EDM2 eq. 3) ----------------------------------------------------------------------------
def _eq3(gamma: float) -> float:
    return math.sqrt((gamma + 1) / ((gamma + 2) ** 2 * (gamma + 3)))


@pytest.mark.parametrize("sigma_rel", [1e-3, 0.01, 0.05, 0.07, 0.1, 0.15, 0.2, 0.25, 0.28, 0.288])
def test_sigma_rel_to_gamma_inverts_eq3(sigma_rel):
    gamma = sigma_rel_to_gamma(sigma_rel)
    assert gamma >= 0 and _eq3(gamma) == pytest.approx(sigma_rel, rel=1e-14, abs=0)
    assert gamma_to_sigma_rel(gamma) == pytest.approx(sigma_rel, rel=1e-14, abs=0)


@pytest.mark.parametrize("gamma", [0.0, 0.5, 1.0, 6.94, 16.97, 100.0, 1e4])
def test_gamma_round_trip(gamma):
    assert sigma_rel_to_gamma(_eq3(gamma)) == pytest.approx(gamma, rel=1e-9, abs=1e-12)


def test_edm2_values_and_the_bound():
    """EDM2 Section 3.1: sigma_rel 0.05 and 0.10 are gamma 16.97 and 6.94. The bound: sigma_rel(gamma) rises on
    (-1, (sqrt 5 - 3)/2] to phi^-5/2 ~ 0.3003 and falls after it; gamma = 0 (the running mean) is 12^-1/2 ~ 0.2887,
    the largest sigma_rel accepted (a larger one has two exponents, both < 0)."""
    assert round(sigma_rel_to_gamma(0.05), 2) == 16.97 and round(sigma_rel_to_gamma(0.10), 2) == 6.94
    assert PHEMA_SIGMA_REL_MAX == pytest.approx(_eq3(0.0), rel=1e-15) == pytest.approx(12**-0.5)
    grid = torch.linspace(-0.999, 5.0, 600_001, dtype=torch.float64)
    s = torch.sqrt((grid + 1) / ((grid + 2) ** 2 * (grid + 3)))
    phi = (1 + 5**0.5) / 2
    assert float(s.max()) == pytest.approx(phi**-2.5, rel=1e-9)
    assert float(grid[s.argmax()]) == pytest.approx((5**0.5 - 3) / 2, abs=1e-4)
    assert sigma_rel_to_gamma(PHEMA_SIGMA_REL_MAX) == pytest.approx(0.0, abs=1e-12)


@pytest.mark.parametrize("bad", [0.0, -0.05, 0.289, 0.3, float("nan"), float("inf")])
def test_sigma_rel_out_of_range_is_refused(bad):
    with pytest.raises(ValueError, match=r"sigma_rel must lie in \(0, 0\.288675\]"):
        sigma_rel_to_gamma(bad)


def test_config_fields(tmp_path):
    cfg = tiny(tmp_path)
    assert cfg.optim.phema_every == 0 and cfg.optim.phema_sigma_rels == [0.05, 0.10]
    cfg = tiny(tmp_path, "optim.phema_every=10", "optim.phema_sigma_rels=[0.05, 0.1, 0.2]")
    assert cfg.optim.phema_sigma_rels == [0.05, 0.1, 0.2]
    with pytest.raises(ValueError, match=r"optim.phema_sigma_rels must lie in \(0.0, 0.2886.*\], got 0.3"):
        tiny(tmp_path, "optim.phema_sigma_rels=[0.05, 0.3]")
    with pytest.raises(ValueError, match=r"optim.phema_sigma_rels must be a list of float"):
        tiny(tmp_path, "optim.phema_sigma_rels=0.1")
    with pytest.raises(ValueError, match="must list one or more distinct values"):
        tiny(tmp_path, "optim.phema_every=5", "optim.phema_sigma_rels=[0.1, 0.1]")


# ---- the power-function average (EDM2 eqs. 2, 4) -----------------------------------------------------------------
def _model(n: int = 7) -> torch.nn.Module:
    torch.manual_seed(0)
    m = torch.nn.Linear(n, 1, bias=True)
    m.register_buffer("count", torch.zeros(()))
    return m


def _set(model: torch.nn.Module, vec: torch.Tensor, step: int) -> None:
    """Put the float64 vector ``vec`` into the model's weight and bias; the buffer counts the steps."""
    with torch.no_grad():
        n = model.weight.numel()
        model.weight.copy_(vec[:n].reshape(model.weight.shape))
        model.bias.copy_(vec[n:])
        model.count.fill_(step)


def _flat(module: torch.nn.Module) -> torch.Tensor:
    return torch.cat([module.weight.reshape(-1), module.bias]).double()


def test_power_ema_is_the_profile_weighted_average():
    """After t updates with theta_1..theta_t, the average of exponent gamma is sum_tau w_tau theta_tau with the
    profile (gamma + 1) s^gamma / t^(gamma + 1) integrated over each step's interval (tau - 1, tau]:
    w_tau = (tau^(gamma + 1) - (tau - 1)^(gamma + 1)) / t^(gamma + 1), written here in float64. That is the discrete
    tau^gamma / sum tau^gamma average up to O(gamma / t): after 300 steps 0.09% to 0.16% of the distance between the
    average and the last weights (measured), bounded here at 0.5%."""
    torch.manual_seed(1)
    T = 300
    thetas = torch.randn(T, 8, dtype=torch.float64).cumsum(0)  # (T, 8) a random walk, theta_1 .. theta_T
    model = _model()
    ema = PowerEMA(model, [0.05, 0.10, 0.25])
    for step in range(1, T + 1):
        _set(model, thetas[step - 1], step)
        ema.update(model)
        if step in (1, 2, 3, 10, 50, T):
            tau = torch.arange(1, step + 1, dtype=torch.float64)
            for gamma, m in zip(ema.gammas, ema.modules):
                w = (tau ** (gamma + 1) - (tau - 1) ** (gamma + 1)) / step ** (gamma + 1)  # (step,)
                want = (w[:, None] * thetas[:step]).sum(0)
                tol = 1e-6 * (1 + want.abs().max())  # float32 averages (measured 4e-6 on values up to 34)
                assert torch.allclose(_flat(m), want, rtol=0, atol=tol), (step, gamma)
                assert float(m.count) == step  # buffers copied
    assert ema.num_updates == T
    assert torch.equal(_flat(PowerEMA(model, [0.1]).modules[0]), thetas[-1].float().double())  # starts as the model
    # the discrete tau^gamma weights: the same average up to the discretisation of the profile
    tau = torch.arange(1, T + 1, dtype=torch.float64)
    for gamma, m in zip(ema.gammas, ema.modules):
        w = tau**gamma / (tau**gamma).sum()
        want = (w[:, None] * thetas).sum(0)
        spread = (thetas[-1] - want).abs().max()  # how far the average is from the last weights
        assert (_flat(m) - want).abs().max() < 5e-3 * spread, gamma


def test_power_ema_first_update_takes_the_weights_and_beta_is_eq4():
    assert power_beta(1, 6.94) == 0.0
    assert power_beta(10, 6.94) == pytest.approx(0.9**7.94, rel=1e-15)
    model = _model()
    ema = PowerEMA(model)
    _set(model, torch.arange(8, dtype=torch.float64), 1)
    ema.update(model)
    for m in ema.modules:
        assert torch.equal(_flat(m), torch.arange(8, dtype=torch.float64))


def test_masked_update_matches_the_host_update():
    """``update(model, ok)`` (the device-side step): a false ``ok`` changes nothing, a true one gives the host
    update's values (its beta computed in float64 on the device)."""
    torch.manual_seed(2)
    thetas = torch.randn(40, 8, dtype=torch.float64)
    model = _model()
    host, dev = PowerEMA(model), PowerEMA(model)
    for step in range(1, 41):
        _set(model, thetas[step - 1], step)
        host.update(model)
        before = [_flat(m).clone() for m in dev.modules]
        dev.update(model, torch.tensor(False))
        assert all(torch.equal(b, _flat(m)) for b, m in zip(before, dev.modules))
        dev.update(model, torch.tensor(True))
    assert dev.num_updates == host.num_updates == 40
    for a, b in zip(host.modules, dev.modules):
        assert torch.allclose(_flat(a), _flat(b), rtol=0, atol=1e-6)


def test_power_ema_state_dict_resumes_exactly():
    torch.manual_seed(3)
    thetas = torch.randn(30, 8, dtype=torch.float64)
    model = _model()
    full, half = PowerEMA(model), PowerEMA(model)
    for step in range(1, 31):
        _set(model, thetas[step - 1], step)
        full.update(model)
        if step <= 12:
            half.update(model)
        if step == 12:
            resumed = PowerEMA(_model())
            resumed.load_state_dict(half.state_dict())
        if step > 12:
            resumed.update(model)
    for a, b in zip(full.modules, resumed.modules):
        assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    with pytest.raises(ValueError, match=r"kept for sigma_rels \[0.05, 0.1\], not \[0.07\]"):
        PowerEMA(model, [0.07]).load_state_dict(full.state_dict())


# ---- reconstruction (EDM2 Appendix C.2) --------------------------------------------------------------------------
def _track(thetas: torch.Tensor, sigma_rels, every: int, run_dir=None):
    """PowerEMA over the rows of ``thetas`` (the parameters of steps 1..T); snapshots every ``every`` steps (and at
    the end) written to ``run_dir``. Returns the tracker."""
    model = _model(thetas.shape[1] - 1)
    ema = PowerEMA(model, sigma_rels)
    T = len(thetas)
    for step in range(1, T + 1):
        _set(model, thetas[step - 1], step)
        ema.update(model)
        if run_dir is not None and (step % every == 0 or step == T):
            for s, m in zip(ema.sigma_rels, ema.modules):
                write_snapshot(run_dir, step, s, ema.num_updates, m.state_dict(), ema.buffer_names(), {"step": step})
    return ema


@pytest.fixture(scope="module")
def walk(tmp_path_factory):
    """Snapshots of sigma_rel 0.05 and 0.10 every 25 steps of a 1000-step random walk of 65 parameters."""
    torch.manual_seed(4)
    thetas = (torch.randn(1000, 65, dtype=torch.float64) * 0.1).cumsum(0)
    run = tmp_path_factory.mktemp("walk")
    ema = _track(thetas, [0.05, 0.10], 25, run)
    return thetas, run, ema


def test_reconstructing_an_unseen_length_matches_tracking_it(walk):
    """sigma_rel 0.07 reconstructed at step 1000 from the 80 snapshots (40 steps x 2 lengths) against the
    PowerEMA tracked at 0.07 all along. Measured: the largest error is 4.6e-5, 4e-5 of the largest distance between
    the 0.05 and 0.10 averages (1.16; the 0.07 average is 0.45 from the 0.05 one), float32 rounding of the snapshots
    included; the test allows 1e-3 (with snapshots every 100 steps instead of 25 the error is 2.6e-3)."""
    thetas, run, _ = walk
    state, how = reconstruct(run, 0.07)
    direct = _flat(_track(thetas, [0.07], 0).modules[0])
    rec = torch.cat([state["weight"].reshape(-1), state["bias"]]).double()
    a, b = (torch.cat([v["weight"].reshape(-1), v["bias"]]).double() for v in _last_pair(run))
    scale = (a - b).abs().max()
    err = (rec - direct).abs().max()
    assert how.step == how.t == 1000 and len(how.snapshots) == 80
    assert float(how.coefficients.sum()) == pytest.approx(1.0, abs=1e-12)
    assert err < 1e-3 * scale, (float(err), float(scale))
    assert state["count"] == 1000 and state["weight"].dtype == torch.float32


def _last_pair(run):
    return [load_file(str(snapshot_path(run, 1000, s))) for s in (0.05, 0.10)]


@pytest.mark.parametrize("sigma_rel", [0.05, 0.10])
def test_reconstructing_a_tracked_length_gives_its_snapshot(walk, sigma_rel):
    thetas, run, ema = walk
    state, how = reconstruct(run, sigma_rel)
    snaps = how.snapshots
    one_hot = torch.tensor([1.0 if (s.step, s.sigma_rel) == (1000, sigma_rel) else 0.0 for s in snaps])
    assert torch.allclose(how.coefficients, one_hot.double(), rtol=0, atol=1e-9), how.coefficients  # measured 4e-13
    snap = load_file(str(snapshot_path(run, 1000, sigma_rel)))
    for key in ("weight", "bias"):
        assert torch.allclose(state[key], snap[key], rtol=0, atol=1e-5)


def test_solve_coefficients_single_snapshot_and_earlier_step(walk):
    assert solve_coefficients([100], [6.94], 100, 16.97).tolist() == [1.0]
    _, run, _ = walk
    state, how = reconstruct(run, 0.07, step=512)  # the newest snapshot up to step 512: step 500
    assert how.step == 500 and all(s.step <= 500 for s in how.snapshots) and state["count"] == 500
    with pytest.raises(ValueError, match="no post-hoc EMA snapshot at or before step 3"):
        reconstruct(run, 0.07, step=3)


# ---- a run that keeps snapshots ----------------------------------------------------------------------------------
SETS = (
    "engine.max_steps=7",
    "checkpoint.every=3",
    "checkpoint.keep_last=5",
    "engine.device=cpu",
    "model.class_dropout_prob=0.5",
)


def _records(run):
    """metrics.jsonl without its timings."""
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in ("img_per_s", "train_s")} for r in recs]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same 7-step run without and with optim.phema_every=3 (snapshots at 3, 6 and the end, 7)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    base = tmp_path_factory.mktemp("phema")
    Trainer(tiny(base / "plain", *SETS)).fit()
    Trainer(tiny(base / "phema", *SETS, "optim.phema_every=3")).fit()
    yield base / "plain", base / "phema"
    torch.set_num_threads(n)


def test_snapshots_leave_the_run_unchanged(runs):
    plain, phema = runs
    names = sorted(p.name for p in (phema / "phema").iterdir())
    assert names == [f"phema-{s:08d}-{r}.safetensors" for s in (3, 6, 7) for r in ("0.05", "0.1")]
    assert not (plain / "phema").exists()
    assert _records(plain) == _records(phema) and _records(plain)
    a, b = (ck.load_checkpoint(ck.latest_checkpoint(r)) for r in runs)
    assert "phema" not in a and b["phema"]["num_updates"] == 7 and b["phema"]["sigma_rels"] == [0.05, 0.1]
    for key in ("model",):
        assert all(torch.equal(v, b[key][k]) for k, v in a[key].items())
    assert all(torch.equal(v, b["ema"]["module"][k]) for k, v in a["ema"]["module"].items())
    assert all(torch.equal(v, load_file(str(phema / "ema.safetensors"))[k]) for k, v in b["ema"]["module"].items())
    # the final snapshots are the checkpoint's averages
    for s, sd in zip((0.05, 0.1), b["phema"]["modules"]):
        snap = load_file(str(snapshot_path(phema, 7, s)))
        assert snap.keys() == sd.keys() and all(torch.equal(v, snap[k]) for k, v in sd.items())
    assert [(s.step, s.t) for s in list_snapshots(phema)][::2] == [(3, 3), (6, 6), (7, 7)]


def test_resume_continues_the_averages_exactly(runs, tmp_path):
    """Resumed from the step-3 checkpoint, the run writes the same snapshots and averages; a snapshot left after
    the checkpoint by an earlier attempt is removed."""
    _, phema = runs
    half = tmp_path / "half"
    (half / ck.CKPT_DIR).mkdir(parents=True)
    shutil.copy(phema / ck.CKPT_DIR / "ckpt_00000003.pt", half / ck.CKPT_DIR)
    shutil.copytree(phema / "phema", half / "phema")
    stale = snapshot_path(half, 9, 0.05)
    shutil.copy(snapshot_path(phema, 7, 0.05), stale)
    torch.manual_seed(12345)
    tr = Trainer(tiny(half, *SETS, "optim.phema_every=3"), resume=True)
    assert tr.step == 3 and not stale.exists()
    assert [(s.step, s.sigma_rel) for s in list_snapshots(half)] == [(3, 0.05), (3, 0.1)]  # the resumed step's stay
    tr.fit()
    assert [(s.path.name, s.t) for s in list_snapshots(half)] == [(s.path.name, s.t) for s in list_snapshots(phema)]
    for step in (3, 6, 7):
        for s in (0.05, 0.1):
            a, b = (load_file(str(snapshot_path(r, step, s))) for r in (phema, half))
            assert all(torch.equal(v, b[k]) for k, v in a.items()), (step, s)
    a, b = (ck.load_checkpoint(ck.latest_checkpoint(r)) for r in (phema, half))
    assert a["phema"]["num_updates"] == b["phema"]["num_updates"] == 7
    assert_resumed_state(a, b)


def test_remove_snapshots_after_keeps_the_step_itself_and_other_files(tmp_path):
    meta = {"config": {}}
    for step in (2, 3, 4, 10):
        write_snapshot(tmp_path, step, 0.05, step, {"w": torch.zeros(2)}, [], meta)
    (tmp_path / "phema" / "phema-notes.txt").write_text("mine")
    gone = remove_snapshots_after(tmp_path, 3)
    assert sorted(p.name for p in gone) == [snapshot_path(tmp_path, s, 0.05).name for s in (4, 10)]
    assert [s.step for s in list_snapshots(tmp_path)] == [2, 3] and (tmp_path / "phema" / "phema-notes.txt").is_file()
    assert remove_snapshots_after(tmp_path, 3) == [] and remove_snapshots_after(tmp_path / "none", 0) == []


def test_resume_refuses_to_start_tracking_midway(runs, tmp_path):
    plain, _ = runs
    run = tmp_path / "run"
    shutil.copytree(plain, run)
    with pytest.raises(ValueError, match="cannot resume: optim.phema_every is set but the checkpoint kept no"):
        Trainer(tiny(run, *SETS, "engine.max_steps=9", "optim.phema_every=3"), resume=True)
    with pytest.raises(ValueError, match=r"cannot resume: .*sigma_rels \[0.05, 0.1\], not \[0.07\]"):
        Trainer(tiny(runs[1], *SETS, "optim.phema_every=3", "optim.phema_sigma_rels=[0.07]"), resume=True)


def test_sample_and_eval_with_ema_length(runs, tmp_path, capsys):
    plain, phema = runs
    out = tmp_path / "s.npz"
    args = _sample_args("--ckpt", str(phema), "--ema-length", "0.07", "--steps", "2", "--num", "3", "--out", str(out))
    assert cli_sample.run(args) == 0
    assert "post-hoc EMA sigma_rel 0.07 at step 7 from 6 snapshots" in capsys.readouterr().out and out.is_file()
    # eval's loader: the reconstruction of a tracked length is its last snapshot
    model, _ = checkpoint_model(phema, ema_length=0.05)
    snap = load_file(str(snapshot_path(phema, 7, 0.05)))
    assert all(torch.allclose(v, snap[k], rtol=0, atol=1e-6) for k, v in model.state_dict().items())
    # a run without snapshots: one line naming the field
    rc, err = _main(capsys, "sample", "--ckpt", str(plain), "--ema-length", "0.07", "--out", str(tmp_path / "x.png"))
    assert rc != 0 and err.count("\n") == 1 and "optim.phema_every" in err and "no post-hoc EMA snapshots" in err
    rc, err = _main(
        capsys, "sample", "--ckpt", str(phema), "--ema-length", "0.07", "--weights", "model", "--out", str(out) + ".png"
    )
    assert rc != 0 and "drop --weights model" in err


def test_device_side_step_keeps_the_same_averages(runs, tmp_path):
    """engine.cuda_graphs (the update masked by the vote on the device, its count on the device): the same bits."""
    _, phema = runs
    Trainer(tiny(tmp_path / "graphs", *SETS, "optim.phema_every=3", "engine.cuda_graphs=true")).fit()
    for step in (3, 6, 7):
        for s in (0.05, 0.1):
            a, b = (load_file(str(snapshot_path(r, step, s))) for r in (phema, tmp_path / "graphs"))
            assert all(torch.equal(v, b[k]) for k, v in a.items()), (step, s)


def test_overwrite_clears_the_snapshots(runs, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(runs[1], run)
    (run / "phema" / "notes.txt").write_text("mine")
    removed = clear_run(run)
    assert sum(p.parent.name == "phema" for p in removed) == 6 and not list_snapshots(run)
    assert (run / "phema" / "notes.txt").is_file()
