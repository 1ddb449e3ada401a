"""Old names fail helpfully, for one release: every name the core's renaming removed raises an error that
names its replacement (labkit/renames.py), in solutions/ and in the generated exercises/ alike, and
CONTRIBUTING.md's "Renamed names" table lists exactly those names. No process is launched: well under a second.
"""
import importlib
import re
from pathlib import Path

import pytest

import labkit
from labkit.grading import impl
from labkit.renames import MOVED_MODULES, RELEASE_NOTE, RENAMED

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("old", sorted(MOVED_MODULES))
def test_a_moved_module_names_its_replacement_on_import(old):
    with pytest.raises(ModuleNotFoundError) as error:
        importlib.import_module(old)
    assert str(error.value) == f"{old} moved: use {MOVED_MODULES[old]} {RELEASE_NOTE}"
    importlib.import_module(MOVED_MODULES[old].split()[0])  # and the replacement is there


@pytest.mark.parametrize("old", sorted(set(MOVED_MODULES) - {"labkit.launch"}))  # labkit.launch is the function now
def test_a_moved_module_names_its_replacement_as_an_attribute_and_in_from_import(old):
    name = old.split(".", 1)[1]
    with pytest.raises(AttributeError, match=re.escape(f"{old} moved: use {MOVED_MODULES[old]}")):
        getattr(labkit, name)
    with pytest.raises(ModuleNotFoundError, match=re.escape(f"{old} moved: use {MOVED_MODULES[old]}")):
        exec(f"from labkit import {name}", {})


def test_a_name_that_never_existed_keeps_the_usual_errors():
    with pytest.raises(AttributeError, match="^module 'labkit' has no attribute 'no_such_name'$"):
        labkit.no_such_name  # noqa: B018
    with pytest.raises(ModuleNotFoundError, match="^No module named 'labkit.no_such_name'$"):
        importlib.import_module("labkit.no_such_name")
    with pytest.raises(AttributeError, match="^module 'solutions.data_parallel' has no attribute 'no_such_name'$"):
        impl("data_parallel", "solutions").no_such_name  # noqa: B018


@pytest.mark.parametrize("which", ["solutions", "exercises"])
@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_renamed_exercise_name_names_its_replacement(old, which):
    topic, *path = old.split(".")
    module = impl(topic, which)
    message = f"{old} was renamed: use {RENAMED[old]} {RELEASE_NOTE}"
    with pytest.raises(AttributeError) as error:
        if len(path) == 1:  # a module's function or class
            getattr(module, path[0])
        else:  # a method: reading it works, calling it says what to call
            getattr(getattr(module, path[0]), path[1])()
    assert str(error.value) == message
    new = RENAMED[old].split("(")[0].split()[0]  # and the replacement is there
    if new.startswith("labkit."):
        module_name, name = new.rsplit(".", 1)
        getattr(importlib.import_module(module_name), name)
    else:  # in the same module
        owner = module
        for part in new.split("."):
            owner = getattr(owner, part)


def renamed_table(text: str) -> list[str]:
    """The backticked old names in the first column of CONTRIBUTING.md's '## Renamed names' table."""
    section = text.split("## Renamed names", 1)[1].split("\n## ", 1)[0]
    return [re.findall(r"`([^`]+)`", line.split("|")[1])[0] for line in section.splitlines() if line.startswith("| `")]


def test_contributing_lists_every_renamed_name_and_nothing_else():
    listed = renamed_table((REPO / "CONTRIBUTING.md").read_text(encoding="utf-8"))
    assert sorted(listed) == sorted([*MOVED_MODULES, *RENAMED]), (
        f"CONTRIBUTING.md's 'Renamed names' table and labkit/renames.py differ: missing "
        f"{sorted(set(MOVED_MODULES) | set(RENAMED) - set(listed))}, extra {sorted(set(listed) - set(MOVED_MODULES) - set(RENAMED))}")
