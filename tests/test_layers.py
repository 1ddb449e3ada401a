"""The layers: labkit's core never reaches the solutions or the exercises, not even through impl().

Core = every module of labkit/ except the applications (labkit/apps/) and the grading support
(labkit/grading/: the switch, the registry, the case runner, stub generation, the pytest plugin and
the first-wrong-place diagnostics), which exists to pick, run and judge the learner's code.
"""
import ast
from pathlib import Path

LABKIT = Path(__file__).resolve().parent.parent / "labkit"
NOT_CORE = ("apps", "grading")  # the folders above the core
FORBIDDEN_MODULES = ("solutions", "exercises", "labkit.apps", "labkit.grading")


def core_modules():
    for path in sorted(LABKIT.rglob("*.py")):
        relative = path.relative_to(LABKIT)
        if relative.parts[0] in NOT_CORE:
            continue
        yield path


def imports_of(path: Path):
    """(module, line) for every import in the file, relative imports resolved against labkit."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node.lineno
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = ["labkit", *path.relative_to(LABKIT).parts[:-1]][: len(path.relative_to(LABKIT).parts) - node.level + 1]
                base = ".".join(package + ([base] if base else []))
            yield base, node.lineno
            for alias in node.names:  # "from labkit import grading" imports labkit.grading
                yield f"{base}.{alias.name}", node.lineno
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in (
                "impl", "import_module", "__import__"):
            yield f"<call {ast.unparse(node)[:60]}>", node.lineno


def test_no_core_module_imports_solutions_exercises_apps_or_the_switch():
    offenders = []
    for path in core_modules():
        for module, line in imports_of(path):
            if module.startswith("<call") and "labkit.launching.launcher" not in module:
                offenders.append(f"{path.relative_to(LABKIT.parent)}:{line} calls {module[6:-1]}")
            elif any(module == f or module.startswith(f + ".") for f in FORBIDDEN_MODULES):
                offenders.append(f"{path.relative_to(LABKIT.parent)}:{line} imports {module}")
    assert not offenders, "labkit's core must not reach the layer above it:\n" + "\n".join(offenders)


def test_the_check_sees_a_forbidden_import(tmp_path, monkeypatch):
    """The checker itself can fail: a planted core module that goes through impl() is caught."""
    planted = LABKIT / "_planted_for_test.py"
    planted.write_text("from labkit.grading import impl\nmod = impl('pipeline')\n")
    try:
        found = [m for m, _ in imports_of(planted)]
        assert "labkit.grading" in found and any(m.startswith("<call impl(") for m in found)
        assert planted in list(core_modules())
    finally:
        planted.unlink()
