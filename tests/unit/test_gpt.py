"""The language model and text generation: GPT's shapes, causality, tied weights and init; its spec; user
factories; the FLOP count; that it learns; and `generate` on a run directory built on tmp_path from real
token shards, a config.toml and a model.pt."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F
from typer.testing import CliRunner

from hpctrain.base.config import ShardConfig, write_toml
from hpctrain.base.errors import CheckpointError, ConfigError, DataError
from hpctrain.cli.main import app
from hpctrain.compute.gpt import (GPT, build_lm, flops_per_token, measure_peak_flops, model_flops_per_token,
                                  parse_gpt_spec)
from hpctrain.data.sharding import shard
from hpctrain.data.tokens import train_bpe
from hpctrain.base.config import ShardConfig
from hpctrain.data.tokenshards import write_token_shards
from hpctrain.tools.generate import generate

TINY = "gpt:layers=1,dim=64,heads=4"
TEXT = "hello world! " * 40


def tiny(seq_len: int = 16, vocab: int = 257) -> GPT:
    torch.manual_seed(0)
    return GPT(vocab, seq_len, **parse_gpt_spec(TINY))


# ---------------------------------------------------------------------------------------------------
# the model
# ---------------------------------------------------------------------------------------------------

def test_shapes_and_shorter_contexts() -> None:
    model = tiny(seq_len=16)
    for t in (1, 7, 16):
        assert model(torch.randint(0, 257, (3, t))).shape == (3, t, 257)
    with pytest.raises(ValueError, match="17 tokens .* seq_len 16"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_causal_a_later_token_never_changes_earlier_logits() -> None:
    model = tiny(seq_len=16).eval()
    x = torch.randint(0, 257, (2, 16))
    y = x.clone()
    y[:, 10] = (x[:, 10] + 1) % 257
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :10], b[:, :10], rtol=0, atol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_head_is_tied_to_the_token_embedding() -> None:
    model = tiny()
    assert model.head.weight is model.tok_emb.weight
    assert model.head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    # counted once: parameters() yields the shared tensor once
    assert model.num_params(positions=True) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert model.num_params() == model.num_params(positions=True) - 16 * 64
    state = model.state_dict()  # both keys, so a plain load_state_dict works; torch.save stores the storage once
    again = tiny()
    again.load_state_dict(state)
    assert again.head.weight is again.tok_emb.weight


def test_gpt2_init() -> None:
    torch.manual_seed(0)
    model = GPT(257, 64, layers=8, dim=256, heads=4)
    assert abs(model.tok_emb.weight.std().item() - 0.02) < 0.002
    assert abs(model.blocks[0].fc.weight.std().item() - 0.02) < 0.002
    scaled = 0.02 / 4  # 1 / sqrt(2 * 8)
    assert abs(model.blocks[3].proj.weight.std().item() - scaled) < 0.0005
    assert abs(model.blocks[3].attn.proj.weight.std().item() - scaled) < 0.0005
    assert model.blocks[0].fc.bias.abs().max().item() == 0


@pytest.fixture(scope="module")
def learned() -> tuple[GPT, list[float]]:
    """A tiny GPT trained for 120 full-batch Adam steps on TEXT's windows of seq_len + 1 bytes, and its losses."""
    model = tiny(seq_len=32)
    rows = torch.tensor(list(TEXT.encode()), dtype=torch.long).unfold(0, 33, 1)[:13]  # each phase of the period 13
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(120):
        loss = F.cross_entropy(model(rows[:, :-1]).reshape(-1, 257), rows[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model.eval(), losses


def test_a_tiny_gpt_overfits_a_repeated_string(learned: tuple[GPT, list[float]]) -> None:
    losses = learned[1]
    assert losses[0] > 5.0  # about ln 257 = 5.55 at init
    assert losses[40] < 1.0 and losses[-1] < 0.1, losses


# ---------------------------------------------------------------------------------------------------
# specs and factories
# ---------------------------------------------------------------------------------------------------

def test_parse_gpt_spec() -> None:
    assert parse_gpt_spec("gpt") == {"layers": 2, "dim": 128, "heads": 4, "dropout": 0.0}
    assert parse_gpt_spec("gpt:heads=6,dropout=0.1,dim=384") == {"layers": 2, "dim": 384, "heads": 6, "dropout": 0.1}
    model = build_lm("gpt:layers=3,dim=48,heads=3", seq_len=20, vocab_size=300)
    assert isinstance(model, GPT) and (model.layers, model.dim, model.heads, model.seq_len) == (3, 48, 3, 20)


@pytest.mark.parametrize(("spec", "message"), [
    ("gpt:depth=2", r"unknown option 'depth=2' in model 'gpt:depth=2': gpt takes layers=.*e\.g\. gpt:layers="),
    ("gpt:layers", r"unknown option 'layers'"),
    ("gpt:layers=2.5", r"layers '2.5' in model 'gpt:layers=2.5' must be a whole number.*e\.g\. gpt:"),
    ("gpt:dim=x", r"dim 'x' in model 'gpt:dim=x' must be a whole number"),
    ("gpt:heads=0", r"heads '0' .* at least 1"),
    ("gpt:dim=100,heads=3", r"dim 100 in model 'gpt:dim=100,heads=3' is not divisible by heads 3.*e\.g\. gpt:"),
    ("gpt:dropout=1", r"dropout '1' in model 'gpt:dropout=1' must be in \[0, 1\)"),
    ("gpt:dim=64,dim=32", r"dim is given twice"),
])
def test_gpt_spec_errors_quote_the_spec_and_give_an_example(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_gpt_spec(spec)
    with pytest.raises(ConfigError, match=message):
        build_lm(spec, 16, 257)


def test_unknown_lm_spec() -> None:
    with pytest.raises(ConfigError, match=r"unknown language model 'transformer': use one of gpt, "):
        build_lm("transformer", 16, 257)


@pytest.mark.parametrize("spec", ["mlp", "mlp:64,32", "cnn:dropout=0.1"])
def test_a_classifier_on_token_shards_says_what_token_shards_need(spec: str) -> None:
    """Before: `unknown language model 'mlp'`, a value the user never typed (the default --model)."""
    with pytest.raises(ConfigError, match=rf"--model {spec} is a classifier.*token shards need `--model gpt`"):
        build_lm(spec, 16, 257)


def test_factory_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "my_lm.py"
    path.write_text(
        "import torch\n"
        "class Bigram(torch.nn.Module):\n"
        "    def __init__(self, seq_len, vocab_size):\n"
        "        super().__init__()\n"
        "        self.seq_len = seq_len\n"
        "        self.table = torch.nn.Embedding(vocab_size, vocab_size)\n"
        "    def forward(self, x):\n"
        "        return self.table(x)\n"
        "def make(seq_len, vocab_size):\n"
        "    return Bigram(seq_len, vocab_size)\n"
        "def not_a_module(seq_len, vocab_size):\n"
        "    return 42\n")
    model = build_lm(f"{path}:make", seq_len=12, vocab_size=50)
    assert type(model).__name__ == "Bigram" and model.seq_len == 12
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 50)
    with pytest.raises(ConfigError, match="returned int, not a torch.nn.Module"):
        build_lm(f"{path}:not_a_module", 12, 50)
    with pytest.raises(ConfigError, match="has no callable 'missing'.*missing\\(seq_len, vocab_size\\)"):
        build_lm(f"{path}:missing", 12, 50)
    with pytest.raises(ConfigError, match="not found"):
        build_lm(f"{tmp_path / 'nope.py'}:make", 12, 50)


# ---------------------------------------------------------------------------------------------------
# FLOPs
# ---------------------------------------------------------------------------------------------------

def test_flops_per_token_formula() -> None:
    # GPT-2 small as nanoGPT counts it: 124M parameters without the 1024 x 768 position embeddings
    n = 124_337_664 - 1024 * 768
    assert flops_per_token(n, layers=12, dim=768, seq_len=1024) == 6 * n + 12 * 12 * 768 * 1024
    model = GPT(257, 64, layers=2, dim=32, heads=2)
    per_block = (32 * 96 + 96) + (32 * 32 + 32) + (32 * 128 + 128) + (128 * 32 + 32) + 2 * 2 * 32
    n = 257 * 32 + 2 * per_block + 2 * 32  # tied embedding/head once, blocks, final LayerNorm
    assert model.num_params() == n
    assert model_flops_per_token(model) == 6 * n + 12 * 2 * 32 * 64
    assert model_flops_per_token(model, seq_len=16) == 6 * n + 12 * 2 * 32 * 16


def test_measure_peak_flops_is_quick_and_plausible() -> None:
    peak = measure_peak_flops("cpu", seconds=0.2)
    assert 1e8 < peak < 1e14


def test_measuring_a_slow_dtype_takes_no_longer_than_a_fast_one() -> None:
    """fp16 matmuls on a CPU run at a few GFLOP/s: at the fast dtypes' size (n = 1024) one takes seconds, and a
    language model's start-up spent over 8 s measuring. The size grows only while a matmul is quick."""
    start = time.process_time()
    peak = measure_peak_flops("cpu", dtype=torch.float16, seconds=0.2)
    assert time.process_time() - start < 1.5 and 1e7 < peak < 1e14


# ---------------------------------------------------------------------------------------------------
# generate
# ---------------------------------------------------------------------------------------------------

def make_run(folder: Path, model: GPT) -> Path:
    """A run directory as `train` leaves it: config.toml, model.pt, and the LM data it names."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corpus.txt").write_text(TEXT)
    data = folder / "data"
    write_token_shards(ShardConfig(source=f"text:{folder / 'corpus.txt'}", out=data, seq_len=32, shards=1,
                                        val_fraction=0))
    run = folder / "run"
    run.mkdir()
    (run / "config.toml").write_text(write_toml({"data": str(data), "run_dir": str(run), "model": TINY}))
    torch.save(model.state_dict(), run / "model.pt")
    return run


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory, learned: tuple[GPT, list[float]]) -> Path:
    return make_run(tmp_path_factory.mktemp("lm"), learned[0])


def test_generate_continues_the_prompt(run_dir: Path) -> None:
    run = run_dir
    text = generate(run, "hello wor", tokens=30, top_k=1)
    assert text.startswith("hello wor") and len(text.encode()) == len("hello wor") + 30
    assert text == TEXT[:39]  # greedy on a model that learned the string: the string
    again = generate(run, "hello", tokens=20, temperature=1.5, seed=3)
    assert again == generate(run, "hello", tokens=20, temperature=1.5, seed=3)  # seeded
    long_prompt = TEXT[:50]  # longer than seq_len: the context is cropped
    assert generate(run, long_prompt, tokens=5, top_k=1) == TEXT[:55]
    assert generate(run, "", tokens=8, top_k=1)  # an empty prompt starts after an end-of-text token
    result = CliRunner().invoke(app, ["generate", str(run), "--prompt", "hello wor", "--tokens", "30", "--top-k", "1"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == TEXT[:39].strip()


def test_generate_errors(tmp_path: Path, run_dir: Path) -> None:
    run = run_dir
    with pytest.raises(ConfigError, match="--temperature 0 must be a number above 0"):
        generate(run, "hi", temperature=0)
    with pytest.raises(ConfigError, match="--tokens 0 must be a whole number of at least 1"):
        generate(run, "hi", tokens=0)
    with pytest.raises(ConfigError, match="--top-k 0"):
        generate(run, "hi", top_k=0)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(CheckpointError, match="model.pt' not found: train first"):
        generate(empty, "hi")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    other = "gpt:layers=2,dim=32,heads=2"
    (wrong / "config.toml").write_text(write_toml({"data": str(run.parent / "data"), "model": other}))
    (wrong / "model.pt").write_bytes((run / "model.pt").read_bytes())
    with pytest.raises(CheckpointError, match="does not load into --model 'gpt:layers=2,dim=32,heads=2'"):
        generate(wrong, "hi")
    result = CliRunner().invoke(app, ["generate", str(empty), "--prompt", "hi"])
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and "train first" in result.stderr


def test_generate_refuses_a_run_that_is_not_a_language_model(tmp_path: Path) -> None:
    data = tmp_path / "data"
    shard(ShardConfig(source="synthetic:64:8:4", out=data, shards=1), show_progress=False)
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(write_toml({"data": str(data), "model": "mlp"}))
    torch.save(torch.nn.Linear(8, 4).state_dict(), run / "model.pt")
    with pytest.raises(ConfigError, match="is not a language model"):
        generate(run, "hi")


def test_generate_keeps_the_tokenizer_inside_the_data_directory(tmp_path: Path) -> None:
    run = make_run(tmp_path, tiny(seq_len=32))
    manifest_path = tmp_path / "data" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["tokenizer"].update(name="tokenizers:tokenizer.json", file="../outside.json")
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="points outside"):
        generate(run, "hi")


def test_generate_with_a_bpe_tokenizer_stored_beside_the_shards(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    (tmp_path / "corpus.txt").write_text(TEXT)
    tok = train_bpe([[TEXT.encode()]], 300, tmp_path / "tok.json", min_frequency=1)
    data = tmp_path / "data"
    write_token_shards(ShardConfig(source=f"text:{tmp_path / 'corpus.txt'}", out=data, seq_len=8, shards=1,
                                        tokenizer=str(tok.path), val_fraction=0))
    # the manifest names the tokenizer.json kept in the data directory, relative to it
    shutil.copyfile(tok.path, data / "tokenizer.json")
    manifest = json.loads((data / "manifest.json").read_text())
    manifest["tokenizer"]["file"] = "tokenizer.json"
    (data / "manifest.json").write_text(json.dumps(manifest))
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(write_toml({"data": str(data), "model": TINY}))
    torch.save(tiny(seq_len=8, vocab=tok.vocab_size).state_dict(), run / "model.pt")
    text = generate(run, "hello", tokens=12)
    assert text.startswith("hello") and len(text) > len("hello")
    (data / "tokenizer.json").write_text((data / "tokenizer.json").read_text().replace("hello", "hellO"))
    with pytest.raises(DataError, match="not the one the data was made with"):
        generate(run, "hello")


def test_generate_help_runs_without_torch() -> None:
    out = subprocess.run([sys.executable, "-m", "hpctrain", "generate", "--help"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "Example: hpctrain generate" in out.stdout and "--top-k" in out.stdout
    code = "import sys, hpctrain.cli.main; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "False"
