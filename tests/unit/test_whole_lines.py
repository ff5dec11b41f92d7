"""Each line a process of the CLI prints goes out in one write, even under PYTHONUNBUFFERED=1 (common in batch
scripts): unbuffered, print() writes its pieces one by one, and mpirun forwards every rank's writes as they come,
so two ranks' lines break each other ("pid 0 22144pid 1 22145"). Line-buffered, a line is one write and still
goes out at once."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

# The CLI's process entry runs (`hpctrain --version`), then the child says how its streams now buffer.
CHILD = """
import sys
sys.argv = ["hpctrain", "--version"]
from hpctrain.cli.main import main
try:
    main()
except SystemExit:
    pass
for s in (sys.stdout, sys.stderr):
    print(s.line_buffering, s.write_through, file=sys.__stderr__)
"""


@pytest.mark.parametrize("unbuffered", ["1", None])
def test_the_cli_entry_writes_each_line_whole_and_at_once(unbuffered: str | None) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    if unbuffered:
        env["PYTHONUNBUFFERED"] = unbuffered
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hpctrain ")
    assert proc.stderr.split()[-4:] == ["True", "False", "True", "False"], proc.stderr
