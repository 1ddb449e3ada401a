"""CONTRIBUTING.md's "Where things live" table agrees with the tree.

Every module of labkit/ (package `__init__` files aside) is named in the table, and every path the
table names exists, so the map a new maintainer reads cannot drift from the code.
"""
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def table_paths(text: str) -> list[str]:
    """The backticked paths in the first column of the table under '## Where things live'."""
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    paths = []
    for line in section.splitlines():
        if line.startswith("| `"):
            first = line.split("|")[1]
            paths += re.findall(r"`([^`]+)`", first)
    return paths


def missing_and_unknown(text: str, repo: Path) -> tuple[list[str], list[str]]:
    named = table_paths(text)
    modules = sorted(str(p.relative_to(repo)) for p in (repo / "labkit").rglob("*.py")
                     if p.name != "__init__.py" and "__pycache__" not in p.parts)
    missing = [m for m in modules if m not in named]
    patterns = ("<", "*", "NN_")  # `solutions/<topic>.py`, `tests/test_*.py`: families, not paths
    unknown = [p for p in named if not any(c in p for c in patterns) and not (repo / p).exists()]
    return missing, unknown


def test_contributing_table_names_every_labkit_module_and_nothing_else():
    missing, unknown = missing_and_unknown((REPO / "CONTRIBUTING.md").read_text(encoding="utf-8"), REPO)
    assert not missing, f"CONTRIBUTING.md's table does not name these labkit modules: {missing}"
    assert not unknown, f"CONTRIBUTING.md's table names paths that do not exist: {unknown}"


@pytest.mark.parametrize("planted", ["unlisted module", "stale path"])
def test_the_table_check_catches_a_planted_drift(tmp_path, planted):
    (tmp_path / "labkit" / "links").mkdir(parents=True)
    (tmp_path / "labkit" / "links" / "shaper.py").write_text("")
    table = "## Where things live\n| path | what |\n| --- | --- |\n| `labkit/links/shaper.py` | a slow link |\n"
    if planted == "unlisted module":
        (tmp_path / "labkit" / "links" / "netem.py").write_text("")
        assert missing_and_unknown(table, tmp_path) == (["labkit/links/netem.py"], [])
    else:
        table += "| `labkit/old_module.py` | gone |\n"
        assert missing_and_unknown(table, tmp_path) == ([], ["labkit/old_module.py"])
