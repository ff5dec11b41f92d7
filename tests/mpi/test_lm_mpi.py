"""Language models end to end on real MPI ranks: text -> token shards -> a GPT on 2 ranks (tokens/s, MFU, bits
per byte) -> generated text; ZeRO 3 beside stage 0, resumed at other stages and world sizes; bf16 and fp16
beside fp32."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from conftest import hpctrain, mpirun, summary

pytestmark = pytest.mark.mpi
# real text: seven modules of this Python's own standard library (base64, bdb, bisect, bz2, hashlib, heapq,
# hmac; about 110 KB), read where the interpreter keeps them rather than copied into the tree
TEXT = Path(sysconfig.get_paths()["stdlib"])
TEXT_GLOB = "[bh]*.py"
GPT = ["--model", "gpt:layers=1,dim=32,heads=2", "--optimizer", "adamw", "--lr", "0.01", "--batch-size", "8",
       "--epochs", "100", "--json"]


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lm") / "data"
    proc = hpctrain(["shard", f"text:{TEXT}", str(out), "--glob", TEXT_GLOB, "--seq-len", "32", "--shards", "2",
                     "--val-fraction", "0.15"])
    assert "rows of 32 + 1 tokens, vocabulary 257 (bytes)" in proc.stdout
    return out


def train(n: int, data: Path, run: Path, *args: str) -> dict:
    hpctrain(["launch", "-n", str(n), "--", "train", "--data", str(data), "--run-dir", str(run), *GPT, *args])
    return summary(run)


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_a_gpt_learns_the_text_on_two_ranks_and_generates_from_it(tmp_path: Path, tokens: Path) -> None:
    manifest = json.loads((tokens / "manifest.json").read_text())
    assert manifest["task"] == "lm" and manifest["version"] == 3 and manifest["vocab_size"] == 257
    assert "ok: 4 shard files" in hpctrain(["verify", str(tokens)]).stdout
    run = tmp_path / "run"
    s = train(2, tokens, run, "--max-steps", "150", "--log-every", "10")
    assert s["ranks_in_sync"] and s["steps"] == 150 and s["seq_len"] == 32
    seen = losses(run)
    # per token, from ln(257) = 5.5 nats at the start (the first window's mean is 4.1) to below the text's
    # unigram entropy (4.7 bits = 3.3 nats per byte): the model uses context
    assert seen[-1] < 0.75 * seen[0] and seen[-1] < 3.0, seen
    assert 0 < s["val_bits_per_byte"] < 4.5 and s["val_perplexity"] == pytest.approx(2.718281828 ** s["val_loss"])
    assert s["tokens_per_s"] > 0 and 0 < s["mfu"] < 1 and s["peak_flops"] > 0 and s["flops_per_token"] > 0
    text = hpctrain(["generate", str(run), "--prompt", "def ", "--tokens", "40", "--seed", "1"]).stdout
    assert text.startswith("def ") and len(text) > 20


def test_zero_3_shards_the_gpt_s_tied_weights_as_stage_0_trains_them_and_resumes_at_any_stage(tmp_path: Path,
                                                                                            tokens: Path) -> None:
    """The GPT's embedding is its head (one tensor used twice: in ZeRO 3's root unit, whole at both uses); its
    blocks are units of their own. Stage 3 ends within 1e-5 of stage 0; its checkpoint at step 10 resumes at stage
    1 on the same ranks and ends within 1e-5 of stage 0 too, and at stage 2 on one rank."""
    plain, straight = tmp_path / "plain", tmp_path / "straight"
    train(2, tokens, plain, "--max-steps", "20")
    train(2, tokens, straight, "--max-steps", "20", "--zero", "3", "--checkpoint-every", "10")
    a = torch.load(plain / "model.pt", weights_only=True)
    b = torch.load(straight / "model.pt", weights_only=True)
    assert torch.equal(b["tok_emb.weight"], b["head.weight"])
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-5
    for n, stage in ((2, "1"), (1, "2")):
        run = tmp_path / f"at-{stage}"
        shutil.copytree(straight, run)
        shutil.rmtree(run / "checkpoints" / "step-0000020")
        s = train(n, tokens, run, "--max-steps", "20", "--zero", stage)
        assert s["resumed_from"] == 10 and s["world_size"] == n and s["steps"] == 20
        if n == 2:
            c = torch.load(run / "model.pt", weights_only=True)
            assert max(float((a[k] - c[k]).abs().max()) for k in a) <= 1e-5


def test_bf16_tracks_fp32_and_fp16_trains_with_an_agreed_loss_scale(tmp_path: Path, tokens: Path) -> None:
    ref = tmp_path / "fp32"
    calm = ["--max-steps", "30", "--log-every", "1", "--lr", "0.003"]  # at 0.01 both spike, at different steps
    train(2, tokens, ref, *calm)
    for precision, stage in (("bf16", "0"), ("fp16", "3")):  # fp16's scale with ZeRO 3's slices
        run = tmp_path / precision
        s = train(2, tokens, run, *calm, "--precision", precision, "--zero", stage)
        assert s["precision"] == precision and s["ranks_in_sync"]
        deviation = max(abs(a - b) / b for a, b in zip(losses(run), losses(ref)))
        assert deviation < 0.05, (precision, deviation)
    state = torch.load(tmp_path / "fp16" / "checkpoints" / "step-0000030" / "state.pt", weights_only=True)
    assert state["train"]["scaler"]["scale"] > 0  # the loss scale is in the checkpoint


def test_one_rank_s_overflow_skips_the_step_on_every_rank() -> None:
    proc = mpirun(2, [str(Path(__file__).parent / "scripts" / "scaler_check.py")], python_module=False, timeout=120)
    assert proc.stdout.count("SCALER OK") == 2
