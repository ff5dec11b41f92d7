"""The generated reference: every command and option of the Typer app, and every config field, as Markdown.

The docs site includes these pages (`docs/hooks.py` calls `cli_reference()` and `config_reference()` while
`mkdocs build` runs), so the reference is the code's own help and cannot drift from it. A test checks that
every option of every command appears.
"""

from __future__ import annotations

import typing
from dataclasses import MISSING
from typing import Any, Iterator

import typer
import typer.main

from ..base.config import SHARD_SECTIONS, TRAIN_SECTIONS, ShardConfig
from ..base.sections import train_options
from .helpformat import metavar_of, usage_line
from .options import flag, option_fields


def commands(app: typer.Typer | None = None) -> Iterator[tuple[str, Any]]:
    """(full name, click command) of every visible command, groups before their subcommands, in app order."""
    if app is None:
        from .main import app as main_app

        app = main_app
    root = typer.main.get_command(app)

    def walk(prefix: str, group: Any) -> Iterator[tuple[str, Any]]:
        for name, command in group.commands.items():
            if command.hidden:
                continue
            full = f"{prefix} {name}"
            yield full, command
            if hasattr(command, "commands"):
                yield from walk(full, command)

    yield "hpctrain", root
    yield from walk("hpctrain", root)


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def command_markdown(name: str, command: Any) -> str:
    ctx = command.context_class(command, info_name=name)
    out = [f"## `{name}`", ""]
    doc = (command.help or "").strip()
    if doc:
        out += [doc, ""]
    out += ["```", usage_line(command, ctx).removeprefix("Usage: "), "```", ""]
    rows = []
    for param in command.params:
        if getattr(param, "hidden", False):
            continue
        if param.param_type_name == "argument":
            rows.append((f"`{metavar_of(param)}`", "argument", _cell(param.help or "")))
            continue
        record = param.get_help_record(ctx)
        if record is None:
            continue
        opts, text = record
        panel = getattr(param, "rich_help_panel", None) or "Options"
        rows.append((f"`{_cell(opts)}`", panel, _cell(text)))
    if rows:
        out += ["| option | section | meaning |", "|---|---|---|"]
        out += [f"| {a} | {b} | {c} |" for a, b, c in rows]
        out.append("")
    if hasattr(command, "commands"):
        subs = [(n, c) for n, c in command.commands.items() if not c.hidden]
        out += ["| command | what it does |", "|---|---|"]
        out += [f"| `{name} {n}` | {_cell(c.get_short_help_str(limit=120))} |" for n, c in subs]
        out.append("")
    return "\n".join(out)


def cli_reference() -> str:
    """Markdown for every command: its help, usage, and a table of its options (name, section, help, default)."""
    return "\n".join(command_markdown(name, command) for name, command in commands())


def _type_name(hint: Any) -> str:
    text = getattr(hint, "__name__", None) if not typing.get_args(hint) else None
    return text or str(hint).replace("typing.", "").replace("pathlib.", "")


def _default(f: Any) -> str:
    if f.default is MISSING:
        return "required" if f.default_factory is MISSING else "(empty)"
    if isinstance(f.default, str):
        return f'`"{f.default}"`'
    return "`" + ("true" if f.default is True else "false" if f.default is False else repr(f.default)) + "`"


def config_table(source: Any, sections: dict[str, tuple[str, ...]]) -> str:
    """One table per section: TOML key, type, default, help (the docstring under each field); `source` as
    `options.option_fields` takes it."""
    options = {name: (hint, f, doc) for name, hint, f, doc in option_fields(source)}
    out = []
    for section, names in sections.items():
        out += [f"### `[{section}]`", "", "| key | flag | type | default | meaning |", "|---|---|---|---|---|"]
        for name in names:
            hint, f, doc = options[name]
            out.append(f"| `{name}` | `{flag(name)}` | `{_cell(_type_name(hint))}` | {_default(f)} | {_cell(doc)} |")
        out.append("")
    return "\n".join(out)


def config_reference() -> str:
    """Markdown for `TrainConfig` and `ShardConfig`, section by section."""
    return "\n".join(["## `hpctrain train --config FILE.toml` (TrainConfig)", "",
                      config_table(train_options(), TRAIN_SECTIONS),
                      "## `hpctrain shard` (ShardConfig)", "", config_table(ShardConfig, SHARD_SECTIONS)])
