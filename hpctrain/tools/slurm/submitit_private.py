"""Every use of submitit's private API, in one place, and why it is needed.

hpctrain submits a command of its own: the batch script `exec`s hpctrain's supervisor, which starts the ranks.
submitit's public API submits a pickled Python function instead (`executor.submit(fn)`, run in the job by
`python -m submitit.core._submit FOLDER` under srun): that script is not hpctrain's, and `--dry-run` could not
print the file that is submitted. For a command, submitit (1.5.4, its newest release when this was written)
has only private names:

- `submitit.slurm.slurm._make_sbatch_string(command, folder, **parameters)`: the batch script's text. Its
  keyword arguments are the valid sbatch parameters (the public `SlurmExecutor.update_parameters` checks
  against them).
- `SlurmExecutor._submit_command(command)`: writes that same text for COMMAND into the job folder, runs
  `sbatch`, and returns the `SlurmJob`.
- The `map_count` parameter of both: the number of elements of a job array (`--array=0-(N-1)%K`, K the
  public `array_parallelism`, and the logs named %A_%a). submitit's own `map_array` sets it the same way
  (`executor.parameters["map_count"] = n`, then `_submit_command`), but only for pickled functions; the
  public `update_parameters` refuses it.

Private names may change in any release, so pyproject.toml keeps `submitit>=1.5,<1.6` (every 1.5.x release
has both, with the parameters used here), and tests/unit/test_submitit_private.py fails, naming the installed
version and what changed, when they differ. To allow a newer submitit: install it, run that test and
tests/unit/test_slurm_render.py (the golden scripts), adapt this module if needed, then widen the pin.

submitit is imported inside the functions: the job's own processes (`python -m hpctrain.tools.slurm`) import
this module (through `render`) and must start fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import submitit


def make_sbatch_string(command: str, folder: Path, *, array_size: int | None = None, **parameters: Any) -> str:
    """submitit's batch script for the shell command COMMAND, logs in FOLDER (`parameters`: sbatch's); with
    ARRAY_SIZE, a job array of that many elements."""
    from submitit.slurm.slurm import _make_sbatch_string

    return _make_sbatch_string(command=command, folder=folder, map_count=array_size, **parameters)


def submit_command(executor: submitit.SlurmExecutor, command: str, *, array_size: int | None = None) -> submitit.SlurmJob:
    """Submit the shell command COMMAND (no pickled function): `executor` writes its script and calls sbatch.
    With ARRAY_SIZE, as a job array of that many elements (the job returned is the array's)."""
    if array_size:
        executor.parameters["map_count"] = array_size
    return executor._submit_command(command)
