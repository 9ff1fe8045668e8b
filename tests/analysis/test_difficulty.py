import argparse
import csv
import math

import pytest
import torch
from torch import nn

from diffcurr_fast.analysis import cli_analyze as cli
from diffcurr_fast.analysis.difficulty import (
    consecutive_kl,
    convergence_by_interval,
    gaussian_consecutive_kl,
    mixture_log_densities,
    plot_convergence,
    plot_kl,
    steps_to_fraction,
    write_convergence_csv,
    write_kl_csv,
)
from diffcurr_fast.data.builtin import load_digits_tensors
from diffcurr_fast.diffusion import DDPMSchedule


def toy_schedule(T=20):
    return DDPMSchedule(betas=torch.linspace(0.02, 0.2, T, dtype=torch.float64))


# ---- mixture densities --------------------------------------------------------------------------------------
@pytest.mark.parametrize("B,N,D", [(1, 1, 1), (3, 17, 5), (17, 9, 3)])
def test_mixture_log_densities_vs_float64_reference(B, N, D):
    gen = torch.Generator().manual_seed(B * 100 + N)
    x = torch.randn(B, D, generator=gen, dtype=torch.float64)
    centres = torch.randn(N, D, generator=gen, dtype=torch.float64)
    params = [(0.9, 0.3), (0.5, 1.7), (1.0, 0.05)]
    got = mixture_log_densities(x, centres, params, chunk_size=4)  # several chunks
    for (a, c), g in zip(params, got):
        comp = torch.distributions.Normal(a * centres[None], c).log_prob(x[:, None]).sum(-1)  # (B, N)
        ref = torch.logsumexp(comp, 1) - math.log(N)
        torch.testing.assert_close(g, ref, rtol=1e-10, atol=1e-9)


# ---- KL between consecutive marginals ---------------------------------------------------------------------------
@pytest.mark.parametrize("estimator", ["direct", "ratio", "auto"])
@pytest.mark.parametrize("t", [2, 9, 17])
def test_kl_single_point_closed_form(estimator, t):
    sched = toy_schedule()
    point = torch.tensor([[0.7, -1.2, 0.3]], dtype=torch.float64)
    gen = torch.Generator().manual_seed(t)
    # the direct estimator is noisier: enough draws that its 4-stderr band is narrower than the KL itself
    n = 200_000 if estimator == "direct" else 4000
    est = consecutive_kl(point, sched, [t], num_samples=n, batch_size=4999, estimator=estimator, generator=gen)
    exact = gaussian_consecutive_kl(sched, t, point[0])
    assert exact > 0
    assert abs(float(est.kl[0]) - exact) <= 4 * float(est.stderr[0]) + 1e-12
    # informative, not just wide: an estimate of 0 (or of twice the KL) would fail the band above
    assert 4 * float(est.stderr[0]) < (0.5 if estimator == "direct" else 0.4) * exact


def test_kl_gaussian_data_matches_gaussian_closed_form():
    # Many points from N(0, s^2) in 1-D: the empirical marginals are close to N(0, a^2 s^2 + c^2).
    sched = toy_schedule()
    gen = torch.Generator().manual_seed(0)
    s = 0.5
    data = s * torch.randn(6000, 1, generator=gen, dtype=torch.float64)
    ts = [6, 12]
    est = consecutive_kl(data, sched, ts, num_samples=3000, batch_size=1000, generator=gen)
    for k, t in enumerate(ts):
        a0, a1 = sched.alphas_cumprod[t], sched.alphas_cumprod[t + 1]
        v0, v1 = float(a0 * s * s + 1 - a0), float(a1 * s * s + 1 - a1)
        exact = 0.5 * (v0 / v1 - 1 - math.log(v0 / v1))
        assert abs(float(est.kl[k]) - exact) <= 4 * float(est.stderr[k]) + 0.05 * exact


def test_kl_digits_decreases_with_t():
    x, _ = load_digits_tensors()
    assert x.shape == (1797, 1, 8, 8) and float(x.min()) == -1.0 and float(x.max()) == 1.0
    sched = DDPMSchedule(1000)
    gen = torch.Generator().manual_seed(0)
    est = consecutive_kl(x[:300], sched, [10, 300, 900], num_samples=200, generator=gen)
    assert bool((est.kl > 0).all()) and float(est.kl[0]) > float(est.kl[1]) > float(est.kl[2])


