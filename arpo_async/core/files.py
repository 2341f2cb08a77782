"""Durable files: atomic writes, JSON and JSONL, one helper each for every process.

A file another process (or a resumed run) reads is never seen half written: it is written
to a temporary name beside it, fsynced and renamed over the old one, and the folder is
fsynced so the rename survives a crash. JSONL readers name the file and the row of any
line that cannot be used."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger("arpo_async.core.files")


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's entry list is what makes a rename durable)."""
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> int:
    """fsync every file and folder under ``root`` (deepest first); returns files synced."""
    count = 0
    for folder, _dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_path(Path(folder) / name)
            count += 1
        fsync_path(Path(folder))
    return count


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Replace ``path`` with ``data``: temporary file, fsync, rename, fsync the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, sort_keys: bool = False) -> None:
    """``obj`` as indented JSON; keys keep their order unless ``sort_keys``."""
    atomic_write_text(path, json.dumps(obj, indent=1, sort_keys=sort_keys) + "\n")


def read_json(path: str | Path) -> dict | None:
    """The JSON object in ``path``, or None when it is missing or unreadable (logged)."""
    path = Path(path)
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.warning("%s is unreadable (%s); ignoring it", path, exc)
        return None
    if not isinstance(obj, dict):
        log.warning("%s does not hold a JSON object; ignoring it", path)
        return None
    return obj


def iter_jsonl(path: str | Path, error: type[Exception] = ValueError) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of ``path``; a line that is not a
    JSON object raises ``error("PATH: row N: ...")``. Rows are numbered from 1."""
    path = Path(path)
    with path.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise error(f"{path}: row {n}: not valid JSON: {exc.msg}") from None
            if not isinstance(row, dict):
                raise error(f"{path}: row {n}: expected a JSON object, got {type(row).__name__}")
            yield n, row


def read_jsonl(path: str | Path, error: type[Exception] = ValueError) -> list[dict]:
    """Every object of a JSONL file (see ``iter_jsonl``)."""
    return [row for _, row in iter_jsonl(path, error)]


def read_jsonl_appended(path: str | Path) -> list[Any]:
    """Every line of a JSONL file that another process appends to that parses ([] while
    the file does not exist): a line that does not (being written right now) is skipped."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            continue
    return rows


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """Replace ``path`` with one JSON object a line (UTF-8 kept as is), atomically."""
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
