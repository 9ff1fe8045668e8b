"""docs/errors.md names, for each bad input, the test that checks it: every test it names exists."""


def test_every_test_docs_errors_names_exists():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "errors.md").read_text()
    # a test named with its file (`tests/<unit>/test_<unit>_errors.py::test_name`) must be defined in that file;
    # one named alone (`test_name`), in some test file under tests/
    by_path = set(re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", text))
    named = set(re.findall(r"`(test_\w+)`", text))
    defined = {
        m for f in root.joinpath("tests").rglob("test_*.py") for m in re.findall(r"def (test_\w+)", f.read_text())
    }
    missing = sorted(
        f"{path}::{name}"
        for path, name in by_path
        if not (root / path).is_file() or not re.search(rf"def {name}\(", (root / path).read_text())
    )
    assert len(by_path) + len(named) > 40 and not missing and not named - defined, missing + sorted(named - defined)
