"""A straggler in a real run (launcher, learner, two simulated-engine actors, ZeroMQ): actor
0 holds its first group (``ARPO_FAULT_HOLD_FIRST_GROUP``, as a slow last tool call would,
heartbeats going on) for HOLD_S, or until the learner published version 2, which would
make that group stale. The learner waits for it before that step and trains it
(learner/service.py ``collect``). The wait itself shows the situation was forced: the
learner waits with a batch ready only while a ticket granted on weights max_staleness
versions behind is out. Without the wait the same group is dropped: the scripted
version of this run in tests/unit/test_straggler_wait.py."""

from __future__ import annotations

import json

import pytest

from actors.actor import FAULT_HOLD_FIRST_GROUP
from tests.integration.faultkit import Run, check_ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOLD_S = 8
STEPS = 5


def test_a_held_group_is_waited_for_and_trained(tiny_model_dir, tmp_path):
    run = Run(tmp_path / "run", tiny_model_dir, "actors.num=2", "actors.engine=simulated",
              f"learner.max_steps={STEPS}", "learner.batch_groups=2",
              "learner.max_staleness=1", "learner.straggler_wait_s=120",
              "rollout.mode=grpo", "rollout.group_size=4",
              "actors.max_inflight_trajectories=0", "actors.concurrent_groups=2",
              env={FAULT_HOLD_FIRST_GROUP: f"0:{HOLD_S}:2"})
    summary = run.finish(timeout=300)
    assert summary["status"] == "ok" and summary["steps"] == STEPS, summary
    check_ledger(summary["ledger"])
    assert "holding group at position" in run.role_log("actor0")
    svc = json.loads((run.dir / "learner_summary.json").read_text())["service"]
    tokens = summary["tokens"]
    assert "stale" not in tokens["dropped"], tokens
    assert all("stale" not in led["dropped"] for led in summary["ledger"].values())
    assert svc["staleness"]["lag_max"] <= 1
    assert svc["events"].get("straggler_wait_expired", 0) == 0
    # the learner waited with a batch ready for most of the hold: only an at-risk ticket
    # makes it wait so
    assert svc["straggler_wait_s"] > HOLD_S / 2, svc["straggler_wait_s"]
    # the held group was trained: every group actor 0 sent is trained or dropped at the
    # end, and none of its groups was dropped for any other reason
    assert set(summary["ledger"]["0"]["dropped"]) <= {"shutdown"}
    print(f"\nstraggler: waited {svc['straggler_wait_s']:.1f} s; tokens {tokens}")
