"""A --trace window that holds no step of the run is said at start-up (#54 item 10): `--trace 500:600` on a
45-step run wrote an empty timeline without a word."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import hpctrain
from hpctrain.base.window import parse_window
from hpctrain.control.tracing import window_note


@pytest.mark.parametrize("spec, done, last, empty", [
    ("500:600", 0, 45, True),
    ("3:14", 20, 45, True),   # resumed past the window
    ("40:60", 0, 45, False),  # partly inside: steps 40-45 recorded
    ("1:1", 0, 1, False),
    ("every:50", 0, 45, True),
    ("every:50", 0, 100, False),
    ("every:10", 41, 45, True),
    ("last:5", 0, 45, False),
    ("last:5", 45, 45, True),  # nothing left to run
])
def test_a_window_without_a_step_of_the_run_is_named(spec: str, done: int, last: int, empty: bool) -> None:
    note = window_note(parse_window(spec), done, last)
    assert (note is not None) == empty, note
    if note:
        assert f"--trace {spec}" in note and f"{done + 1}" in note and f"{last}" in note


def test_train_says_so_at_start_up(digits2: Path, tmp_path: Path) -> None:
    proc = hpctrain(["train", "--data", str(digits2), "--run-dir", str(tmp_path / "run"), "--max-steps", "3",
                     "--trace", "500:600", "--checkpoint-every", "0"], timeout=240)
    assert "warning: --trace 500:600 records no step of this run (steps 1 to 3)" in proc.stderr, proc.stderr
