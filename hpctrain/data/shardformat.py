"""The shard format: what `hpctrain shard` writes and every reader checks.

A shard set is `OUT/manifest.json` plus `OUT/{train,val}/shard-*.h5`. This module owns the manifest's
constants and entry names, the shard file names, `load_manifest` (which checks the manifest and refuses
paths that leave the dataset directory) and `verify` (the files against the manifest's sizes and sha256, and
the rows of a language-model dataset against its packing rule).
The writer is `sharding`; the per-rank reader is `reader`.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import AbstractSet, Any

import numpy as np

from ..base.durable import fsync_dir, sha256_file
from ..base.errors import ConfigError, DataError
from .hdf5env import reader_locking

MANIFEST = "manifest.json"
FORMAT = "hpctrain-shards"
VERSION = 2  # 2: the normalization keys renamed (normalize_on_read, normalized_on_write); 1 still reads
LM_VERSION = 3  # 3: token rows for language models (task "lm": x only, no labels)
READS = (1, 2, 3)  # an older hpctrain refuses a newer manifest instead of misreading it
TOKENIZER_FILE = "tokenizer.json"  # a language-model dataset's own tokenizer (not the bytes one), beside the shards
SPLITS = ("train", "val")
# The two normalization entries, each named for the one thing it says: NORMALIZE_ON_READ is what the reader
# applies to stored uint8 images to make float32; NORMALIZED_ON_WRITE records what --normalize already applied
# to the stored x (the reader applies nothing). Manifests written before the rename call them "normalization"
# and "normalize" (OLD_NAMES); `manifest_entry` reads either.
NORMALIZE_ON_READ = "normalize_on_read"
NORMALIZED_ON_WRITE = "normalized_on_write"
OLD_NAMES = {NORMALIZE_ON_READ: "normalization", NORMALIZED_ON_WRITE: "normalize"}


def manifest_entry(manifest: dict[str, Any], name: str) -> Any:
    """The manifest's entry `name` (or None), read under its old name from a manifest written before then."""
    if name in manifest:
        return manifest[name]
    return manifest.get(OLD_NAMES.get(name, name))


def shard_name(index: int, count: int) -> str:
    return f"shard-{index:05d}-of-{count:05d}.h5"


