"""README's notebook table agrees with the notebooks (their headers are the single source of the times).

Every notebook of notebooks/ (11, 12, 13 ... included, as they are added) must have a row, and
the row's time must be its header's "about NN min". Fix: `python -m labkit.apps.readme`.
"""
import json

import pytest

from labkit.apps import readme


def test_readme_table_agrees_with_the_notebook_headers():
    text = (readme.REPO_ROOT / "README.md").read_text(encoding="utf-8")
    diff = readme.differences(text, readme.render(text, readme.REPO_ROOT / "notebooks"))
    assert not diff, "\n".join(diff) + "\nrun `python -m labkit.apps.readme` to regenerate the README's table"


def test_every_notebook_header_says_how_long_it_takes():
    for path in sorted((readme.REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert readme.notebook_minutes(path) > 0, path


def write_notebook(path, header):
    path.write_text(json.dumps({"cells": [{"cell_type": "markdown", "source": header.splitlines(True)}],
                                "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))


README = """# Lab

| notebook | what you build and measure | time |
| --- | --- | --- |
| `00_a` | things | 99 min |

after
"""


def test_render_takes_times_from_headers_keeps_what_and_adds_missing_rows(tmp_path):
    write_notebook(tmp_path / "00_a.ipynb", "# 00 · A\n\n**What you will learn** (about 20 minutes)\n")
    write_notebook(tmp_path / "11_new.ipynb", "# 11 · Something new\n\n(about 35 min, with the stretch)\n")
    out = readme.render(README, tmp_path)
    assert "| `00_a` | things | 20 min |" in out
    assert "| `11_new` | Something new | 35 min |" in out
    assert out.endswith("\nafter\n")
    assert readme.differences(README, out) == [
        "notebooks/11_new.ipynb has no row in the README table",
        "00_a: README says '99 min', the notebook's header says '20 min'"]
    assert readme.differences(out, readme.render(out, tmp_path)) == []


def test_a_row_without_its_notebook_is_reported(tmp_path):
    write_notebook(tmp_path / "01_b.ipynb", "# 01 · B (about 5 minutes)")
    assert "the README has a row for 00_a, but notebooks/00_a.ipynb does not exist" in \
        readme.differences(README, readme.render(README, tmp_path))


def test_header_without_a_time_is_a_clear_error(tmp_path):
    write_notebook(tmp_path / "00_a.ipynb", "# 00 · A\n\nno time here")
    with pytest.raises(ValueError, match="about NN minutes"):
        readme.render(README, tmp_path)
