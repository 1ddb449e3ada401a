"""A pytest plugin for bench/gpu_check.py: each failure written to $GPU_CHECK_LOG_DIR/failures.txt as it happens.

A suite cut short by its time limit (a GPU node's lease, say) still tells which tests failed and why,
where pytest itself prints its summary only at the end. Loaded with ``-p bench.pytest_failures_log``.
"""
import os


def pytest_runtest_logreport(report):
    folder = os.environ.get("GPU_CHECK_LOG_DIR")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under xdist the controller gets every report too: write it once
        return
    if not folder or not (report.failed or (report.when != "call" and report.outcome == "error")):
        return
    text = str(report.longrepr)
    with open(os.path.join(folder, "failures.txt"), "a") as f:
        f.write(f"=== {report.nodeid} ({report.when})\n{text[-1500:]}\n")
