"""Run one notebook top to bottom in a fresh kernel; print one JSON line (tests/test_notebooks.py).

    python tests/run_notebook.py notebooks/03_allreduce.ipynb

The kernel inherits this process's environment (LABKIT_IMPL, LABKIT_QUICK). The JSON says whether a
cell raised (`error`: the cell and its traceback's end), whether the notebook selects exercises with
impl() (`uses_impl`) and whether a stub said "is not implemented yet" (`met_a_stub`). Not a pytest
file: its own process, so that two notebooks can run at once.
"""
import json
import sys
import time
from pathlib import Path

SLOW_CELL_S = 120  # a cell slower than this is named on stderr (the quick setting's cells take seconds)
POLL_S = 1.0  # the longest wait for a kernel message between two looks at the socket itself


def _short_polls(channel) -> None:
    """Make ``channel.get_msg(timeout)`` look at its socket at least every POLL_S seconds.

    pyzmq's asyncio poll wakes on the socket's file descriptor, which signals an edge; a send on the same
    socket (nbclient sends widget updates on the shell channel while it waits there for a cell's reply) can
    take that edge, and the waiting poll then sleeps until its timeout, where it polls the socket itself and
    finds the reply. Seen twice in one session: notebook 06's and 09's widget cells each answered after
    exactly 600 s (nbclient's timeout) and passed. Short polls bound such a wait to POLL_S.
    """
    import queue

    get = channel.get_msg

    async def get_msg(timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            step = POLL_S if deadline is None else min(POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                return await get(timeout=step)
            except queue.Empty:
                if deadline is not None and time.monotonic() >= deadline:
                    raise

    channel.get_msg = get_msg


_client = None


def __getattr__(name):
    """`from run_notebook import NotebookClient`: nbclient's client whose channels poll short (`_short_polls`),
    for every test that drives a kernel; nbclient is imported on first use."""
    global _client
    if name != "NotebookClient":
        raise AttributeError(name)
    if _client is None:
        from nbclient import NotebookClient

        class PollingClient(NotebookClient):
            async def async_start_new_kernel_client(self):
                kc = await super().async_start_new_kernel_client()
                _short_polls(kc.shell_channel)
                _short_polls(kc.iopub_channel)
                return kc

        _client = PollingClient
    return _client


_began = {}  # cell index -> when it was sent


def _started(cell, cell_index, **_):
    _began[cell_index] = time.monotonic()


def _ended(cell, cell_index, **_):
    seconds = time.monotonic() - _began.pop(cell_index, time.monotonic())
    if seconds > SLOW_CELL_S:
        first = "".join(cell.source).strip().splitlines()[:1]
        print(f"run_notebook: cell {cell_index} took {seconds:.0f} s: {first[0][:80] if first else ''}",
              file=sys.stderr, flush=True)


def main(path: Path) -> dict:
    # nbformat validates with jsonschema, which imports rfc3987_syntax where it is installed (jupyter-events
    # asks for it); that module builds a grammar at import: 2.8 s of CPU in each of the suite's 32 runs.
    # Without it, jsonschema leaves IRI formats unchecked, and a notebook holds none.
    sys.modules.setdefault("rfc3987_syntax", None)
    import nbformat
    from nbclient.exceptions import CellExecutionError

    NotebookClient = __getattr__("NotebookClient")

    error = None
    for attempt in (1, 2):
        nb = nbformat.read(path, as_version=4)
        client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}},
                                on_cell_execute=_started, on_cell_executed=_ended)
        try:
            client.execute()
        except CellExecutionError as err:
            error = str(err)[-3000:]
        except RuntimeError as err:
            # a kernel that never answered, or died before its first answer (each seen once in 32 runs on a loaded
            # machine), ran none of the cells: start another, once, and say so; the verdict is about the cells
            lost = "didn't respond" in str(err) or "died before replying" in str(err)
            if not lost or attempt == 2 or any(c.get("outputs") for c in nb.cells if c.cell_type == "code"):
                raise
            print(f"run_notebook: {err}; starting another kernel", file=sys.stderr, flush=True)
            continue
        break
    code = [cell for cell in nb.cells if cell.cell_type == "code"]
    said = "".join(o.get("text", "") for cell in code for o in cell.get("outputs", []))
    return {"error": error, "uses_impl": any("impl(" in "".join(cell.source) for cell in code),
            "met_a_stub": "is not implemented yet" in said}


if __name__ == "__main__":
    began = time.monotonic()
    result = main(Path(sys.argv[1]))
    print(f"run_notebook: {sys.argv[1]} ran in {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    print(json.dumps(result), flush=True)
