"""The house's layers, read from the imports (docs/design.md, "Layout").

    core      arpo_async/core/      imports only the core
    toolenv   toolenv/              the core
    actors    actors/               the core and toolenv
    learner   learner/              the core
    launcher  arpo_async/launcher/  the core (it starts roles as processes, never imports them)
    jobs      arpo_async/jobs/ and arpo_async/launch.py: anything

Every import counts, the ones inside functions too (a lazy import is still a
dependency); only ``if TYPE_CHECKING:`` blocks are left out. No two files may import each
other in a circle either."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("arpo_async", "actors", "learner", "toolenv")
ALLOWED = {
    "core": {"core"},
    "toolenv": {"core", "toolenv"},
    "actors": {"core", "toolenv", "actors"},
    "learner": {"core", "learner"},
    "launcher": {"core", "launcher"},
    "jobs": {"core", "toolenv", "actors", "learner", "launcher", "jobs"},
}


def layer(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "arpo_async":
        if len(parts) > 1 and parts[1] in ("core", "launcher"):
            return parts[1]
        return "jobs"  # arpo_async.jobs.* and the entry point
    return parts[0]


def module_files(root: Path) -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).with_suffix("")
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            out[".".join(parts)] = path
    return out


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for sub in node.body:
                lines.update(range(sub.lineno, (sub.end_lineno or sub.lineno) + 1))
    return lines


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The project modules ``module`` imports (a package's ``from P import m`` names the
    submodule ``P.m`` when it is one)."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    out: set[str] = set()
    for node in ast.walk(tree):
        if getattr(node, "lineno", None) in skip:
            continue
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".")[: -node.level] if path.name != "__init__.py" \
                    else module.split(".")[: len(module.split(".")) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                     for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    files = module_files(root)
    return {m: imports_of(m, p, set(files)) for m, p in files.items()}


def violations(root: Path) -> list[str]:
    """One line per import that crosses the layers the wrong way."""
    bad = []
    for module, targets in sorted(import_graph(root).items()):
        for target in sorted(targets):
            if layer(target) not in ALLOWED[layer(module)]:
                bad.append(f"{module} ({layer(module)}) imports {target} ({layer(target)})")
    return bad


def cycles(root: Path) -> list[list[str]]:
    """Import circles between files (strongly connected components of size > 1)."""
    graph = import_graph(root)
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:  # Tarjan
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_crosses_the_layers():
    assert violations(ROOT) == []


def test_no_import_cycles():
    assert cycles(ROOT) == []


def test_every_module_has_a_layer():
    files = module_files(ROOT)
    assert {layer(m) for m in files} == set(ALLOWED)
    assert "arpo_async.core.protocol" in files and "actors.engines.base" in files


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for pkg in PACKAGES:
        (tmp_path / pkg).mkdir(exist_ok=True)
        (tmp_path / pkg / "__init__.py").write_text("")
    for rel, text in files.items():
        path = tmp_path / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize(("source", "expected"), [
    ("from actors.branching import x\n", ["learner.trainer (learner) imports actors.branching "
                                          "(actors)"]),
    ("def f():\n    from arpo_async.launcher import plan\n",  # lazy imports count
     ["learner.trainer (learner) imports arpo_async.launcher.plan (launcher)"]),
    ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from actors.branching import x\n",
     []),
    ("from arpo_async.core import protocol as P\n", []),
])
def test_the_checker_sees_a_forbidden_import(tmp_path, source, expected):
    root = _tree(tmp_path, {
        "learner/trainer.py": source, "actors/branching.py": "x = 1\n",
        "arpo_async/core/__init__.py": "", "arpo_async/core/protocol.py": "",
        "arpo_async/launcher/__init__.py": "", "arpo_async/launcher/plan.py": "",
    })
    assert violations(root) == expected


def test_the_checker_sees_a_cycle_and_the_core_reaching_up(tmp_path):
    root = _tree(tmp_path, {
        "toolenv/a.py": "from toolenv import b\n", "toolenv/b.py": "import toolenv.a\n",
        "arpo_async/core/__init__.py": "",
        "arpo_async/core/config.py": "from toolenv.a import thing\n",
    })
    assert cycles(root) == [["toolenv.a", "toolenv.b"]]
    assert violations(root) == ["arpo_async.core.config (core) imports toolenv.a (toolenv)"]
