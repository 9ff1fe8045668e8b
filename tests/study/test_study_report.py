"""The numbers ``study report`` prints, from hand-made status files and post-hoc records (no run is trained): the
final metrics' mean +- std, steps, FLOPs and wall time per arm, the paired differences over the seeds both arms
finished with their t interval, the per-seed table, results.csv's rows, the post-hoc EMA section's grid, and the
speedrun's decomposition of the best wall-time speed-up into its three factors."""

import json

from diffcurr_fast._files import write_json
from diffcurr_fast.study import posthoc
from diffcurr_fast.study.report import write_report
from diffcurr_fast.study.runner import prepare_study, status_path
from diffcurr_fast.study.spec import spec_from_dict
from diffcurr_fast.study.speedrun_report import decomposition

# (arm, seed): final FD, IS, precision, recall and wall seconds; every run 100 steps, base 1e12 FLOPs, fast 2e12
FINALS = {
    ("base", 0): (10.0, 2.0, 0.5, 0.1, 50.0),
    ("base", 1): (12.0, 3.0, 0.6, 0.2, 60.0),
    ("base", 2): (14.0, 4.0, 0.7, 0.3, 70.0),
    ("fast", 0): (8.0, 5.0, 0.8, 0.4, 30.0),
    ("fast", 1): (11.0, 6.0, 0.9, 0.5, 40.0),  # seed 2 of fast has not finished
}


def _study(tmp_path):
    spec = spec_from_dict(
        {
            "name": "hand",
            "seeds": [0, 1, 2],
            "metric": "fd",
            "reference": "base",
            "eval_every": 50,
            "arms": [{"name": "base"}, {"name": "fast"}],
        }
    )
    out = prepare_study(spec, tmp_path / "study")
    for (arm, seed), (fd, is_, prec, rec, wall) in FINALS.items():
        final = {"step": 100, "fd": fd, "is": is_, "precision": prec, "recall": rec, "train_s": 0.4 * wall}
        halfway = {**final, "step": 50, "fd": 2 * fd, "train_s": 0.2 * wall}
        flops = 1e12 if arm == "base" else 2e12
        status = {"steps": 100, "train_flops": flops, "wall_s": wall, "final": final, "evals": [halfway, final]}
        write_json(status, status_path(out, arm, seed))
    return spec, out


def test_the_reports_tables_by_hand(tmp_path):
    _, out = _study(tmp_path)
    text = write_report(out)["report"].read_text()
    # base: FD 10, 12, 14 (mean 12, std 2), IS 2, 3, 4, precision 0.5-0.7, recall 0.1-0.3, wall 50, 60, 70
    assert "| base | 3 | 100 | 12 +- 2 | 3 +- 1 | 0.6 +- 0.1 | 0.2 +- 0.1 | 1e+12 | 60 +- 10 |" in text
    # fast: FD 8, 11 (std 3 / sqrt 2 = 2.12), IS 5, 6 (std 0.707), wall 30, 40
    assert "| fast | 2 | 100 | 9.5 +- 2.1 | 5.5 +- 0.71 | 0.85 +- 0.071 | 0.45 +- 0.071 | 2e+12 | 35 +- 7.1 |" in text
    # paired over seeds 0, 1: 8 - 10 = -2, 11 - 12 = -1; mean -1.5, s = 0.7071, t_{0.975, 1} = 12.7062:
    # half width 12.7062 x 0.7071 / sqrt 2 = 6.3531; both seeds lower; FLOPs 2e12 / 1e12
    assert "| fast | base | 2 | -1.5 | [-7.853, 4.853] | 2/2 | x2 |" in text
    assert "| base | 10 | 12 | 14 |" in text and "| fast | 8 | 11 | n/a |" in text
    rows = (out / "results.csv").read_text().splitlines()
    assert rows[0] == "arm,seed,step,fd,is,is_std,precision,recall,train_s,train_flops"
    assert "fast,1,50,22,6,,0.9,0.5,8,1e+12" in rows and "base,2,100,14,4,,0.7,0.3,28,1e+12" in rows
    assert len(rows) == 1 + 2 * len(FINALS)


def test_the_posthoc_section_by_hand(tmp_path):
    spec, out = _study(tmp_path)
    fds = {  # (arm, seed): FD at lengths 0.05 and 0.1 at the last snapshot (100), and at the pick at 50
        ("base", 0): (9.0, 8.0),
        ("base", 1): (11.0, 10.0),
        ("base", 2): (13.0, 15.0),  # base: means 11 and 11: a tie, the shorter length
        ("fast", 0): (7.0, 6.0),
        ("fast", 1): (9.0, 7.0),  # fast: means 8 and 6.5
    }
    for (arm, seed), (a, b) in fds.items():
        path = posthoc.records_path(out, arm, seed)
        path.parent.mkdir(parents=True, exist_ok=True)
        recs = [{"step": 100, "sigma_rel": 0.05, "fd": a}, {"step": 100, "sigma_rel": 0.1, "fd": b}]
        recs.append({"step": 50, "sigma_rel": 0.05 if arm == "base" else 0.1, "fd": 30.0})
        path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    text = write_report(out)["report"].read_text()
    section = text[text.index("## Post-hoc EMA") :]
    assert "| arm | FD at 0.05 | FD at 0.1 | picked |" in section
    assert "| base | 11 +- 2 | 11 +- 3.606 | 0.05 |" in section  # std of 8, 10, 15: sqrt(13)
    assert "| fast | 8 +- 1.414 | 6.5 +- 0.7071 | 0.1 |" in section
    assert "Not evaluated post hoc" not in section


def test_the_speedruns_decomposition_by_hand():
    """The best arm's wall speed-up x6 over the official recipe, x2 in steps over it and x1.5 from uniform t to the
    official recipe in steps: time per step x3, recipe x1.5, strategy x2/1.5 = x1.33."""
    spec = spec_from_dict(
        {
            "name": "d",
            "seeds": [0],
            "eval_every": 10,
            "reference": "official",
            "arms": [{"name": "official", "set": ["optim.lr=1e-4"]}, {"name": "vanilla"}, {"name": "best"}],
            "speedrun": {"official_arm": "official"},
        }
    )
    res = {
        "reference": "official",
        "official_arm": "official",
        "arms": {
            "official": {"speedup": {"wall_s": (1.0, 1.0, 1.0), "step": (1.0, 1.0, 1.0)}},
            "vanilla": {"speedup": {"wall_s": (4.0, 3.0, 5.0), "step": (1.5, 1.2, 1.8)}},
            "best": {"speedup": {"wall_s": (6.0, 5.0, 7.0), "step": (2.0, 1.5, 2.5)}},
        },
    }
    (line, blank) = decomposition(spec, res)
    assert blank == "" and line.startswith("Where `best`'s x6 comes from")
    assert "the time per step x3 (the official arm's over `best`'s)" in line
    assert "the recipe x1.5 (`vanilla`, uniform t" in line and "the official arm sets `optim.lr=1e-4`" in line
    assert "the timestep strategy x1.33 (`best` over `vanilla`, in steps)" in line
    res["reference"] = "vanilla"  # the factors are over the official recipe only
    assert decomposition(spec, res) == []
