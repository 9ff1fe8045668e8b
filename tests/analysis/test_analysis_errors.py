"""Bad inputs of ``diffcurr-fast analyze``: its result files are checked before the analysis runs (an --out where
nothing can be created, under a file, or a result name taken by a folder). docs/errors.md lists what each gets."""

import pytest
from conftest import _main

from diffcurr_fast import _files
from diffcurr_fast.analysis import difficulty
from diffcurr_fast.curriculum import clustering


@pytest.fixture
def no_analysis(monkeypatch):
    """The analyses fail if they run: an error must come before them."""

    def ran(*a, **k):
        raise AssertionError("the analysis ran")

    monkeypatch.setattr(clustering, "cluster_timesteps", ran)
    monkeypatch.setattr(difficulty, "consecutive_kl", ran)


def test_analyze_checks_its_result_files_before_it_runs(tmp_path, capsys, monkeypatch, no_analysis):
    """A result file that cannot be written is one line, exit 2, before the analysis runs (it failed after it)."""
    (tmp_path / "notes.txt").write_text("mine")
    rc, err = _main(capsys, "analyze", "clusters", "-N", "2", "--out", str(tmp_path / "notes.txt" / "an"))
    assert rc == 2 and "result file" in err and "notes.txt' is a file, not a directory; choose another --out" in err
    (tmp_path / "an" / "kl.csv").mkdir(parents=True)
    rc, err = _main(capsys, "analyze", "kl", "--out", str(tmp_path / "an"), "--overwrite")
    assert rc == 2 and "kl.csv' is a folder, not a file; choose another --out" in err, err
    with monkeypatch.context() as mp:

        def refuse(*a, **k):
            raise PermissionError(13, "Permission denied")

        mp.setattr(_files.tempfile, "mkdtemp", refuse)  # a read-only folder (as root, permissions do not tell)
        rc, err = _main(capsys, "analyze", "clusters", "-N", "2", "--out", str(tmp_path / "ro"))
    assert rc == 2 and "cannot be written" in err and "refuses new files (Permission denied)" in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "ro").exists()


def test_too_few_timesteps_for_the_linear_schedule_name_the_flags(tmp_path, capsys, no_analysis):
    """-T 10 with the linear schedule (betas up to 0.02 * 1000 / T = 2): one line naming the flags (it said
    ``betas must be a 1-D tensor with values in (0, 1]``)."""
    rc, err = _main(capsys, "analyze", "clusters", "-T", "10", "-N", "2", "--out", str(tmp_path))
    assert rc == 2 and "--beta-schedule linear needs --num-timesteps >= 20" in err, err
