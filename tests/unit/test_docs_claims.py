"""The performance page and the README state the current claims, not the story of how they were reached: their
size, their tables' width, and benchmarks/ holding only scripts that back a claim, each named where the claim is."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PERF = ROOT / "docs" / "performance.md"
BENCH = ROOT / "benchmarks"
NAMED = re.compile(r"benchmarks/([\w-]+\.(?:py|sh))")  # a script as the docs name it
CELL = re.compile(r"`([\w-]+\.(?:py|sh))`")  # a script in a cell of benchmarks/README.md
WIDE = 200  # a table line wider than this no longer reads as a table


def _wide_rows(text: str) -> list[str]:
    return [line[:80] for line in text.splitlines() if line.startswith("|") and len(line) > WIDE]


def _scripts() -> set[str]:
    return {p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")}


def test_the_performance_page_is_a_table_of_current_claims_then_how_to_measure() -> None:
    text = PERF.read_text()
    assert len(text.splitlines()) <= 200
    assert not _wide_rows(text), f"table lines over {WIDE} characters: shorten the cells"
    assert text.index("| claim |") < text.index("## How to measure") < text.index("## On a GPU machine")
    narration = re.findall(r"[^\n]{0,40}\bsession\b(?!\.sh)[^\n]{0,40}", text)
    assert not narration, f"the page narrates the work instead of stating the figures: {narration}"


def test_the_readme_tables_stay_narrow_and_point_to_the_performance_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 150
    assert not _wide_rows(text), f"README table lines over {WIDE} characters: details belong in performance.md"
    assert "(docs/performance.md)" in text


def test_every_benchmark_script_backs_a_claim_and_is_named_with_it() -> None:
    scripts = _scripts()
    table = [line for line in (BENCH / "README.md").read_text().splitlines() if line.startswith("| `")]
    listed = {CELL.search(line).group(1) for line in table}
    assert listed == scripts, f"benchmarks/README.md lists {sorted(listed - scripts)} (absent) and misses " \
                              f"{sorted(scripts - listed)}"
    unnamed = scripts - set(NAMED.findall(PERF.read_text()))
    assert not unnamed, f"scripts that docs/performance.md does not name: {sorted(unnamed)}"


def test_every_script_the_docs_name_exists() -> None:
    pages = [ROOT / "README.md", BENCH / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    missing = [f"{page.relative_to(ROOT)}: {name}" for page in pages if page.is_file()
               for name in sorted(set(NAMED.findall(page.read_text()))) if not (BENCH / name).is_file()]
    assert not missing, f"docs name benchmark scripts that are not in benchmarks/ (git history keeps them): {missing}"
