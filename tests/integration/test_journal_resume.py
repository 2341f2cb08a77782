"""Trees in flight survive their actor (actors/journal.py): SIGKILL an actor while its
journal holds a tree with a Python call in flight and a session with state, and the
launcher's restart finishes those trees instead of generating them again; then SIGKILL
every process of the run after a step past its last checkpoint, ``launch --resume``, and
SIGKILL every process again while the learner is inside a checkpoint write (held there by
``ARPO_FAULT_HOLD_CHECKPOINT``), and ``launch --resume``: every prompt is trained once.

A real run through the launcher (DeepSpeed learner, ZeroMQ, the Python sandbox with
sessions, ``tools.python.state=session``), one actor on the simulated engine (it starts in
seconds and writes a call on most rounds; ``actors.engine.python_code`` makes every call
count in its session: ``n`` goes 1, 2, 3 along a lineage, and restarts at 1 only if a
session lost its state). The kill is forced: the test reads the journal until it holds
what it wants, then kills. Checked against the journal as the kill left it: the
restarted actor resumed exactly its trees and tokens; every prompt was trained once (none
skipped, none twice); the resumed groups were trained with the tokens sampled before the
kill; and in every trained group (``learner.trees_every=1``) every leaf's Python results
read 1, 2, ... k, so the state set before the kill was read after it. The job kill:
the resumed learner rolls back the groups trained after its checkpoint, the actor draws
those prompts again (the Hello reply) after finishing its journal's trees, and over the
whole run no prompt is skipped or generated twice. The kill mid-write: the half-written
checkpoint is never loaded (both resumes start from the one before it) and the next write
removes it."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time

import pytest

from actors.journal import TreeJournal, journal_path
from arpo_async.core import rundir as R
from learner import checkpoint as C
from arpo_async.core.faults import FAULT_HOLD_CHECKPOINT
from tests.conftest import PY, REPO, python_env
from tests.integration.faultkit import Run, check_ledger, gone, signal_group

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CODE = "import time; n = globals().get('n') or 0; n += 1; time.sleep(1.0); print(n)"
STEPS = 10  # of 2 groups each, a checkpoint every 2


def _journal_trees(path, copy) -> dict:
    """The trees the journal at ``path`` holds, read through a copy ({} before it exists)."""
    return TreeJournal(shutil.copyfile(path, copy)).load() if path.is_file() else {}


def _holds_a_session_call(path) -> bool:
    """The journal has a trajectory whose calls are in flight and whose session kept an
    earlier call."""
    trees = _journal_trees(path, path.with_name("probe.bin"))
    return any(p.phase == "calls" and p.sessions.get("python") for t in trees.values()
               for p in t.paths.values())


def _leaf_results(tree: dict) -> list[list[int]]:
    """Each leaf's Python results, in order, from a trees/ file."""
    out = []
    for leaf in tree["leaves"]:
        nodes = sorted((n for n in tree["nodes"] if leaf["index"] in n["leaves"]),
                       key=lambda n: n["start"])
        text = "".join(p["text"] for n in nodes for p in n["parts"] if p["kind"] == "tool")
        out.append([int(x) for x in re.findall(r"<result>\s*(\d+)\s*</result>", text)])
    return out