def test_kl_bad_inputs():
    sched = toy_schedule()
    data = torch.zeros(4, 2)
    with pytest.raises(ValueError, match=r"\[0, 18\]"):
        consecutive_kl(data, sched, [19], 10)
    with pytest.raises(ValueError, match="unknown estimator 'exact'"):
        consecutive_kl(data, sched, [1], 10, estimator="exact")
    with pytest.raises(ValueError, match="num_samples"):
        consecutive_kl(data, sched, [1], 1)
    with pytest.raises(ValueError, match="integer"):
        consecutive_kl(data, sched, [1.5], 10)


# ---- convergence per interval ----------------------------------------------------------------------------------
class TinyDenoiser(nn.Module):
    """A small conv net with a timestep embedding, called as model(x, t, y)."""

    def __init__(self, T: int = 20):
        super().__init__()
        self.embed = nn.Embedding(T, 8)
        self.inp = nn.Conv2d(1, 8, 3, padding=1)
        self.out = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x, t, y):
        h = self.inp(x) + self.embed(t)[:, :, None, None]  # (B, 8, H, W)
        return self.out(torch.relu(h))  # (B, 1, H, W)


def test_convergence_by_interval_tiny_net(tmp_path):
    x, y = load_digits_tensors()
    sched = toy_schedule()
    res = convergence_by_interval(
        lambda: TinyDenoiser(20),
        x[:257],
        sched,
        [(0, 7), (7, 20)],
        steps=40,
        batch_size=17,
        lr=3e-3,
        labels=y[:257],
        eval_every=5,
        eval_size=33,
    )
    assert [r.interval for r in res.intervals] == [(0, 7), (7, 20)]
    for rec in res.intervals:
        assert rec.eval_steps == [0, 5, 10, 15, 20, 25, 30, 35, 40] and len(rec.train_loss) == 40
        assert rec.normalised[0] == 1.0 and rec.eval_loss[-1] < rec.eval_loss[0]
        assert rec.steps_to_fraction is not None and 0 < rec.steps_to_fraction <= 40
    write_convergence_csv(res, tmp_path / "c.csv", tmp_path / "s.csv")
    plot_convergence(res, tmp_path / "c.png")
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert len(rows) == 2 and rows[0]["steps_to_90pct"] == str(res.intervals[0].steps_to_fraction)
    assert len(list(csv.DictReader((tmp_path / "c.csv").open()))) == 18
    assert (tmp_path / "c.png").stat().st_size > 1000
    with pytest.raises(ValueError, match="interval"):
        convergence_by_interval(lambda: TinyDenoiser(20), x[:8], sched, [(5, 5)], steps=1)


def test_steps_to_fraction():
    steps = [0, 10, 20, 30, 40]
    assert steps_to_fraction(steps, [1.0, 0.5, 0.2, 0.11, 0.1], 0.9) == 30  # gain 0.9 -> needs L <= 0.19
    assert steps_to_fraction(steps, [1.0, 0.5, 0.2, 0.11, 0.1], 0.5) == 10
    assert steps_to_fraction(steps, [1.0, 1.1, 1.2, 1.3, 1.4], 0.9) is None


def test_kl_csv_and_plot(tmp_path):
    est = consecutive_kl(torch.randn(5, 3), toy_schedule(), [1, 4, 7], num_samples=20)
    write_kl_csv(est, tmp_path / "kl.csv")
    plot_kl(est, tmp_path / "kl.png")
    rows = list(csv.DictReader((tmp_path / "kl.csv").open()))
    assert [int(r["t"]) for r in rows] == [1, 4, 7] and float(rows[0]["kl"]) == pytest.approx(float(est.kl[0]))
    assert (tmp_path / "kl.png").stat().st_size > 1000


# ---- the analyze CLI ---------------------------------------------------------------------------------------------
def parse(argv):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_clusters(tmp_path, capsys):
    args = parse(["clusters", "-T", "100", "-N", "7", "--out", str(tmp_path)])
    assert cli.run(args) == 0
    out = capsys.readouterr().out
    assert "uniform:" in out and "snr:" in out and "log_snr:" in out and str(tmp_path / "clusters.csv") in out
    rows = list(csv.DictReader((tmp_path / "clusters.csv").open()))
    assert len(rows) == 21
    with pytest.raises(FileExistsError, match="--overwrite"):
        cli.run(args)
    assert cli.run(parse(["clusters", "-T", "100", "-N", "7", "--out", str(tmp_path), "--overwrite"])) == 0
    with pytest.raises(ValueError, match="num-clusters"):
        cli.run(parse(["clusters", "-T", "10", "-N", "11", "--out", str(tmp_path / "x")]))


