"""Grading support: one switch between the learner's code and the reference.

    from labkit.grading import impl
    allreduce = impl("allreduce")   # exercises.allreduce, or solutions.allreduce

The switch is the environment variable ``LABKIT_IMPL`` (``exercises`` by default,
``solutions`` in CI); ``pytest --impl=...`` sets it for a whole run, so notebooks
executed by that run and ranks started by `labkit.launch` see the same choice.

This module is only the switch. The exercise registry (which exercises exist, for
`labkit.stubgen` and the grade table) is `labkit.registry`; the many-cases-in-one-launch
runner used by the grading tests is `labkit.cases`. labkit's core never calls `impl`: only
the applications (`labkit.apps`), the solutions, tests, notebooks and benchmarks do.
"""
from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
IMPLEMENTATIONS = ("exercises", "solutions")


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
