"""``replace_file``: the old content or the new, never half, and no scratch left behind; a
generator's files written or checked."""

from __future__ import annotations

import pathlib

import pytest

from sidecar_runtime.process.files import generate, replace_file, stale_files


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


def test_a_generator_writes_its_files_and_check_names_the_stale_ones(
        tmp_path: pathlib.Path, capsys: pytest.CaptureFixture[str]) -> None:
    files = {"a/one.md": "one\n", "two.yaml": "two\n"}
    assert stale_files(files, str(tmp_path)) == ["a/one.md", "two.yaml"]  # missing: stale
    assert generate([], lambda: files, str(tmp_path), "gen") == 0
    assert (tmp_path / "a" / "one.md").read_text() == "one\n"
    assert generate(["--check"], lambda: files, str(tmp_path), "gen") == 0
    (tmp_path / "two.yaml").write_text("edited by hand\n")
    capsys.readouterr()
    assert generate(["--check"], lambda: files, str(tmp_path), "gen") == 1
    assert capsys.readouterr().err == "two.yaml: stale; run `gen`\n"
    assert (tmp_path / "two.yaml").read_text() == "edited by hand\n"  # --check writes nothing
    assert generate(["--force"], lambda: files, str(tmp_path), "gen") == 2