def _kill_everything(run: Run) -> None:
    """SIGKILL the launcher (nothing restarts what follows), then every role's group."""
    roles = run.pids()
    run.proc.kill()
    run.proc.wait(30)
    run.out.close()
    for pid in roles.values():
        signal_group(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not all(gone(int(p)) for p in roles.values()) and time.monotonic() < deadline:
        time.sleep(0.1)


def test_a_killed_actor_then_killed_jobs_lose_no_tree_and_no_prompt(tiny_model_dir,
                                                                     tmp_path):
    run = Run(tmp_path / "run", tiny_model_dir, "actors.num=1", "actors.engine=simulated",
              f"actors.engine.python_code={json.dumps(CODE)}", "actors.engine.tokens_per_s=100",
              "actors.engine.tool_call_prob=0.8", "tools.enabled=[python]",
              "tools.python.state=session", "rollout.mode=arpo", "rollout.group_size=4",
              "rollout.initial_samples=2", "rollout.tool_call_limit=3",
              "sampling.round_max_tokens=64", "sampling.max_response_tokens=400",
              "actors.max_inflight_trajectories=8", f"learner.max_steps={STEPS}",
              "learner.batch_groups=2", "learner.trees_every=1", "actors.restart_backoff_s=1",
              "learner.checkpoint_every=2",
              # no group can be stale: this test checks the journal, not the staleness rule
              # (a resumed tree still in flight after STEPS more steps would be dropped)
              f"learner.max_staleness={STEPS}")
    live = journal_path(run.dir, 0)
    # a path's second call takes 1 s: the journal holds one long before the run ends
    # (whenever the kill comes, the restarted actor draws the trees it resumes first)
    run.wait_for("a tree with a call in flight in a session with state",
                 lambda: _holds_a_session_call(live), 300)
    signal_group(run.pids()["actor0"], signal.SIGKILL)
    # the restart backs off 1 s before it reads the file
    held = _journal_trees(live, tmp_path / "at_kill.bin")
    tokens = sum(t.model_tokens() for t in held.values())
    run.wait_for("the restarted actor", lambda: "resuming" in run.role_log("actor0"), 120)
    # the whole job, after an odd step (past the checkpoint of the even one before it), once
    # the resumed trees were trained with every token they carried over (metrics.jsonl; a
    # later job kill may roll their steps back: their prompts are then generated again)
    run.wait_for("an odd step from 3 with trees in flight, the resumed tokens trained",
                 lambda: run.step() >= 3 and run.step() % 2 == 1 and
                 sum(r["rollout/resumed_tokens"] for r in run.rows()) >= tokens and
                 bool(_journal_trees(live, tmp_path / "p.bin")), 300)
    resumed = sum(r["rollout/resumed_tokens"] for r in run.rows())
    killed_at = run.step()
    _kill_everything(run)
    job = _journal_trees(live, tmp_path / "at_job_kill.bin")
    # resumed, the whole job killed again while the learner writes its next checkpoint (its
    # weights and optimizer state in the partial folder, nothing committed): the next
    # resume starts from the same checkpoint as this one
    resumed_from = C.read_meta(R.latest_checkpoint(run.dir))["step"]
    hold = resumed_from + 2
    assert hold <= STEPS, (killed_at, resumed_from)
    mid = Run(run.dir, None, env={FAULT_HOLD_CHECKPOINT: str(hold)})
    mid.wait_for(f"the checkpoint of step {hold} half written",
                 lambda: f"holding the checkpoint of step {hold}" in run.role_log("learner"),
                 300)
    partial = list(R.checkpoints_dir(run.dir).glob(".partial-*"))
    assert partial and (partial[0] / "model.safetensors").is_file(), partial
    _kill_everything(mid)
    mid_write = _journal_trees(live, tmp_path / "at_write_kill.bin")
    res = subprocess.run([PY, "-m", "arpo_async.launch", "--quiet", "--resume", str(run.dir)],
                         cwd=REPO, env=python_env(), capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run.dir / "summary.json").read_text())

    assert summary["status"] == "ok" and summary["steps"] == STEPS
    sessions = sum(bool(p.sessions.get("python")) for t in held.values()
                   for p in t.paths.values() if p.phase != "done")
    assert held and tokens > 0 and sessions >= 1
    log = run.role_log("actor0")  # both incarnations after the kills append to it
    assert (f"resuming {len(held)} trees left in flight (positions {sorted(held)}, "
            f"{tokens} model tokens)") in log, log[-2000:]
    ledger = summary["ledger"]
    check_ledger(ledger)
    # exactly once over the whole run: none skipped, none generated twice (a group the
    # learner holds is never sent again: the journal retires a group in the same step of
    # the event loop as its send returns), the rolled back ones trained again
    prompts = ledger["0"]["prompts"]
    assert prompts["skipped"] == 0 and prompts["duplicates"] == 0, prompts
    dropped = ledger["0"]["dropped"]
    assert dropped.get("rolled_back", 0) >= 1 and "stale" not in dropped, ledger
    for kept in (job, mid_write):
        kept_tokens = sum(t.model_tokens() for t in kept.values())
        assert not kept or (f"resuming {len(kept)} trees left in flight (positions "
                            f"{sorted(kept)}, {kept_tokens} model tokens)") in log, log[-2000:]
    # the half-written checkpoint was never loaded: both resumes started from the one
    # before it, and the next write removed the partial folder
    resumes = re.findall(r"resumed from \S+: step (\d+)", run.role_log("learner"))
    assert resumes == [str(resumed_from)] * 2, resumes
    assert not list(R.checkpoints_dir(run.dir).glob(".partial-*"))
    # every trained group's leaves: the sessions counted on across both kills
    trees = [json.loads(p.read_text()) for p in sorted((run.dir / "trees").glob("*.json"))]
    results = [r for tree in trees for r in _leaf_results(tree)]
    assert sum(map(len, results)) >= 8
    assert all(r == list(range(1, len(r) + 1)) for r in results), results
    print(f"\njournal: actor kill {len(held)} trees, {tokens} model tokens, {sessions} live "
          f"trajectories with a session; job kill at step {killed_at}, {len(job)} trees; "
          f"job kill in the checkpoint write of step {hold}, {len(mid_write)} trees; "
          f"prompts {prompts}; dropped {dropped}; resumed tokens trained {resumed}")


