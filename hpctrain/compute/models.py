"""The compute layer: build the user's `torch.nn.Module` from a model spec.

Specs: `mlp` (hidden 128,128), `mlp:H1,H2,...[:dropout=P]`, `cnn[:dropout=P]`, `module.path:factory` or
`path/to/file.py:factory`, where `factory(input_shape, num_classes) -> nn.Module`. The module knows
nothing about distribution.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import sys
from pathlib import Path
from typing import Any, Callable

from ..base.errors import ConfigError

BUILTINS = ("mlp", "mlp:H1,H2,...[:dropout=P]", "cnn[:dropout=P]")


def _options(parts: list[str], spec: str) -> dict[str, float]:
    opts = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key != "dropout" or not value:
            raise ConfigError(f"unknown option {part!r} in model {spec!r}: the built-in models take dropout=P")
        try:
            p = float(value)
        except ValueError:
            raise ConfigError(f"dropout {value!r} in model {spec!r} must be a number in [0, 1)") from None
        if not 0 <= p < 1:
            raise ConfigError(f"dropout {value!r} in model {spec!r} must be in [0, 1)")
        opts[key] = p
    return opts


def mlp(input_shape: tuple[int, ...], num_classes: int, hidden: tuple[int, ...] = (128, 128), dropout: float = 0.0) -> Any:
    """Flatten -> (Linear -> ReLU [-> Dropout]) per hidden width -> Linear."""
    from torch import nn

    layers: list[Any] = [nn.Flatten()]
    width = math.prod(input_shape)
    for h in hidden:
        layers += [nn.Linear(width, h), nn.ReLU()]
        if dropout:
            layers.append(nn.Dropout(dropout))
        width = h
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) == 3:
        return input_shape  # type: ignore[return-value]
    if len(input_shape) == 2:
        return (1, *input_shape)
    side = math.isqrt(input_shape[0]) if len(input_shape) == 1 else 0
    if side * side == (input_shape[0] if len(input_shape) == 1 else -1):
        return (1, side, side)
    raise ConfigError(f"model 'cnn' needs images (C, H, W), (H, W) or a square number of features; the data has shape {input_shape}: use --model mlp")


def cnn(input_shape: tuple[int, ...], num_classes: int, dropout: float = 0.0) -> Any:
    """A small conv net: two 3x3 conv blocks (32, 64 channels), global average pooling, a linear head."""
    from torch import nn

    c, h, w = _image_shape(input_shape)
    layers: list[Any] = [
        nn.Flatten(), nn.Unflatten(1, (c, h, w)),  # flat rows and (N, C, H, W) images alike
        nn.Conv2d(c, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
        nn.MaxPool2d(2) if min(h, w) >= 2 else nn.Identity(),
        nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(),
    ]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(64, num_classes))
    return nn.Sequential(*layers)


def load_factory(spec: str, *, known: str = "", signature: str = "(input_shape, num_classes)") -> Callable[..., Any]:
    """The callable named by `module.path:factory` or `path/to/file.py:factory`; `known` lists the built-in
    specs and `signature` the factory's arguments, for the messages."""
    target, _, name = spec.rpartition(":")
    if not target or not name.isidentifier():
        known = known or ", ".join(BUILTINS)
        raise ConfigError(f"unknown model {spec!r}: use one of {known}, module.path:factory or path/to/file.py:factory")
    if target.endswith(".py"):
        path = Path(target)
        if not path.is_file():
            raise ConfigError(f"model file {target!r} (from --model {spec!r}) not found")
        mod_name = f"hpctrain_user_model_{abs(hash(str(path.resolve())))}"
        module_spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(module_spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        try:
            module_spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:
            raise ConfigError(f"model file {target!r} failed to import: {type(exc).__name__}: {exc}") from exc
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ConfigError(f"cannot import module {target!r} for --model {spec!r} ({exc}); is it on PYTHONPATH?") from exc
    factory = getattr(module, name, None)
    if not callable(factory):
        raise ConfigError(f"{target!r} has no callable {name!r} for --model {spec!r}: define {name}{signature} -> nn.Module")
    return factory


def build_model(spec: str, input_shape: tuple[int, ...], num_classes: int) -> Any:
    """The module for `spec`; raises ConfigError for an unknown or broken spec."""
    from torch import nn

    head, *rest = spec.split(":")
    if head == "mlp" and (not rest or "=" in rest[0] or all(p.strip().isdigit() for p in rest[0].split(","))):
        hidden = (128, 128)
        if rest and "=" not in rest[0]:
            hidden = tuple(int(p) for p in rest[0].split(",") if p.strip())
            rest = rest[1:]
        return mlp(input_shape, num_classes, hidden, **_options(rest, spec))
    if head == "cnn" and (not rest or "=" in rest[0]):
        return cnn(input_shape, num_classes, **_options(rest, spec))
    if ":" not in spec:
        raise ConfigError(f"unknown model {spec!r}: use one of {', '.join(BUILTINS)}, module.path:factory or path/to/file.py:factory")
    model = load_factory(spec)(tuple(input_shape), int(num_classes))
    if not isinstance(model, nn.Module):
        raise ConfigError(f"the factory of --model {spec!r} returned {type(model).__name__}, not a torch.nn.Module")
    return model
