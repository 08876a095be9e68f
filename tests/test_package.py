"""The package's shape: its modules import one another without a circle, the library does not import the bench,
and no module reads an environment variable of this project's own."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jax_moe_comm"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}
# The compiled modules and the file the build writes beside them: they import nothing of the package.
COMPILED = {"jax_moe_comm._nvshmem_ext", "jax_moe_comm._status_ext", "jax_moe_comm._build_config"}


def imported_modules(name: str, path: Path) -> set[str]:
    """The package's modules that `name` imports anywhere in its text (function-level imports included: a circle
    hidden in a function is still a circle)."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: the package `level - 1` steps up, then the module named
                base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
            else:
                base = node.module or ""
            # `from x import y` imports module x.y when y is one, else names of x.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES.keys() | COMPILED else base
                       for alias in node.names]
        else:
            continue
        found |= {t for t in targets if t in MODULES and t != name}
    return found


GRAPH = {name: imported_modules(name, path) for name, path in MODULES.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of the graph (its modules in order, the first repeated at the end), or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (circle := visit(dep)):
                return circle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (circle := visit(node)):
            return circle
    return None


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for dep in graph[todo.pop()] - seen:
            seen.add(dep)
            todo.append(dep)
    return seen


def test_the_circle_finder_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_the_known_imports():
    assert "jax_moe_comm.autodiff" in GRAPH["jax_moe_comm.comm"]
    assert "jax_moe_comm._native" in GRAPH["jax_moe_comm.runtime"]
    assert "jax_moe_comm.bench.cli" in GRAPH["jax_moe_comm.bench.__main__"]


def test_no_module_imports_itself_through_others():
    assert find_circle(GRAPH) is None


@pytest.mark.parametrize("library", ["jax_moe_comm", "jax_moe_comm.layers", "jax_moe_comm.launch"])
def test_the_library_does_not_run_through_the_bench(library):
    assert not {m for m in reachable(GRAPH, library) if m.startswith("jax_moe_comm.bench")}


def test_no_module_reads_a_variable_of_ours():
    """Behaviour is chosen by MoEComm's arguments; the environment carries only the transport's own settings."""
    ours = re.compile(r"""environ[^\n]*["']JAX_MOE_COMM_|getenv\(\s*["']JAX_MOE_COMM_""")
    assert [str(p.relative_to(PACKAGE)) for p in MODULES.values() if ours.search(p.read_text())] == []


ROOT = PACKAGE.parent
DOCS = [ROOT / "README.md", ROOT / "docs" / "design.md", ROOT / "benchmarks" / "NOTES.md",
        ROOT / "benchmarks" / "README.md", ROOT / "tests" / "gpu" / "LAST_RUN.md"]


def test_the_readme_is_short_enough_to_read():
    assert len((ROOT / "README.md").read_bytes()) < 14_000


def test_the_project_cites_no_document_outside_it():
    """The project stands alone: no path out of the repository, no design document it does not hold."""
    outside = re.compile(r"\.\./shared|\bDESIGN(\.md)?\b|DESIGN §")
    texts = DOCS + sorted(PACKAGE.rglob("*.py")) + sorted((ROOT / "ffi").glob("*.*"))
    assert [str(p.relative_to(ROOT)) for p in texts if outside.search(p.read_text())] == []


def test_the_readme_use_example_runs_as_written(tmp_path):
    """The README's Use example, copied out of it, runs in a fresh process with no setup of its own (it asks for its
    8 CPU devices itself) and prints the MoEComm and the layer's output."""
    import os
    import subprocess
    import sys

    readme = (ROOT / "README.md").read_text()
    use = readme[readme.index("## Use\n"):]
    code = use[use.index("```python\n") + len("```python\n"):use.index("\n```", use.index("```python\n"))]
    script = tmp_path / "use.py"
    script.write_text(code + "\n")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    env["JAX_PLATFORMS"] = "cpu"
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "MoEComm(world=8, " in done.stdout and "backend='reference'" in done.stdout
    assert "(256, 64) bfloat16" in done.stdout