def test_a_resumed_tree_past_the_staleness_bound_is_generated_again(tiny_model_dir, tmp_path):
    """Actor 0 is stopped (SIGSTOP) with sampled tokens in its journal, held until the
    learner, training actor 1's groups, is more than ``max_staleness`` versions past the
    newest of its trees' oldest tokens, then SIGKILLed (actor 1 stopped until the restart
    drew them): the restart generates each of those trees again from its prompt instead
    of finishing a group the learner would drop "stale" (without the rule it finishes
    them: no such line in its log), and no prompt is skipped or trained twice. (Whether a
    later group of actor 0 is dropped stale depends on the machine's load: not checked.)"""
    run = Run(tmp_path / "run", tiny_model_dir, "actors.num=2", "actors.engine=simulated",
              "actors.engine.tool_call_prob=0.8", "tools.enabled=[python]",
              "rollout.mode=arpo", "rollout.group_size=4", "rollout.initial_samples=2",
              "rollout.tool_call_limit=2", "sampling.round_max_tokens=32",
              "sampling.max_response_tokens=200", "actors.max_inflight_trajectories=8",
              "learner.max_staleness=1", "learner.batch_groups=2", "learner.max_steps=16",
              "learner.actor_silent_s=3", "actors.restart_backoff_s=1")
    live, probe = journal_path(run.dir, 0), tmp_path / "probe.bin"
    run.wait_for("sampled tokens in actor 0's journal", lambda: any(
        t.versions()[0] >= 0 for t in _journal_trees(live, probe).values()), 300)
    actor0 = run.pids()["actor0"]
    signal_group(actor0, signal.SIGSTOP)
    held = _journal_trees(live, tmp_path / "at_stop.bin")
    sampled = sorted(pos for pos, t in held.items() if t.versions()[0] >= 0)
    past = max(held[pos].versions()[0] for pos in sampled) + 2  # every one lags 2 or more
    run.wait_for(f"the learner at v{past} on actor 1's groups", lambda: run.step() >= past, 300)
    # actor 1 stopped too until actor 0 is back and has drawn its trees: the run cannot end
    # first (a loaded machine's restart is slow)
    actor1 = run.pids()["actor1"]
    signal_group(actor1, signal.SIGSTOP)
    signal_group(actor0, signal.SIGKILL)

    def again() -> list[int]:
        return sorted(int(p) for p in re.findall(
            r"tree at position (\d+) holds tokens of v\d+-v\d+, stale at learner v\d+: "
            r"generated again", run.role_log("actor0")))

    run.wait_for("the restarted actor 0 drawing its trees", lambda: len(again()) >= len(sampled),
                 180)
    signal_group(actor1, signal.SIGCONT)
    summary = run.finish(timeout=300)

    assert summary["status"] == "ok", summary
    assert again() == sampled, (again(), sampled, run.role_log("actor0")[-2000:])
    check_ledger(summary["ledger"])
    prompts, dropped = summary["ledger"]["0"]["prompts"], summary["ledger"]["0"]["dropped"]
    assert prompts["skipped"] == 0 and prompts["duplicates"] == 0, prompts
    print(f"\nstale resume: {len(held)} trees held, {len(sampled)} with sampled tokens "
          f"generated again at learner v{past}+; actor 0 prompts {prompts}, dropped {dropped}")
