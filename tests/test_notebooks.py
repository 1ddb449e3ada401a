"""Every notebook runs top to bottom on the untouched stubs: a learner who has written nothing yet
sees one line per cell that needs an exercise, and no cell raises.

Cells that fail on purpose (a timeout demo) catch their error and print it, so they pass too.
Needs pristine stubs, so it runs in the maintainers' mode (`--impl=solutions`, as `make test` and
CI do); the notebooks themselves are executed on `exercises/`.
"""
import os
from pathlib import Path

import pytest

from labkit.grading import REPO_ROOT, current_impl

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


@pytest.mark.skipif(current_impl() != "solutions", reason="needs pristine stubs: maintainers' mode only")
@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_to_the_end_on_untouched_stubs(path: Path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    monkeypatch.setenv("LABKIT_IMPL", "exercises")  # the kernel inherits it
    monkeypatch.setenv("LABKIT_QUICK", "1")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=300, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as error:
        text = str(error)
        pytest.fail(f"{path.name} stops on the untouched stubs:\n{text[-3000:]}", pytrace=False)
    said = "".join(o.get("text", "") for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", []))
    if any("impl(" in "".join(cell.source) for cell in nb.cells if cell.cell_type == "code"):
        # it really ran on the stubs, and said so in the stub's own words
        assert "is not implemented yet" in said, f"{path.name} never met a stub: did it run on exercises/?"
    assert os.environ["LABKIT_IMPL"] == "exercises"
