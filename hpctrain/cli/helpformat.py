"""`--help` that reads at 80 columns: options grouped in panels by config section, flags in a narrow column.

Typer's own layout gives the long flag, its `--no-` twin and the type a column each, which at 80 columns
leaves the help text about 20 characters (`--collective-timeout` + `--no-audit-samples` + `<float>`). Here the
flags and type share one column of at most FLAG_WIDTH characters that wraps between words, so the help keeps
the rest (48 characters at 80 columns). Panels follow each option's `rich_help_panel` (its config section).
"""

from __future__ import annotations

import inspect
from typing import Any

import typer
from rich.console import Console
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer.core import TyperCommand

FLAG_WIDTH = 26  # the widest flag column: `--collective-timeout FLOAT` fits on one line


def _console() -> Console:
    return Console(highlight=False, soft_wrap=False)


def metavar_of(param: Any) -> str:
    return (param.metavar or param.name or "").upper() + ("..." if param.nargs == -1 else "")


def usage_line(command: Any, ctx: Any) -> str:
    pieces = ["[OPTIONS]"] if any(p.param_type_name == "option" and not p.hidden for p in command.params) else []
    pieces += [metavar_of(p) for p in command.params if p.param_type_name == "argument"]
    if hasattr(command, "commands"):
        pieces.append("COMMAND [ARGS]...")
    return " ".join(["Usage:", ctx.command_path, *pieces])


def _rows(command: Any, ctx: Any, params: list[Any]) -> Table:
    table = Table(show_header=False, box=None, expand=True, padding=(0, 1), pad_edge=False)
    table.add_column("flag", max_width=FLAG_WIDTH, overflow="fold", style="bold cyan")
    table.add_column("help", ratio=1, overflow="fold")
    for param in params:
        if param.param_type_name == "argument":
            table.add_row(Text(metavar_of(param)), Text(param.help or ""))
            continue
        record = param.get_help_record(ctx)
        if record is not None:
            flags, text = record
            table.add_row(Text(flags), Text(text))  # Text: `[default: 32]` is not rich markup
    return table


def render_help(command: Any, ctx: Any) -> None:
    """Print `command`'s help: usage, its docstring, then one panel per section of options."""
    console = _console()
    console.print(Padding(Text(usage_line(command, ctx), style="bold"), (1, 1, 0, 1)))
    for para in inspect.cleandoc(command.help or "").split("\n\n"):
        text = " ".join(line.strip() for line in para.splitlines() if line.strip() != "\b")
        console.print(Padding(Text(text), (1, 1, 0, 1)))
    console.print()
    panels: dict[str, list[Any]] = {}
    for param in command.get_params(ctx):
        if getattr(param, "hidden", False):
            continue
        default = "Arguments" if param.param_type_name == "argument" else "Options"
        panels.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(param)
    order = sorted(panels, key=lambda name: (name != "Arguments", name == "Options"))  # general options last
    for name in order:
        console.print(Panel(_rows(command, ctx, panels[name]), title=name, title_align="left", border_style="dim"))
    if command.epilog:
        console.print(Padding(Text(inspect.cleandoc(command.epilog)), (0, 1)))


class PanelledCommand(TyperCommand):
    """A Typer command whose `--help` is `render_help`'s."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        render_help(self, ctx)


class App(typer.Typer):
    """typer.Typer whose commands default to PanelledCommand."""

    def command(self, *args: Any, cls: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        return super().command(*args, cls=cls or PanelledCommand, **kwargs)
