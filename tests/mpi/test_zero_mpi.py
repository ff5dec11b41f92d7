"""ZeRO stages 1, 2 and 3 on real MPI ranks: the same model as stage 0, the memory plan against what the ranks
hold, every reducer, a checkpoint of any stage on W ranks resumed at any stage on W' ranks (reading only what
each rank will hold, by the reader's own count), a checkpoint of format 1, bit-exact --deterministic, 16-bit wire
formats, a hang in a stage 3 gather named by the flight records, and the library API.

Runs are shared: the module's fixtures train SGD with momentum at stages 0-3 and Adam at stages 0 and 3 on 4
ranks, 12 steps each, with a checkpoint at step 6 that the resume tests continue from."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from conftest import hpctrain, mpi_env, mpirun, summary
from hpctrain.checkpoint import manager as ckpt

pytestmark = pytest.mark.mpi
# small buckets, so that slices cut through parameters and differ in size between the 4 ranks
BASE = ["--no-shuffle", "--batch-size", "16", "--seed", "1", "--bucket-mb", "0.02", "--model", "mlp:64,32",
        "--checkpoint-every", "0", "--json"]
SGD = ["--optimizer", "sgd", "--momentum", "0.9"]
ADAM = ["--optimizer", "adam", "--lr", "0.01", "--clip-grad", "0.5"]
REDUCERS = {1: "reduce-scatter-block", 2: "reduce-scatter", 3: "allreduce"}  # each stage of the SGD runs, one reducer


@pytest.fixture(scope="module")
def digits4(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("digits4") / "data"
    hpctrain(["shard", "digits", str(out), "--shards", "4"])
    return out


def train(n: int, data: Path, run: Path, *args: str) -> dict:
    hpctrain(["launch", "-n", str(n), "--", "train", "--data", str(data), "--run-dir", str(run), *BASE, *args])
    return summary(run)


def max_diff(a: Path, b: Path) -> float:
    wa = torch.load(a / "model.pt", weights_only=True)
    wb = torch.load(b / "model.pt", weights_only=True)
    assert wa.keys() == wb.keys()
    return max(float((wa[k] - wb[k]).abs().max()) for k in wa)


def log(run: Path, rank: int = 0) -> str:
    return (run / "logs" / f"rank-{rank:04d}.log").read_text()


@pytest.fixture(scope="module")
def sgd(tmp_path_factory: pytest.TempPathFactory, digits4: Path) -> dict[int, Path]:
    """SGD with momentum, 12 steps on 4 ranks at stages 0-3 (stages 1-3 by one reducer each), checkpoints at 6."""
    root, runs = tmp_path_factory.mktemp("sgd"), {}
    for stage in (0, 1, 2, 3):
        runs[stage] = root / f"z{stage}"
        reduce = ["--zero-reduce", REDUCERS[stage]] if stage else []
        train(4, digits4, runs[stage], "--max-steps", "12", "--checkpoint-every", "6", "--zero", str(stage), *SGD,
              *reduce)
    return runs


@pytest.fixture(scope="module")
def adam(tmp_path_factory: pytest.TempPathFactory, digits4: Path) -> dict[int, Path]:
    """Adam with --clip-grad, 12 steps on 4 ranks at stages 0 and 3 (--zero-reduce auto), checkpoints at 6."""
    root, runs = tmp_path_factory.mktemp("adam"), {}
    for stage in (0, 3):
        runs[stage] = root / f"z{stage}"
        train(4, digits4, runs[stage], "--max-steps", "12", "--checkpoint-every", "6", "--zero", str(stage), *ADAM)
    return runs


def test_stages_1_to_3_end_within_1e_5_of_stage_0_holding_what_the_plan_says(sgd: dict[int, Path],
                                                                              adam: dict[int, Path]) -> None:
    held = {}
    for stage, run in [*sgd.items(), *((f"adam {s}", r) for s, r in adam.items())]:
        s = summary(run)
        assert s["ranks_in_sync"] and s["steps"] == 12, stage
        memory, plan = s["memory"], s["memory"]["plan"]
        held[stage] = memory["params"] + memory["grads"] + memory["optimizer"]
        assert plan["stage"] == s["zero"] and abs(held[stage] / plan["state"] - 1) <= 0.10, (stage, memory, plan)
    for stage in (1, 2, 3):
        assert max_diff(sgd[0], sgd[stage]) <= 1e-5, stage
        assert f"gradients summed by {REDUCERS[stage]}" in log(sgd[stage], 1)
    assert 0 < max_diff(adam[0], adam[3]) <= 1e-5  # Adam and a clipped norm too; a real reduce-scatter, not a copy
    assert held[3] < 0.4 * held[0]  # a 4-rank slice of everything (the tiny model's 0-d states weigh in)
    text = log(sgd[3])
    assert "zero stage 3" in text and "memory plan, ZeRO stage 3" in text


def read_bytes(run: Path, rank: int) -> int:
    """What a resumed rank's checkpoint reader copied out of the part files (its log says)."""
    return int(re.findall(r"resumed from .*; read (\d+) bytes of its tensors", log(run, rank))[-1])


