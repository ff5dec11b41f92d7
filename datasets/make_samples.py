"""Write the small sample files in datasets/samples/, one per SOURCE form that `hpctrain shard` reads from
the common dataset formats. Seeded and free of downloads, so running it again gives the same data.

    python datasets/make_samples.py [--out datasets/samples]

images/          imagefolder: 3 class folders (circle, square, triangle) of 4 images each, PNG and JPEG, in
                 three sizes (shard it with --image-size)
mnist/           MNIST idx files: 30 training digits gzipped, 10 test digits plain (28x28, from scikit-learn's
                 digits scaled up)
cifar10/         CIFAR-10 python batches: data_batch_1 (4 images), test_batch (3), batches.meta (class names)
table.parquet    a numeric table (16 pixel columns p0..p15 and a `label` column) [needs pyarrow]
images.parquet   encoded PNG images in an `image` column as Hugging Face datasets write them (a struct of
                 bytes and path) with class names in `label` [needs pyarrow]
"""

from __future__ import annotations

import argparse
import gzip
import io
import pickle
import struct
import sys
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
CIFAR10_CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _digits() -> tuple[np.ndarray, np.ndarray]:
    from sklearn.datasets import load_digits

    d = load_digits()
    return np.round(d.images * (255 / 16)).astype(np.uint8), d.target.astype(np.uint8)


def _shape_image(kind: str, size: tuple[int, int], rng: np.random.Generator) -> "object":
    from PIL import Image, ImageDraw

    w, h = size
    background = tuple(int(v) for v in rng.integers(0, 80, 3))
    color = tuple(int(v) for v in rng.integers(150, 256, 3))
    img = Image.new("RGB", (w, h), background)
    draw = ImageDraw.Draw(img)
    m = int(rng.integers(1, 4))
    box = (m, m, w - 1 - m, h - 1 - m)
    if kind == "circle":
        draw.ellipse(box, fill=color)
    elif kind == "square":
        draw.rectangle(box, fill=color)
    else:
        draw.polygon([(w // 2, m), (w - 1 - m, h - 1 - m), (m, h - 1 - m)], fill=color)
    return img


def image_folder(out: Path) -> None:
    rng = np.random.default_rng(10)
    layout = {"circle": ((24, 20), "png"), "square": ((20, 24), "png"), "triangle": ((16, 16), "jpg")}
    for kind, (size, ext) in layout.items():
        (out / kind).mkdir(parents=True, exist_ok=True)
        for i in range(4):
            _shape_image(kind, size, rng).save(out / kind / f"{kind}-{i}.{ext}", quality=90)


def _idx(array: np.ndarray) -> bytes:
    return bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape) + array.tobytes()


def mnist(out: Path) -> None:
    images, labels = _digits()
    big = np.pad(np.kron(images[:40], np.ones((3, 3), np.uint8)), ((0, 0), (2, 2), (2, 2)))  # 8x8 -> 28x28
    out.mkdir(parents=True, exist_ok=True)
    for name, data in (("train-images-idx3-ubyte", big[:30]), ("train-labels-idx1-ubyte", labels[:30])):
        (out / f"{name}.gz").write_bytes(gzip.compress(_idx(data), mtime=0))
    (out / "t10k-images-idx3-ubyte").write_bytes(_idx(big[30:40]))
    (out / "t10k-labels-idx1-ubyte").write_bytes(_idx(labels[30:40]))


def cifar10(out: Path) -> None:
    images, _ = _digits()
    rng = np.random.default_rng(11)
    out.mkdir(parents=True, exist_ok=True)
    offset = 0
    for name, count in (("data_batch_1", 4), ("test_batch", 3)):
        labels = [int(v) for v in rng.integers(0, 10, count)]
        rows = []
        for i, label in enumerate(labels):
            glyph = np.kron(images[offset + i], np.ones((4, 4), np.uint8)).astype(np.float32) / 255  # 32x32
            tint = rng.uniform(0.3, 1.0, 3).astype(np.float32)
            rows.append(np.round(glyph[None] * tint[:, None, None] * 255).astype(np.uint8).reshape(-1))
        offset += count
        # The layout of the real batches: bytes keys, uint8 rows of 1024 R, 1024 G, 1024 B values.
        batch = {b"batch_label": f"sample {name}".encode(), b"labels": labels, b"data": np.stack(rows),
                 b"filenames": [f"sample_{offset - count + i}.png".encode() for i in range(count)]}
        (out / name).write_bytes(pickle.dumps(batch, protocol=2))
    meta = {b"num_cases_per_batch": 4, b"label_names": [n.encode() for n in CIFAR10_CLASSES], b"num_vis": 3072}
    (out / "batches.meta").write_bytes(pickle.dumps(meta, protocol=2))


def parquet(out: Path) -> bool:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        print("pyarrow is not installed: skipping table.parquet and images.parquet (pip install pyarrow)")
        return False
    images, labels = _digits()
    flat = images[:60, 2:6, 2:6].reshape(60, -1)  # the 4x4 center of each digit
    table = pa.table({**{f"p{j}": pa.array(flat[:, j]) for j in range(flat.shape[1])}, "label": pa.array(labels[:60])})
    pq.write_table(table, out / "table.parquet", row_group_size=30)
    rng = np.random.default_rng(12)
    blobs, names = [], []
    for i in range(12):
        kind = ("circle", "square", "triangle")[i % 3]
        buf = io.BytesIO()
        _shape_image(kind, (16, 16), rng).save(buf, format="PNG")
        blobs.append({"bytes": buf.getvalue(), "path": f"{kind}-{i}.png"})
        names.append(kind)
    pq.write_table(pa.table({"image": blobs, "label": names}), out / "images.parquet", row_group_size=5)
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write the small sample files of datasets/samples/.")
    parser.add_argument("--out", type=Path, default=HERE / "samples", help="output folder (default datasets/samples)")
    args = parser.parse_args(argv)
    image_folder(args.out / "images")
    mnist(args.out / "mnist")
    cifar10(args.out / "cifar10")
    parquet(args.out)
    print(f"wrote samples under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
