"""Checkpoints: the policy and the checkpoint directory (`manager`), the on-disk format (`format`), the background
writer (`writer`), reading by boxes of named tensors (`boxes`), opening one on every rank (`loader`), the state
a training loop saves and restores (`state`; a split run's shares: `layoutfree`), what every entry path does
when it resumes (`resume`), each rank's random state (`rng`), and the final model file (`modelfile`).

`hpctrain.checkpoint.load_files(PATH)` reads a whole checkpoint into dicts, for tools and tests."""

from .manager import load_files

__all__ = ["load_files"]
