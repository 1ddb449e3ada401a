"""Find code that binds a torch.distributed op before call time, which `labkit.comm.intercept` cannot see.

The rule (CONTRIBUTING, "Communication layer"): call ``dist.<op>(...)`` at call time. Two
ways to break it, both found here from the source alone:
- ``from torch.distributed import all_reduce`` (or from ``torch.distributed.distributed_c10d``):
  the name is the real function forever;
- a statement outside any function (module or class level) that mentions ``dist.<op>`` or
  ``getattr(dist, "<op>")`` without calling it: ``_ag = dist.all_gather_single``.
Inside a function, ``dist.P2POp(dist.isend, ...)`` is fine: the look-up happens at call time.
"""
from __future__ import annotations

import ast
from pathlib import Path

from labkit.comm.ops import OPS

_MODULES = ("torch.distributed", "torch.distributed.distributed_c10d")


def _aliases(tree) -> set:
    """Names under which this module imported torch.distributed (dist, torch.distributed)."""
    names = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.asname or a.name for a in node.names if a.name in _MODULES}
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            names |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    return names


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return base and f"{base}.{node.attr}"
    return None


def _op_reference(node, aliases) -> str | None:
    """The op named by `node` when it is dist.<op> or getattr(dist, "<op>"...), else None."""
    if isinstance(node, ast.Attribute) and node.attr in OPS and _dotted(node.value) in aliases:
        return node.attr
    if (isinstance(node, ast.Call) and _dotted(node.func) == "getattr" and len(node.args) >= 2
            and _dotted(node.args[0]) in aliases and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in OPS):
        return node.args[1].value
    return None


def find_bindings(source: str, filename: str = "<source>") -> list[str]:
    """Every place in `source` that binds a table op before call time, as 'file:line: what'."""
    tree = ast.parse(source, filename)
    aliases, found = _aliases(tree), []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in _MODULES:
            for a in node.names:
                if a.name in OPS or a.name == "*":
                    found.append(f"{filename}:{node.lineno}: from {node.module} import {a.name}")

    def outside_functions(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            yield child
            yield from outside_functions(child)

    called = {id(n.func) for n in outside_functions(tree) if isinstance(n, ast.Call)}
    for node in outside_functions(tree):
        op = _op_reference(node, aliases)
        if op and id(node) not in called:
            found.append(f"{filename}:{node.lineno}: dist.{op} bound outside a function (call dist.{op} at call time)")
    return found


def scan(*folders) -> list[str]:
    """find_bindings over every .py file under `folders`."""
    out = []
    for folder in folders:
        for path in sorted(Path(folder).rglob("*.py")):
            out += find_bindings(path.read_text(), str(path))
    return out
