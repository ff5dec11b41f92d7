"""The random state of one rank (torch, CUDA, numpy, Python), as checkpoints carry it for exact resume.

`capture()` returns a tree of plain values and tensors (loadable with `torch.load(weights_only=True)`);
`restore(state)` puts it back.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np


def capture() -> dict[str, Any]:
    """Every random stream this rank draws from."""
    import torch

    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached": float(cached)}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore(state: dict[str, Any]) -> None:
    """Put back what `capture()` returned."""
    import torch

    torch.set_rng_state(state["torch"])
    s = state["numpy"]
    np.random.set_state((s["name"], s["keys"].numpy().astype(np.uint32), s["pos"], s["has_gauss"], s["cached"]))
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
