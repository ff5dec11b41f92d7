"""ZeRO 3's units: which modules of a model are gathered and released as one (FSDP2's per-module units), and
which of them owns each parameter. The strategy (zero3.py) cuts one bucket per unit; the memory plan
(control/plan.py, through the strategy class) counts the same units.
"""

from __future__ import annotations

from typing import Any

CONTAINERS = ("Sequential", "ModuleList", "ModuleDict")


def unit_modules(root: Any) -> list[Any]:
    """The modules that are units of `root`, in registration order: the elements of its containers."""
    import torch

    kinds = tuple(getattr(torch.nn, name) for name in CONTAINERS)
    units: list[Any] = []

    def elements(container: Any) -> None:
        for element in container.children():
            if isinstance(element, kinds):
                elements(element)
            elif any(True for _ in element.parameters()) and all(element is not u for u in units):
                units.append(element)

    def visit(module: Any) -> None:
        for child in module.children():
            if isinstance(child, kinds):
                elements(child)
            else:
                visit(child)

    if isinstance(root, kinds):
        elements(root)
    else:
        visit(root)
    return units


def group_by_unit(root: Any, ordered: list[Any]) -> list[tuple[list[Any], Any]]:
    """`ordered` (trainable parameters, backward order) grouped into units: [(parameters, unit module)],
    units in reverse registration order, then the root's own (module `root`), empty groups left out."""
    units = unit_modules(root)
    owner: dict[int, int | None] = {}
    inside: set[int] = set()
    for i, unit in enumerate(units):
        inside.update(id(m) for m in unit.modules())
        for p in unit.parameters():
            owner[id(p)] = i if owner.get(id(p), i) == i else None  # in two units: the root's
    for module in root.modules():
        if id(module) not in inside:
            for p in module._parameters.values():
                if p is not None:
                    owner[id(p)] = None  # registered outside every unit too (a tied weight): the root's
    groups: list[list[Any]] = [[] for _ in units] + [[]]
    for p in ordered:
        index = owner.get(id(p))
        groups[len(units) if index is None else index].append(p)
    modules = [*units, root]
    out = [(groups[i], modules[i]) for i in reversed(range(len(units)))]
    out.append((groups[-1], root))
    return [(group, module) for group, module in out if group]
