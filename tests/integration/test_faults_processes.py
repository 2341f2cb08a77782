"""Faults injected into the processes of real runs (issue 7): a SIGKILLed actor and a
stalled one (SIGSTOP past the staleness bound), a launcher terminated by SIGTERM or SIGHUP,
and a learner frozen for several request timeouts."""

from __future__ import annotations

import json
import re
import signal
import time

import pytest

from tests.integration.faultkit import Run, check_ledger, gone, signal_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# ----------------------------------------------------------------------------- actor faults

SILENT_S = 4  # learner.actor_silent_s of the kill+stall run
# learner.max_steps of the kill+stall run: the kill and a first stall that holds are over
# by step 12 or so on a 2-core VM (a faster machine makes more steps in the timed waits);
# the rest leaves room for one more stall and the recovery. (At 30 steps, ~40 s went to
# steps that no assertion looks at.)
MAX_STEPS = 20
STALL_STEPS = 6  # a fresh step, 3 steps stopped, the late group's arrival, recovery
# transport.timeout_s of the kill+stall run: the first stall lasts as long as actor 0's
# restart (26-33 s here). Past the default 30 s, actor 1's requests time out when it
# resumes and it says Hello again: its tickets are voided and a retried ticket request is
# granted anew (seen 2026-12-01: that stall left no late group, a second one was needed).
# Request timeouts and reconnects are the frozen-learner test's subject, below.
REQUEST_TIMEOUT_S = 120
# learner/service.py expire_silent, from the learner's ledger: only an actor with
# outstanding tickets (granted, group not received) is named
_RELEASED_ACTOR1 = re.compile(r"actor 1 silent for \d+ s: released its (\d+) tickets")
_RELEASED_ACTOR0 = re.compile(r"actor 0 silent for \d+ s: released its (\d+) tickets")
_LOADED_ACTOR1 = re.compile(r"actor 1: weights v(\d+) loaded")  # actors/actor.py


