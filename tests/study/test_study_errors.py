"""Bad inputs of studies (diffcurr_fast/study/): duplicate study spec keys (spec.py), the cluster plot of a
cluster no seed trained (report.py). docs/errors.md lists what each input gets."""

import json

import pytest


def test_duplicate_study_spec_keys_are_refused(tmp_path):
    from diffcurr_fast.study.spec import load_spec

    (tmp_path / "s.yaml").write_text("name: a\nseeds: [0, 1]\nname: b\n")
    with pytest.raises(ValueError, match=r"study spec .* sets a key more than once .*'name' at lines 1, 3"):
        load_spec(tmp_path / "s.yaml")


def test_study_cluster_plot_of_an_untrained_cluster_warns_nothing(tmp_path):
    import warnings

    from diffcurr_fast.study.report import plot_cluster_loss
    from diffcurr_fast.study.runner import run_dir_of
    from diffcurr_fast.study.spec import spec_from_dict

    spec = spec_from_dict(
        {"name": "s", "seeds": [0, 1], "metric": "fd", "reference": "a", "eval_every": 1, "arms": [{"name": "a"}]}
    )
    for seed, losses in ((0, [0.5, None, 0.25]), (1, [0.7, None, 0.35])):  # cluster 1 never unlocked
        rd = run_dir_of(tmp_path, "a", seed)
        rd.mkdir(parents=True)
        (rd / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 0.4, "cluster_loss": losses}) + "\n")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "Mean of empty slice" was one
        plot_cluster_loss(spec, tmp_path, tmp_path / "c.png")
    assert (tmp_path / "c.png").is_file()
