"""``run.tool_call_budget``: the learner's stop rule (``LearnerLoop.time_up``) ends the run
once the groups it trained have executed that many tool calls, whatever the clock says;
0 is no limit."""

from __future__ import annotations

import time
from types import SimpleNamespace

from arpo_async.core.config import config_from_dict
from learner.loop import LearnerLoop


def _loop(budget: int, calls: int, time_limit_s: float = 0.0):
    cfg = config_from_dict({"run": {"tool_call_budget": budget, "time_limit_s": time_limit_s}})
    return SimpleNamespace(cfg=cfg, tool_calls=calls, t_start=time.time(), t_first_step=None)


def test_the_budget_ends_the_run_once_spent():
    assert not LearnerLoop.time_up(_loop(600, 599))
    assert LearnerLoop.time_up(_loop(600, 600)) and LearnerLoop.time_up(_loop(600, 640))
    assert not LearnerLoop.time_up(_loop(0, 10**9))  # 0: no limit
    late = _loop(600, 10, time_limit_s=5.0)
    late.t_start -= 10.0
    assert LearnerLoop.time_up(late)  # the clock still ends a run that spends little
