"""The commands the README and the docs show as runnable (a fenced block right after `<!-- runnable -->`) run as
written, in order, in a fresh directory: each line is split as a shell would (comments dropped, no shell run),
and `hpctrain` is this checkout's."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, mpi_env

pytestmark = pytest.mark.mpi
BLOCK = re.compile(r"<!-- runnable -->\n```[a-z]*\n(.*?)```", re.S)
PAGES = [ROOT / "README.md", ROOT / "docs" / "getting-started.md"]


def runnable_lines(page: Path) -> list[list[str]]:
    lines = []
    for block in BLOCK.findall(page.read_text()):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                lines.append(argv)
    return lines


def test_every_page_with_commands_marks_some_runnable() -> None:
    for page in PAGES:
        assert runnable_lines(page), page
    others = [p.name for p in (ROOT / "docs").rglob("*.md") if p not in PAGES and BLOCK.search(p.read_text())]
    assert not others, f"runnable blocks on pages this test does not run: add them to PAGES: {others}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_runnable_commands_of_a_page_run_as_written(tmp_path: Path, page: Path) -> None:
    for argv in runnable_lines(page):
        assert argv[0] == "hpctrain", f"{page.name}: only hpctrain commands are marked runnable: {argv}"
        proc = subprocess.run([sys.executable, "-m", "hpctrain", *argv[1:]], cwd=tmp_path, env=mpi_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{page.name}: {shlex.join(argv)} exited {proc.returncode}\n{proc.stderr[-3000:]}"
    assert (tmp_path / "runs" / "a" / "summary.json").is_file()
