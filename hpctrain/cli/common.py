"""What every command shares: turning library errors into one line and an exit code."""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable, TypeVar

import typer

from ..base.rankenv import read_env
from ..base.errors import HpctrainError

F = TypeVar("F", bound=Callable[..., Any])


def is_rank0() -> bool:
    rank = read_env().rank
    return rank is None or rank == 0


def fail(message: str, code: int = 2, label: str = "error: ") -> typer.Exit:
    """Print `error: message` (or `label` + message) once (on rank 0 under MPI) and return the Exit to raise."""
    if is_rank0():
        print(f"{label}{message}", file=sys.stderr)
    return typer.Exit(code)


def usage_error(exc: BaseException, path: str) -> str | None:
    """click's usage error (an unknown flag, a bad value; of whichever click Typer ships, so duck-typed) as one
    line that points to `PATH --help`; None for any other exception."""
    if callable(getattr(exc, "format_message", None)) and isinstance(getattr(exc, "exit_code", None), int):
        return f"{exc.format_message()} (see `{path} --help`)"
    return None


def handle_errors(fn: F) -> F:
    """Run a command, printing an HpctrainError as one line and exiting with its code (no traceback)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except HpctrainError as exc:
            raise fail(str(exc).replace("\n", " "), exc.exit_code, exc.label) from None
        except KeyboardInterrupt:
            raise fail("interrupted", 130) from None

    return wrapper  # type: ignore[return-value]
