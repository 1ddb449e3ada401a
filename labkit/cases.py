"""Many grading cases in one launch.

Launching ranks costs far more than most checks, so a grading module can run all its cases
in one launch per world size: `run_cases` inside the ranks records each case's outcome,
`launch_cases` launches once (cached), and `expect_case` turns one case's outcome into a
pass, a NotImplementedError (an unwritten stub) or a failure that shows every rank's trace.
"""
from __future__ import annotations

import functools

def run_cases(cases: dict) -> dict:
    """In a rank: call every ``key -> body()`` and record ("ok" | "not implemented" | "failed", detail)."""
    import traceback

    results = {}
    for key, body in cases.items():
        try:
            body()
            results[key] = ("ok", "")
        except NotImplementedError as error:
            results[key] = ("not implemented", str(error))
        except Exception:
            results[key] = ("failed", traceback.format_exc())
    return results


@functools.lru_cache(maxsize=None)
def launch_cases(run_all, world_size: int, timeout: float = 60):
    """``launch(run_all, world_size)``, once per (function, world size); a launch error is returned."""
    from .launch import launch

    try:
        return launch(run_all, world_size, timeout=timeout)
    except Exception as error:  # a hang or a crash: every test of this world size reports it
        return error


def expect_case(per_rank, key, label: str):
    """Raise the launch's error, NotImplementedError, or fail the test with the failing ranks' traces."""
    import pytest

    if isinstance(per_rank, Exception):
        raise per_rank
    failed = []
    for rank, outcomes in enumerate(per_rank):
        status, detail = outcomes[key]
        if status == "not implemented":
            raise NotImplementedError(detail)
        if status != "ok":
            failed.append(f"rank {rank}: {detail}")
    if failed:
        pytest.fail(f"{label}:\n" + "\n".join(failed), pytrace=False)
