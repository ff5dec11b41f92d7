"""The shard sets and weight files of chaos cases, built once per session on first use (thread-safe).

Classifier shard sets come from `hpctrain shard SOURCE`; token shard sets from `hpctrain shard text:DIR
--seq-len T`, DIR holding a few files of the running interpreter's standard library (read at run time,
`sysconfig.get_paths()["stdlib"]`: text nobody wrote for this test, on every machine that runs it). A
weight file for `--init-weights` is the state_dict of a freshly initialized model of one spec for one
shard set's shapes, built by hpctrain's own model builder in a subprocess.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sysconfig
import threading
from pathlib import Path

from chaos_procs import PYTHON, base_env
from chaos_space import SOURCE_INFO, DataSpec, classifier_shard_sizes

STDLIB_FILES = ("bisect.py", "colorsys.py", "heapq.py", "keyword.py", "textwrap.py", "this.py")
WEIGHTS_SCRIPT = """import sys, torch
from hpctrain.control.lm import build
from hpctrain.data.shardformat import load_manifest
data, model, out = sys.argv[1:4]
torch.manual_seed(20261201)
net = build(model, load_manifest(data))
torch.save(net.state_dict(), out + '.tmp')
"""


class DataCache:
    """Shard sets and weight files built on first use in ROOT (once per session, thread-safe)."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self._lock = threading.Lock()
        self._manifests: dict[DataSpec, dict] = {}

    def path(self, spec: DataSpec) -> Path:
        return self.root / spec.name

    def train_shard_sizes(self, spec: DataSpec) -> list[int]:
        """Training samples of each shard: computed for a classifier source, read from built token shards."""
        if not spec.lm:
            return classifier_shard_sizes(spec)
        return [int(s["samples"]) for s in self.manifest(spec)["splits"]["train"]["shards"]]

    def manifest(self, spec: DataSpec) -> dict:
        with self._lock:
            if spec not in self._manifests:
                out = self.path(spec)
                if not (out / "manifest.json").exists():
                    self._build(spec, out)
                manifest = json.loads((out / "manifest.json").read_text())
                built = [int(s["samples"]) for s in manifest["splits"]["train"]["shards"]]
                if not spec.lm and built != classifier_shard_sizes(spec):
                    raise RuntimeError(f"{spec.short()}: `hpctrain shard` wrote train shards of {built} samples, "
                                       f"the drawing assumed {classifier_shard_sizes(spec)}: update chaos_space")
                self._manifests[spec] = manifest
            return self._manifests[spec]

    def _build(self, spec: DataSpec, out: Path) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        source = spec.source
        extra: list[str] = []
        if SOURCE_INFO[spec.source] is None:  # token rows of a few standard-library files
            corpus = self.root / "stdlib-text"
            if not corpus.is_dir():
                tmp = self.root / "stdlib-text.tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
                for name in STDLIB_FILES:
                    shutil.copyfile(Path(sysconfig.get_paths()["stdlib"]) / name, tmp / name)
                tmp.rename(corpus)
            source = f"text:{corpus}"
            extra = ["--glob", "*.py", "--seq-len", spec.source.split(":")[1]]
        self._check([PYTHON, "-m", "hpctrain", "shard", source, str(out), "--shards", str(spec.shards),
                     "--val-fraction", str(spec.val_fraction), *extra])

    def weights(self, model: str, spec: DataSpec) -> Path:
        """A state_dict of `model` for the shapes of `spec`'s source (the same for any shard count)."""
        data = self.path(spec)
        self.manifest(spec)
        out = self.root / "weights" / f"{spec.source.replace(':', '-')}_{model.replace(':', '-').replace(',', '-')}.pt"
        with self._lock:
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                self._check([PYTHON, "-c", WEIGHTS_SCRIPT, str(data), model, str(out)])
                Path(str(out) + ".tmp").rename(out)
        return out

    @staticmethod
    def _check(cmd: list[str]) -> None:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=base_env())
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
