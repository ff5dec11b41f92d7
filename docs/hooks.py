"""MkDocs hook: the reference pages are generated from the code while the site builds.

A page holding `<!-- generated: cli -->` gets every command and option of the Typer app; one holding
`<!-- generated: config -->` gets every field of TrainConfig and ShardConfig, section by section
(`hpctrain/cli/reference.py`). So the reference is `--help`'s own text and cannot drift from it.
"""

from __future__ import annotations

from typing import Any


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- generated: " not in markdown:
        return markdown
    from hpctrain.cli.reference import cli_reference, config_reference

    return markdown.replace("<!-- generated: cli -->", cli_reference()).replace(
        "<!-- generated: config -->", config_reference())
