"""The error tree of hpctrain.

Library code raises these; the CLI catches `HpctrainError`, prints its message on one line and exits with
`exit_code` (2 for bad input, 1 for a failure during the work). Messages quote the bad value and say what
to do about it.
"""

from __future__ import annotations


class HpctrainError(Exception):
    """Base of every error hpctrain raises on purpose.

    `agreed` is True when every rank of the job raises this error together (after `Comm.agree` or a
    broadcast failure): the ranks can simply exit. An error that is not agreed happened on one rank alone,
    while the others go on into the next collective; in a job of several ranks that rank must end the whole
    job (MPI_Abort) or the others wait forever."""

    exit_code = 1
    agreed = False
    label = "error: "  # how the CLI starts its one line (a stop is not an error: it says "stopped ...")


class ConfigError(HpctrainError):
    """A bad option, flag combination or config file: the user can fix it by changing the command."""

    exit_code = 2


class DataError(HpctrainError):
    """A missing, malformed or corrupt dataset, source file or shard."""

    exit_code = 2


class CommError(HpctrainError):
    """MPI is missing, misconfigured, or a collective failed or timed out."""

    exit_code = 1


class CheckpointError(HpctrainError):
    """A checkpoint cannot be written, found or used for this run."""

    exit_code = 2


class StorageError(HpctrainError):
    """A file of the run cannot be written: a full disk or quota, a read-only or failing filesystem (a failure
    during the work: exit 1). `no_space` is True for a full disk or quota (ENOSPC, EDQUOT)."""

    exit_code = 1
    no_space = False


class SubmissionError(HpctrainError):
    """A Slurm submission was refused or cannot be built."""

    exit_code = 2


def one_of(name: str, value: object, valid: list[str] | tuple[str, ...]) -> ConfigError:
    """The error for an unknown choice, listing the valid ones."""
    return ConfigError(f"unknown {name} {value!r}: choose one of {', '.join(valid)}")


def brief(value: object, limit: int = 80) -> str:
    """`repr(value)` cut to `limit` characters: for quoting a value read from a file in a one-line message,
    which must stay one short line however long or garbled the file is."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit - 3]}..."


def describe(exc: BaseException, limit: int = 120) -> str:
    """What went wrong, in a few words and never the data: a UnicodeDecodeError's repr quotes every byte it
    was decoding (a whole file), an OSError's names its error; anything else is its text, cut to `limit`."""
    if isinstance(exc, UnicodeDecodeError):
        return f"not valid {exc.encoding.upper()} at byte {exc.start} ({exc.reason})"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    text = " ".join(str(exc).split())
    text = text if len(text) <= limit else f"{text[:limit - 3]}..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