@dataclass(frozen=True, slots=True)
class ShardFile:
    path: Path
    samples: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ShardSet:
    """A loaded, validated manifest."""

    root: Path
    manifest: dict[str, Any]
    num_shards: int
    num_classes: int
    x_shape: tuple[int, ...]
    x_dtype: str
    splits: dict[str, list[ShardFile]]

    @property
    def task(self) -> str:
        """`classify` (samples and labels) or `lm` (rows of tokens; the targets are each row shifted by one)."""
        return str(self.manifest.get("task", "classify"))

    @property
    def seq_len(self) -> int:
        """lm: the tokens a model reads per row (a row stores one more)."""
        return int(self.manifest.get("seq_len", self.x_shape[0] - 1))

    def datasets(self) -> tuple[str, ...]:
        """The HDF5 datasets of every shard file."""
        return ("x", "index") if self.task == "lm" else ("x", "y", "index")

    @property
    def row_bytes(self) -> int:
        """Bytes of one sample's x as stored (at least 1)."""
        return max(1, int(np.prod(self.x_shape)) * np.dtype(self.x_dtype).itemsize)

    @property
    def fingerprint(self) -> str:
        """sha256 of the manifest's content: the identity of this dataset in checkpoints."""
        canonical = json.dumps(self.manifest, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(canonical).hexdigest()

    def normalize_on_read(self, x: np.ndarray) -> np.ndarray:
        """x as train feeds it: stored integers (uint8 images) become float32 with the manifest's
        normalize_on_read entry, (x * scale - mean[c]) / std[c] per channel c (axis 1); floats pass as they are."""
        norm = manifest_entry(self.manifest, NORMALIZE_ON_READ)
        if norm is None or np.issubdtype(x.dtype, np.floating):
            return x
        out = x.astype(np.float32) * np.float32(norm.get("scale", 1.0))
        mean = np.asarray(norm.get("mean", [0.0]), np.float32)
        std = np.asarray(norm.get("std", [1.0]), np.float32)
        shape = (1, -1) + (1,) * (out.ndim - 2) if out.ndim >= 2 and mean.size > 1 else (1,) * out.ndim
        out -= mean.reshape(shape) if mean.size > 1 else mean[0]
        out /= std.reshape(shape) if std.size > 1 else std[0]
        return out

    def samples(self, split: str) -> int:
        return sum(s.samples for s in self.splits.get(split, []))

    def rank_shards(self, split: str, rank: int, world: int) -> list[ShardFile]:
        return self.splits.get(split, [])[rank::world]

    def check_world(self, world: int) -> None:
        if self.num_shards % world:
            divisors = [w for w in range(1, self.num_shards + 1) if self.num_shards % w == 0]
            raise ConfigError(
                f"--data {str(self.root)!r} holds {self.num_shards} shards per split, and {world} ranks cannot "
                f"share them evenly (rank r reads shards r, r+{world}, ...): run on {', '.join(map(str, divisors))} "
                f"ranks, or reshard with "
                f"`hpctrain shard SOURCE OUT --shards {world * max(1, self.num_shards // world + 1)}`"
            )


def inside(root: Path, rel: str) -> Path:
    """The path of a manifest entry, refusing entries that escape the dataset directory."""
    if not isinstance(rel, str) or not rel or Path(rel).is_absolute():
        raise DataError(f"manifest entry {rel!r} in {root / MANIFEST} must be a path relative to {root}")
    path = (root / rel).resolve()
    if not path.is_relative_to(root.resolve()):
        raise DataError(f"manifest entry {rel!r} in {root / MANIFEST} points outside {root}; refusing to read it")
    return path


def load_manifest(root: Path | str) -> ShardSet:
    """Read and check `root/manifest.json`; raise DataError naming what is wrong and how to fix it."""
    root = Path(root)
    mpath = root / MANIFEST
    if not root.exists():
        raise DataError(f"--data {str(root)!r} does not exist: create it with `hpctrain shard SOURCE {root}`")
    if not mpath.is_file():
        raise DataError(f"{str(mpath)!r} not found: is {str(root)!r} a directory written by `hpctrain shard`?")
    try:
        manifest = json.loads(mpath.read_text())
    except (OSError, ValueError) as exc:
        raise DataError(f"{str(mpath)!r} is not valid JSON ({exc}); re-create it with `hpctrain shard`") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DataError(f"{str(mpath)!r} is not an hpctrain manifest (format must be {FORMAT!r})")
    if manifest.get("version") not in READS:
        raise DataError(f"{str(mpath)!r} has version {manifest.get('version')!r}; this hpctrain reads versions "
                        f"{', '.join(map(str, READS))}: re-create the data with this version's `hpctrain shard`")
    try:
        num_shards = int(manifest["num_shards"])
        num_classes = int(manifest["num_classes"])
        x_shape = tuple(int(d) for d in manifest["x"]["shape"])
        x_dtype = str(manifest["x"]["dtype"])
        splits: dict[str, list[ShardFile]] = {}
        for split, body in manifest["splits"].items():
            if split not in SPLITS:
                raise DataError(f"{str(mpath)!r} has an unknown split {split!r}; expected {', '.join(SPLITS)}")
            files = [ShardFile(inside(root, e["file"]), int(e["samples"]), str(e["sha256"])) for e in body["shards"]]
            if len(files) != num_shards:
                raise DataError(f"{str(mpath)!r}: split {split!r} lists {len(files)} shards, expected {num_shards}")
            splits[split] = files
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(f"{str(mpath)!r} is missing or has a malformed field ({exc}); re-create it with `hpctrain shard`") from exc
    if "train" not in splits:
        raise DataError(f"{str(mpath)!r} has no train split")
    for files in splits.values():
        for f in files:
            if not f.path.is_file():
                raise DataError(f"shard {str(f.path)!r} listed in {str(mpath)!r} is missing; re-create the data with `hpctrain shard`")
    return ShardSet(root, manifest, num_shards, num_classes, x_shape, x_dtype, splits)


def verify(root: Path | str, *, quick: bool = False, show_progress: bool = False) -> list[str]:
    """Re-hash every shard (or, with `quick`, check sizes and datasets only); return the problems found.
    Without `quick`, the rows of a language-model dataset are checked too (`lm_row_problems`)."""
    import h5py

    from ..base.progress import Progress

    shardset = load_manifest(root)
    problems: list[str] = []
    broken: set[Path] = set()  # unreadable or of the wrong size: the row check leaves their split alone
    everything = [f for files in shardset.splits.values() for f in files]
    with Progress(len(everything), "verify", enabled=show_progress, unit="files") as bar:
        for f in everything:
            bar.update(1)
            try:
                with h5py.File(f.path, "r", locking=reader_locking()) as h5:
                    n = {name: h5[name].shape[0] for name in shardset.datasets()}
            except (OSError, KeyError) as exc:
                problems.append(f"{f.path}: unreadable or missing a dataset ({exc})")
                broken.add(f.path)
                continue
            if set(n.values()) != {f.samples}:
                problems.append(f"{f.path}: holds {n} samples, the manifest says {f.samples}")
                broken.add(f.path)
            if not quick and sha256_file(f.path) != f.sha256:
                problems.append(f"{f.path}: sha256 differs from the manifest (file changed or corrupt)")
    if not quick and shardset.task == "lm":
        problems += lm_row_problems(shardset, skip=broken, show_progress=show_progress)
    return problems


# -- the rows of a language-model dataset ----------------------------------------------------------------
ROW_SLAB_BYTES = 16 << 20  # rows of x the row check reads at a time
REMAKE = "the rows were stored wrong (a file's sha256 is taken after writing, so it cannot tell): " \
         "re-create the data with `hpctrain shard`"


def lm_row_problems(shardset: ShardSet, *, skip: AbstractSet[Path] = frozenset(),
                    show_progress: bool = False) -> list[str]:
    """What the stored rows of a language-model dataset break of the packing rule (`tokens`: row r is
    stream[r * seq_len : r * seq_len + seq_len + 1] of the split's token stream, each document's tokens then
    EOT). Per split: `index` numbers the rows 0..n-1 once each; every id is below vocab_size; row r + 1 starts
    with the token row r ends with; the rows cover as many EOTs as the split's documents and dropped tail
    allow, and end with EOT when nothing was dropped. Rows written wrong and then hashed pass the sha256 check
    but rarely all of these. A split with a file in `skip` is left out. Memory: two tokens and a flag per
    row, and ROW_SLAB_BYTES of rows at a time."""
    from ..base.progress import Progress

    problems: list[str] = []
    splits = {split: files for split, files in shardset.splits.items() if not skip.intersection(f.path for f in files)}
    with Progress(sum(map(len, splits.values())), "rows", enabled=show_progress, unit="files") as bar:
        for split, files in splits.items():
            problems += _split_row_problems(shardset, split, files, bar)
    return problems


def _split_row_problems(shardset: ShardSet, split: str, files: list[ShardFile], bar: Any) -> list[str]:
    manifest, n = shardset.manifest, shardset.samples(split)
    if n == 0:
        return []
    eot, vocab = int(manifest["eot_id"]), int(manifest["vocab_size"])
    first, last = np.zeros(n, shardset.x_dtype), np.zeros(n, shardset.x_dtype)
    seen = np.zeros(n, bool)
    problems: list[str] = []
    eots = 0  # EOTs of the stream the rows cover: those in row[1:] of every row, and row 0's first token
    for f in files:
        bar.update(1)
        try:
            for index, x in _row_slabs(f.path, shardset):
                if ((index < 0) | (index >= n)).any() or seen[index].any():
                    return [f"{f.path}: its index repeats a row or passes the {n} rows of split {split!r}: {REMAKE}"]
                seen[index] = True
                first[index], last[index] = x[:, 0], x[:, -1]
                eots += int(np.count_nonzero(x[:, 1:] == eot))
                if x.max() >= vocab and not any(str(f.path) in p for p in problems):
                    r = int(np.argmax(x.max(axis=1)))
                    problems.append(f"{f.path}: row {int(index[r])} holds id {int(x[r].max())}, not below the "
                                    f"vocabulary size {vocab}: {REMAKE}")
        except (OSError, KeyError) as exc:
            return [f"{f.path}: cannot read its rows ({exc}): {REMAKE}"]
    if not seen.all():
        return [f"split {split!r}: row {int(np.argmin(seen))} is in none of its shards' index: {REMAKE}"]
    bad = np.flatnonzero(last[:-1] != first[1:])
    if bad.size:
        r = int(bad[0])
        more = f" ({bad.size - 1} more rows do not join the row before them)" if bad.size > 1 else ""
        problems.append(f"split {split!r}: row {r} ends with token {last[r]} but row {r + 1} (in "
                        f"{_holder(files, r + 1)}) starts with {first[r + 1]}; consecutive rows share one token"
                        f"{more}: {REMAKE}")
    return problems + _eot_problems(shardset, split, eots + int(first[0] == eot), int(last[-1]))


def _row_slabs(path: Path, shardset: ShardSet) -> Any:
    """(index, x) of a shard file, a whole number of HDF5 chunks of rows at a time."""
    import h5py

    chunk = int(shardset.manifest.get("chunk_rows", 1))
    step = max(1, ROW_SLAB_BYTES // (shardset.row_bytes * chunk)) * chunk
    with h5py.File(path, "r", locking=reader_locking()) as h5:
        x, index = h5["x"], h5["index"]
        for a in range(0, x.shape[0], step):
            yield index[a:a + step], x[a:a + step]


def _holder(files: list[ShardFile], row: int) -> str:
    """The file whose index holds `row` (read again only to name it in a problem)."""
    import h5py

    for f in files:
        with h5py.File(f.path, "r", locking=reader_locking()) as h5:
            if np.any(h5["index"][()] == row):
                return str(f.path)
    return "no file"


def _eot_problems(shardset: ShardSet, split: str, eots: int, last_token: int) -> list[str]:
    """The EOTs of the covered stream against the split's counts. Every document ends with one EOT and the
    `dropped_tokens` tail (the stream's end, so its last token is an EOT) holds 1..dropped of them: so at least
    documents - dropped are covered; with the bytes tokenizer, whose text never yields the EOT id, at most
    documents - 1 when a tail was dropped (documents when none). A subword tokenizer may read EOT from the text."""
    from .tokens import BYTES_SHA256

    body = shardset.manifest["splits"][split]
    eot, docs, dropped = int(shardset.manifest["eot_id"]), body.get("documents"), body.get("dropped_tokens")
    if docs is None or dropped is None:
        return []
    low = docs - min(dropped, docs)
    high = docs - (dropped > 0) if shardset.manifest.get("tokenizer", {}).get("sha256") == BYTES_SHA256 else None
    problems = []
    if eots < low or (high is not None and eots > high):
        allowed = f"{low}..{high}" if high is not None else f"at least {low}"
        problems.append(f"split {split!r}: its rows hold {eots} end-of-document tokens (id {eot}) where its {docs} "
                        f"documents, {dropped} tokens dropped at the end, allow {allowed}: {REMAKE}")
    if dropped == 0 and last_token != eot:
        problems.append(f"split {split!r}: its last row ends with token {last_token}, not the end-of-document token "
                        f"{eot}, though no tokens were dropped: {REMAKE}")
    return problems


# -- writing: what `sharding` and `tokenshards` share --------------------------------------------------------
def safe_to_replace(out: Path) -> bool:
    """Whether --force may replace `out`: an empty directory or an hpctrain dataset, nothing else."""
    if out.is_dir() and not any(out.iterdir()):
        return True
    try:
        return json.loads((out / MANIFEST).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def write_manifest(tmp: Path, manifest: dict[str, Any], fsync: bool) -> None:
    """`tmp`/manifest.json, made durable with `fsync`."""
    with open(tmp / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=2)
        fh.write("\n")
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())


def discard_partial(tmp: Path, created: list[Path]) -> None:
    """After a failed write: remove the temporary directory and the parent folders the writer created, so
    bad input leaves nothing behind."""
    shutil.rmtree(tmp, ignore_errors=True)
    for p in created[::-1]:
        try:
            p.rmdir()
        except OSError:
            pass


def hash_and_sync(path: Path, fsync: bool) -> str:
    """The sha256 of a written shard file, made durable first with `fsync`."""
    digest = sha256_file(path)
    if fsync:
        with open(path, "rb") as fh:
            os.fsync(fh.fileno())
    return digest


def commit(tmp: Path, out: Path, fsync: bool) -> None:
    """Move the finished directory into place; an old OUT (with --force) is removed only afterwards.

    With --fsync every shard file and the manifest were fsynced by their writers; what remains are the
    directory entries, before and after the rename."""
    if fsync:
        for path in [tmp, *(p for p in tmp.iterdir() if p.is_dir())]:
            fsync_dir(path)
    old = None
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        out.rename(old)
    tmp.rename(out)
    if fsync:
        fsync_dir(out.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)

