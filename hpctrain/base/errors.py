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


class SubmissionError(HpctrainError):
    """A Slurm submission was refused or cannot be built."""

    exit_code = 2


def one_of(name: str, value: object, valid: list[str] | tuple[str, ...]) -> ConfigError:
    """The error for an unknown choice, listing the valid ones."""
    return ConfigError(f"unknown {name} {value!r}: choose one of {', '.join(valid)}")
