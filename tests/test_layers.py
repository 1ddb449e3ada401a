"""The layers: labkit's core never reaches the solutions or the exercises, not even through impl().

Core = every module of labkit/ except the applications (labkit/apps/), the grading support
(labkit/grading/: the switch, the registry, the case runner, stub generation, the pytest plugin and
the first-wrong-place diagnostics), which exists to pick, run and judge the learner's code, and the
composition of notebook 14 (labkit/compose/), which runs the learner's pieces together.
"""
import ast
from pathlib import Path

LABKIT = Path(__file__).resolve().parent.parent / "labkit"
NOT_CORE = ("apps", "grading", "compose")  # the folders above the core
FORBIDDEN_MODULES = ("solutions", "exercises", "labkit.apps", "labkit.grading", "labkit.compose")


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
            if module.startswith("<call") and path.name == "zygote_server.py" and module == "<call importlib.import_module(name)>":
                continue  # the zygote's preload: the names its caller passes, failures ignored (see there)
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


# -- the solution layer ------------------------------------------------------------------------
# A solution builds on another topic only through impl("<topic>") at call time (so a learner's
# notebook 07 runs on their own notebook 06 code), never imports a private (_name) core name, and
# no solution module imports another one at all, so there can be no import cycle among them.
SOLUTIONS = LABKIT.parent / "solutions"
# Known violations still to remove (none now). Each entry must still be found, so a stale one fails.
PENDING: set = set()


def _solution_imports(path: Path, topics: set):
    """(imported solutions topic or None, imported labkit module, names, line, at module level) per import."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    top = {id(n) for n in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno, id(node) in top
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:  # relative: inside the solutions package
                module = "solutions" + (f".{module}" if module else "")
            names = [a.name for a in node.names]
            if module == "solutions":  # "from . import zero" imports solutions.zero
                for name in names:
                    yield f"solutions.{name}", [], node.lineno, id(node) in top
            else:
                yield module, names, node.lineno, id(node) in top


def _module_level_impl_calls(path: Path):
    """Lines of impl(...) calls that run when the module is imported (outside any def or class body)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    lines = []
    for stmt in tree.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        for node in ast.walk(stmt):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "impl":
                lines.append(node.lineno)
    return lines


def _private_attribute_uses(path: Path):
    """(line, 'alias._name') where a labkit module bound to `alias` has a private attribute read."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    aliases = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("labkit"):
            aliases |= {a.asname or a.name for a in node.names}
        elif isinstance(node, ast.Import):
            aliases |= {a.asname or a.name.split(".")[0] for a in node.names if a.name.startswith("labkit")}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in aliases):
            yield node.lineno, f"{node.value.id}.{node.attr}"


def solution_violations(root: Path) -> list[str]:
    """Every break of the solution layer's rules in root/solutions/*.py, one line each."""
    paths = {p.stem: p for p in sorted((root / "solutions").glob("*.py")) if p.stem != "__init__"}
    found, edges = [], {topic: set() for topic in paths}
    for topic, path in paths.items():
        for module, names, line, _ in _solution_imports(path, set(paths)):
            if module == "solutions" or module.startswith("solutions.") or module.startswith("exercises"):
                other = module.split(".")[1] if "." in module else "?"
                found.append(f"{topic} imports {module}")
                edges[topic].add(other)
            elif module.startswith("labkit"):
                found += [f"{topic} imports the private core name {module}.{n} (line {line})"
                          for n in names if n.startswith("_") and not n.startswith("__")]
        found += [f"{topic} calls impl() at import time (line {n}): call it where it is used"
                  for n in _module_level_impl_calls(path)]
        found += [f"{topic} reads the private core name {name} (line {n})" for n, name in _private_attribute_uses(path)]
    found += _cycles(edges)
    return found


