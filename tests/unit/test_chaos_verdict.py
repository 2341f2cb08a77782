"""The chaos soak's verdict (arpo_async/jobs/chaos_verdict.py) on hand-made run records:
each check passes on sound records and fails on the defect it is there for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from arpo_async.core.config import config_from_dict
from arpo_async.jobs import chaos_verdict as V
from learner.ledger import Ledger


def _ledger_after_a_restart() -> Ledger:
    """Actor 0: incarnation 10 sent 3 (2 arrived) and died; 11 sent 2 and said Bye."""
    led = Ledger()
    led.hello(0, 10, 0)
    for _ in range(2):
        led.receive(0, 10)
    led.heartbeat(0, 0, {"pid": 10, "groups_sent": 3})
    led.hello(0, 11, 0)
    for _ in range(2):
        led.receive(0, 11)
    led.mark_trained([0, 0, 0])
    led.drop(0, "stale")
    led.bye(0, 2, {"pid": 11})
    return led


def test_a_sound_ledger_passes_per_actor_and_incarnation():
    led = _ledger_after_a_restart()
    summary = {str(k): v for k, v in led.summary().items()}
    assert summary["0"]["lost"] == 1
    assert V.ledger_problems(summary, led.incarnations()) == []


def test_ledger_defects_are_named():
    led = _ledger_after_a_restart()
    summary = {str(k): v for k, v in led.summary().items()}
    inc = led.incarnations()
    broken = json.loads(json.dumps(summary))
    broken["0"]["trained"] -= 1  # a group neither trained nor dropped
    assert "received 4 != trained 2 + dropped 1" in V.ledger_problems(broken, inc)[0]
    dup = json.loads(json.dumps(inc))
    dup["0"]["by_pid"]["11"][1] = 3  # the closed incarnation delivered more than it sent
    problems = V.ledger_problems(summary, dup)
    assert any("pid 11: received 3 > sent 2" in p for p in problems), problems
    open_ = {"0": summary["0"] | {"sent": -1, "lost": -1}}
    assert V.ledger_problems(open_, inc) == ["actor 0 never said bye"]


def _rows(tmp_path, times, faults=()):
    with (tmp_path / "metrics.jsonl").open("w") as f:
        for i, t in enumerate(times):
            f.write(json.dumps({"time": t, "step": i + 1, "step_time_s": 1.0, "wait_s": 0.5,
                                "staleness_max": 0}) + "\n")
    with (tmp_path / "chaos.jsonl").open("w") as f:
        for fault in faults:
            f.write(json.dumps(fault) + "\n")


def test_the_gap_bound_adds_up_the_faults_inside_the_gap(tmp_path):
    cfg = config_from_dict({"actors": {"restart_backoff_s": 2.0},
                            "learner": {"actor_silent_s": 5.0}})
    # step_s = 0.5 (work) + 1.0 (median step) ; base bound = 1.5 + 5 = 6.5 s
    _rows(tmp_path, [0, 1, 2, 8])  # a 6 s gap without a fault: within 6.5
    assert V.check_gap(tmp_path, cfg, startup_s=10)["ok"]
    _rows(tmp_path, [0, 1, 2, 30])  # 28 s without a fault: a hang
    res = V.check_gap(tmp_path, cfg, startup_s=10)
    assert not res["ok"] and res["tightest"]["gap_s"] == 28.0
    # the same gap with a learner kill inside: + backoff 2 + start-up 10 = 18.5 s: still over
    _rows(tmp_path, [0, 1, 2, 30], [{"time": 3, "kind": "learner_kill"}])
    assert not V.check_gap(tmp_path, cfg, startup_s=10)["ok"]
    # two overlapping kills: 6.5 + 2 x 12 = 30.5 s >= 28 s
    _rows(tmp_path, [0, 1, 2, 30], [{"time": 3, "kind": "learner_kill"},
                                    {"time": 9, "kind": "actor_kill"}])
    res = V.check_gap(tmp_path, cfg, startup_s=10)
    assert res["ok"] and res["tightest"]["bound_s"] == 30.5, res
    # a launcher kill is two start-ups in a row (the launcher's, then its learner's):
    # 6.5 + 2 + 10 + 10 = 28.5 s; a gap past that is still a hang
    _rows(tmp_path, [0, 1, 2, 30], [{"time": 3, "kind": "launcher_kill"}])
    res = V.check_gap(tmp_path, cfg, startup_s=10)
    assert res["ok"] and res["tightest"]["bound_s"] == 28.5, res
    _rows(tmp_path, [0, 1, 2, 32], [{"time": 3, "kind": "launcher_kill"}])
    assert not V.check_gap(tmp_path, cfg, startup_s=10)["ok"]


def test_a_fault_injected_before_a_gap_counts_while_it_lasts(tmp_path):
    """The 30-minute soak's longest gaps began 1-2 s after a cache_full fault (22 s: the
    actors could not write their weight file) and a slow tool: faults act for their
    duration, not only at the instant they are injected."""
    cfg = config_from_dict({"learner": {"actor_silent_s": 5.0}, "tools": {"timeout_s": 10}})
    _rows(tmp_path, [0, 1, 2, 26], [{"time": 1.5, "kind": "cache_full", "for_s": 22}])
    res = V.check_gap(tmp_path, cfg, startup_s=10)  # 24 s <= 6.5 + 22
    assert res["ok"] and res["tightest"]["bound_s"] == 28.5, res
    _rows(tmp_path, [0, 1, 2, 26], [{"time": 1.5, "kind": "slow_tool", "for_s": 12,
                                     "delay_s": 15}])  # 6.5 + 12 + min(15, 10)
    assert V.check_gap(tmp_path, cfg, startup_s=10)["tightest"]["bound_s"] == 28.5
    # over by the time it ended: a fault long gone explains nothing
    _rows(tmp_path, [0, 30, 31, 60], [{"time": 1.5, "kind": "cache_full", "for_s": 22}])
    assert not V.check_gap(tmp_path, cfg, startup_s=10)["ok"]


def test_a_process_of_the_run_left_behind_is_found(tmp_path):
    marker = str(tmp_path / "run")
    env = dict(os.environ, ARPO_CHAOS_RUN=marker)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    try:
        deadline = time.monotonic() + 10
        found = []
        while not found and time.monotonic() < deadline:  # until its environ is readable
            found = V.run_processes(marker, tmp_path / "run", V.ancestors(os.getpid()))
            time.sleep(0.05)
        assert [p["pid"] for p in found] == [proc.pid]
        assert not V.check_processes(marker, tmp_path / "run", V.ancestors(os.getpid()))["ok"]
    finally:
        proc.kill()
        proc.wait()
    assert V.check_processes(marker, tmp_path / "run", V.ancestors(os.getpid()))["ok"]


def test_a_skipped_prompt_fails_the_ledger_check_and_duplicates_are_reported(tmp_path):
    led = _ledger_after_a_restart()
    ledger = {str(k): v for k, v in led.summary().items()}
    for skipped, ok in ((0, True), (-1, True), (2, False)):  # -1: a record restored unknown
        prompts = {"taken": 5, "duplicates": 1, "skipped": skipped}
        (tmp_path / "summary.json").write_text(json.dumps({
            "ledger": ledger, "prompts": prompts,
            "learner": {"incarnations": led.incarnations()}}))
        check = V.check_ledger(tmp_path)
        assert check["ok"] is ok, check
        assert ("2 prompts skipped" in check["value"]) is (not ok)
        assert check["prompts"]["duplicates"] == 1


def test_a_job_kill_holds_the_learner_back_as_long_as_a_launcher_kill():
    cfg = config_from_dict({})
    fault = {"time": 0.0, "target": "run"}
    assert V.fault_effect(fault | {"kind": "job_kill"}, cfg, 10.0, 5.0) == \
        V.fault_effect(fault | {"kind": "launcher_kill"}, cfg, 10.0, 5.0) == 15.0
