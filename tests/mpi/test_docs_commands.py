"""Every fenced block of the README and the docs that shows an `hpctrain` command is marked, just above it:
`<!-- runnable -->` (this test runs it as written, in order, in a fresh directory per page: each line split as
a shell would, comments dropped, no shell run, `hpctrain` this checkout's), `<!-- run by PATH -->` (a test or
example of the project runs the same commands, at a size fit for the suite) or `<!-- not run: REASON -->`
(what it needs that no machine here has: a Slurm cluster with GPUs, apptainer, a job id)."""

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
FENCE = re.compile(r"(?:<!-- (runnable|run by [^>]*?|not run: [^>]*?) -->\n)?```([a-z]*)\n(.*?)```", re.S)
COMMAND = re.compile(r"^\s*(\$ )?hpctrain\s", re.M)  # a line that runs hpctrain (a ```text block is output)
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PAGES = [p for p in DOCS if BLOCK.search(p.read_text())]
MADE = {"README.md": "runs/a/summary.json", "getting-started.md": "runs/a/summary.json",
        "report.md": "www/run-a/report.md", "data-at-scale.md": "runs/a/summary.json",
        "parallelism.md": "runs/pipe/summary.json"}


def _line(page: Path, offset: int) -> str:
    return f"{page.relative_to(ROOT)}:{page.read_text()[:offset].count(chr(10)) + 1}"


def test_every_block_that_shows_a_command_says_whether_and_where_it_runs() -> None:
    unmarked, missing = [], []
    for page in DOCS:
        for m in FENCE.finditer(page.read_text()):
            mark, kind, body = m.groups()
            if kind == "text" or not COMMAND.search(body):
                continue
            if mark is None:
                unmarked.append(_line(page, m.start()))
            elif mark.startswith("run by "):
                path = mark.removeprefix("run by ").split()[0]
                if not (ROOT / path).is_file():
                    missing.append(f"{_line(page, m.start())}: {path}")
            elif mark.startswith("not run: ") and len(mark.split()) < 6:
                missing.append(f"{_line(page, m.start())}: say why in a few words: {mark!r}")
    assert not unmarked, f"blocks with hpctrain commands and no runnable / run by / not run mark: {unmarked}"
    assert not missing, missing


def runnable_lines(page: Path) -> list[list[str]]:
    lines = []
    for block in BLOCK.findall(page.read_text()):
        for line in block.splitlines():
            argv = shlex.split(line, comments=True)
            if argv:
                lines.append(argv)
    return lines


def test_the_front_pages_and_the_guides_run_some() -> None:
    names = {p.name for p in PAGES}
    assert {"README.md", "getting-started.md", "report.md", "data-at-scale.md", "containers.md"} <= names, names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_the_runnable_commands_of_a_page_run_as_written(tmp_path: Path, page: Path) -> None:
    for argv in runnable_lines(page):
        assert argv[0] == "hpctrain", f"{page.name}: only hpctrain commands are marked runnable: {argv}"
        proc = subprocess.run([sys.executable, "-m", "hpctrain", *argv[1:]], cwd=tmp_path, env=mpi_env(),
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{page.name}: {shlex.join(argv)} exited {proc.returncode}\n{proc.stderr[-3000:]}"
    if page.name in MADE:
        assert (tmp_path / MADE[page.name]).is_file(), MADE[page.name]
