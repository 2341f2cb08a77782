"""arpo_async/core/faults.py: the table holds every fault point the tree names, and each
value format parses as the roles always read it (malformed values fail loudly)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from arpo_async.core.faults import (
    FAULT_CORRUPT_DELTA,
    FAULT_HOLD_CHECKPOINT,
    FAULT_HOLD_FIRST_GROUP,
    FAULT_POINTS,
    FAULT_STOP_AFTER_GRANT,
    actor_fault,
    actor_fault_floats,
    actor_fault_int,
    fault_value,
)

ROOT = Path(__file__).resolve().parents[2]
# not the project's own text: environments, run folders, caches, data
SKIP = {"runs", "models", "data", "build", "dist", "node_modules", "__pycache__"}
TEXT = {".py", ".sh", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg"}
NAME = re.compile(r"ARPO_FAULT_[A-Z0-9_]+")


def _sources(folder: Path):
    for path in folder.iterdir():
        if path.name.startswith(".") or path.name in SKIP or path.name.endswith(".egg-info"):
            continue
        if path.is_dir() and not path.is_symlink():
            yield from _sources(path)
        elif path.suffix in TEXT and path.is_file():
            yield path


def test_every_fault_point_in_the_tree_is_in_the_table():
    found = {}
    for path in _sources(ROOT):
        for name in NAME.findall(path.read_text(errors="replace")):
            found.setdefault(name, str(path.relative_to(ROOT)))
    missing = {n: where for n, where in found.items() if n not in FAULT_POINTS}
    assert not missing, f"fault points not in arpo_async/core/faults.py: {missing}"
    assert FAULT_HOLD_CHECKPOINT in found  # the scan reaches the learner (learner/loop.py)


def test_the_table_describes_each_point():
    for name, point in FAULT_POINTS.items():
        assert point.name == name and NAME.fullmatch(name)
        assert point.does and point.value and point.role


def test_unset_and_other_actors_give_none(monkeypatch):
    monkeypatch.delenv(FAULT_STOP_AFTER_GRANT, raising=False)
    assert fault_value(FAULT_STOP_AFTER_GRANT) is None
    assert actor_fault(FAULT_STOP_AFTER_GRANT, 0) is None
    assert actor_fault_int(FAULT_STOP_AFTER_GRANT, 0) is None
    monkeypatch.setenv(FAULT_STOP_AFTER_GRANT, "")  # set but empty: as unset
    assert fault_value(FAULT_STOP_AFTER_GRANT) == ""
    assert actor_fault_int(FAULT_STOP_AFTER_GRANT, 0) is None
    monkeypatch.setenv(FAULT_STOP_AFTER_GRANT, "1:4")
    assert actor_fault_int(FAULT_STOP_AFTER_GRANT, 0) is None
    assert actor_fault_int(FAULT_STOP_AFTER_GRANT, 1) == 4


def test_actor_values(monkeypatch):
    monkeypatch.setenv(FAULT_CORRUPT_DELTA, "0:3")
    assert actor_fault(FAULT_CORRUPT_DELTA, 0) == "3"
    assert actor_fault_int(FAULT_CORRUPT_DELTA, 0) == 3
    monkeypatch.setenv(FAULT_CORRUPT_DELTA, " 2:-1")  # int() takes what it always took
    assert actor_fault_int(FAULT_CORRUPT_DELTA, 2) == -1
    monkeypatch.setenv(FAULT_HOLD_FIRST_GROUP, "0:30:2")
    assert actor_fault_floats(FAULT_HOLD_FIRST_GROUP, 0) == [30.0, 2.0]
    monkeypatch.setenv(FAULT_HOLD_FIRST_GROUP, "3:1.5")
    assert actor_fault_floats(FAULT_HOLD_FIRST_GROUP, 3) == [1.5]
    assert actor_fault_floats(FAULT_HOLD_FIRST_GROUP, 0) is None


def test_step_value_is_the_string_as_set(monkeypatch):
    monkeypatch.setenv(FAULT_HOLD_CHECKPOINT, "3")
    assert fault_value(FAULT_HOLD_CHECKPOINT) == str(3)


@pytest.mark.parametrize("spec", ["x:3", ":3", "one:3"])
def test_a_malformed_actor_fails_in_every_actor(monkeypatch, spec):
    monkeypatch.setenv(FAULT_STOP_AFTER_GRANT, spec)
    for actor_id in (0, 1):
        with pytest.raises(ValueError):
            actor_fault(FAULT_STOP_AFTER_GRANT, actor_id)


@pytest.mark.parametrize("spec", ["0", "0:", "0:v3", "0:3:4", "0:1.5"])
def test_a_malformed_version_fails_in_its_actor_only(monkeypatch, spec):
    monkeypatch.setenv(FAULT_CORRUPT_DELTA, spec)
    with pytest.raises(ValueError):
        actor_fault_int(FAULT_CORRUPT_DELTA, 0)
    assert actor_fault_int(FAULT_CORRUPT_DELTA, 1) is None


@pytest.mark.parametrize("spec", ["0", "0:", "0:ten", "0:5:"])
def test_malformed_seconds_fail_in_their_actor_only(monkeypatch, spec):
    monkeypatch.setenv(FAULT_HOLD_FIRST_GROUP, spec)
    with pytest.raises(ValueError):
        actor_fault_floats(FAULT_HOLD_FIRST_GROUP, 0)
    assert actor_fault_floats(FAULT_HOLD_FIRST_GROUP, 1) is None
