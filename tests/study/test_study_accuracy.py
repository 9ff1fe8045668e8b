"""The conditional accuracy in a study's report (study/report.py): its column in results.csv and the final metrics,
its paired difference against the reference by hand, the report naming the arm whose accuracy is lower than the
reference's by more than its interval; a study whose runs recorded none reports as it did before."""

import math
import warnings

from scipy import stats

from diffcurr_fast._files import write_json
from diffcurr_fast.study.report import write_report
from diffcurr_fast.study.runner import prepare_study, status_path
from diffcurr_fast.study.spec import spec_from_dict

ACC = {"ref": [0.98, 0.99, 1.0], "low": [0.86, 0.88, 0.87], "same": [0.97, 1.0, 0.99]}


def _study(folder, accuracies):
    """A finished study of status files alone (its run folders gone, as a committed study is)."""
    spec = spec_from_dict(
        {"name": "acc", "seeds": [0, 1, 2], "eval_every": 8, "reference": "ref", "arms": [{"name": n} for n in ACC]}
    )
    prepare_study(spec, folder)
    for arm in ACC:
        for seed in (0, 1, 2):
            final = {"step": 8, "eval": True, "fd": 5.0 + seed, "is": 2.0, "precision": 0.9, "recall": 0.5}
            if accuracies:
                final["cond_acc"] = ACC[arm][seed]
            st = {"arm": arm, "seed": seed, "kind": "train", "steps": 8, "train_flops": 8.0, "wall_s": 1.0}
            write_json({**st, "final": final, "evals": [final]}, status_path(folder, arm, seed))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the plots drawn from run folders: none here
        return write_report(folder)


def _interval(diffs):
    mean, sd = sum(diffs) / 3, stats.tstd(diffs)
    half = stats.t.ppf(0.975, 2) * sd / math.sqrt(3)
    return mean, mean - half, mean + half


def test_the_report_names_the_arm_whose_conditional_accuracy_is_lower_than_the_reference(tmp_path):
    files = _study(tmp_path / "s", accuracies=True)
    header = files["csv"].read_text().splitlines()[0].split(",")
    assert header[header.index("recall") + 1] == "cond_acc" and header[-2:] == ["train_s", "train_flops"]
    text = files["report"].read_text()
    assert "| arm | seeds | steps | FD | IS | precision | recall | cond. accuracy | train FLOPs |" in text
    low = _interval([a - r for a, r in zip(ACC["low"], ACC["ref"])])  # -0.12, interval below 0
    same = _interval([a - r for a, r in zip(ACC["same"], ACC["ref"])])  # -0.0067, interval across 0
    assert low[2] < 0 < same[2]
    assert f"| low | ref | 0.87 +- 0.01 | 3 | {low[0]:.4g} | [{low[1]:.4g}, {low[2]:.4g}] |" in text
    assert f"| same | ref | 0.9867 +- 0.015 | 3 | {same[0]:.4g} | [{same[1]:.4g}, {same[2]:.4g}] |" in text
    named = f"`low` ({low[0]:.4g} [{low[1]:.4g}, {low[2]:.4g}] against `ref`)."
    assert f"**Lower conditional accuracy than its reference** (the interval below 0): {named}" in text


def test_a_study_whose_runs_recorded_no_accuracy_reports_without_it(tmp_path):
    files = _study(tmp_path / "s", accuracies=False)
    assert "cond_acc" not in files["csv"].read_text()
    text = files["report"].read_text()
    assert "accuracy" not in text and "| arm | seeds | steps | FD | IS | precision | recall | train FLOPs |" in text
    assert "## Per-seed final fd" in text
