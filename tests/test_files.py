"""Atomic JSON files: a failed write leaves the previous file whole."""

import json
import os

import pytest

from diffcurr_fast import _files
from diffcurr_fast._files import write_json


def test_write_json_replaces_whole_and_a_failure_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "sub" / "status.json"
    assert write_json({"a": 1}, path, indent=1) == path  # parents created
    assert json.loads(path.read_text()) == {"a": 1}
    with pytest.raises(TypeError):
        write_json({"b": object()}, path)  # not JSON: nothing written
    assert json.loads(path.read_text()) == {"a": 1} and sorted(os.listdir(path.parent)) == ["status.json"]

    def crash(src, dst):
        raise OSError("killed before the rename")

    monkeypatch.setattr(_files.os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        write_json({"c": 2}, path)
    assert json.loads(path.read_text()) == {"a": 1}  # the old file, whole
