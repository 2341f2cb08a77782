"""The delta weight channel through real processes: a DeepSpeed learner training in
bfloat16 and two actors serving in bfloat16, ``learner.weight_sync.channel=delta``. The
actors run the transformers engine (seconds to start, where a vLLM actor's restart alone
took 25-30 s of this test's 90-145 s); vLLM in bf16 and its bf16 updates are
tests/integration/test_engines.py's, and the channel hands every engine the same
``update_weights`` call.

Each fault is forced, not timed (fault points in arpo_async/core/weights/delta.py and
actors/actor.py):

- actor 0's first step to v3 or later is corrupted after it arrives: its checksum fails
  and a full copy follows;
- actor 1 kills itself right after its first step to v2 or later: it restarts with no
  copy of its own, between a delta and the next full copy;
- actor 0 then stops itself (SIGSTOP) on a ticket for v4 or later, so the run can only
  go on with actor 1's second incarnation, which loads a full copy and then steps again;
  once it has loaded three versions past the one it died at, the test lets actor 0 go on.

Every version each actor probes gives the learner's log-probs for that version, nearer
to it than to the versions beside it."""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import numpy as np
import pytest

from actors.actor import FAULT_STOP_AFTER_GRANT
from arpo_async.core.weights.delta import FAULT_CORRUPT_DELTA, FAULT_KILL_AFTER_DELTA
from tests.integration.faultkit import Run, check_ledger, signal_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STEPS = 14
ATOL = 1e-2  # bf16 engines against the learner's (vLLM: 2e-3 to 4e-3 measured)


def _probes(run_dir: Path, actor: int) -> list[dict]:
    path = run_dir / f"actor{actor}_probe.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _group(pgid: int) -> list[int]:
    """The live processes of process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _pid(run: Run, role: str) -> int | None:
    return run.pids().get(role) if (run.dir / "processes.json").exists() else None


def _stopped(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"
    except (FileNotFoundError, IndexError):
        return False


def test_corrupted_and_restarted_actors_end_in_the_learners_weights(tiny_model_dir, tmp_path):
    env = {FAULT_CORRUPT_DELTA: "0:3", FAULT_KILL_AFTER_DELTA: "1:2",
           FAULT_STOP_AFTER_GRANT: "0:4"}
    run = Run(tmp_path / "run", tiny_model_dir, "model.dtype=bfloat16",
              "actors.engine=transformers",
              "learner.weight_sync.channel=delta", "learner.lr=1e-3",
              f"learner.max_steps={STEPS}", "learner.max_staleness=0", "actors.num=2",
              "actors.max_restarts=2", "actors.restart_backoff_s=0.5",
              "learner.actor_silent_s=4", "transport.request_timeout_s=120",
              "learner.batch_groups=2", "run.probe_logprobs=true", env=env)
    try:
        run.wait_for("actor 0 stopped on a v4 ticket",
                     lambda: _stopped(_pid(run, "actor0")), 300)
        stopped = _pid(run, "actor0")
        killed = run.dir / "fault_kill_after_delta.actor1"  # says the version it died at
        run.wait_for("actor 1 back, with three versions loaded after it died", lambda: (
            killed.exists() and len([p for p in _probes(run.dir, 1)
                                     if p["version"] > int(killed.read_text().split()[0])])
            >= 3), 300)
    finally:
        if "stopped" in locals():
            signal_group(stopped, signal.SIGCONT)
    summary = run.finish(timeout=300)
    assert summary["status"] == "ok" and summary["steps"] == STEPS
    check_ledger(summary["ledger"])
    learner = {r["version"]: r["logprobs"] for r in map(
        json.loads, (run.dir / "learner_probe.jsonl").read_text().splitlines())}
    probed = {}
    for actor in (0, 1):
        probed[actor] = sorted({p["version"] for p in _probes(run.dir, actor)})
        for p in _probes(run.dir, actor):  # the engine in bf16 against the learner's in bf16
            v = p["version"]
            err = {w: np.abs(np.subtract(p["logprobs"], learner[w])).max()
                   for w in (v - 1, v, v + 1) if w in learner}
            # the learner's own version, and nearer to it than to the versions beside it
            assert err[v] < ATOL and err[v] == min(err.values()), (actor, v, err)
    assert len(probed[0]) >= 2, probed
    figures = summary["learner"]  # the actors' last counters (their last incarnation)
    assert figures["actor1/incarnations"] == 2
    # the launcher killed what the dead actor left in its process group (with vLLM, its
    # engine core and worker)
    dead = int(killed.read_text().split()[1])
    assert not _group(dead), "processes of the killed actor's group live on"
    # actor 1's second incarnation: one full copy, then steps again
    assert figures["actor1/weights/fulls"] >= 1 and figures["actor1/weights/steps"] >= 2
    # actor 0: a full copy at the start, the corrupted step refused, a full copy after it
    # (and another whenever it came back from its stop more than keep versions behind)
    assert figures["actor0/weights/rejected"] == 1 and figures["actor0/weights/fulls"] >= 2
    assert re.search(r"delta to v([3-9]|\d\d) refused \(checksum", run.role_log("actor0"))
    served = json.loads((run.dir / "learner_summary.json").read_text())["service"]["weights"]
    assert served["delta"]["steps_served"] >= STEPS and served["delta"]["full_served"] >= 4
    assert served["zmq"]["requests"] == 0  # every actor used the delta channel
