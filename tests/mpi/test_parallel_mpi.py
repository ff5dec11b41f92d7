"""Model parallelism on real MPI ranks: one tiny GPT trained in every layout (D, T, P) the issue names, against
pure data parallelism; a checkpoint of one layout resumed in others; refusals; the timeline of a split run; a
stage that never sends, named by the watchdog and by the flight records lined up."""

from __future__ import annotations

import json
import subprocess
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import PYTHON, hpctrain, mpi_env, mpirun, summary
from hpctrain.trace.lineup import line_up, read_dumps

pytestmark = pytest.mark.mpi
SCRIPTS = Path(__file__).parent / "scripts"
TEXT = Path(sysconfig.get_paths()["stdlib"]) / "bisect.py"  # 3 KB: 195 rows of 16 + 1 byte tokens
TOLERANCE = 1e-5  # fp32, SGD: the layouts sum the same terms in other orders (measured: at most 1.2e-7 here)


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("parallel") / "tokens"
    hpctrain(["shard", f"text:{TEXT}", str(out), "--seq-len", "16", "--shards", "2", "--val-fraction", "0"])
    return out


@pytest.fixture(scope="module")
def layouts(tmp_path_factory: pytest.TempPathFactory, tokens: Path, digits2: Path) -> Path:
    out = tmp_path_factory.mktemp("parallel") / "layouts"
    mpirun(8, [str(SCRIPTS / "layouts_check.py"), str(tokens), str(digits2), str(out)], python_module=False,
           timeout=600)
    return out


def _model(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "model.pt", weights_only=True)


