"""The load generators' command lines."""

from __future__ import annotations

from pathlib import Path

from bench.loadgen import Load, command


def test_a_wrk_script_is_one_file_whatever_the_points_name(tmp_path: Path) -> None:
    """Points are named by scenario ("bare/chat"): the script must not need a directory per
    stack (saturation_pairs failed with FileNotFoundError in a fresh clone)."""
    load = Load("http://127.0.0.1:1/v1/chat/completions", "/dev/null", (), None, 1.0, 4)
    argv = command("wrk", load, str(tmp_path), "bare/chat-warmup")
    script = Path(argv[argv.index("-s") + 1])
    assert script.parent == tmp_path and script.exists()