def resumed(tmp_path: Path, data: Path, source: Path, name: str, n: int, stage: int, *args: str) -> Path:
    """`source`'s run continued from its step-6 checkpoint to step 12 on `n` ranks at ZeRO `stage`."""
    run = tmp_path / name
    shutil.copytree(source, run)
    shutil.rmtree(run / "checkpoints" / "step-0000012")
    s = train(n, data, run, "--max-steps", "12", "--zero", str(stage), *args)
    assert s["resumed_from"] == 6 and s["steps"] == 12 and s["world_size"] == n and s["ranks_in_sync"], name
    return run


def test_a_resume_at_another_stage_on_the_same_ranks_ends_where_the_uninterrupted_run_does(
        tmp_path: Path, digits4: Path, sgd: dict[int, Path], adam: dict[int, Path]) -> None:
    """Stage 0's checkpoint read at stage 3 (replicated tensors read by each rank's flat slices), stage 3's at stage
    2; and stage 3 resumed at stage 3 is bit-identical, keeping the reducer --zero-reduce auto chose (on 3 or
    more ranks the reducers sum in different orders: a resume that chose anew went on with other bits)."""
    assert max_diff(sgd[0], resumed(tmp_path, digits4, sgd[0], "0-to-3", 4, 3, *SGD)) <= 1e-5
    assert max_diff(sgd[0], resumed(tmp_path, digits4, sgd[3], "3-to-2", 4, 2, *SGD)) <= 1e-5
    same = resumed(tmp_path, digits4, adam[3], "3-to-3", 4, 3, *ADAM)
    first = summary(adam[3])
    assert summary(same)["param_sha256"] == first["param_sha256"] and summary(same)["zero_reduce"] == first["zero_reduce"]
    assert f"--zero-reduce auto: keeping {first['zero_reduce']}" in log(same)


def test_a_checkpoint_resumes_on_fewer_ranks_at_any_stage_reading_only_what_each_rank_holds(
        tmp_path: Path, digits4: Path, adam: dict[int, Path]) -> None:
    """Adam on 4 ranks, saved at step 6 at stages 0 and 3, resumed on 2 ranks, stage 3's at stage 3 and stage 0's
    at stage 1: they end within 1e-5 of each other. At stage 3 a rank reads its half of the parameters and of Adam's
    moments (12 bytes a parameter, halved), at stage 1 the whole parameters and half the moments."""
    path = adam[3] / "checkpoints" / "step-0000006"
    state = ckpt.load_files(path)
    assert state["train"]["optimizer"]["zero"] == 3 and state["train"]["optimizer"]["world_size"] == 4
    whole = torch.load(adam[0] / "model.pt", weights_only=True)
    assert state["model"].keys() == whole.keys() and all(v.shape == whole[k].shape for k, v in state["model"].items())
    index = torch.load(path / "state.pt", weights_only=True)["index"]
    params = sum(v.numel() for v in state["model"].values())
    for name, entry in index.items():  # every parameter and its Adam moments: the ranks' boxes cover it once
        if name.startswith("model/") or name.endswith("exp_avg"):
            numel = torch.Size(entry["shape"]).numel()
            assert sum(torch.Size(piece[2]).numel() for piece in entry["pieces"]) == numel, name
            if name.endswith("weight"):  # (a bias lies in one rank's slice)
                assert {piece[0] for piece in entry["pieces"]} == {0, 1, 2, 3}, name
    sharded = resumed(tmp_path, digits4, adam[3], "3-to-3", 2, 3, *ADAM)
    for r in range(2):  # 4 bytes of each parameter and 8 of its moments, half of them; Adam's steps are 0-d
        assert 12 * params / 2 - 12 * 64 <= read_bytes(sharded, r) <= 12 * params / 2 + 4096, (r, params)
    one = resumed(tmp_path, digits4, adam[0], "0-to-1", 2, 1, *ADAM)
    assert max_diff(sharded, one) <= 1e-5
    for r in range(2):
        assert 8 * params - 8 * 64 <= read_bytes(one, r) <= 8 * params + 4096, (r, params)


