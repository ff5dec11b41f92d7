"""Typer options derived from a config dataclass: each option's name, default and help live once, in the field.

`hpctrain train` is built from the sections of `TrainConfig` (under their flat names) and `hpctrain shard` from
`ShardConfig`: a field `batch_size: int = 32` with the docstring under it becomes `--batch-size INTEGER [default:
32]` with that docstring as its help, and a TOML file (`--config`) takes the same keys. A renamed field keeps its old flag as a hidden alias that says
which flag to use now (`RENAMED` in base/config.py).
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
import textwrap
import types
import typing
from dataclasses import MISSING, Field, fields
from typing import Annotated, Any, Callable, Optional

import typer


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """{field: the docstring written under it} (torchtitan's convention), joined into one paragraph."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _cli_type(hint: Any) -> Any:
    """What Typer parses for a field's type: `int | str` (a number or a word) as str, X | None as Optional[X],
    tuple[X, ...] as a repeatable option (a list)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple:
        return Optional[list[args[0]]]  # type: ignore[valid-type]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) > 1:
            return Optional[str] if len(rest) < len(args) else str
        return Optional[rest[0]]
    return hint


def option_fields(source: Any) -> list[tuple[str, Any, Field, str]]:
    """(option name, type, field, help) of each option of `source`: a dataclass's fields, or the sections'
    fields under their flat names ({flat name: (section class, field)}, base.sections.train_options)."""
    if isinstance(source, dict):
        return [(name, typing.get_type_hints(cls)[f.name], f, field_help(cls).get(f.name, ""))
                for name, (cls, f) in source.items()]
    hints, helps = typing.get_type_hints(source), field_help(source)
    return [(f.name, hints[f.name], f, helps.get(f.name, "")) for f in fields(source)]


def config_parameters(source: Any, *, skip: tuple[str, ...] = (), arguments: tuple[str, ...] = (),
                      required: tuple[str, ...] = (), renamed: dict[str, str] | None = None,
                      flags: dict[str, str] | None = None, panels: dict[str, str] | None = None,
                      defaults: dict[str, Any] | None = None) -> list[inspect.Parameter]:
    """One Typer parameter per option of `source` (a dataclass, or sections' fields: `option_fields`), in
    order: `arguments` are positional, `required` options may come from a config file instead (so they default
    to None here), `renamed` {old: new} adds the old spelling as a hidden option, `flags` {field: "--flag"}
    names a flag differently from its field, `panels` {field: title} groups the options of `--help` (by config
    section), `defaults` {field: value} gives a command's own default (a benchmark's model; None: optional).
    A field with a default_factory, or a tuple, defaults to None here: `config_values` leaves it out."""
    options = option_fields(source)
    hints = {name: hint for name, hint, _, _ in options}
    params = []
    for name, field_hint, f, doc in options:
        if name in skip:
            continue
        hint = _cli_type(field_hint)
        if name in arguments:
            info: Any = typer.Argument(help=doc, show_default=False, rich_help_panel=(panels or {}).get(name))
            default: Any = inspect.Parameter.empty
        else:
            default = None if name in required or f.default is MISSING or isinstance(f.default, tuple) else f.default
            default = (defaults or {}).get(name, default)
            if name in required or (name in (defaults or {}) and default is None):
                hint = Optional[hint]
            decls = [f"{flag(name)}/--no-{name.replace('_', '-')}"] if hint in (bool, Optional[bool]) else []
            decls = [(flags or {})[name]] if name in (flags or {}) else decls
            info = typer.Option(*decls, help=doc, show_default=default is not None,
                                rich_help_panel=(panels or {}).get(name))
        params.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default,
                                        annotation=Annotated[hint, info]))
    if panels:  # grouped by section, the sections in their table's order (arguments stay first: they are)
        rank = {title: i for i, title in enumerate(dict.fromkeys(panels.values()))}
        params.sort(key=lambda p: rank.get(panels.get(p.name, ""), len(rank)))
    for old, new in (renamed or {}).items():
        old_hint = _cli_type(hints[new])
        params.append(inspect.Parameter(old, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[Optional[old_hint] if old_hint is not bool else Optional[bool],
                                                             typer.Option(flag(old), hidden=True)]))
    return params


def config_values(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments for `cls(...)` from parsed options: repeated options as tuples, and the fields
    whose option was left out (None) and whose default is a factory or a tuple left to the dataclass."""
    out = dict(values)
    for f in fields(cls):
        if f.name not in out:
            continue
        if out[f.name] is None and (f.default is MISSING or isinstance(f.default, tuple)):
            del out[f.name]
        elif isinstance(out[f.name], list):
            out[f.name] = tuple(out[f.name])
    return out


def given(ctx: typer.Context, name: str) -> bool:
    """Whether option `name` was typed on the command line (not a default, not from a config file)."""
    source = ctx.get_parameter_source(name)
    return source is not None and source.name == "COMMANDLINE"


def take_renamed(ctx: typer.Context, values: dict[str, Any], renamed: dict[str, str]) -> None:
    """Move a value given under an old flag to its new name (the new flag wins), saying so on stderr."""
    for old, new in renamed.items():
        value = values.pop(old, None)
        if value is not None:
            print(f"note: {flag(old)} is now {flag(new)}; the old spelling still works", file=sys.stderr)
            if not given(ctx, new):
                values[new] = value


def with_signature(fn: Callable[..., Any], params: list[inspect.Parameter]) -> Callable[..., Any]:
    """`fn(**values)` presented to Typer with `params` (what `inspect.signature` and `get_type_hints` see)."""
    own = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in inspect.signature(fn, eval_str=True).parameters.values()
           if p.kind is not inspect.Parameter.VAR_KEYWORD]
    context = [p for p in own if p.annotation is typer.Context]
    params = [*context, *params, *(p for p in own if p not in context)]  # Typer calls with keywords only
    fn.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    fn.__annotations__ = {p.name: p.annotation for p in params}
    return fn

