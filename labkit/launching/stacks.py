"""Read a stuck or failed rank's Python stack as the learner needs it: which line of THEIR code.

A hung rank's stack runs through torch, the lab's given helpers and the learner's exercise.
`where_waiting` names the innermost frame inside an exercise's own function (a top-level
def or class of ``exercises/<topic>.py`` whose ``solutions/`` twin holds a solution block),
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
def _exercise_names(solutions_file: str) -> frozenset:
    """The top-level defs/classes of a solutions file that hold a solution block: the exercises."""
    try:
        source = open(solutions_file, encoding="utf-8").read()
        tree = ast.parse(source)
    except (OSError, SyntaxError):
        return frozenset()
    lines = source.splitlines()
    return frozenset(n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))
                     and any("### BEGIN SOLUTION" in line for line in lines[n.lineno - 1:n.end_lineno]))


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
    solutions_file = os.path.join(os.path.dirname(os.path.dirname(path)), "solutions", parts[-1])
    for lo, hi, name in _owners(path, mtime):
        if lo <= line <= hi:
            return name, name in _exercise_names(solutions_file)
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
            mine = f"at your {_show(path, line, fn)}"
            return f"in the given {given}, called from {mine[3:]}" if given else mine
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
    found = frames(stack)
    calls = [fn for path, _line, fn in found
             if "torch/distributed" in path.replace("\\", "/") and fn not in ("wrapper", "_func")]
    if calls:
        return calls[-1]  # the outermost: the public function the code called (new_group, not its helpers)
    if found and ".wait(" in linecache.getline(found[0][0], found[0][1]):
        return "wait"  # Work.wait() is C++: no frame of its own
    return None


def hint(stuck: dict, failed_first: bool = False, values_wrong: bool = False) -> str:
    """The likely cause, from what the stuck ranks ({rank: stack}) wait in."""
    calls = {rank: _waiting_call(stack) or "?" for rank, stack in stuck.items()}
    if failed_first:
        return ("hint: the ranks that stopped waited only because a peer had failed: the failure above is "
                "the news." + (" Wrong values on some ranks only, in code that receives: a received tensor "
                               "used before its wait()?" if values_wrong else ""))
    kinds = set(calls.values())
    by_call: dict = {}
    for rank, call in sorted(calls.items()):
        by_call.setdefault(call, []).append(str(rank))
    waits = ", ".join(f"rank{'s' if len(r) > 1 else ''} {', '.join(r)} in {c}" for c, r in by_call.items())
    if len(kinds) > 1 and not kinds <= set(_P2P):
        return (f"hint: the ranks wait in different calls ({waits}): a collective called on some ranks "
                "only, in another order, or on another group?")
    if kinds == {"send"}:
        return (f"hint: {waits}: every rank waits in a blocking send, which returns only once its recv is "
                "posted: two ranks that both send first wait for each other (receive first on one side, "
                "or isend/irecv)")
    if kinds <= set(_P2P):
        return (f"hint: {waits}: a recv whose send is missing, goes to another peer, group or tag, or "
                "two ranks that both wait to receive first?")
    return f"hint: {waits}: does every rank of the group make the same calls in the same order?"


# --------------------------------------------------------------------------- grading case reports

def consequence(detail: str) -> bool:
    from labkit.launching.failures import CONSEQUENCE_MARKERS

    return any(marker in detail for marker in CONSEQUENCE_MARKERS)


def stuck_after(failed_first, stack) -> str:
    where = where_waiting(stack) if stack.strip() else None
    return (f"stopped: it waited for rank(s) {', '.join(map(str, failed_first))}, which had failed"
            + (f", {where}" if where else ""))


def crash_text(key, crashed, died, stacks) -> str:
    lines = [f"case {key} crashed: rank(s) {', '.join(map(str, crashed))} died."]
    for r in crashed:
        failure = died[r]
        lines.append(f"rank {r}: {failure.summary}")
        last = where_waiting(failure.details)
        if last:
            lines.append(f"  its last line: {last}")
        lines.append(head(failure.details, 12))
    return "\n".join(lines)


def head(text: str, n: int) -> str:
    lines = text.strip().splitlines()
    return "\n".join(lines[:n] + ([f"... ({len(lines) - n} more lines)"] if len(lines) > n else []))


def trim(stack: str, keep: int = 40) -> str:
    """The hung rank's frames from where it waits up to the case's body: the rest is the runner's."""
    sections = re.split(r"\n(?=(?:Current thread|Thread) 0x)", stack)  # faulthandler: one per thread
    stack = next((sec for sec in sections if " in run_cases" in sec), sections[-1])  # the main thread's
    lines = []
    for line in stack.splitlines():
        if "labkit/grading/cases.py" in line:
            break  # run_cases, then the frames the fork inherited from the test process
        if line.strip() and not line.startswith(("Timeout (", "Thread 0x", "Current thread 0x")) and "c10d_logger.py" not in line:
            lines.append(line)
    return head("\n".join(lines), keep)


def failure_text(label: str, failed: list) -> str:
    """The first failing rank's traceback in full (short), the other ranks in one line each, a hint."""
    stopped = [(r, d) for r, d in failed if d.startswith("stopped: it waited")]
    raised = [(r, d) for r, d in failed if (r, d) not in stopped]
    lines = [f"{label}: failed on rank(s) {', '.join(str(r) for r, _ in raised)}"]
    if raised:
        first_rank, first = raised[0]
        lines.append(f"rank {first_rank}: {short_traceback(first)}")
        for rank, detail in raised[1:]:
            last, first_last = (next((x for x in reversed(d.strip().splitlines())
                                      if x.strip() and not x.startswith("hint:")), "?") for d in (detail, first))
            same = last == first_last
            lines.append(f"rank {rank}: {'the same: ' if same else ''}{last[:300]}")
    for rank, detail in stopped:
        lines.append(f"rank {rank}: {detail}")
    if stopped and raised:
        wrong_values = any(m in first for m in ("AssertionError", "not close", "Mismatched"))
        lines.append(hint({}, failed_first=True, values_wrong=wrong_values))
    return "\n".join(lines)


def short_traceback(text: str, keep: int = 30) -> str:
    """A rank's traceback without the case runner's frames, at most ``keep`` lines (its end)."""
    lines, skip = [], False
    for line in text.rstrip().splitlines():
        if line.startswith('  File "'):
            skip = "labkit/grading/cases.py" in line
        elif not line.startswith("    "):
            skip = False
        if not skip:
            lines.append(line)
    if len(lines) > keep:
        lines = lines[:1] + [f"  ... ({len(lines) - keep + 1} lines of frames left out)"] + lines[-(keep - 2):]
    return "\n".join(lines)
