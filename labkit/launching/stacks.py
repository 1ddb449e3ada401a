"""Read a stuck or failed rank's Python stack as the learner needs it: which line of THEIR code.

A hung rank's stack runs through torch, the lab's given helpers and the learner's exercise.
`where_waiting` names the innermost frame inside an exercise's own function (a top-level
def or class of ``exercises/<topic>.py`` that holds a solution block, `labkit.registry`),
and says when the rank waits in given code instead ("in the given _ring_backward, called
from your ring_attention_forward line 98"). `hint` turns what the ranks wait in into the
likely cause, in words.
"""
from __future__ import annotations

import ast
import functools
import linecache
import os
import re

_FRAME = re.compile(r'File "([^"]+)", line (\d+),? in (\S+)')  # faulthandler's and traceback's formats
_LAB_DIRS = ("exercises", "solutions")


def frames(stack: str, innermost_first: bool = True) -> list[tuple[str, int, str]]:
    """(path, line, function) of each frame; faulthandler lists innermost first, tracebacks last."""
    found = [(p, int(n), f) for p, n, f in _FRAME.findall(stack)]
    return found if innermost_first else found[::-1]


@functools.lru_cache(maxsize=None)
def _exercise_names(topic: str) -> frozenset:
    from ..registry import exercises

    return frozenset(e.name for e in exercises() if e.topic == topic)


@functools.lru_cache(maxsize=256)
def _owners(path: str, mtime: float) -> list[tuple[int, int, str]]:
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError):
        return []
    return [(n.lineno, n.end_lineno, n.name) for n in tree.body
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]


def owner(path: str, line: int) -> tuple[str, bool] | None:
    """(top-level def/class holding ``line``, whether it is an exercise) for a lab file, else None."""
    parts = path.replace("\\", "/").split("/")
    if len(parts) < 2 or parts[-2] not in _LAB_DIRS or not parts[-1].endswith(".py"):
        return None
    try:
        mtime = os.path.getmtime(path)
    except OSError:
        return None
    topic = parts[-1][:-3]
    for lo, hi, name in _owners(path, mtime):
        if lo <= line <= hi:
            return name, name in _exercise_names(topic)
    return None


def _show(path: str, line: int, fn: str) -> str:
    short = "/".join(path.replace("\\", "/").split("/")[-2:])
    code = linecache.getline(path, line).strip()
    return f"{short} line {line} in {fn}" + (f": {code}" if code else "")


def where_waiting(stack: str, innermost_first: bool = True) -> str | None:
    """The learner's line in a stack, in words; None when no lab file is on it."""
    given = None
    for path, line, fn in frames(stack, innermost_first):
        found = owner(path, line)
        if found is None:
            continue
        if found[1]:
            mine = f"your {_show(path, line, fn)}"
            return f"in the given {given}, called from {mine}" if given else mine
        given = given or _show(path, line, fn)
    if given:
        return f"in the given {given} (no line of an exercise is on its stack)"
    for path, line, fn in frames(stack, innermost_first):  # not lab code: the innermost frame outside torch
        if "/torch/" not in path and "/labkit/" not in path and "/lib/python" not in path:
            return f"at {_show(path, line, fn)}"
    return None


_P2P = ("recv", "irecv", "send", "isend", "wait", "batch_isend_irecv", "_wait")


def _waiting_call(stack: str) -> str | None:
    """The torch.distributed function a stack waits in (innermost), e.g. 'all_reduce' or 'recv'."""
    for path, _line, fn in frames(stack):
        if "torch/distributed" in path.replace("\\", "/") and fn not in ("wrapper", "_func"):
            return fn
    return None


def hint(stuck: dict, failed_first: bool = False, values_wrong: bool = False) -> str:
    """The likely cause, from what the stuck ranks ({rank: stack}) wait in."""
    calls = {rank: _waiting_call(stack) or "?" for rank, stack in stuck.items()}
    if failed_first:
        return ("hint: the ranks that stopped waited only because a peer had failed: the failure above is "
                "the news." + (" Wrong values on some ranks only, in code that receives: a received tensor "
                               "used before its wait()?" if values_wrong else ""))
    kinds = set(calls.values())
    waits = ", ".join(f"rank {r} in {c}" for r, c in sorted(calls.items()))
    if len(kinds) > 1 and not kinds <= set(_P2P):
        return (f"hint: the ranks wait in different calls ({waits}): a collective called on some ranks "
                "only, in another order, or on another group?")
    if kinds <= set(_P2P):
        return (f"hint: {waits}: a recv whose send is missing, goes to another peer, group or tag, or "
                "two ranks that both wait to receive first?")
    return f"hint: {waits}: does every rank of the group make the same calls in the same order?"
