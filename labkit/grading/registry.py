"""The exercise registry, read from ``solutions/``.

Every ``### BEGIN SOLUTION`` block belongs to the top-level ``def`` or ``class`` around it
(that is the exercise's name), and the module's ``NOTEBOOK`` constant says where it is taught.
`labkit.grading.stubgen` turns the blocks into stubs; the pytest plugin's grade table lists the exercises.
"""
from __future__ import annotations

import ast
from dataclasses import dataclass

from labkit.grading import REPO_ROOT

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"


@dataclass(frozen=True)
class Exercise:
    name: str  # the top-level def/class holding the solution block
    topic: str  # the module: solutions/<topic>.py
    notebook: str  # e.g. "03_allreduce"

    key: str = ""  # how grading marks and the grade table name it: `name`, or `topic.name` when two topics share it

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
    # One verb across topics (e.g. sync_gradients in DP and EP): a shared name is qualified by its topic.
    shared = {e.name for e in found if sum(f.name == e.name for f in found) > 1}
    found = [Exercise(e.name, e.topic, e.notebook, f"{e.topic}.{e.name}" if e.name in shared else e.name)
             for e in found]
    return sorted(found, key=lambda e: e.notebook)  # stable: source order within a notebook


def not_implemented_message(name: str, topic: str, notebook: str) -> str:
    return (f"exercise {name} is not implemented yet: edit exercises/{topic}.py, "
            f"see notebooks/{notebook}.ipynb")
