"""The environment a child process needs to import this checkout's labkit, and nothing more.

A kernel, script or pytest that the suite starts must run this checkout's labkit. `make setup` installs it
(editable), so a child usually finds it without help; setting PYTHONPATH anyway changes the child's
environment, and a process whose environment differs from the suite's cannot share the suite's zygote
(labkit/launching/zygote_sharing.py): it starts its own, about 4 s of CPU, and a session's kernel pays it
before its first engine.
"""
import functools
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


@functools.lru_cache(maxsize=None)
def _found_by_a_child(python_path: str | None) -> str:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    if python_path is not None:
        env["PYTHONPATH"] = python_path
    out = subprocess.run([sys.executable, "-c", "import importlib.util as u; "
                          "print(u.find_spec('labkit').submodule_search_locations[0])"],
                         capture_output=True, text=True, timeout=60, env=env, cwd="/")
    return out.stdout.strip()


def labkit_path_env() -> dict:
    """{} if a child with this process's environment, started in any folder, imports labkit from this
    checkout; else {"PYTHONPATH": this checkout, then the current PYTHONPATH}."""
    if Path(_found_by_a_child(os.environ.get("PYTHONPATH")) or "/nonexistent").resolve() == REPO / "labkit":
        return {}
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
