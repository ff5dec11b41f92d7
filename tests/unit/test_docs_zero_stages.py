"""Every place the docs list `--zero`'s stages lists them all (#54 item 10: `--zero 0|1|2` after stage 3 came):
all of them, or all the sharded ones (`--zero 1|2|3`, where a rule holds for every stage that shards)."""

from __future__ import annotations

import re
from pathlib import Path

from hpctrain.base.config import ZERO_STAGES

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_list_every_zero_stage() -> None:
    want = ("|".join(str(s) for s in ZERO_STAGES), "|".join(str(s) for s in ZERO_STAGES if s))
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "benchmarks").glob("*.py"))]
    found = [(page.relative_to(ROOT).as_posix(), m.group(1)) for page in pages if page.is_file()
             for m in re.finditer(r"--zero (\d(?:\|\d)+)", page.read_text(encoding="utf-8"))]
    assert found, "no `--zero A|B|...` in the docs: the check looks in the wrong place"
    assert [(page, listed) for page, listed in found if listed not in want] == []
