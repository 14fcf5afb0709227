"""The course's layering, read from the import statements of every module (no module is run):
utils imports no phase, an earlier phase never imports a later one, and no import circle exists."""

import ast
import re
from pathlib import Path

from utils.build import REPO_ROOT

LAYERS = ["utils", "phase1_baseline", "phase2_naive", "phase3_tiled", "phase4_coalesced", "phase5_fused",
          "phase6_layernorm_mlp", "final"]


def course_modules() -> dict[str, Path]:
    """Dotted module name -> file, for every Python file of the course (tests included)."""
    modules = {}
    for top in LAYERS:
        for path in sorted((REPO_ROOT / top).rglob("*.py")):
            if "results" in path.parts or "build" in path.parts:
                continue
            parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def imports_of(path: Path, name: str, modules: dict) -> set[str]:
    """The course modules a file imports (at any depth in the file: lazy imports count too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def graph() -> dict[str, set[str]]:
    modules = course_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def layer(module: str) -> int:
    return LAYERS.index(module.split(".")[0])


def is_test(module: str) -> bool:
    return bool(re.search(r"(^|\.)test_", module))


def test_utils_imports_no_phase():
    offenders = {m: sorted(t for t in targets if layer(t) > 0)
                 for m, targets in graph().items() if layer(m) == 0 and not is_test(m)}
    assert not {m: t for m, t in offenders.items() if t}


def test_earlier_phases_never_import_later_ones():
    offenders = {m: sorted(t for t in targets if layer(t) > layer(m))
                 for m, targets in graph().items() if layer(m) > 0}
    assert not {m: t for m, t in offenders.items() if t}


def test_no_import_circle():
    edges = {m: {t for t in targets if not is_test(t)} for m, targets in graph().items() if not is_test(m)}
    state: dict[str, int] = {}
    circles = []

    def visit(node, path):
        state[node] = 1
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                circles.append(path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt])
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(edges):
        if node not in state:
            visit(node, [node])
    # A package's __init__ importing its own sub-modules is how Python packages work, not a circle.
    circles = [c for c in circles if not all(x.startswith(c[0]) or c[0].startswith(x) for x in c)]
    assert not circles, circles


def test_the_checker_sees_imports(tmp_path):
    """The graph is not empty: a phase that imports utils shows that edge."""
    g = graph()
    assert "utils.build" in g["phase2_naive"] or any(t.startswith("utils") for t in g["phase2_naive"])
