"""What a ZeRO stage 3 parameter is while its unit is released: a parameter that holds no bytes here, whose
every read by torch raises one line naming it and its unit.

zero3.py gathers a unit's parameters for that unit's own forward and backward only. Between, each parameter
keeps its shape and holds a NaN placeholder (writes are refused by torch), and a plain `nn.Parameter` takes the
class `ReleasedParameter`, whose `__torch_function__` answers metadata (shape, dtype, device, `.grad`, hooks)
and refuses everything else: a forward that reads a unit's weight outside the unit (GPT-2's
`F.linear(x, self.transformer.wte.weight)`) would otherwise compute on the placeholder and train into NaN. The
class is swapped back when the unit is gathered, so a gathered parameter costs nothing extra.
"""

from __future__ import annotations

from types import GetSetDescriptorType
from typing import Any, Iterator

from ..base.errors import ConfigError

ALLOWED_ATTRIBUTES = frozenset((
    "shape", "dtype", "device", "requires_grad", "grad", "data", "is_leaf", "ndim", "is_cuda", "layout", "grad_fn",
    "is_sparse", "is_meta", "_version", "_base", "names", "is_quantized", "is_nested", "_grad", "_grad_fn",
    "_post_accumulate_grad_hooks", "_backward_hooks"))
"""What a released parameter answers: its metadata, its gradient, its `.data` (the NaN placeholder, which
refuses writes) and its hooks; anything that reads its values raises."""
ALLOWED_METHODS = frozenset((
    "numel", "nelement", "size", "dim", "element_size", "stride", "storage_offset", "is_contiguous",
    "is_floating_point", "is_complex", "get_device", "requires_grad_", "register_hook",
    "register_post_accumulate_grad_hook", "untyped_storage", "data_ptr", "__hash__", "__setstate__",
    "_has_compatible_shallow_copy_type"))
NO_OP = frozenset(("to",))
"""Answered when they return the parameter itself (`model.to(device)` where it already is: nothing is read)."""
_RELEASED: Any = None


def released_parameter() -> Any:
    """The class a released unit's `nn.Parameter`s take (and leave when gathered): a parameter whose every
    read by torch raises a ConfigError naming it and its unit. Its values are not on this rank, so a forward
    that reads it outside its unit (the unit's hooks gather it for the unit's own forward and backward only)
    would otherwise compute on the NaN placeholder and train into NaN."""
    global _RELEASED  # torch is imported on first use: importing hpctrain does not import it
    if _RELEASED is None:
        import torch

        class ReleasedParameter(torch.nn.Parameter):
            @classmethod
            def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                owner = getattr(func, "__self__", None)  # an attribute's __get__/__set__: its descriptor
                if isinstance(owner, (GetSetDescriptorType, property)):
                    name, allowed = getattr(owner, "__name__", None) or owner.fget.__name__, ALLOWED_ATTRIBUTES
                else:
                    name, allowed = getattr(func, "__name__", None), ALLOWED_METHODS
                if name in allowed:
                    with torch._C.DisableTorchFunctionSubclass():
                        return func(*args, **(kwargs or {}))
                if name in NO_OP and allowed is ALLOWED_METHODS:
                    with torch._C.DisableTorchFunctionSubclass():
                        out = func(*args, **(kwargs or {}))
                    if out is args[0]:
                        return out
                where = next((a.__dict__.get("_zero3_where") for a in _flat_args(args, kwargs)
                              if type(a) is cls), None) or "a parameter of a released unit"
                raise ConfigError(
                    f"ZeRO stage 3: {where} was read by {name or func} while its unit holds no "
                    "bytes (a unit's parameters are gathered only for that unit's own forward and backward): "
                    "read it inside the module that registers it, register it also in the module that reads it "
                    "(a tied weight: self.head.weight = self.transformer.wte.weight), or use ZeRO stage 2")

        _RELEASED = ReleasedParameter
    return _RELEASED


def _flat_args(args: Any, kwargs: Any) -> Iterator[Any]:
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a



def mark_released(p: Any) -> None:
    """`p`'s unit was released: a plain `nn.Parameter` refuses reads from now on (a parameter of another class
    keeps it, and reads the NaN placeholder)."""
    import torch

    if type(p) is torch.nn.Parameter:
        p.__class__ = released_parameter()


def mark_gathered(p: Any) -> None:
    """`p`'s unit is gathered: a parameter `mark_released` changed is a plain `nn.Parameter` again."""
    import torch

    if _RELEASED is not None and type(p) is _RELEASED:
        p.__class__ = torch.nn.Parameter


def name_parameters(module: Any, units: list[tuple[Any, list[Any], bool]]) -> None:
    """Name each unit's parameters, as the error a read of a released one raises quotes them: `units` are
    (unit module, its parameters, whether it is the model's own root unit)."""
    names = {id(m): name for name, m in module.named_modules(remove_duplicate=False)}
    params: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        params.setdefault(id(p), name)
    for unit, members, root in units:
        where = "the model's own (root) unit" if root else f"unit {names.get(id(unit), '?')!r}"
        for p in members:
            p.__dict__["_zero3_where"] = f"parameter {params.get(id(p), '?')!r} of {where}"
