"""Render scikit-learn's handwritten digits as a PNG image folder: OUT/<digit>/<index>.png.

The 1,797 8x8 images (16 gray levels) ship with scikit-learn, so this is a real image dataset that needs no
download. Gray level g in 0..16 becomes pixel round(g * 255 / 16); `--size` scales the images up (bilinear).

    python datasets/digits_to_imagefolder.py data/digits-png
    hpctrain shard imagefolder:data/digits-png data/digits-shards --shards 2
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np


def render(out: Path, size: int = 8, fmt: str = "png") -> int:
    """Write the digits under `out` (one subfolder per class); return the number of images."""
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    pixels = np.round(digits.images * (255 / 16)).astype(np.uint8)
    for name in map(str, sorted(set(digits.target))):
        (out / name).mkdir(parents=True, exist_ok=True)
    for i, (image, label) in enumerate(zip(pixels, digits.target)):
        img = Image.fromarray(image)
        if size != image.shape[0]:
            img = img.resize((size, size), Image.Resampling.BILINEAR)
        img.save(out / str(label) / f"{i:04d}.{fmt}")
    return len(pixels)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="folder to create (must not exist or be empty)")
    parser.add_argument("--size", type=int, default=8, help="side in pixels (default 8, the original)")
    parser.add_argument("--format", choices=("png", "jpg"), default="png", help="image file format")
    args = parser.parse_args(argv)
    if args.out.exists() and any(args.out.iterdir()):
        parser.error(f"{args.out} exists and is not empty: choose a new folder")
    if args.size < 1:
        parser.error("--size must be at least 1")
    count = render(args.out, args.size, args.format)
    print(f"wrote {count} images in 10 class folders under {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