def test_a_checkpoint_of_format_1_resumes_at_stage_3_as_the_version_that_wrote_it_went_on(tmp_path: Path,
                                                                                        digits2: Path) -> None:
    """tests/golden/ckpt-format1: a --zero 2 checkpoint at step 4 written by the format of earlier versions (numbered
    tensors, the optimizer's slices in per-rank trees), and the model that version reached resuming it to step 8.
    The digits shards are the same; their manifest is the one of that run (the same files, its creation time)."""
    golden = Path(__file__).parents[1] / "golden"
    run, data = tmp_path / "run", tmp_path / "data"
    shutil.copytree(digits2, data)
    shutil.copy(golden / "ckpt-format1-manifest.json", data / "manifest.json")
    shutil.copytree(golden / "ckpt-format1", run / "checkpoints" / "step-0000004")
    s = train(2, data, run, "--model", "mlp:16", "--zero", "3", "--optimizer", "adam", "--lr", "0.01",
              "--bucket-mb", "0.002", "--max-steps", "8")
    assert s["resumed_from"] == 4 and s["ranks_in_sync"]
    want = torch.load(golden / "ckpt-format1-resumed-to-8.pt", weights_only=True)
    got = torch.load(run / "model.pt", weights_only=True)
    assert max(float((want[k] - got[k]).abs().max()) for k in want) <= 1e-6
    assert json.loads((ckpt.latest(run) / "meta.json").read_text())["format"] == 3  # and it saves in the new one


def test_deterministic_zero_2_is_bit_exact_across_runs_and_16_bit_wires_stay_in_sync(tmp_path: Path,
                                                                                     digits4: Path) -> None:
    first = train(4, digits4, tmp_path / "d1", "--max-steps", "8", "--zero", "2", "--deterministic")
    second = train(4, digits4, tmp_path / "d2", "--max-steps", "8", "--zero", "2", "--deterministic")
    assert first["param_sha256"] == second["param_sha256"] and first["ranks_in_sync"]
    for wire, stage in (("bf16", ["3", "--deterministic"]), ("fp16", ["2"])):
        s = train(4, digits4, tmp_path / wire, "--max-steps", "8", "--zero", *stage, "--grad-compression", wire)
        assert s["ranks_in_sync"] and s["train_loss"] == s["train_loss"]  # not NaN
        assert max_diff(tmp_path / wire, tmp_path / "d1") < 0.05


def test_a_hang_in_a_stage_3_gather_is_lined_up_naming_the_gather_and_the_rank_that_never_arrived(
        tmp_path: Path, digits2: Path) -> None:
    """The flight recorder sees stage 3's parameter gathers: rank 1 never enters the first collective of bucket 2
    (the first Linear, the first unit of the forward) at step 3, its gather."""
    run = tmp_path / "run"
    proc = mpirun(2, ["train", "--data", str(digits2), "--run-dir", str(run), *BASE, "--zero", "3", "--max-steps",
                      "6", "--collective-timeout", "5"], check=False, timeout=120, env=mpi_env(HPCTRAIN_TEST_HANG="1:3:2"))
    assert proc.returncode != 0
    assert re.search(r"allgather of bucket 2 \(float32[^)]*\) at step 3 \([^)]*\): rank 0 entered it and was still inside; "
                     r"rank 1 never arrived", proc.stderr), proc.stderr


@pytest.mark.parametrize("n", [1, 3])
def test_the_library_api_shards_steps_and_restores_across_stages(tmp_path: Path, n: int) -> None:
    proc = mpirun(n, [str(Path(__file__).parent / "scripts" / "zero_api_check.py"), str(tmp_path / "run")],
                  python_module=False, timeout=180)
    assert f"ZERO API OK {n}" in proc.stdout


def test_stage_3_frees_the_gradient_slices_between_steps_and_kept_memory_before_a_large_units_backward() -> None:
    """What lowers stage 3's peak: a unit's backward (its parameters and gradient whole) holds only the gradient
    slices reduced before it, and none of the freed memory glibc kept; the model still ends as zero=0's."""
    proc = mpirun(2, [str(Path(__file__).parent / "scripts" / "zero3_memory_check.py")], python_module=False,
                  timeout=180)
    assert proc.stdout.count("ZERO3 MEMORY OK") == 2, proc.stdout


def test_gradient_accumulation_at_stage_3_with_overlap_matches_stage_0(tmp_path: Path, digits4: Path) -> None:
    """Micro-batches accumulate into autograd's own gradients; only the last one's backward sends them; each
    micro-batch gathers the parameters again, on the communication thread, the next unit prefetched."""
    ref, run = tmp_path / "ref", tmp_path / "z3"
    train(2, digits4, ref, "--max-steps", "5", "--accumulate", "3", "--optimizer", "adamw", "--lr", "0.01")
    train(2, digits4, run, "--max-steps", "5", "--accumulate", "3", "--optimizer", "adamw", "--lr", "0.01",
          "--zero", "3", "--overlap")
    assert max_diff(ref, run) <= 1e-5
