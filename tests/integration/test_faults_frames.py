"""Hostile frames at the learner's trajectory socket (issue 7): 10,000 fuzzed frame lists
(random bytes, truncated or lying headers, wrong versions, kinds and types, oversized
messages, groups that decode but must not be trained on) in the middle of a run (its
actors stopped meanwhile, so that the run cannot end first on a loaded machine), then an
actor that keeps dying until it is given up. Every frame is counted as rejected and
the other actor carries the run to its end."""

from __future__ import annotations

import signal
import time

import numpy as np
import pytest
import yaml

from arpo_async.jobs.chaos_faults import fuzz_frames  # shared with the chaos soak
from tests.integration.faultkit import Run, check_ledger, signal_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FUZZ_FRAMES = 10_000
MAX_MB = 8  # transport.max_message_mb of the fuzz run
STEPS = 18  # learner.max_steps: the frames are in by step ~6, actor 1 given up by ~8
# transport.request_timeout_s: the learner waits this long at the end for the Bye of actor 1,
# which it gave up on (the default 30 s was half of this test's time); actors' requests
# time out and are retried after it (test_faults_processes.py runs with 1.5 s)
TIMEOUT_S = 5


def test_fuzzed_frames_and_an_actor_that_keeps_dying_leave_training_going(tiny_model_dir,
                                                                          tmp_path):
    """10,000 hostile frames at the trajectory socket in the middle of the run, then actor
    1 SIGKILLed twice with actors.max_restarts=1: every frame is counted as rejected, actor
    1 is given up with a reason, and actor 0 carries the run to learner.max_steps."""
    run_dir = tmp_path / "run"
    run = Run(run_dir, tiny_model_dir, "actors.num=2", "actors.engine=transformers",
              f"learner.max_steps={STEPS}", "rollout.mode=grpo", "rollout.group_size=4",
              f"transport.max_message_mb={MAX_MB}", f"transport.request_timeout_s={TIMEOUT_S}",
              "actors.max_restarts=1", "actors.restart_backoff_s=0.5", "learner.actor_silent_s=3")
    run.wait_for("step 1", lambda: run.step() >= 1, 300)
    import zmq

    port = yaml.safe_load((run_dir / "config.yaml").read_text())["transport"]["trajectory_port"]
    rng = np.random.default_rng(7)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.sndhwm = 100
    sock.linger = 10_000
    sock.connect(f"tcp://127.0.0.1:{port}")
    # both actors stopped while the frames go in: the run cannot end before they are in,
    # however slowly a loaded machine lets the learner read them (admission bounds the
    # groups out to (max_staleness + 1) * batch_groups, a step or two); the learner keeps
    # its loop, and trains what it holds
    actors = [run.pids()[f"actor{i}"] for i in (0, 1)]
    for pid in actors:
        signal_group(pid, signal.SIGSTOP)
    t0, sent_at_step = time.time(), run.step()
    for i in range(FUZZ_FRAMES):
        sock.send_multipart(fuzz_frames(rng, i, MAX_MB))
    sock.close()
    ctx.term()  # waits (linger) until every frame left
    fuzz_s, fuzz_end_step = time.time() - t0, run.step()
    for pid in actors:
        signal_group(pid, signal.SIGCONT)
    run.wait_for("a step after the frames", lambda: run.step() > fuzz_end_step, 120)
    for _ in range(2):  # the first death is restarted, the second is one too many
        pid = run.pids()["actor1"]
        signal_group(pid, signal.SIGKILL)
        run.wait_for("actor 1 handled", lambda p=pid: run.pids()["actor1"] != p
                     or any(e["event"] == "give_up" for e in run.events()), 60)
    summary = run.finish()

    assert summary["status"] == "ok" and summary["steps"] == STEPS
    assert fuzz_end_step <= sent_at_step + 2  # the frames were in before the run could end
    rejected = {k: v for k, v in summary["learner"]["rejected"].items()
                if not k.startswith("control/")}
    assert sum(rejected.values()) == FUZZ_FRAMES, rejected
    for reason in ("not_msgpack", "frame_count", "bad_version", "unknown_kind", "bad_field",
                   "bad_size", "too_large", "wrong_kind", "group/token_id", "group/logprobs",
                   "group/tree"):
        assert rejected.get(reason, 0) > 0, (reason, rejected)
    give_up = [e for e in run.events() if e["event"] == "give_up"]
    assert len(give_up) == 1 and give_up[0]["role"] == "actor1"
    assert "after 1 restarts; giving up" in give_up[0]["reason"]
    assert "giving up" in (tmp_path / "run.out").read_text()
    assert summary["restarts"]["actor1"] == 1
    ledger = summary["ledger"]
    check_ledger({"0": ledger["0"]})  # actor 1 never said bye: its totals are open
    assert ledger["0"]["lost"] == 0
    print(f"\nfuzz: {FUZZ_FRAMES} frames in {fuzz_s:.1f} s during steps {sent_at_step}-"
          f"{fuzz_end_step}: {rejected}; actor1 given up: {give_up[0]['reason']}")
