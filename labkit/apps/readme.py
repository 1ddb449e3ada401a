"""The README's notebook table, generated from the notebooks: their headers are the single source.

Every notebook's first cell says how long it takes, "(about NN minutes ...)". The README's
table (`| notebook | what you build and measure | time |`) has one row per notebook of
`notebooks/`, in file order; its time column is that header's figure ("NN min"). The "what"
column is written by hand in the README and kept; a notebook without a row gets one with its
title, to be edited.

    python -m labkit.apps.readme           # rewrite README.md's table from the notebooks
    python -m labkit.apps.readme --check   # exit 1 and say what differs (tests/test_readme.py does this)
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
MINUTES = re.compile(r"\babout (\d+) min(?:utes?)?\b")
ROW = re.compile(r"^\| `(?P<name>\d\d_[\w-]+)` \| (?P<what>.*) \| (?P<time>[^|]*) \|\s*$")
HEADER = "| notebook | what you build and measure | time |"


def header_cell(path: Path) -> str:
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    cells = [c for c in nb.get("cells", []) if c.get("cell_type") == "markdown"]
    if not cells:
        raise ValueError(f"{path}: no markdown cell: the first one must say what you learn and 'about NN min'")
    src = cells[0]["source"]
    return "".join(src) if isinstance(src, list) else src


def notebook_minutes(path: Path) -> int:
    """NN from the header cell's "about NN minutes" (ValueError if it has none)."""
    found = MINUTES.findall(header_cell(path))
    if not found:
        raise ValueError(f"{path}: the header cell does not say how long the notebook takes: write "
                         "'(about NN minutes)' in the first markdown cell")
    return int(found[0])


def notebook_title(path: Path) -> str:
    first = header_cell(path).strip().splitlines()[0].lstrip("# ").strip()
    return first.split("·", 1)[-1].strip()


def render(readme: str, notebooks_dir: Path) -> str:
    """The README text with its notebook table regenerated (rows in file order, times from headers)."""
    lines = readme.splitlines()
    try:
        start = lines.index(HEADER)
    except ValueError:
        raise ValueError(f"the README has no notebook table (a line {HEADER!r})") from None
    end = start + 2  # header, separator
    rows = {}
    while end < len(lines) and lines[end].startswith("|"):
        match = ROW.match(lines[end])
        if not match:
            raise ValueError(f"README line {end + 1} is not a notebook row `| \\`NN_name\\` | what | NN min |`: "
                             f"{lines[end]!r}")
        rows[match["name"]] = match["what"]
        end += 1
    new_rows = []
    for path in sorted(Path(notebooks_dir).glob("[0-9][0-9]_*.ipynb")):
        what = rows.get(path.stem) or notebook_title(path)
        new_rows.append(f"| `{path.stem}` | {what} | {notebook_minutes(path)} min |")
    return "\n".join(lines[:start + 2] + new_rows + lines[end:]) + ("\n" if readme.endswith("\n") else "")


def differences(readme: str, generated: str) -> list[str]:
    old = {m["name"]: m for m in map(ROW.match, readme.splitlines()) if m}
    new = {m["name"]: m for m in map(ROW.match, generated.splitlines()) if m}
    out = [f"notebooks/{n}.ipynb has no row in the README table" for n in new if n not in old]
    out += [f"the README has a row for {n}, but notebooks/{n}.ipynb does not exist" for n in old if n not in new]
    out += [f"{n}: README says {old[n]['time'].strip()!r}, the notebook's header says {new[n]['time'].strip()!r}"
            for n in new if n in old and old[n]["time"] != new[n]["time"]]
    if not out and readme != generated:
        out.append("the rows are not in the notebooks' order")
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="README notebook table from the notebooks' headers")
    parser.add_argument("--check", action="store_true", help="only compare; exit 1 when they differ")
    parser.add_argument("--root", type=Path, default=REPO_ROOT)
    args = parser.parse_args(argv)
    path = args.root / "README.md"
    readme = path.read_text(encoding="utf-8")
    generated = render(readme, args.root / "notebooks")
    diff = differences(readme, generated)
    if args.check:
        for line in diff:
            print(line)
        if diff:
            print("run `python -m labkit.apps.readme` to regenerate the README's table")
        return 1 if diff else 0
    path.write_text(generated, encoding="utf-8")
    print("\n".join(diff) or "README table already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
