"""The name the docs gave `load_files` before the checkpoint code had its own package: importing it still works
and warns. Use `hpctrain.checkpoint.load_files`."""

import warnings

from ...checkpoint.manager import (CheckpointManager, last_complete, latest, list_checkpoints, load_broadcast,
                                   load_files, verify)

__all__ = ["CheckpointManager", "last_complete", "latest", "list_checkpoints", "load_broadcast", "load_files", "verify"]

warnings.warn("hpctrain.control.checkpoint is deprecated: use hpctrain.checkpoint.load_files (hpctrain.checkpoint "
              "holds the checkpoint code)", DeprecationWarning, stacklevel=2)
