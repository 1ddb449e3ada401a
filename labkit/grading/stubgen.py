"""Generate ``exercises/`` from ``solutions/``: every solution block becomes a stub.

    python -m labkit.grading.stubgen            # write exercises/<topic>.py for every solution module
    python -m labkit.grading.stubgen --check    # only compare; exit 1 if exercises/ is out of date
    python -m labkit.grading.stubgen --force    # also replace files a learner has edited (after a backup)

Between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` the generator puts one line,
``raise NotImplementedError("exercise <name> is not implemented yet: ...")``, at the
block's indentation; everything else (imports, helpers, signatures, docstrings) is
copied unchanged.

Learner work is never lost: each generated file carries a fingerprint of its own text.
A file whose text no longer matches its fingerprint has been edited; it is left alone
(and listed) unless ``--force`` is given, and then it is first copied to
``exercises/<topic>.py.bak-<time>``. Untouched files are simply regenerated.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import sys
import time
from pathlib import Path

from labkit.grading import REPO_ROOT
from labkit.grading.registry import BEGIN, END, exercise_blocks, not_implemented_message, notebook_of

HEADER = ("# GENERATED from solutions/{topic}.py by `python -m labkit.grading.stubgen`: this file is yours to edit.\n"
          "# Fill in every `raise NotImplementedError(...)`; see notebooks/{notebook}.ipynb.\n"
          "# untouched-stub fingerprint: {fingerprint}\n")


def make_stub(source: str, topic: str) -> str:
    """The exercise text for a solution module's source."""
    blocks = exercise_blocks(source)
    notebook = notebook_of(source, topic)
    lines = source.splitlines(keepends=True)
    out, skip_until = [], 0
    starts = {begin: (name, end) for name, begin, end in blocks}
    for number, line in enumerate(lines, start=1):
        if number <= skip_until:
            continue
        if number in starts:
            name, end = starts[number]
            indent = line[: len(line) - len(line.lstrip())]
            message = not_implemented_message(name, topic, notebook)
            out.append(f'{indent}raise NotImplementedError("{message}")\n')
            skip_until = end
            continue
        out.append(line)
    body = "".join(out)
    if BEGIN in body or END in body:
        raise ValueError(f"solutions/{topic}.py: a solution marker was left behind")
    return HEADER.format(topic=topic, notebook=notebook, fingerprint=_fingerprint(body)) + body


def _fingerprint(body: str) -> str:
    return hashlib.sha256(body.encode("utf-8")).hexdigest()[:16]


def is_untouched(text: str) -> bool:
    """True when a generated file is exactly as generated (its fingerprint matches its body).

    Such a file holds no learner work and may be regenerated without a backup.
    """
    header = text.split("\n", 3)
    if len(header) < 4 or not header[2].startswith("# untouched-stub fingerprint: "):
        return False
    return header[2].split(": ", 1)[1].strip() == _fingerprint(header[3])


def plan(root: Path = REPO_ROOT) -> dict[Path, str]:
    """exercises path -> generated text, for every solution module with at least one block."""
    wanted = {}
    for path in sorted((root / "solutions").glob("*.py")):
        if path.stem == "__init__":
            continue
        source = path.read_text(encoding="utf-8")
        if exercise_blocks(source):
            wanted[root / "exercises" / path.name] = make_stub(source, path.stem)
    return wanted


def sync(root: Path = REPO_ROOT, check: bool = False, force: bool = False):
    """Bring exercises/ up to date; return (stale, kept, written) lists of paths."""
    stale, kept, written = [], [], []
    for target, text in plan(root).items():
        current = target.read_text(encoding="utf-8") if target.exists() else None
        if current == text:
            continue
        stale.append(target)
        if check:
            continue
        untouched = current is None or is_untouched(current)
        if not untouched and not force:
            kept.append(target)  # a learner's work: never replaced without --force
            continue
        if not untouched:
            backup = target.with_name(f"{target.name}.bak-{time.strftime('%Y%m%d-%H%M%S')}")
            shutil.copy2(target, backup)
            print(f"saved the previous {target.name} as {backup.name}")
        target.write_text(text, encoding="utf-8")
        written.append(target)
    return stale, kept, written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m labkit.grading.stubgen", description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 if out of date")
    parser.add_argument("--force", action="store_true", help="replace edited files too, after a backup")
    parser.add_argument("--root", type=Path, default=REPO_ROOT, help=argparse.SUPPRESS)
    options = parser.parse_args(argv)
    stale, kept, written = sync(options.root, options.check, options.force)
    names = lambda paths: ", ".join(f"exercises/{p.name}" for p in paths)  # noqa: E731
    if options.check:
        if stale:
            print(f"out of date: {names(stale)}. Maintainers: run `python -m labkit.grading.stubgen` and commit.")
            return 1
        print("exercises/ is in sync with solutions/")
        return 0
    if written:
        print(f"wrote {names(written)}")
    if kept:
        print(f"left alone (you have edited them): {names(kept)}. "
              "Use --force to regenerate them; your version is saved as a .bak file first.")
    if not stale:
        print("exercises/ is already in sync with solutions/")
    return 0


if __name__ == "__main__":
    sys.exit(main())
