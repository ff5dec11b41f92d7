"""The compute layer: the user's `torch.nn.Module` (built-in `mlp`/`cnn`, or `module:factory`)."""
