"""The house rules the tree keeps as it grows: read from the source, no import run.

A newcomer finds a module's role from its folder; an import circle or a 500-line module makes
the next change harder. These hold for ``app/``, ``workers/`` and ``benchmarks/``.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "workers", "benchmarks")
MAX_LINES = 350


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``name`` imports at module level or inside functions."""
    out = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        out |= {t for t in targets if t in known and t != name}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_among_the_projects_modules():
    modules = _modules()
    # a package's __init__ is imported by its every module: count only edges between modules
    graph = {name: {m for m in _imports(name, path, set(modules)) if not name.startswith(m + ".")}
             for name, path in modules.items()}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_workers_never_import_the_serving_side():
    modules = _modules()
    offenders = {name: sorted(m for m in _imports(name, path, set(modules)) if m.split(".")[0] == "app")
                 for name, path in modules.items() if name.startswith("workers")}
    assert not {k: v for k, v in offenders.items() if v}


def test_no_module_is_over_the_line_limit():
    long = {str(p.relative_to(ROOT)): n for p in _modules().values()
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"over {MAX_LINES} lines: {long}"


def test_app_keeps_its_roles_in_folders():
    top = sorted(p.name for p in (ROOT / "app").glob("*.py"))
    assert len(top) <= 8, top
    assert {"edge", "page", "dispatch", "pool"} <= {p.name for p in (ROOT / "app").iterdir() if p.is_dir()}


def test_every_named_benchmark_is_a_module_that_runs_as_main():
    from benchmarks.__main__ import BENCHMARKS

    for name, (module, _) in BENCHMARKS.items():
        path = ROOT / (module.replace(".", "/") + ".py")
        assert path.is_file(), name
        assert 'if __name__ == "__main__":' in path.read_text(), name
