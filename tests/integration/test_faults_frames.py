"""Hostile frames at the learner's trajectory socket (issue 7): 10,000 fuzzed frame lists
(random bytes, truncated or lying headers, wrong versions, kinds and types, oversized
messages, groups that decode but must not be trained on) while the learner trains, then
an actor that keeps dying until it is given up. Every frame is counted as rejected and
the other actor carries the run to its end."""

from __future__ import annotations

import signal
import time

import msgpack
import numpy as np
import pytest
import yaml

from tests.integration.faultkit import Run, check_ledger, signal_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

FUZZ_FRAMES = 10_000
MAX_MB = 8  # transport.max_message_mb of the fuzz run


def _valid_group_frames(rng: np.random.Generator) -> list[bytes]:
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup, encode

    n = int(rng.integers(1, 20))
    leaf = Trajectory(tokens=rng.integers(0, 100, n, dtype=np.int32),
                      loss_mask=np.ones(n, np.uint8), logprobs=-rng.random(n, np.float32),
                      versions=np.zeros(n, np.int32))
    group = TrajectoryGroup("fuzz", 0, "p", np.arange(1, 5, dtype=np.int32), [leaf])
    return [bytes(f) for f in encode(group)]


def _with_header(frames: list[bytes], change) -> list[bytes]:
    header = msgpack.unpackb(frames[0], raw=False)
    change(header)
    return [msgpack.packb(header, use_bin_type=True)] + frames[1:]


def _bad_semantics(rng: np.random.Generator, kind: int) -> list[bytes]:
    """Groups that decode but must not be trained on (learner/service.py check_group)."""
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup, encode

    n = 8
    fields = dict(tokens=np.arange(1, n + 1, dtype=np.int32), loss_mask=np.ones(n, np.uint8),
                  logprobs=np.full(n, -1.0, np.float32), versions=np.zeros(n, np.int32))
    bad = [{"tokens": np.full(n, 10**6, np.int32)}, {"tokens": np.full(n, -5, np.int32)},
           {"logprobs": np.full(n, np.nan, np.float32)}, {"loss_mask": np.full(n, 7, np.uint8)},
           {"parent": 0, "branch_point": 2}, {"reward": float("nan")},
           {"versions": np.full(n, -9, np.int32)}][kind % 7]
    group = TrajectoryGroup("fuzz", 0, "p", np.arange(1, 4, dtype=np.int32),
                            [Trajectory(**(fields | bad))])
    return [bytes(f) for f in encode(group)]


def fuzz_frames(rng: np.random.Generator, i: int) -> list[bytes]:
    """Frame list number ``i``: every one of them must be rejected."""
    kind = i % 10
    if kind == 0:  # random bytes
        return [rng.bytes(int(rng.integers(0, 300))) for _ in range(int(rng.integers(1, 4)))]
    frames = _valid_group_frames(rng)
    if kind == 1:  # truncated header
        return [frames[0][:int(rng.integers(0, len(frames[0])))]] + frames[1:]
    if kind == 2:  # a frame missing or one too many
        return frames[:-1] if rng.random() < 0.5 else frames + [b"extra"]
    if kind == 3:  # wrong protocol version
        bad = [0, 2, 99, -1, "1", 1.0, True, None][int(rng.integers(0, 8))]
        return _with_header(frames, lambda h: h.__setitem__("p", bad))
    if kind == 4:  # unknown kind
        return _with_header(frames, lambda h: h.__setitem__("kind", f"kind{i}"))
    if kind == 5:  # wrong types in valid msgpack
        key, wrong = [("group_id", [7, 1.5, None, [1]]), ("actor_id", ["0", 1.5, None, True]),
                      ("prompt_id", [3, None, {"a": 1}, b"p"]),
                      ("leaves", [5, "x", None, {"a": 1}, [1, 2]]),
                      ("created_at", ["now", None, [1.0], True])][i % 5]
        value = wrong[int(rng.integers(0, len(wrong)))]
        return _with_header(frames, lambda h: h["body"].__setitem__(key, value))
    if kind == 6:  # array specs lying about sizes
        return _with_header(frames, lambda h: h["arrays"][1].__setitem__(
            2, [int(rng.integers(21, 10**6))]))
    if kind == 7:  # oversized: over max_message_mb, under libzmq's hard limit (2x)
        if i % 500 == 7:
            return [rng.bytes(int(MAX_MB * 2**20 * 1.2))]
        return [frames[0][:int(rng.integers(1, len(frames[0])))]]  # keep the run fast
    if kind == 8:  # a valid message of the wrong kind for this socket
        from arpo_async.core.protocol import Hello, encode

        return [bytes(f) for f in encode(Hello(actor_id=0, pid=i))]
    return _bad_semantics(rng, i)


def test_fuzzed_frames_and_an_actor_that_keeps_dying_leave_training_going(tiny_model_dir,
                                                                          tmp_path):
    """10,000 hostile frames at the trajectory socket while the learner trains, then actor
    1 SIGKILLed twice with actors.max_restarts=1: every frame is counted as rejected, actor
    1 is given up with a reason, and actor 0 carries the run to learner.max_steps."""
    run_dir = tmp_path / "run"
    run = Run(run_dir, tiny_model_dir, "actors.num=2", "actors.engine=transformers",
              "learner.max_steps=24", "rollout.mode=grpo", "rollout.group_size=4",
              f"transport.max_message_mb={MAX_MB}", "actors.max_restarts=1",
              "actors.restart_backoff_s=0.5", "learner.actor_silent_s=3")
    run.wait_for("step 1", lambda: run.step() >= 1, 300)
    import zmq

    port = yaml.safe_load((run_dir / "config.yaml").read_text())["transport"]["trajectory_port"]
    rng = np.random.default_rng(7)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.sndhwm = 100
    sock.linger = 10_000
    sock.connect(f"tcp://127.0.0.1:{port}")
    t0, sent_at_step = time.time(), run.step()
    for i in range(FUZZ_FRAMES):
        sock.send_multipart(fuzz_frames(rng, i))
    sock.close()
    ctx.term()  # waits (linger) until every frame left
    fuzz_s, fuzz_end_step = time.time() - t0, run.step()
    for _ in range(2):  # the first death is restarted, the second is one too many
        pid = run.pids()["actor1"]
        signal_group(pid, signal.SIGKILL)
        run.wait_for("actor 1 handled", lambda p=pid: run.pids()["actor1"] != p
                     or any(e["event"] == "give_up" for e in run.events()), 60)
    summary = run.finish()

    assert summary["status"] == "ok" and summary["steps"] == 24
    assert fuzz_end_step < 24  # the frames arrived while the learner trained
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
