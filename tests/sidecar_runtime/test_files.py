"""``replace_file``: the old content or the new, never half, and no scratch left behind."""

from __future__ import annotations

import pathlib

import pytest

from sidecar_runtime.process.files import replace_file


def test_a_file_is_replaced_whole_and_no_scratch_is_left(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("old")
    replace_file(str(path), b"new")
    assert path.read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["routing.yaml"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_scratch(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "routing.yaml"
    path.write_text("old")
    (tmp_path / "sub").mkdir()
    with pytest.raises(IsADirectoryError):  # renaming a file over a folder fails
        replace_file(str(tmp_path / "sub"), b"new")
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["routing.yaml", "sub"]
