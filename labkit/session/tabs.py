"""``%%ranks --tabs``: a cell's output as an ipywidgets ``Tab``, one tab per rank (as jupyter-distributed
shows it), each holding that rank's printed lines (stderr after stdout) and its ``Out[rank k]``.

Where ipywidgets cannot be imported, `show` returns False and the caller prints the grouped text instead.
"""
from __future__ import annotations


def show(out: dict[int, str], err: dict[int, str], results: dict[int, dict | None], ranks: list[int]) -> bool:
    """Display the tabs; False (nothing shown) when ipywidgets is missing."""
    try:
        import ipywidgets as widgets
        from IPython.display import display
    except ImportError:
        return False
    children = []
    for rank in ranks:
        pane = widgets.Output()
        if out.get(rank):
            pane.append_stdout(out[rank])
        if err.get(rank):
            pane.append_stderr(err[rank])
        value = (results.get(rank) or {}).get("text/plain")
        if value is not None:
            pane.append_stdout(f"Out[rank {rank}]: {value}\n")
        children.append(pane)
    tab = widgets.Tab(children=children)
    for i, rank in enumerate(ranks):
        tab.set_title(i, f"rank {rank}")
    display(tab)
    return True
