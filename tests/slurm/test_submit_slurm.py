"""`hpctrain submit` on a real Slurm (slurmctld + two slurmd + munge on localhost, see slurm/cluster.sh).

Pins the issue's numbers: a 2-node job ends with the same param_sha256 as `hpctrain launch -n 2`; after
`scancel --signal=USR2` mid-run the job requeues, resumes from its checkpoint and still ends bit-identical;
a failing job never requeues; each rank picks its own (emulated, GRES-allocated) GPU.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import hpctrain, mpi_env, summary
from hpctrain.tools.slurm.config import SubmitConfig
from hpctrain.tools.slurm.render import render_sbatch
from hpctrain.tools.slurm.status import job_status

from slurm_util import cli, cluster_session, submit_json, wait_for

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
PROBE = Path(__file__).parent / "scripts" / "gpu_probe.py"
SLOW_HANDLER = Path(__file__).parent / "scripts" / "slow_handler.py"


@pytest.fixture(scope="session")
def slurm_cluster():
    """The local cluster, up for the whole session (started and stopped here unless it already ran)."""
    yield from cluster_session()


_REFERENCE: dict[tuple[str, ...], dict] = {}


def launch_reference(data: Path, run: Path, args: list[str]) -> dict:
    """The summary of `hpctrain launch -n 2 -- train ARGS` (run once per ARGS in a session)."""
    key = (str(data), *args)
    if key not in _REFERENCE:
        hpctrain(["launch", "-n", "2", "--", "train", "--data", str(data), "--run-dir", str(run), *args],
                 env=mpi_env(), timeout=300)
        _REFERENCE[key] = summary(run)
    return _REFERENCE[key]


@pytest.mark.parametrize("mpi", ["pmix", "mpirun"])
def test_two_node_job_equals_launch_and_runs_the_dry_run_script(slurm_cluster, digits2: Path, tmp_path: Path,
                                                                 mpi: str) -> None:
    args = ["--epochs", "3", "--log-every", "5"]
    command = ["train", "--data", str(digits2), "--run-dir", str(tmp_path / "job"), *args]
    flags = ["--nodes", "2", "--time", "5", "--folder", str(tmp_path / "jobs"), "--mpi", mpi]
    info = submit_json([*flags, "--wait", "--", *command], cwd=tmp_path)
    assert info["state"] == "completed" and info["exit_code"] == 0, info
    got = summary(tmp_path / "job")
    want = launch_reference(digits2, tmp_path / "ref", args)
    assert got["world_size"] == 2 and got["ranks_in_sync"]
    assert got["param_sha256"] == want["param_sha256"]
    # What --dry-run prints is the file that was submitted.
    dry = cli(["submit", "--dry-run", *flags, "--", *command], cwd=tmp_path).stdout
    assert dry == Path(info["script"]).read_text()
    assert "on n1" in (tmp_path / "jobs" / f"{info['job_id']}_0_log.err").read_text()  # the supervisor's line
    listed = json.loads(cli(["jobs", "--folder", str(tmp_path / "jobs"), "--json"], cwd=tmp_path).stdout)
    assert [j["job_id"] for j in listed] == [info["job_id"]] and listed[0]["state"] == "completed"


def test_container_ranks_run_in_apptainer_with_binds(slurm_cluster, digits2: Path, tmp_path: Path) -> None:
    """Through a FAKE apptainer (the real one cannot be installed here): the arguments each rank passes."""
    fake = Path(__file__).parent / "scripts" / "fake-apptainer"
    image = tmp_path / "hpctrain.sif"
    image.write_bytes(b"not really an image")
    log = tmp_path / "apptainer.log"
    env = {"PATH": f"{fake}:{os.environ['PATH']}", "FAKE_APPTAINER_LOG": str(log), "FAKE_APPTAINER_PYTHON": sys.executable}
    args = ["--epochs", "3", "--log-every", "5"]
    run = tmp_path / "job"
    info = submit_json(["--nodes", "2", "--time", "5", "--folder", str(tmp_path / "jobs"), "--container", str(image),
                        "--wait", "--", "train", "--data", str(digits2), "--run-dir", str(run), *args],
                       cwd=tmp_path, env=env)
    assert info["state"] == "completed", info
    calls = log.read_text().splitlines()
    assert len(calls) == 2
    for call in calls:
        assert call.startswith("exec --nv --bind ") and "/pmix." in call  # the step's PMIx server directory
        assert f"--bind {tmp_path / 'jobs'},{digits2},{run} {image} python3 -u -m hpctrain train" in call
    assert summary(run)["param_sha256"] == launch_reference(digits2, tmp_path / "ref", args)["param_sha256"]


def test_usr2_requeues_and_resumes_bit_identical(slurm_cluster, digits2: Path, tmp_path: Path) -> None:
    # 20 epochs of about 1 ms steps: the signal must land mid-run. With 4 epochs (0.4 s of training) it could
    # reach the ranks after their last step; the run then rightly completed, and this test failed.
    args = ["--epochs", "20", "--batch-size", "8", "--log-every", "1"]
    run, folder = tmp_path / "job", tmp_path / "jobs"
    info = submit_json(["--nodes", "2", "--time", "5", "--folder", str(folder), "--", "train", "--data",
                        str(digits2), "--run-dir", str(run), *args], cwd=tmp_path)
    job = info["job_id"]
    metrics = run / "metrics.jsonl"
    wait_for(lambda: metrics.exists() and len(metrics.read_text().splitlines()) >= 60, 90, "60 logged steps")
    assert not (run / "summary.json").exists(), "the run ended before the signal: make it longer"
    subprocess.run(["scancel", "--signal=USR2", job], check=True)
    # Slurm holds a requeued job for cred_expire + 1 s (the local cluster sets 10 s; Slurm's default is 120 s):
    # the reference trains meanwhile
    with ThreadPoolExecutor(1) as pool:
        reference = pool.submit(launch_reference, digits2, tmp_path / "ref", args)
        status = wait_for(lambda: (s := job_status(folder, job))["state"] == "requeued" and s, 60, "the requeue")
        assert status["reason"] == "preempted"
        final = wait_for(lambda: (s := job_status(folder, job))["state"] in ("completed", "failed") and s, 120,
                         "the resumed job to finish")
        want = reference.result(timeout=300)
    assert final["state"] == "completed" and final["restarts"] == 1, final
    events = [e["event"] for e in final["events"]]
    assert events == ["start", "ranks_stopped", "requeued", "start", "completed"], events
    got = summary(run)
    assert got["resumed_from"] is not None and 0 < got["resumed_from"] < got["steps"]
    assert got["param_sha256"] == want["param_sha256"]
    text = cli(["status", job, "--folder", str(folder)], cwd=tmp_path).stdout
    assert "completed (restarts: 1)" in text and "requeued" in text and "reason=preempted" in text


def test_usr2_while_a_rank_starts_or_ends_is_held_not_fatal(slurm_cluster, tmp_path: Path) -> None:
    """Slurm signals every process of the step as soon as it exists. A SIGUSR2 that came before the rank's
    program had a handler (a trainer importing torch) killed the rank, and the job failed; one that came after
    its last step, once it had given its handler back, killed a completed rank. Now the rank's wrapper holds it
    until the program handles it, and a program with no handler left ignores it."""
    run, folder = tmp_path / "run", tmp_path / "jobs"
    run.mkdir()
    info = submit_json(["--nodes", "2", "--time", "5", "--folder", str(folder), "--", sys.executable,
                        str(SLOW_HANDLER), str(run), "3"], cwd=tmp_path)
    job = info["job_id"]
    wait_for(lambda: all((run / f"started-{r}-0").exists() for r in (0, 1)), 90, "both ranks to start", poll=0.05)
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # the programs sleep 3 s without a handler
    ending = lambda: all((run / f"ending-{r}-1").exists() for r in (0, 1))  # noqa: E731
    wait_for(lambda: ending() or job_status(folder, job)["state"] in ("completed", "failed"), 120,
             "the requeued ranks' last step", poll=0.05)
    assert ending(), job_status(folder, job)  # not so: the first stop killed the ranks
    subprocess.run(["scancel", "--signal=USR2", job], check=True)  # they gave their handler back: 3 s to go
    final = wait_for(lambda: (s := job_status(folder, job))["state"] in ("completed", "failed") and s, 60, "the end")
    assert final["state"] == "completed" and final["restarts"] == 1, final
    assert [e["event"] for e in final["events"]] == ["start", "ranks_stopped", "requeued", "start", "completed"]
    for r in (0, 1):  # each rank got the first stop once its handler was there, and only then
        got = json.loads((run / f"stop-{r}").read_text())
        assert got and set(got) == {signal.SIGUSR2}, (r, got)
    assert "did not handle it" in (folder / f"{job}_1_log.err").read_text()


def test_failing_job_fails_once_and_says_why(slurm_cluster, tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    proc = cli(["submit", "--nodes", "2", "--time", "5", "--folder", str(folder), "--wait", "--json", "--",
                "train", "--data", str(tmp_path / "missing"), "--run-dir", str(tmp_path / "r")], cwd=tmp_path,
               check=False)
    info = json.loads(proc.stdout.strip().splitlines()[-1])
    assert proc.returncode == 2 and info["state"] == "failed" and info["exit_code"] == 2, proc.stdout + proc.stderr
    status = job_status(folder, info["job_id"])
    assert [e["event"] for e in status["events"] if e["event"] in ("start", "failed", "requeued")] == ["start", "failed"]
    logs = cli(["logs", info["job_id"], "--folder", str(folder)], cwd=tmp_path)
    assert "does not exist" in logs.stderr


def _probe_lines(folder: Path, job: str, ranks: int) -> list[dict]:
    rows = []
    for r in range(ranks):
        text = (folder / f"{job}_{r}_log.out").read_text()
        rows += [json.loads(line) for line in text.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda row: row["rank"])


def test_each_rank_uses_its_own_gres_gpu(slurm_cluster, tmp_path: Path) -> None:
    folder = tmp_path / "jobs"
    info = submit_json(["--nodes", "2", "--gpus", "2", "--cpus-per-task", "2", "--time", "5", "--folder", str(folder), "--env",
                        "HPCTRAIN_PROBE=it works", "--wait", "--", sys.executable, str(PROBE)], cwd=tmp_path)
    assert info["state"] == "completed", info
    rows = _probe_lines(folder, info["job_id"], 4)
    assert [r["rank"] for r in rows] == [0, 1, 2, 3]
    for node in ("n1", "n2"):
        mine = [r for r in rows if r["node"] == node]
        # Slurm gives every task of the node both GPUs; the local rank picks one, never the same twice.
        assert sorted(r["device"] for r in mine) == ["cuda:0", "cuda:1"], rows
        assert all(r["cuda_visible_devices"] == "0,1" for r in mine), rows
    assert all(r["cuda_device_order"] == "PCI_BUS_ID" and r["omp_num_threads"] == "2" and r["threads"] == 2
               for r in rows)
    assert all(r["probe_env"] == "it works" for r in rows)


def test_binding_when_slurm_gives_each_task_one_gpu(slurm_cluster) -> None:
    proc = subprocess.run(["srun", "-N", "1", "--ntasks-per-node=2", "--gpus-per-task=1", sys.executable, str(PROBE)],
                          capture_output=True, text=True, timeout=120, check=True)
    rows = sorted((json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")),
                  key=lambda r: r["rank"])
    # each task sees one GPU of its own (which task gets which is Slurm's choice: CI saw rank 0 get GPU 1), as
    # device 0
    assert sorted(r["cuda_visible_devices"] for r in rows) == ["0", "1"], rows
    assert [r["device"] for r in rows] == ["cuda:0", "cuda:0"]


def test_more_ranks_than_gpus_is_refused_before_submitting(slurm_cluster, tmp_path: Path) -> None:
    proc = cli(["submit", "--nodes", "1", "--gpus", "2", "--tasks-per-node", "3", "--folder", str(tmp_path / "j"),
                "--", "train"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "every rank needs a GPU of its own" in proc.stderr
    assert not (tmp_path / "j").exists()


def test_sbatch_test_only_refuses_what_the_cluster_cannot_run(slurm_cluster, tmp_path: Path) -> None:
    proc = cli(["submit", "--nodes", "3", "--folder", str(tmp_path / "j"), "--", "train"], cwd=tmp_path, check=False)
    assert proc.returncode == 2 and "Slurm refuses this job" in proc.stderr, proc.stderr
    assert not (tmp_path / "j").exists()
    # the script itself is fine; the cluster is too small
    assert render_sbatch(SubmitConfig(nodes=3, cpus_per_task=1), ["train"])
