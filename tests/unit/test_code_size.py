"""No library file over 500 lines and no function over 60: a room a reader can hold in
their head. A file that grows past it is split where it has a seam (as session_child.py
was into the checkpoint half and the rest), not exempted here."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("arpo_async", "actors", "learner", "toolenv")
MAX_FILE_LINES, MAX_FUNCTION_LINES = 500, 60


def _library() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py"))


def test_no_library_file_over_500_lines():
    long = {str(p.relative_to(REPO)): n for p in _library()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, long


def test_no_function_over_60_lines():
    long = {}
    for path in _library():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(REPO)}:{node.name}"] = n
    assert not long, long
