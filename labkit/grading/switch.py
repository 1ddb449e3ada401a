"""Grading support: one switch between the learner's code and the reference.

    from labkit.grading import impl
    allreduce = impl("allreduce")   # exercises.allreduce, or solutions.allreduce

The switch is the environment variable ``LABKIT_IMPL`` (``exercises`` by default,
``solutions`` in CI); ``pytest --impl=...`` sets it for a whole run, so notebooks
executed by that run and ranks started by `labkit.launch` see the same choice.

This module is only the switch. The exercise registry (which exercises exist, for
`labkit.grading.stubgen` and the grade table) is `labkit.grading.registry`; the many-cases-in-one-launch
runner used by the grading tests is `labkit.grading.cases`. labkit's core never calls `impl`: only
the applications (`labkit.apps`), the solutions, tests, notebooks and benchmarks do.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
IMPLEMENTATIONS = ("exercises", "solutions")


def current_impl() -> str:
    """Which implementation is selected: 'exercises' (default) or 'solutions'."""
    name = os.environ.get("LABKIT_IMPL", "exercises").strip() or "exercises"
    if name not in IMPLEMENTATIONS:
        raise ValueError(
            f"LABKIT_IMPL={name!r} is not one of {IMPLEMENTATIONS}: "
            "set it to 'exercises' (your code) or 'solutions' (the reference)."
        )
    return name


_stamps: dict[str, tuple] = {}  # module name -> (path, hash of its source when last loaded)


def impl(topic: str, which: str | None = None):
    """Return the module ``<which>.<topic>``, ``which`` defaulting to `current_impl()`.

    The module is always the file's current code: when ``exercises/<topic>.py`` changed
    since it was loaded, it is reloaded (in place: a notebook's ``pl = impl("pipeline")``
    sees the new functions), so a learner never needs to restart the kernel after an edit.
    Every `labkit.launch` also reloads changed modules just before it forks the ranks.
    """
    which = which or current_impl()
    if which not in IMPLEMENTATIONS:
        raise ValueError(f"which={which!r} must be one of {IMPLEMENTATIONS}")
    if str(REPO_ROOT) not in sys.path:  # notebooks run from notebooks/, tests from anywhere
        sys.path.insert(0, str(REPO_ROOT))
    path = REPO_ROOT / which / f"{topic}.py"
    if not path.exists():
        known = sorted(p.stem for p in (REPO_ROOT / "solutions").glob("*.py") if p.stem != "__init__")
        raise ValueError(f"no exercise module {which}/{topic}.py; known topics: {known}")
    name = f"{which}.{topic}"
    module = sys.modules.get(name)
    if module is None:
        module = importlib.import_module(name)
    elif _stamps.get(name, (None, None))[1] != _source_hash(path):
        module = _reload(module, path)
    _stamps[name] = (path, _source_hash(path))
    _register_refresh()
    return module


def refresh_changed() -> list[str]:
    """Reload every exercise or solution module whose file changed since it was loaded.

    Covers the modules `impl` returned and any other ``exercises.*`` / ``solutions.*`` module
    imported meanwhile; then reloads, in place, the lab modules that hold names imported from a
    reloaded one (``from .zero import shard_size`` in fsdp.py), so that nothing keeps old code.
    Returns the names of the modules reloaded. Called before every launch's fork and, in a
    notebook, before every cell (`labkit.launching.notebook.install_cell_refresh`).
    """
    _stamp_new_modules()
    changed = []
    for name, (path, digest) in list(_stamps.items()):
        module = sys.modules.get(name)
        if module is not None and path.exists() and _source_hash(path) != digest:
            _reload(module, path)
            _stamps[name] = (path, _source_hash(path))
            changed.append(name)
    while changed and (stale := _importers_of(changed)):  # a dependent of a dependent, too
        for name in stale:
            path = _stamps[name][0]
            _reload(sys.modules[name], path)
            _stamps[name] = (path, _source_hash(path))
            changed.append(name)
    return changed


def _stamp_new_modules() -> None:
    """Remember the source hash of lab modules imported since the last look (not through impl)."""
    for name, module in sys.modules.copy().items():  # one C call: a thread importing meanwhile cannot break it
        which, _, topic = name.partition(".")
        if which in IMPLEMENTATIONS and topic and "." not in topic and name not in _stamps:
            path = REPO_ROOT / which / f"{topic}.py"
            if path.exists() and Path(getattr(module, "__file__", "") or "").resolve() == path:
                _stamps[name] = (path, _source_hash(path))


def _importers_of(reloaded: list[str]) -> list[str]:
    """Loaded lab modules, not yet reloaded, holding a function or class defined in a reloaded one."""
    stale = []
    for name in _stamps:
        module = sys.modules.get(name)
        if module is None or name in reloaded:
            continue
        if any(getattr(value, "__module__", None) in reloaded and callable(value)
               for value in vars(module).values()):
            stale.append(name)
    return stale


def _source_hash(path: Path) -> str:
    return hashlib.sha1(path.read_bytes()).hexdigest()


def _reload(module, path: Path):
    # Python trusts a cached .pyc whose recorded mtime (whole seconds) and size match the
    # source: two edits within a second, of equal length, would reload stale bytecode.
    cached = Path(importlib.util.cache_from_source(str(path)))
    cached.unlink(missing_ok=True)
    importlib.invalidate_caches()
    return importlib.reload(module)


def _register_refresh():
    hooks = importlib.import_module("labkit.launching.launcher").BEFORE_FORK
    if refresh_changed not in hooks:  # the core offers the hook; it never calls impl() itself
        hooks.append(refresh_changed)
    cells = importlib.import_module("labkit.launching.notebook")  # every notebook cell and needs_exercise() block
    if refresh_changed not in cells.BEFORE_CELL:
        cells.BEFORE_CELL.append(refresh_changed)
        cells.AFTER_CELL.append(_stamp_new_modules)


_register_refresh()  # importing the switch is enough: a notebook's setup cell does
