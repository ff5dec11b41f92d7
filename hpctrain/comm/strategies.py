"""The one place that maps a ZeRO stage's number to the strategy that owns its behaviour: the gradient engine
builds it, and the trainer, the step, the memory plan, the checkpoint, the library API and the tools ask its
class (`strategy_class(stage).gathers_in_forward`) or the engine's instance (`sync.strategy.holds_whole_model`)
instead of comparing the number (tests/unit/test_zero_home.py keeps it so).
"""

from __future__ import annotations

from typing import Any

from ..base.errors import ConfigError
from .allreduce import WholeGradients
from .buckets import Strategy
from .zero import ShardedGradients, ShardedState
from .zero3 import ShardedParams

STRATEGIES: dict[int, type[Strategy]] = {0: WholeGradients, 1: ShardedState, 2: ShardedGradients, 3: ShardedParams}


def strategy_class(stage: Any) -> type[Strategy]:
    """The strategy class of ZeRO `stage`; a ConfigError naming the stages for any other value."""
    cls = STRATEGIES.get(stage) if isinstance(stage, int) and not isinstance(stage, bool) else None
    if cls is None:
        raise ConfigError(f"ZeRO stage {stage!r} must be 0 (none), 1 (optimizer state), 2 (also gradients) or 3 "
                          "(also parameters)")
    return cls
