"""The short command names (``[project.scripts]`` in pyproject.toml): each names a
``main`` that exists and answers ``--help`` (the console script the install writes calls
exactly that), and the README lists each one."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


def test_the_commands_are_declared_and_documented():
    assert {"arpo-launch", "arpo-experiments", "arpo-keys"} <= set(SCRIPTS)
    readme = (ROOT / "README.md").read_text()
    assert [name for name in SCRIPTS if f"`{name}`" not in readme] == []


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_each_command_runs_its_main(name, capsys):
    module, _, attr = SCRIPTS[name].partition(":")
    main = getattr(importlib.import_module(module), attr)
    with pytest.raises(SystemExit) as stop:
        main(["--help"])
    assert stop.value.code == 0
    assert "usage:" in capsys.readouterr().out
