"""ZeRO has one home: what varies by stage is a strategy class (comm/allreduce.py, zero.py, zero3.py, mapped from
the stage's number in comm/strategies.py), and the trainer, the step, the plan, the checkpoint, the API and the
tools ask it (`strategy.gathers_in_forward`, `strategy.holds_whole_model`, ...) instead of branching on the
number. Checked on the source: no comparison of a stage value (`zero`, `stage`, `x.zero`, `x.stage`) with
==, !=, <, >, <=, >=, `in`/`not in` a tuple, list or set of ints, and no stage value used as a bare truth value
(`if cfg.zero:`, `x if stage else y`, `not stage`, `stage and ...`), outside the strategy modules and the
config's validation (base/config.py).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "hpctrain"
HOME = {"comm/allreduce.py", "comm/zero.py", "comm/zero3.py", "comm/strategies.py", "base/config.py"}
NAMES = {"zero", "stage"}


def _is_stage(node: ast.AST) -> bool:
    """Whether `node` reads a stage value: the name `zero` or `stage`, or an attribute of that name."""
    return (isinstance(node, ast.Name) and node.id in NAMES) or (isinstance(node, ast.Attribute) and node.attr in NAMES)


def _int_collection(node: ast.AST) -> bool:
    return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and all(
        isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts)


def _truth_tested(tree: ast.AST) -> list[ast.AST]:
    """The expressions Python tests for truth: conditions of if/while/ternaries/asserts/comprehensions, the
    operands of `and`/`or`/`not`."""
    tested: list[ast.AST] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.If, ast.While, ast.IfExp, ast.Assert)):
            tested.append(node.test)
        elif isinstance(node, ast.BoolOp):
            tested.extend(node.values)
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tested.append(node.operand)
        elif isinstance(node, ast.comprehension):
            tested.extend(node.ifs)
    return tested


def stage_branches(source: str) -> list[tuple[int, str]]:
    """(line, code) of every branch on a stage value in `source`."""
    tree = ast.parse(source)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            for op, left, right in zip(node.ops, operands, operands[1:]):
                ordered = isinstance(op, (ast.Eq, ast.NotEq, ast.Lt, ast.Gt, ast.LtE, ast.GtE))
                member = isinstance(op, (ast.In, ast.NotIn)) and _is_stage(left) and _int_collection(right)
                if member or (ordered and (_is_stage(left) or _is_stage(right))):
                    found.append((node.lineno, ast.unparse(node)))
    found += [(node.lineno, ast.unparse(node)) for node in _truth_tested(tree) if _is_stage(node)]
    return sorted(set(found))


def test_the_detector_sees_each_kind_of_branch() -> None:
    src = ("a = cfg.zero == 3\nb = stage != 3\nif self.stage == 1: pass\nc = stage >= 2\nd = zero in (0, 1, 2, 3)\n"
           "if cfg.zero: pass\ne = x if stage else y\nf = not sync.stage\ng = sync.stage and h\n"
           "ok = pipeline.stage.tied\nok2 = 'zero' in train\nok3 = f(zero=zero)\n")
    assert [line for line, _ in stage_branches(src)] == [1, 2, 3, 4, 5, 6, 7, 8, 9]


def test_no_branch_on_the_zero_stage_outside_its_strategies() -> None:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in HOME:
            found += [f"hpctrain/{rel}:{line}: {code}" for line, code in stage_branches(path.read_text())]
    assert not found, ("branches on a ZeRO stage's value outside its strategies (ask the strategy class instead, "
                       "e.g. `strategy_class(stage).gathers_in_forward`):\n" + "\n".join(found))


KNOBS = {"enabled", "loss_scale", "prescale", "postscale", "scale_fn"}


def flipped_knobs(source: str) -> list[tuple[int, str]]:
    """(line, code) of every assignment of a gradient engine's knob on another object than `self` (including
    `setattr(obj, "knob", ...)`): callers say what they mean (`with sync.no_sync():`, `sync.set_loss_scale(s)`,
    `GradSync(..., scales=...)`) instead of flipping the engine's state from outside."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in KNOBS and not (isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append((node.lineno, ast.unparse(node)))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr"
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and node.args[1].value in KNOBS):
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def test_the_knob_detector_sees_assignments_from_outside() -> None:
    src = ("sync.enabled = False\nself.enabled = True\nopt.sync.scale_fn = f\nsetattr(sync, 'enabled', True)\n"
           "sync.loss_scale = 2.0\nx = sync.enabled\n")
    assert [line for line, _ in flipped_knobs(src)] == [1, 3, 4, 5]


def test_no_caller_flips_the_gradient_engines_knobs() -> None:
    root = PACKAGE.parent
    paths = sorted([*PACKAGE.rglob("*.py"), *(root / "tests").rglob("*.py"), *(root / "benchmarks").rglob("*.py")])
    found = [f"{path.relative_to(root)}:{line}: {code}" for path in paths if path.name != "test_zero_home.py"
             for line, code in flipped_knobs(path.read_text())]
    assert not found, "knobs of the gradient engine set from outside it:\n" + "\n".join(found)