def test_cli_kl(tmp_path, capsys):
    args = parse(["kl", "-T", "50", "--points", "3", "--samples", "20", "--out", str(tmp_path), "--seed", "4"])
    assert cli.run(args) == 0
    assert (tmp_path / "kl.csv").exists() and (tmp_path / "kl.png").stat().st_size > 1000
    assert "KL(p_t || p_t+1) at 3 timesteps" in capsys.readouterr().out
    with open(tmp_path / "kl.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [int(r["t"]) for r in rows] == [0, 24, 48] and {r["num_samples"] for r in rows} == {"20"}
    x, _ = load_digits_tensors()  # the same estimate computed directly with the same seed
    want = consecutive_kl(
        x, DDPMSchedule(50), torch.tensor([0, 24, 48]), 20, 250, generator=torch.Generator().manual_seed(4)
    )
    for r, kl, se in zip(rows, want.kl.tolist(), want.stderr.tolist()):
        assert float(r["kl"]) == pytest.approx(kl, rel=1e-8) and float(r["stderr"]) == pytest.approx(se, rel=1e-8)
    assert all(float(r["kl"]) > 0 for r in rows)
    with pytest.raises(FileExistsError):
        cli.run(args)


def test_cli_convergence_default_dit(tmp_path, capsys):
    args = parse(
        [
            "convergence",
            "-T",
            "50",
            "--intervals",
            "2",
            "--steps",
            "3",
            "--batch-size",
            "5",
            "--eval-every",
            "1",
            "--out",
            str(tmp_path),
        ]
    )
    assert cli.run(args) == 0
    for name in ("convergence.csv", "convergence_summary.csv", "convergence.png"):
        assert (tmp_path / name).exists()
    assert "convergence_summary.csv" in capsys.readouterr().out


def test_cli_rejects_bad_options(tmp_path):
    with pytest.raises(SystemExit):
        parse(["clusters", "-N", "0"])
    with pytest.raises(SystemExit):
        parse(["bogus"])


def test_cli_convergence_fd(tmp_path, capsys, monkeypatch):
    """--metric fd: an FD curve per interval beside the loss, in the CSVs and the printout."""
    monkeypatch.setenv("DIFFCURR_FAST_CACHE", str(tmp_path / "cache"))
    args = parse(
        [
            "convergence",
            "-T",
            "50",
            "--intervals",
            "2",
            "--steps",
            "4",
            "--batch-size",
            "5",
            "--eval-every",
            "2",
            "--metric",
            "fd",
            "--out",
            str(tmp_path),
        ]
    )
    assert cli.run(args) == 0
    rows = list(csv.DictReader((tmp_path / "convergence.csv").open()))
    assert len(rows) == 6 and all(float(r["eval_fd"]) > 0 for r in rows)
    summary = list(csv.DictReader((tmp_path / "convergence_summary.csv").open()))
    assert {"initial_fd", "final_fd", "steps_to_90pct_fd"} <= set(summary[0])
    assert "FD" in capsys.readouterr().out


def test_one_step_x0_is_exact_for_the_true_noise():
    """With a network that returns the true eps, the one-step estimate is x0 itself."""
    from diffcurr_fast.analysis.difficulty import one_step_x0
    from diffcurr_fast.diffusion.ddpm import DDPMSchedule

    sched = DDPMSchedule(50, "linear")
    x0 = torch.rand(6, 1, 8, 8) * 1.6 - 0.8
    gen = torch.Generator().manual_seed(3)

    seen = []

    def oracle(xt, tt, y):
        seen.append(tt)
        abar = sched.alphas_cumprod[tt].double().reshape(-1, 1, 1, 1)
        return ((xt.double() - abar.sqrt() * x0.double()) / (1 - abar).sqrt()).float()

    weights = torch.zeros(50)
    weights[10:20] = 1.0  # t ~ U[10, 20)
    est = one_step_x0(oracle, sched, x0, torch.zeros(6, dtype=torch.long), weights, gen)
    assert torch.allclose(est, x0, atol=1e-5)
    assert int(seen[0].min()) >= 10 and int(seen[0].max()) < 20


def test_analyze_takes_a_thread_count(tmp_path):
    torch.set_num_threads(2)
    args = parse(["clusters", "-T", "40", "-N", "4", "--threads", "1", "--out", str(tmp_path)])
    assert cli.run(args) == 0 and torch.get_num_threads() == 1
