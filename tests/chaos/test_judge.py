"""The hang matrix's new judges fail when they must: a non-finite loss, a refusal with the wrong exit code or
error lines, a configuration refused that should run, staged copies left behind, and a pair whose models
differ. Fast: the runs are written by hand into tmp_path; nothing is launched."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from chaos import check_ended, check_finished, check_refused, compare_pair
from chaos_procs import RunResult
from chaos_space import PAIR_RTOL, STAGE_DIR, Case, DataSpec

BASE = Case(seed=0, index=0, world=2, data=DataSpec("digits", 2, 0.0), options=(("stage_to", None),),
            steps_per_epoch=3, expected_steps=3, max_steps_note="all epochs", event="none", target_rank=None,
            anchor="start", fraction=0.5)
SUMMARY = {"steps": 3, "ranks_in_sync": True, "param_sha256": "ab" * 32, "train_loss": 0.5, "staged_bytes": 0}


def finished(run_dir: Path, losses: list[float], **summary: object) -> RunResult:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps({"step": i + 1, "loss": v}) + "\n"
                                                   for i, v in enumerate(losses)))
    return RunResult("run", "cmd", 0, 1.0, run_dir=str(run_dir), summary=dict(SUMMARY, **summary))


def kinds(failures: list) -> set[str]:
    return {f.kind for f in failures}


def test_a_finished_run_with_finite_losses_passes_and_a_nan_or_inf_fails(tmp_path: Path) -> None:
    assert check_finished(finished(tmp_path / "a", [2.0, 1.0, 0.5]), BASE, SUMMARY["param_sha256"], tmp_path) == []
    assert kinds(check_finished(finished(tmp_path / "b", [2.0, float("nan"), 0.5]), BASE, None, tmp_path)) == {"nonfinite"}
    assert kinds(check_finished(finished(tmp_path / "c", [2.0], val_loss=float("inf")), BASE, None, tmp_path)) == {"nonfinite"}
    assert kinds(check_finished(finished(tmp_path / "d", []), BASE, None, tmp_path)) == {"nonfinite"}  # none logged


def test_staging_must_stage_and_remove_its_copies_unless_kept(tmp_path: Path) -> None:
    staged = replace(BASE, options=(("stage_to", STAGE_DIR), ("keep_staged", False)))
    stage = tmp_path / "stage"
    (stage / "hpctrain-0123456789ab-cafe0123").mkdir(parents=True)
    run = finished(tmp_path / "run", [1.0], staged_bytes=4096)
    assert kinds(check_finished(run, staged, None, stage)) == {"staged"}  # copies left without --keep-staged
    kept = replace(BASE, options=(("stage_to", STAGE_DIR), ("keep_staged", True)))
    assert check_finished(run, kept, None, stage) == []
    assert kinds(check_finished(finished(tmp_path / "r2", [1.0]), kept, None, stage)) == {"staged"}  # 0 bytes


def refused_run(tmp_path: Path, rc: int, errors: list[str]) -> RunResult:
    return RunResult("run", "cmd", rc, 1.0, run_dir=str(tmp_path / "run"), error_lines=errors)


def test_a_refusal_needs_exit_2_and_exactly_one_error_line_naming_the_problem(tmp_path: Path) -> None:
    case = replace(BASE, refusal="keep 1")
    line = "error: --keep 1 must be at least 2, so a complete checkpoint always survives"
    assert check_refused(refused_run(tmp_path, 2, [line]), case) == []
    assert kinds(check_refused(refused_run(tmp_path, 1, [line]), case)) == {"refused"}
    assert kinds(check_refused(refused_run(tmp_path, 2, [line, line]), case)) == {"refused"}
    assert kinds(check_refused(refused_run(tmp_path, 2, ["error: something else"]), case)) == {"refused"}
    assert kinds(check_refused(refused_run(tmp_path, 0, []), case)) == {"refused"}  # ran: should have been refused
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    assert kinds(check_refused(refused_run(tmp_path, 2, [line]), case)) == {"refused"}  # trained first


def test_a_configuration_that_should_run_and_is_refused_fails_as_refused(tmp_path: Path) -> None:
    run = refused_run(tmp_path, 2, ["error: --zero 1 does not combine with --hierarchical"])
    assert kinds(check_ended(run, BASE)) == {"refused"}


@pytest.mark.parametrize("exact", [False, True])
def test_a_pair_fails_when_its_models_differ(tmp_path: Path, exact: bool) -> None:
    case = replace(BASE, pair="deterministic" if exact else "zero")
    weights = {"0.weight": torch.linspace(-1, 1, 64).reshape(8, 8), "0.bias": torch.zeros(8)}
    runs = []
    for name, delta in (("a", 0.0), ("b", PAIR_RTOL / 10), ("c", PAIR_RTOL * 10)):
        (tmp_path / name).mkdir()
        torch.save({k: v + delta for k, v in weights.items()}, tmp_path / name / "model.pt")
        runs.append(RunResult(name, "cmd", 0, 1.0, run_dir=str(tmp_path / name),
                              summary={"param_sha256": "same" if (exact and name != "c") or delta == 0 else name}))
    same_bits, close, far = (compare_pair(case, runs[0], r) for r in runs)
    assert same_bits[0] == [] and same_bits[1] == 0.0
    assert kinds(far[0]) == {"pair"} and far[1] == pytest.approx(PAIR_RTOL * 10, rel=1e-2)  # float32 files
    assert close[0] == [] and close[1] == pytest.approx(PAIR_RTOL / 10, rel=1e-2)  # exact: equal hashes pass