def _poll(run: Run, cond, timeout: float, every: float = 0.02) -> bool:
    """Whether ``cond`` became true within ``timeout`` s (False, not an error, when the
    launcher exited first: the caller's assertions say what was missing)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if run.proc.poll() is not None or time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True


def _stall_actor1(run: Run, pid: int) -> dict:
    """SIGSTOP actor 1 while it holds a ticket, for 3 steps and more than 5 s, then
    SIGCONT; what the learner's ledger saw.

    When: after a fresh step, the moment actor 1 logs that it loaded that step's weights.
    Its weights load at a safe point (after its calls in flight drained), and right after
    it its slots are granted tickets at that version and generate with it: the step just
    published opened capacity, and a slot refused for its older weights asks again. A
    group of 8 x 192 tokens then takes about a second; on the 96 tokens spine.yaml allows
    (as sampling.max_response_tokens) it took ~0.4 s, which a later stop often missed.
    Whether it really held one is not guessed: the learner releases the tickets of an
    actor silent for ``actor_silent_s`` only if its ledger counts some outstanding, and
    logs it by actor (``held``). Such a group arrives after SIGCONT with tokens sampled
    3 versions back, past max_staleness=1: the learner's ledger drops it as stale
    (RUN_DIR/state.json, per actor: ``stale_after``, and ``late_dropped`` when this stall
    added to it)."""
    before = run.step()
    run.wait_for("a fresh step", lambda: run.step() > before, 120)
    fresh = run.step()

    def loaded() -> int:
        return max(map(int, _LOADED_ACTOR1.findall(run.role_log("actor1"))), default=-1)

    on_fresh = _poll(run, lambda: loaded() >= fresh, 60)
    # its slots ask for tickets and start generating: past the request's round trip (a
    # ticket granted whose reply is still unread is held but has no tokens yet), well
    # before the group's end
    time.sleep(0.15)
    releases = len(_RELEASED_ACTOR1.findall(run.role_log("learner")))
    stale = _stale(run)
    signal_group(pid, signal.SIGSTOP)
    stopped_at, t_stop = run.step(), time.time()
    try:
        run.wait_for("3 steps past the stall",
                     lambda: run.step() >= stopped_at + 3 and time.time() > t_stop + 5, 300)
    finally:
        signal_group(pid, signal.SIGCONT)
    stalled_s, resumed_at, t_cont = time.time() - t_stop, run.step(), time.time()
    held = len(_RELEASED_ACTOR1.findall(run.role_log("learner"))) > releases
    # the group it held arrives (finishing it takes seconds) and is dropped as stale; a
    # few steps without that drop (the ticket was granted but its reply not yet read when
    # it stopped: that group starts on new weights) leave steps for another try
    def dropped() -> bool:
        return _stale(run) > stale

    late = held and _poll(run, lambda: dropped() or (
        run.step() >= resumed_at + 3 and time.time() > t_cont + 10), 60, every=0.2)
    late = late and dropped()
    return {"fresh": fresh, "on_fresh_weights": on_fresh, "stopped_at": stopped_at,
            "stalled_s": round(stalled_s), "held": held, "stale_after": _stale(run),
            "late_dropped": late}


def _stale(run: Run) -> int:
    """Actor 1's groups dropped as stale so far, from the learner's run state."""
    return run.state().get("ledger", {}).get("1", {}).get("dropped", {}).get("stale", 0)


def test_killed_actor_restarts_and_a_stalled_one_only_loses_its_late_groups(tiny_model_dir,
                                                                           tmp_path):
    """SIGKILL actor 0 (vLLM): the learner keeps training on actor 1, the launcher restarts
    actor 0. SIGSTOP actor 1 for longer than the staleness bound (the first time while
    actor 0 is still restarting): actor 0 alone carries on once back (actor 1's tickets are
    released), and actor 1's late groups are dropped and counted.

    Actor 1 is stopped while it holds a ticket (``_stall_actor1``), and the stall is
    repeated (at most 3 times, while MAX_STEPS leaves room) until the learner's ledger
    shows actor 1's late group dropped as stale after it. (Tickets actor 0 held when it
    was killed may be released as "actor_silent" too: that counter alone does not tell
    that actor 1 held one.)"""
    # long groups (a random model rarely stops early): actors are busy generating, so a
    # stopped actor holds tickets (spine.yaml caps responses at 96 tokens: lift it too)
    run = Run(tmp_path / "run", tiny_model_dir, "actors.num=2", f"learner.max_steps={MAX_STEPS}",
              "rollout.mode=grpo", "rollout.group_size=8", "sampling.max_new_tokens=192",
              "sampling.max_response_tokens=192", "learner.batch_groups=2",
              # group slots: the stall is timed against a slot's grant right after a
              # weights load (_stall_actor1); the scheduler admits on its own clock (it
              # failed this way once in a clean-clone suite run). The chaos test kills
              # and stops actors that run the trajectory-level scheduler.
              "actors.max_inflight_trajectories=0", "actors.concurrent_groups=2",
              f"learner.actor_silent_s={SILENT_S}",
              "actors.restart_backoff_s=1", "actors.max_restarts=2",
              f"transport.timeout_s={REQUEST_TIMEOUT_S}")
    run.wait_for("step 2", lambda: run.step() >= 2, 400)
    first = run.pids()
    signal_group(first["actor0"], signal.SIGKILL)
    killed_at, t_kill = run.step(), time.time()
    run.wait_for("two steps without actor 0", lambda: run.step() >= killed_at + 2, 120)
    # the tickets the dead actor 0 held count against admission until the learner releases
    # them (silent for actor_silent_s): until then actor 1 may be refused for capacity, and
    # hold none. Either they are released (logged), or it had none (no line).
    _poll(run, lambda: _RELEASED_ACTOR0.search(run.role_log("learner")) is not None,
          t_kill + SILENT_S + 4 - time.time(), every=0.2)

    stalls = []
    while len(stalls) < 3 and run.step() + STALL_STEPS <= MAX_STEPS:
        stalls.append(_stall_actor1(run, first["actor1"]))
        if stalls[-1]["held"] and stalls[-1]["late_dropped"]:
            break
    summary = run.finish()

    assert summary["status"] == "ok" and summary["steps"] == MAX_STEPS
    assert summary["restarts"] == {"learner": 0, "actor0": 1, "actor1": 0}
    ev = [(e["event"], e["role"]) for e in run.events()]
    assert ("exit", "actor0") in ev and ("restart", "actor0") in ev, ev
    assert [e["code"] for e in run.events() if e["event"] == "exit"] == [-signal.SIGKILL]
    ledger = summary["ledger"]
    check_ledger(ledger)
    assert ledger["0"]["incarnations"] == 2 and ledger["1"]["incarnations"] == 1
    assert ledger["1"]["lost"] == 0
    assert ledger["1"]["dropped"].get("stale", 0) >= 1, (ledger, stalls)  # its late groups
    assert summary["learner"]["admission"]["released_actor_silent"] >= 1
    # a stall in which actor 1's own tickets were released, and its late group (sampled
    # before the stop) then dropped as stale: stale drops also happen without a stall
    # (groups finishing out of order), so the count above alone does not show it
    assert any(s["held"] and s["late_dropped"] for s in stalls), stalls
    # metrics.jsonl: the gap (the learner waits while actor 0 restarts and actor 1 is
    # stopped; fewer actors alive; actor 1 silent past actor_silent_s) and the recovery
    # (actor 0's new incarnation trained on, then actor 1 alive again)
    rows = [r for r in run.rows() if r["step"] > killed_at]
    svc = [r["service"] for r in rows]
    gap = max(range(len(rows)), key=lambda i: rows[i]["wait_s"])
    assert rows[gap]["wait_s"] > 5 and rows[gap]["actors_alive"] < 2, rows[gap]
    assert svc[gap]["actor1/silent_s"] > SILENT_S
    assert svc[gap]["actor0/incarnations"] == 2
    assert svc[-1]["actor0/trained"] > svc[gap]["actor0/trained"] >= svc[0]["actor0/trained"]
    assert rows[-1]["actors_alive"] == 2 and svc[-1]["actor1/trained"] > svc[gap]["actor1/trained"]
    assert [r["step"] for r in run.rows()] == list(range(1, MAX_STEPS + 1))
    # the restarted actor continued its prompt stream where the learner last saw it
    assert "continuing the prompt stream at position" in (run.dir / "logs" / "actor0.log"
                                                           ).read_text()
    print(f"\nkill+stall: actor0 killed at step {killed_at}, actor1 stalls {stalls}; "
          f"gap {rows[gap]['wait_s']:.0f} s before step {rows[gap]['step']}; "
          f"ledger {json.dumps(ledger)}")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_terminated_launcher_takes_its_processes_with_it(tiny_model_dir, tmp_path, sig):
    """The roles run in their own sessions, so a SIGTERM or SIGHUP to the launcher alone
    (a job scheduler, a closed terminal) must stop them: once it took only the launcher,
    and the learner and actors (vLLM engines included) trained on."""
    run = Run(tmp_path / "run", tiny_model_dir, "actors.num=2", "actors.engine=simulated",
              "learner.max_steps=10000")
    run.wait_for("step 1", lambda: run.step() >= 1, 300)
    pids = run.pids()
    run.proc.send_signal(sig)
    assert run.proc.wait(60) == 130, run.log()
    run.out.close()
    deadline = time.monotonic() + 10
    while not all(gone(p) for p in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = {name: p for name, p in pids.items() if not gone(p)}
    for p in left.values():  # do not leave them to the rest of the suite
        signal_group(p, signal.SIGKILL)
    assert not left, (left, run.log())
    summary = json.loads((run.dir / "summary.json").read_text())
    assert (summary["status"], summary["reason"]) == ("interrupted", sig.name)


def test_a_learner_frozen_past_the_request_timeout_loses_no_capacity(tiny_model_dir,
                                                                      tmp_path):
    """SIGSTOP the learner for several request timeouts (a network partition as the actors
    see it): their retried requests time out and are retried, and queued duplicates can be
    granted when it wakes up. The actors say Hello after the outage so that it releases
    the grants nobody waits for (else each flap leaks admission capacity for good)."""
    run = Run(tmp_path / "run", tiny_model_dir, "actors.num=2", "actors.engine=transformers",
              "learner.max_steps=12", "rollout.mode=grpo", "rollout.group_size=4",
              "transport.timeout_s=1.5", "learner.wait_timeout_s=60",
              # group slots: each holds at most one ticket, so the bound below is exact
              "actors.max_inflight_trajectories=0", "actors.concurrent_groups=4")
    run.wait_for("step 2", lambda: run.step() >= 2, 300)
    learner = run.pids()["learner"]
    signal_group(learner, signal.SIGSTOP)
    frozen_at = run.step()
    try:
        time.sleep(10)
    finally:
        signal_group(learner, signal.SIGCONT)
    summary = run.finish(timeout=200)
    assert summary["status"] == "ok" and summary["steps"] == 12
    assert summary["restarts"] == {"learner": 0, "actor0": 0, "actor1": 0}
    svc = summary["learner"]
    assert svc["events"].get("actor_reconnects", 0) >= 2, svc["events"]  # both actors
    # every ticket is trained, released with a reason, or held by a group in flight at the
    # end (at most concurrent_groups per actor): none leaked; a group trained without a
    # counted ticket is counted again (adopted), so started counts every trained group
    adm = svc["admission"]
    trained = sum(led["trained"] for led in summary["ledger"].values())
    assert adm.get("adopted", 0) == svc["events"].get("untracked", 0), (adm, svc["events"])
    assert 0 <= adm["started"] - trained <= 2 * 4, adm
    check_ledger(summary["ledger"])
    assert all(led["lost"] == 0 for led in summary["ledger"].values())
    logs = "".join((run.dir / "logs" / f"actor{i}.log").read_text() for i in (0, 1))
    assert "said hello again (the learner answers again)" in logs
    print(f"\nfrozen learner: 10 s at step {frozen_at}; admission {svc['admission']}")
