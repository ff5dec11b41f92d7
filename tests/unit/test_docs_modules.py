"""The docs name only code that exists: every `hpctrain/...py` path, and every dotted `hpctrain.pkg.module.name`,
in the README, the guides and the reference resolves in the tree (a module moved to its package is renamed in the
docs too). The changelog is history and keeps the names of its day."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PATH = re.compile(r"\bhpctrain/[\w/]+\.py\b")
DOTTED = re.compile(r"\bhpctrain(?:\.[A-Za-z_]\w*)+")


def _resolves(dotted: str) -> bool:
    """Whether `hpctrain.a.b.c` is a module of the tree, or a name one of them gives (lazy names included)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        name = ".".join(parts[:n])
        base = ROOT.joinpath(*parts[:n])
        if (base / "__init__.py").is_file() or base.with_suffix(".py").is_file():
            obj = importlib.import_module(name)
            for attr in parts[n:]:
                if not hasattr(obj, attr):
                    return False
                obj = getattr(obj, attr)
            return True
    return False


def _named(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    return [(str(page.relative_to(ROOT)), name) for page in PAGES if page.is_file()
            for name in sorted(set(pattern.findall(page.read_text())))]


def test_every_module_path_the_docs_name_exists() -> None:
    missing = [f"{page}: {path}" for page, path in _named(PATH) if not (ROOT / path).is_file()]
    assert not missing, f"the docs name files that are not in the tree (rename them where they moved): {missing}"


def test_every_dotted_name_the_docs_give_resolves() -> None:
    # a file name that starts with the package's name (hpctrain.sif, hpctrain.def, hpctrain.jsonl) is no module
    dotted = [(page, name) for page, name in _named(DOTTED) if name.split(".")[1] not in ("sif", "def", "jsonl")]
    missing = [f"{page}: {name}" for page, name in dotted if not _resolves(name)]
    assert not missing, f"the docs give module names that do not resolve (rename them where they moved): {missing}"
