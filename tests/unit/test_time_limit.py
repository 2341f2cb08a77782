"""``run.time_limit_s`` counts from the learner's start, or with ``run.time_limit_from=
first_step`` from the end of its first step (start-up then costs no training time)."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from arpo_async.core.config import ConfigError, config_from_dict
from learner.loop import LearnerLoop


def _loop(limit: float, mode: str, started_ago: float, first_step_ago: float | None):
    cfg = config_from_dict({"run": {"time_limit_s": limit, "time_limit_from": mode}})
    now = time.time()
    return SimpleNamespace(cfg=cfg, t_start=now - started_ago,
                           t_first_step=None if first_step_ago is None else now - first_step_ago)


@pytest.mark.parametrize("mode,started_ago,first_step_ago,up", [
    ("start", 100.0, None, True),         # start-up alone used the budget up
    ("start", 50.0, 10.0, False),
    ("first_step", 100.0, None, False),   # no step yet: start-up is not counted
    ("first_step", 100.0, 50.0, False),
    ("first_step", 200.0, 70.0, True),
])
def test_time_limit_origin(mode, started_ago, first_step_ago, up):
    loop = _loop(60.0, mode, started_ago, first_step_ago)
    assert LearnerLoop.time_up(loop) is up


def test_no_limit_and_bad_origin():
    assert LearnerLoop.time_up(_loop(0.0, "first_step", 1e6, 1e6)) is False
    with pytest.raises(ConfigError, match="time_limit_from"):
        config_from_dict({"run": {"time_limit_from": "launch"}})
