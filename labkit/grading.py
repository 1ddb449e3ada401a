"""Grading support: one switch between the learner's code and the reference.

    from labkit.grading import impl
    allreduce = impl("allreduce")   # exercises.allreduce, or solutions.allreduce

The switch is the environment variable ``LABKIT_IMPL`` (``exercises`` by default,
``solutions`` in CI); ``pytest --impl=...`` sets it for a whole run, so notebooks
executed by that run and ranks started by `labkit.launch` see the same choice.

The exercise registry is read from ``solutions/``: every ``### BEGIN SOLUTION``
block belongs to the top-level ``def`` or ``class`` around it, and the module's
``NOTEBOOK`` constant says where it is taught.
"""
from __future__ import annotations

import ast
import functools
import importlib
import os
import sys
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = ("exercises", "solutions")
BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


def current_impl() -> str:
    """Which implementation is selected: 'exercises' (default) or 'solutions'."""
    name = os.environ.get("LABKIT_IMPL", "exercises").strip() or "exercises"
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"LABKIT_IMPL={name!r} is not one of {IMPLEMENTATIONS}: "
            "set it to 'exercises' (your code) or 'solutions' (the reference)."
        )
    return name


def impl(topic: str, which: str | None = None):
    """Return the module ``<which>.<topic>``, ``which`` defaulting to `current_impl()`."""
    which = which or current_impl()
    if which not in IMPLEMENTATIONS:
        raise ValueError(f"which={which!r} must be one of {IMPLEMENTATIONS}")
    if str(REPO_ROOT) not in sys.path:  # notebooks run from notebooks/, tests from anywhere
        sys.path.insert(0, str(REPO_ROOT))
    path = REPO_ROOT / which / f"{topic}.py"
    if not path.exists():
        known = sorted(p.stem for p in (REPO_ROOT / "solutions").glob("*.py") if p.stem != "__init__")
        raise ValueError(f"no exercise module {which}/{topic}.py; known topics: {known}")
    return importlib.import_module(f"{which}.{topic}")


@dataclass(frozen=True)
class Exercise:
    name: str  # the top-level def/class holding the solution block
    topic: str  # the module: solutions/<topic>.py
    notebook: str  # e.g. "03_allreduce"

    @property
    def file(self) -> str:
        return f"exercises/{self.topic}.py"


def exercise_blocks(source: str) -> list[tuple[str, int, int]]:
    """(exercise name, begin line, end line) for each solution block, lines 1-based.

    Raises ValueError for unbalanced markers or a block outside any def/class.
    """
    tree = ast.parse(source)
    owners = [(n.lineno, n.end_lineno, n.name) for n in tree.body
              if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    blocks, start = [], None
    for number, line in enumerate(source.splitlines(), start=1):
        marker = line.strip()
        if marker.startswith(BEGIN):
            if start is not None:
                raise ValueError(f"line {number}: {BEGIN} inside another block")
            start = number
        elif marker.startswith(END):
            if start is None:
                raise ValueError(f"line {number}: {END} without {BEGIN}")
            owner = [name for lo, hi, name in owners if lo <= start <= hi]
            if not owner:
                raise ValueError(f"line {start}: solution block outside any top-level def or class")
            blocks.append((owner[0], start, number))
            start = None
    if start is not None:
        raise ValueError(f"line {start}: {BEGIN} without {END}")
    return blocks


def notebook_of(source: str, topic: str) -> str:
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "NOTEBOOK" for t in node.targets):
            return ast.literal_eval(node.value)
    raise ValueError(f"solutions/{topic}.py has no NOTEBOOK = '<NN_name>' constant")


def exercises() -> list[Exercise]:
    """Every exercise in ``solutions/``, in teaching order: by notebook, then source order."""
    found = []
    for path in sorted((REPO_ROOT / "solutions").glob("*.py")):
        if path.stem == "__init__":
            continue
        source = path.read_text(encoding="utf-8")
        blocks = exercise_blocks(source)
        if not blocks:
            continue
        notebook = notebook_of(source, path.stem)
        for name in dict.fromkeys(name for name, _, _ in blocks):
            found.append(Exercise(name, path.stem, notebook))
    return sorted(found, key=lambda e: e.notebook)  # stable: source order within a notebook


def not_implemented_message(name: str, topic: str, notebook: str) -> str:
    return (f"exercise {name} is not implemented yet: edit exercises/{topic}.py, "
            f"see notebooks/{notebook}.ipynb")


# --------------------------------------------------------------------------- many cases, one launch
# Launching ranks costs far more than most checks, so a grading module can run all its cases
# in one launch per world size: `run_cases` inside the ranks records each case's outcome,
# `launch_cases` launches once (cached), and `expect_case` turns one case's outcome into a
# pass, a NotImplementedError (an unwritten stub) or a failure that shows every rank's trace.

def run_cases(cases: dict) -> dict:
    """In a rank: call every ``key -> body()`` and record ("ok" | "not implemented" | "failed", detail)."""
    import traceback

    results = {}
    for key, body in cases.items():
        try:
            body()
            results[key] = ("ok", "")
        except NotImplementedError as error:
            results[key] = ("not implemented", str(error))
        except Exception:
            results[key] = ("failed", traceback.format_exc())
    return results


@functools.lru_cache(maxsize=None)
def launch_cases(run_all, world_size: int, timeout: float = 60):
    """``launch(run_all, world_size)``, once per (function, world size); a launch error is returned."""
    import torch

    from .launch import launch

    # The first assert_close in a process imports for seconds: paid once here, inherited by the ranks.
    torch.testing.assert_close(torch.zeros(1), torch.zeros(1))
    try:
        return launch(run_all, world_size, timeout=timeout)
    except Exception as error:  # a hang or a crash: every test of this world size reports it
        return error


def expect_case(per_rank, key, label: str):
    """Raise the launch's error, NotImplementedError, or fail the test with the failing ranks' traces."""
    import pytest

    if isinstance(per_rank, Exception):
        raise per_rank
    failed = []
    for rank, outcomes in enumerate(per_rank):
        status, detail = outcomes[key]
        if status == "not implemented":
            raise NotImplementedError(detail)
        if status != "ok":
            failed.append(f"rank {rank}: {detail}")
    if failed:
        pytest.fail(f"{label}:\n" + "\n".join(failed), pytrace=False)