def _gap(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_every_layout_trains_step_for_step_like_data_parallelism(layouts: Path) -> None:
    plain2, plain1 = _model(layouts / "2-1-1"), _model(layouts / "1-1-1")
    for name in ("2-2-1", "2-1-2", "2-2-2", "2-1-2-zero2", "2-2-1-zero1-deterministic"):
        s = summary(layouts / name)
        d, t, p = (int(v) for v in name.split("-")[:3])
        assert s["layout"] == {"data": d, "tensor": t, "pipe": p} and s["ranks_in_sync"] and s["steps"] == 8, name
        assert s["global_batch_size"] == 16, name  # --batch-size is per data-parallel rank
        assert _gap(_model(layouts / name), plain2) < TOLERANCE, name
    for name in ("1-2-2", "1-1-4"):
        assert _gap(_model(layouts / name), plain1) < TOLERANCE, name
    assert summary(layouts / "1-1-4")["micro_batches"] == 8  # 4 x pp, at most --batch-size
    assert 0 < _gap(_model(layouts / "2-2-2"), plain2)  # a real split: sums in another order
    # dropout: the tensor-parallel ranks drop the same elements of their replicated activations
    assert summary(layouts / "dropout-1-2-1")["ranks_in_sync"]
    mlp = summary(layouts / "mlp-1-1-3")
    assert mlp["layout"]["pipe"] == 3 and mlp["ranks_in_sync"]
    assert _gap(_model(layouts / "mlp-1-1-3"), _model(layouts / "mlp-1-1-1")) < TOLERANCE
    # validation through the pipeline: the whole model's loss and accuracy on the digits' validation split
    plain = summary(layouts / "mlp-1-1-1")
    assert mlp["val_loss"] == pytest.approx(plain["val_loss"], rel=1e-5) and mlp["val_accuracy"] == plain["val_accuracy"]


def test_a_checkpoint_of_one_layout_resumes_in_another(layouts: Path) -> None:
    """Saved at (2,2,1) at step 4, resumed at (2,1,2) to step 8: the uninterrupted (2,2,1) run's model."""
    s = summary(layouts / "saved")
    assert s["resumed_from"] == 4 and s["steps"] == 8 and s["layout"] == {"data": 2, "tensor": 1, "pipe": 2}
    meta = json.loads((layouts / "saved" / "checkpoints" / "step-0000004" / "meta.json").read_text())
    assert meta["layout"] == [2, 2, 1] and meta["layout_free"] and meta["format"] == 3
    index = torch.load(layouts / "saved" / "checkpoints" / "step-0000004" / "state.pt", weights_only=True)["index"]
    emb = index["model/tok_emb.weight"]  # 257 ids over T = 2: 129 + 128, each tensor rank's share one box
    assert emb["shape"] == [257, 32] and sorted(p[1:3] for p in emb["pieces"]) == [[[0, 0], [129, 32]],
                                                                                   [[129, 0], [128, 32]]]
    assert "model/head.weight" not in index  # the tied head is the embedding's name
    assert _gap(_model(layouts / "saved"), _model(layouts / "2-2-1")) < TOLERANCE
    # and between a split run and plain data parallelism, both ways: the (2,1,1) run's model
    for name, layout in (("plain-saved", {"data": 2, "tensor": 2, "pipe": 1}),
                         ("to-plain", {"data": 2, "tensor": 1, "pipe": 1})):
        s = summary(layouts / name)
        assert s["resumed_from"] == 4 and s["steps"] == 8 and s["layout"] == layout, name
        assert _gap(_model(layouts / name), _model(layouts / "2-1-1")) < TOLERANCE, name


def test_an_elastic_resume_into_a_pipeline_uses_every_sample_once(layouts: Path, tokens: Path) -> None:
    """Saved at (2,2,1) at step 4 (64 rows), resumed at (1,1,4): the rest of the epoch, each row once."""
    s = summary(layouts / "elastic")
    assert s["resumed_from"] == 4 and s["layout"] == {"data": 1, "tensor": 1, "pipe": 4}
    assert s["steps"] == 4 + -(-(195 - 64) // 8) and s["pipeline_schedule"] == "gpipe"
    seen: Counter = Counter()
    for path in (layouts / "elastic" / "samples").glob("rank-*.txt"):
        text = path.read_text()
        for epoch, sample in (np.array(text.split(), dtype=np.int64).reshape(-1, 2) if text else ()):
            seen[(int(epoch), int(sample))] += 1
    assert len(seen) == 195 and set(seen.values()) == {1}


def test_a_layout_that_does_not_fit_is_refused_in_one_line_listing_those_that_do(tmp_path: Path,
                                                                                  tokens: Path) -> None:
    proc = hpctrain(["launch", "-n", "2", "--", "train", "--data", str(tokens), "--run-dir", str(tmp_path / "r"),
                     "--model", "gpt:layers=2,dim=32,heads=2", "--tp", "2", "--pp", "2"], check=False)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr
    assert errors[0] == ("error: --tp 2 x --pp 2 = 4 does not divide the 2 ranks: on 2 rank(s) with this model and "
                         "data, use --tp 1 --pp 1 (D=2), --tp 1 --pp 2 (D=1), --tp 2 --pp 1 (D=1)")
    assert not (tmp_path / "r").exists()


def test_a_split_runs_timeline_shows_micro_batches_transfers_and_groups(layouts: Path) -> None:
    """The (2,2,2) run traced steps 3-6: per rank each micro-batch's forward and backward, the waits for a
    neighbour stage, the transfers (async slices, arrows from send to receive), the tensor-parallel sums and
    the data-parallel gradient sums with their groups; the bubble is no straggler."""
    run = layouts / "2-2-2"
    events = json.loads((run / "trace.json").read_text())["traceEvents"]
    assert sorted(p.name for p in (run / "trace").iterdir()) == [f"rank-000{r}.json" for r in range(8)]
    phase = [e for e in events if e.get("cat") == "phase"]
    for name in ("forward", "backward"):  # 8 micro-batches (4 x pp, at most --batch-size)
        assert {(e["pid"], e["args"]["step"], e["args"]["micro"]) for e in phase if e["name"] == name} == \
               {(r, s, m) for r in range(8) for s in range(3, 7) for m in range(8)}, name
    assert {e["pid"] for e in phase if e["name"] == "pipeline wait"} == set(range(8))
    assert {"data wait", "wait", "optimizer"} <= {e["name"] for e in phase}
    # rank = p x 4 + d x 2 + t: stage 0 is ranks 0-3, each sends to the rank 4 above it
    sends = [e for e in events if e["ph"] == "b" and e["name"].startswith("send activations of micro-batch")]
    assert {(e["pid"], e["args"]["peer"]) for e in sends} == {(r, r + 4) for r in range(4)}
    assert len(sends) == 4 * 4 * 8 and all(e["args"]["dtype"] == "float32" and e["args"]["bytes"] > 0 for e in sends)
    arrows = [e for e in events if e.get("cat") == "transfer"]
    assert {(s["pid"], f["pid"]) for s, f in zip(arrows[::2], arrows[1::2])} == \
           {(r, r + 4) for r in range(4)} | {(r + 4, r) for r in range(4)}
    colls = [e for e in events if e.get("cat") == "collective"]
    tp = {tuple(e["args"]["ranks"]) for e in colls if e["name"] == "forward sum (tensor-parallel group)"}
    assert tp == {(0, 1), (2, 3), (4, 5), (6, 7)}
    assert any(e["name"] == "backward sum (tensor-parallel group)" for e in colls)
    dp = {tuple(e["args"]["ranks"]) for e in colls if e["name"].endswith("(data-parallel group)")}
    assert dp == {(0, 2), (1, 3), (4, 6), (5, 7)}
    straggler = summary(run)["straggler"]
    assert straggler["verdict"].endswith("(a pipeline: ranks compared with the others of their stage; "
                                         "the stages' waits for each other, its bubble, not counted)")
    # a step's phases add up to the step: the micro-batches' forward/backward and the pipeline waits are in it (a
    # split step once summed to its data wait and optimizer alone: 0.07 ms against a logged step of 18.6 ms)
    logged = [json.loads(line)["step_ms"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert logged and straggler["step_ms"] > 0.5 * min(logged), (straggler["step_ms"], logged)


def test_a_stage_that_never_sends_is_named(tmp_path: Path, digits2: Path) -> None:
    """(2,1,2): rank 0, stage 0 of replica 0, stops in its forward of micro-batch 1 at step 2. Rank 2, its stage 1,
    waits for those activations; ranks 1 and 3 (replica 1) finish their schedule and wait for ranks 0 and 2 in
    their data-parallel groups' gradient sums. The watchdog names the wait; the flight records lined up name the
    transfer and the rank that never sent it, and each data-parallel group's sum that rank never arrived at."""
    run = tmp_path / "r"
    cmd = ["mpirun", "-n", "4", "--oversubscribe", "--bind-to", "none", PYTHON, "-m", "hpctrain", "train",
           "--data", str(digits2), "--run-dir", str(run), "--model", f"{SCRIPTS / 'stuck_stage.py'}:factory", "--pp", "2",
           "--micro-batches", "2", "--collective-timeout", "5", "--checkpoint-every", "0"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=mpi_env())
    assert proc.returncode != 0
    assert "pipeline stage 1 waiting for stage 0 (rank 0) to send the activations of micro-batch 1 at step 2" \
        in proc.stderr or "pipeline stage 0 computing the forward of micro-batch 1 at step 2 has waited" in proc.stderr, \
        proc.stderr
    dumps, beats, world = read_dumps(run / "logs")
    assert sorted(dumps) == [0, 1, 2, 3]  # each dumped at half its wait's budget
    found = line_up(world, dumps, beats)  # what rank 0's abort message and `hpctrain report` say
    assert found["culprits"] == [0], found["text"]
    assert found["text"].startswith(
        "the job waits for rank 0: stage 1 (rank 2) waits for the activations of micro-batch 1 at step 2 from stage 0 "
        "(rank 0), which never sent them (rank 0 was in pipeline stage 0 computing the forward of micro-batch 1 at "
        "step 2)"), found["text"]
    for waiting, missing in ((1, 0), (3, 2)):
        ranks = f"ranks {min(waiting, missing)}, {max(waiting, missing)}"
        assert f"{ranks} of the data-parallel group diverge at collective #" in found["text"], found["text"]
        assert f"rank {waiting} entered it and was still inside; rank {missing} never arrived" in found["text"]
    if "flight records:" in proc.stderr:  # rank 0 lined them up in its abort message, unless another rank's came first
        assert "flight records: the job waits for rank 0: stage 1 (rank 2) waits for the activations" in proc.stderr
