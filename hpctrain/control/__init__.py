"""The control layer: the trainer loop, its step, checkpoints, the watchdog, run logs and RNG state."""
