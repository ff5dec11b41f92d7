"""Slurm: the batch script, the submission (through submitit), the job's supervisor, and job status.

The only package that imports submitit. Its modules, one per concern:

- `config`: `SubmitConfig`, what `hpctrain submit` asks for, checked in `__post_init__`.
- `cpus`: `--cpus-per-task auto` (the default): the partition's CPUs per node, from `sinfo`, shared among the
  ranks of a node; resolved before rendering (`resolve_cpus(cfg, table)` is pure, `with_cpus(cfg)` asks sinfo).
- `sweep`: `--sweep KEY=V1,V2,...`: the grid of train flags, one element of a job array per combination, each
  in RUN/KEY=V[_KEY=V...]; the elements' arguments are written to a file in the job folder at submission and
  read by each element's supervisor by its array index.
- `render`: `render_sbatch(cfg, command)`, the batch script, a pure function (pinned by golden files). It is
  built by submitit's own sbatch writer, so the text `--dry-run` prints is byte for byte the file that is
  submitted. The script `exec`s the supervisor, which starts the ranks with
  `srun --mpi=pmix|pmi2 --kill-on-bad-exit=1` (or `mpirun` inside the allocation), each under the rank wrapper
  (`python -m hpctrain.tools.slurm rank`).
- `submission`: `submit(cfg, command)`, `sbatch --test-only` first where the cluster allows it, then
  submitit's submission; `cancel`.
- `submitit_private`: every use of submitit's private API (and why), in one place.
- `supervise`: `supervise(...)` runs in the job (`python -m hpctrain.tools.slurm supervise`). It keeps a record
  of the job in the job folder (FOLDER/JOBID_hpctrain.jsonl; JOBID_TASK_hpctrain.jsonl for an element of a job
  array, which requeues alone) and decides what an exit means: 0 completed; 3
  (every rank stopped on SIGTERM/SIGUSR2 and wrote one checkpoint together) is a preemption or a timeout, and
  the job requeues itself (`scontrol requeue`) up to `max_requeues` times to resume with `--resume auto`; any
  other code is a failure and never requeues. `run_rank(...)`: one rank's wrapper: forwards signals, notes the
  first failing rank, and turns the collective stop (exit 3) into exit 0 so --kill-on-bad-exit does not kill
  ranks still finishing theirs.
- `core`: the job folder's files (the record, the submission's note, the logs), running a Slurm command, and
  what Slurm still knows of a job (`scontrol show job`), shared by the parts above.
- `status`: `job_status`, `list_jobs`, `wait`: read that record together with what Slurm still knows, since
  sacct needs slurmdbd, which many clusters (and the local one) lack; a job array's state is made of its
  elements'.
- `__main__`: `python -m hpctrain.tools.slurm rank|supervise`, holding the stop signals from its first line.

This file imports nothing: Python imports it before `__main__`, whose first lines must hold the stop signals
before anything slow is imported (see below).

Signals: Slurm sends SIGUSR2 `signal_delay_s` before the time limit to every task (`--signal=USR2@T`), and
`scancel --signal=USR2 JOB` does the same by hand; the trainer of every rank acts on it. With `mpirun` the
signal goes to the batch shell instead (`B:USR2`), that is to the supervisor, which hands it to mpirun, which
forwards it to every rank.

A stop signal must neither kill a process of the job nor vanish because it came early or late. Slurm signals
every process of the step (the rank wrapper and the program under it) from the moment it exists, seconds before
a trainer has imported torch and installed its handler, and SIGUSR2's default action is to terminate. So:
the wrapper starts with SIGUSR2 blocked (`env --block-signal=USR2`: pending, not lost, across exec) and takes
it over on its first line, before its own imports; it starts the program with SIGUSR2 ignored, and
`_StopRelay` keeps each SIGUSR2 and hands it on as soon as the program (or a process under it) has a handler
for it, read from /proc/PID/status; once the program has exited, SIGUSR2 is ignored, so a stop that comes after
the run's last step cannot turn a completed rank into a failed one. The supervisor does the same with srun or
mpirun. What no process of the job can see: a `scancel --signal=USR2 JOB` sent before the job's step exists
(the first fraction of a second, while the supervisor starts srun) is dropped by slurmd itself ("No steps in
jobid N to send signal 12"); `scancel --full` or `--batch` reaches the supervisor then.
"""
