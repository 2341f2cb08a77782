"""A straggler in a real run (launcher, learner, two simulated-engine actors, ZeroMQ): actor
0 holds its first group (``ARPO_FAULT_HOLD_FIRST_GROUP``, as a slow last tool call would,
heartbeats going on) for HOLD_S, or until the learner published version 2, which makes
that group stale.
The learner waits for it before the step that would make it stale and trains it
(learner/service.py ``collect``); with ``learner.straggler_wait_s=0`` the same group is
dropped as stale, which shows the situation was forced."""

from __future__ import annotations

import json

import pytest

from actors.actor import FAULT_HOLD_FIRST_GROUP
from tests.integration.faultkit import Run, check_ledger

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOLD_S = 8
STEPS = 6


def _run(tmp_path, model, wait_s: float) -> dict:
    run = Run(tmp_path / f"wait{wait_s:g}", model, "actors.num=2", "actors.engine=simulated",
              f"learner.max_steps={STEPS}", "learner.batch_groups=2",
              "learner.max_staleness=1", f"learner.straggler_wait_s={wait_s}",
              "rollout.mode=grpo", "rollout.group_size=4",
              "actors.max_inflight_trajectories=0", "actors.concurrent_groups=2",
              env={FAULT_HOLD_FIRST_GROUP: f"0:{HOLD_S}:2"})
    summary = run.finish(timeout=300)
    assert summary["status"] == "ok" and summary["steps"] == STEPS, summary
    check_ledger(summary["ledger"])
    assert "holding group at position" in run.role_log("actor0")
    learner = json.loads((run.dir / "learner_summary.json").read_text())["service"]
    return summary | {"service": learner}


def test_the_held_group_is_trained_with_the_wait_and_dropped_without(tiny_model_dir, tmp_path):
    waited = _run(tmp_path, tiny_model_dir, wait_s=120)
    svc = waited["service"]
    assert "stale" not in waited["tokens"]["dropped"], waited["tokens"]
    assert all("stale" not in led["dropped"] for led in waited["ledger"].values())
    assert svc["staleness"]["lag_max"] <= 1
    assert svc["events"].get("straggler_wait_expired", 0) == 0
    assert svc["straggler_wait_s"] > HOLD_S / 2, svc["straggler_wait_s"]

    dropped = _run(tmp_path, tiny_model_dir, wait_s=0)
    assert dropped["ledger"]["0"]["dropped"].get("stale", 0) >= 1, dropped["ledger"]
    assert dropped["tokens"]["dropped"].get("stale", 0) > 0
    assert dropped["service"]["straggler_wait_s"] < 0.5
    print(f"\nstraggler: waited {svc['straggler_wait_s']:.1f} s, tokens "
          f"{waited['tokens']}; without the wait: {dropped['tokens']}")
