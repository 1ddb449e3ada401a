"""Per-cell overhead of a session (`%ranks start N`, then `%%ranks` cells) against a forked `%%ranks N` cell.

    python bench/session.py [--quick] [--world-size N]

The same one-all-reduce cell, run alternately in one process: on the session's persistent ranks
(ipyparallel engines, already started; their start-up is reported apart) and as a fork-per-cell
`%%ranks N` cell (ranks forked from the warm zygote, a new process group each time). The figure to
read is the ratio of medians, session / forked (below 1: a session cell is cheaper than a new world).
Last line: one JSON object.
"""
import argparse
import contextlib
import io
import json
import os
import statistics
import sys
import time
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from labkit.launching import magic  # noqa: E402
from labkit.launching.launcher import OversubscriptionWarning  # noqa: E402
from labkit.session.session import Session  # noqa: E402

CELL = "t = torch.ones(4) * rank\ndist.all_reduce(t)\n"


def timed(run) -> float:
    began = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        run()
    return time.perf_counter() - began


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--world-size", type=int, default=2)
    options = parser.parse_args()
    warnings.simplefilter("ignore", OversubscriptionWarning)
    repeats = 5 if options.quick else 20
    n = options.world_size
    began = time.perf_counter()
    session = Session(n, "gloo").start()
    start_s = time.perf_counter() - began
    try:
        timed(lambda: session.run_cell(CELL))  # warm both paths once
        timed(lambda: magic.ranks(f"{n} --backend gloo", CELL, {}))
        session_times, forked_times = [], []
        for _ in range(repeats):
            session_times.append(timed(lambda: session.run_cell(CELL)))
            forked_times.append(timed(lambda: magic.ranks(f"{n} --backend gloo", CELL, {})))
    finally:
        session.stop()
    se, fo = statistics.median(session_times), statistics.median(forked_times)
    print(f"one all-reduce cell on {n} ranks, median of {repeats} (seconds)")
    print(f"{'cell':<34}{'median s':>10}{'min s':>10}")
    print(f"{'%%ranks on a session (persistent)':<34}{se:>10.4f}{min(session_times):>10.4f}")
    print(f"{'%%ranks N (forked per cell)':<34}{fo:>10.4f}{min(forked_times):>10.4f}")
    print(f"session start-up (once): {start_s:.1f} s; ratio session/forked per cell: {se / fo:.3f}")
    print(json.dumps({"bench": "session", "world_size": n, "repeats": repeats, "session_cell_s": round(se, 4),
                      "forked_cell_s": round(fo, 4), "ratio": round(se / fo, 4), "session_start_s": round(start_s, 2)}))


if __name__ == "__main__":
    main()
