"""docs/design.md's "Layout" section names every library file, under its own folder, so
the list cannot drift from the tree: a file added without its line fails here, and so
does a line naming a file that no longer exists."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("arpo_async", "actors", "learner", "toolenv")
# "folder/   text" starts an entry ("folder/file.py   text" names that file too); an
# indented line continues it
ENTRY = re.compile(r"^([a-z_]+(?:/[a-z_]+)*/)([a-z_]+\.py)?\s*(.*)$")
FILE = re.compile(r"\b([a-z_][a-z0-9_]*\.py)\b")


def layout() -> dict[str, set[str]]:
    """Folder -> the file names its entry of the Layout section mentions."""
    text = (REPO / "docs" / "design.md").read_text()
    section = text.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1]
    entries: dict[str, set[str]] = {}
    folder = None
    for line in block.splitlines():
        m = ENTRY.match(line)
        if m:
            folder, rest = m.group(1), f"{m.group(2) or ''} {m.group(3)}"
        elif folder is None:
            continue
        else:
            rest = line
        entries.setdefault(folder, set()).update(FILE.findall(rest))
    return entries


def library_files() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (REPO / package).rglob("*.py"):
            if path.name == "__init__.py" and not _has_code(path):
                continue
            folder = path.parent.relative_to(REPO).as_posix() + "/"
            out.setdefault(folder, set()).add(path.name)
    return out


def _has_code(path: Path) -> bool:
    """An ``__init__.py`` with more than a docstring (a factory, re-exports)."""
    def trivial(node: ast.stmt) -> bool:
        return ((isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant))
                or (isinstance(node, ast.ImportFrom) and node.module == "__future__"))

    return not all(trivial(n) for n in ast.parse(path.read_text()).body)


def test_every_library_file_is_in_the_layout_section():
    named, files = layout(), library_files()
    missing = sorted(f"{folder}{name}" for folder, names in files.items()
                     for name in names - named.get(folder, set()))
    assert not missing, f"docs/design.md Layout does not name: {missing}"


def test_the_layout_section_names_no_file_that_is_gone():
    named, files = layout(), library_files()
    gone = sorted(f"{folder}{name}" for folder, names in named.items()
                  if folder.split("/")[0] in PACKAGES
                  for name in names - files.get(folder, set()) - {"__init__.py"})
    assert not gone, f"docs/design.md Layout names files that do not exist: {gone}"