def _cycles(edges: dict) -> list[str]:
    """'import cycle: a -> b -> a' for each cycle of the import graph (each reported once)."""
    cycles = set()

    def walk(node, path):
        for nxt in sorted(edges.get(node, ())):
            if nxt in path:
                cycle = path[path.index(nxt):]
                start = cycle.index(min(cycle))  # one rotation per cycle
                cycles.add(tuple(cycle[start:] + cycle[:start]))
            else:
                walk(nxt, path + [nxt])

    for node in edges:
        walk(node, [node])
    return [f"import cycle: {' -> '.join(c + (c[0],))}" for c in sorted(cycles)]


def test_solutions_reach_other_topics_only_through_impl_no_private_core_names_no_cycles():
    found = solution_violations(LABKIT.parent)
    stale = PENDING - set(found)
    assert not stale, f"fixed, delete them from PENDING in tests/test_layers.py: {sorted(stale)}"
    new = [v for v in found if v not in PENDING]
    assert not new, ("a solution reaches another topic only through impl('<topic>') at call time, and uses "
                     "labkit's public names only:\n" + "\n".join(new))


def test_the_solution_check_catches_each_planted_violation(tmp_path):
    """A tree of planted solutions: every rule is broken once and every break is reported."""
    (tmp_path / "solutions").mkdir()
    plant = {
        "clean": "from labkit.grading import impl\n\ndef f():\n    return impl('a').x\n",
        "a": "from .b import y\nx = 1\n",                                  # cross-topic import ...
        "b": "import solutions.a\ny = 2\n",                                # ... and the cycle a -> b -> a
        "c": "from labkit.comm.checks import _DTYPES\n",            # a private core name
        "d": "from labkit.grading import impl\nzero = impl('zero')\n",     # impl() bound at import time
        "e": "from labkit.comm import checks as cc\n\ndef f():\n    return cc._allowed_devices\n",
        "f": "def g():\n    from exercises.zero import shard_size\n",      # the other package, inside a function
    }
    for name, text in plant.items():
        (tmp_path / "solutions" / f"{name}.py").write_text(text)
    found = solution_violations(tmp_path)
    expected = ["a imports solutions.b", "b imports solutions.a",
                "c imports the private core name labkit.comm.checks._DTYPES (line 1)",
                "d calls impl() at import time (line 2): call it where it is used",
                "e reads the private core name cc._allowed_devices (line 4)",
                "f imports exercises.zero", "import cycle: a -> b -> a"]
    assert sorted(found) == sorted(expected), found


# -- no import cycle among labkit's modules ------------------------------------------------------
def labkit_import_cycles(root: Path) -> list[str]:
    """'import cycle: a -> b -> a' among root/labkit's modules, imports inside functions counted too (a lazy
    import hides a cycle from Python, not from a reader). An import names the longest labkit module it
    starts with: `from labkit.apps.rank_grid import draw_grid` is an edge to labkit.apps.rank_grid."""
    lab = root / "labkit"
    paths = {".".join(("labkit", *p.relative_to(lab).with_suffix("").parts)).removesuffix(".__init__"): p
             for p in sorted(lab.rglob("*.py")) if "__pycache__" not in p.parts}
    edges = {name: set() for name in paths}
    for name, path in paths.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets = [f"{node.module}.{a.name}" for a in node.names]
            else:
                continue
            for target in targets:
                parts = target.split(".")
                hit = next((".".join(parts[:k]) for k in range(len(parts), 0, -1) if ".".join(parts[:k]) in paths), None)
                if hit and hit != name:
                    edges[name].add(hit)
    return _cycles(edges)


def test_labkit_has_no_import_cycle():
    assert not labkit_import_cycles(LABKIT.parent), labkit_import_cycles(LABKIT.parent)


def test_the_cycle_check_sees_a_lazy_import_cycle(tmp_path):
    (tmp_path / "labkit" / "apps").mkdir(parents=True)
    (tmp_path / "labkit" / "apps" / "figures.py").write_text("def main():\n    from labkit.apps.moves import draw\n")
    (tmp_path / "labkit" / "apps" / "moves.py").write_text("from labkit.apps.figures import COLORS\n")
    assert labkit_import_cycles(tmp_path) == ["import cycle: labkit.apps.figures -> labkit.apps.moves -> labkit.apps.figures"]
