"""Crash and resume with the journal of trees in flight (actors/journal.py).

Real launcher runs (DeepSpeed learner, ZeroMQ, the Python sandbox with sessions,
``tools.python.state=session``, ARPO branching) whose actors run the simulated engine
(they start in seconds; every Python call counts in its session and sleeps
``--call-s``, so calls are in flight at any moment). Three measurements:

1. **actor_kill** (``--repeats`` runs): SIGKILL an actor while its journal holds a tree
   with a call in flight in a session with state; the launcher restarts it.
   ``tokens_kept`` = model tokens the restarted actor carried over and the learner
   trained (``rollout/resumed_tokens`` summed over metrics.jsonl) / model tokens of the
   trees in flight as the journal held them at the kill (every round they had completed;
   the rounds in progress at the kill, at most one per live trajectory, are counted apart
   as ``rounds_lost``: no journal can keep a round the engine has not returned).
2. **job_kill**: SIGKILL every process of a run (the launcher first, then the learner's
   and the actors' process groups) after a step past its last checkpoint (so that the
   resumed learner rolls groups back), with trees in flight, then
   ``launch --resume RUN_DIR``: the prompts skipped and the prompts generated twice
   (dropped as duplicates: never trained twice) over the whole run, from summary.json.
3. **journal overhead**: the same run with ``actors.journal=false`` and ``true``
   (A-B-B-A): the actor's tokens/s each way, and the share of the actor's wall time spent
   writing its journal (``journal/write_s`` / ``elapsed_s``, the event loop's own cost;
   the simulated engine makes tokens faster than vLLM on this machine, so the share is an
   upper bound of a vLLM actor's).

Last line: ``RESULT crash_resume tokens_kept=<x> prompts_skipped=<n> prompts_duplicated=<m>
journal_overhead=<r> target=tokens_kept>=0.95,prompts_skipped=0,prompts_duplicated=0 met|missed``.

    python bench/crash_resume.py [--out runs/bench_crash_resume] [--repeats 2]
        [--max-staleness 4] [--batch-groups 4] [--call-s 1.0] [--results FILE]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from actors.journal import TreeJournal, journal_path  # noqa: E402
from arpo_async.core.metrics import read_metrics  # noqa: E402
from arpo_async.jobs.chaos_faults import gone, signal_group  # noqa: E402
from common import write_results  # noqa: E402

PY = sys.executable


def overrides(args, run_dir: Path, model: Path, journal: bool = True, steps: int = 8) -> list:
    code = (f"import time; n = globals().get('n') or 0; n += 1; time.sleep({args.call_s}); "
            "print(n)")
    return [f"run.dir={run_dir}", f"model.path={model}", f"actors.num={args.actors}",
            "actors.engine=simulated", f"actors.engine.python_code={json.dumps(code)}",
            "actors.engine.tokens_per_s=100", "actors.engine.tool_call_prob=0.8",
            "tools.enabled=[python]", "tools.python.state=session", "rollout.mode=arpo",
            "rollout.group_size=4", "rollout.initial_samples=2", "rollout.tool_call_limit=3",
            "sampling.round_max_tokens=64", "sampling.max_response_tokens=400",
            "actors.max_inflight_trajectories=8", f"learner.max_steps={steps}",
            f"learner.batch_groups={args.batch_groups}", "learner.checkpoint_every=4",
            "actors.restart_backoff_s=1", f"learner.max_staleness={args.max_staleness}",
            f"actors.journal={str(journal).lower()}"]


def launch(argv: list, out: Path) -> subprocess.Popen:
    return subprocess.Popen([PY, "-m", "arpo_async.launch", "--quiet", "--config",
                             str(ROOT / "configs" / "spine.yaml"), *argv], cwd=ROOT,
                            stdout=out.open("w"), stderr=subprocess.STDOUT)


def wait_for(proc, cond, timeout: float, what: str) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None or time.monotonic() > end:
            raise SystemExit(f"{what}: not reached (launcher {proc.poll()})")
        time.sleep(0.1)


def journal_now(path: Path) -> dict:
    """The trees an actor's journal holds now (read through a copy; {} before it exists)."""
    if not path.is_file():
        return {}
    probe = path.with_name("probe.bin")
    shutil.copyfile(path, probe)
    return TreeJournal(probe).load()


def session_call_in_flight(path: Path) -> bool:
    return any(p.phase == "calls" and p.sessions.get("python")
               for t in journal_now(path).values() for p in t.paths.values())


def step(run_dir: Path) -> int:
    rows = read_metrics(run_dir)
    return rows[-1]["step"] if rows else 0


def actor_kill(args, model: Path, out: Path, i: int) -> dict:
    run_dir = out / f"actor_kill{i}"
    proc = launch(overrides(args, run_dir, model), out / f"actor_kill{i}.out")
    live = journal_path(run_dir, 0)
    wait_for(proc, lambda: step(run_dir) >= 1 + i and session_call_in_flight(live), 300,
             "a call in flight in a session with state")
    pid = json.loads((run_dir / "processes.json").read_text())["actor0"]
    signal_group(pid, signal.SIGKILL)
    at_kill = out / f"actor_kill{i}.bin"
    shutil.copyfile(live, at_kill)
    held = TreeJournal(at_kill).load()
    proc.wait(600)
    summary = json.loads((run_dir / "summary.json").read_text())
    held_tokens = sum(t.model_tokens() for t in held.values())
    trained = sum(r.get("rollout/resumed_tokens", 0) for r in read_metrics(run_dir))
    live_paths = sum(p.phase == "round" for t in held.values() for p in t.paths.values())
    row = {"trees": len(held), "tokens_held": held_tokens, "tokens_trained": trained,
           "rounds_lost": live_paths, "sessions": sum(bool(p.sessions.get("python"))
                                                    for t in held.values()
                                                    for p in t.paths.values()),
           "prompts": summary.get("prompts", {}), "status": summary["status"]}
    print(f"actor_kill {i}: {json.dumps(row)}", flush=True)
    return row


def job_kill(args, model: Path, out: Path) -> dict:
    run_dir = out / "job_kill"
    proc = launch(overrides(args, run_dir, model, steps=14), out / "job_kill.out")
    wait_for(proc, lambda: 5 <= step(run_dir) < 12 and step(run_dir) % 4 and
             bool(journal_now(journal_path(run_dir, 0))), 300,
             "a step past a checkpoint (every 4 steps) with trees in flight")
    roles = json.loads((run_dir / "processes.json").read_text())
    proc.kill()  # the launcher first: nothing restarts what follows
    for pid in roles.values():
        signal_group(int(pid), signal.SIGKILL)
    deadline = time.monotonic() + 30
    while not all(gone(int(p)) for p in roles.values()) and time.monotonic() < deadline:
        time.sleep(0.1)
    killed_at = step(run_dir)
    held = TreeJournal(shutil.copyfile(journal_path(run_dir, 0), out / "job_kill.bin")).load()
    resumed = subprocess.run([PY, "-m", "arpo_async.launch", "--quiet", "--resume",
                              str(run_dir)], cwd=ROOT, capture_output=True, text=True,
                             timeout=900)
    summary = json.loads((run_dir / "summary.json").read_text())
    row = {"killed_at_step": killed_at, "trees_held": len(held), "resume_rc": resumed.returncode,
           "status": summary["status"], "steps": summary["steps"],
           "prompts": summary.get("prompts", {}),
           "dropped": {a: led["dropped"] for a, led in summary["ledger"].items()},
           "resumed_tokens_trained": sum(r.get("rollout/resumed_tokens", 0)
                                         for r in read_metrics(run_dir))}
    print(f"job_kill: {json.dumps(row)}", flush=True)
    return row


def overhead(args, model: Path, out: Path) -> dict:
    rows = []
    for k, journal in enumerate((False, True, True, False)):
        run_dir = out / f"overhead{k}"
        proc = launch(overrides(args, run_dir, model, journal, steps=args.overhead_steps),
                      out / f"overhead{k}.out")
        proc.wait(900)
        learner = json.loads((run_dir / "summary.json").read_text())["learner"]
        rows.append({"journal": journal, "tokens_per_s": learner["actor0/tokens_per_s"],
                     "write_share": (learner.get("actor0/journal/write_s", 0.0)
                                     / learner["actor0/elapsed_s"])})
        print(f"overhead {k}: {json.dumps(rows[-1])}", flush=True)
    on = [r["tokens_per_s"] for r in rows if r["journal"]]
    off = [r["tokens_per_s"] for r in rows if not r["journal"]]
    return {"runs": rows, "tokens_per_s_on": on, "tokens_per_s_off": off,
            "on_vs_off": sum(on) / sum(off),
            "write_share": max(r["write_share"] for r in rows if r["journal"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="runs/bench_crash_resume", help="the runs' folder")
    ap.add_argument("--results", default=None, help="figures (default "
                    "bench/results/crash_resume.json)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--actors", type=int, default=1)
    ap.add_argument("--call-s", type=float, default=1.0)
    # steps of 4 groups and a bound of 4 versions: a window (20 groups) larger than the
    # groups an actor has in flight (8-10 here), so that what the journal keeps is what
    # is measured; with a bound of 2 (12 groups) trees already old at the kill can pass
    # the bound before they are done (bench/README.md: both)
    ap.add_argument("--batch-groups", type=int, default=4)
    ap.add_argument("--max-staleness", type=int, default=4)
    ap.add_argument("--overhead-steps", type=int, default=8)
    args = ap.parse_args()
    out = (ROOT / args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    from arpo_async.jobs.tiny_model import build_tiny_model

    model = Path(build_tiny_model(out / "tiny"))
    kills = [actor_kill(args, model, out, i) for i in range(args.repeats)]
    job = job_kill(args, model, out)
    cost = overhead(args, model, out)
    kept = sum(r["tokens_trained"] for r in kills) / max(sum(r["tokens_held"] for r in kills), 1)
    prompts = [job["prompts"], *(r["prompts"] for r in kills)]
    skipped = sum(p.get("skipped", 0) for p in prompts)
    duplicated = sum(p.get("duplicates", 0) for p in prompts)
    result = {"actor_kill": kills, "job_kill": job, "overhead": cost, "tokens_kept": kept,
              "prompts_skipped": skipped, "prompts_duplicated": duplicated}
    path = write_results("crash_resume", {"args": vars(args), **result}, args.results)
    print(f"tokens kept {kept:.3f} over {len(kills)} actor kills; job kill + --resume: "
          f"prompts {job['prompts']}; actor tokens/s with the journal / without "
          f"{cost['on_vs_off']:.3f}; journal writes {cost['write_share']:.4f} of the actor's "
          f"time; wrote {path}")
    met = kept >= 0.95 and skipped == 0 and duplicated == 0
    print(f"RESULT crash_resume tokens_kept={kept:.3f} prompts_skipped={skipped} "
          f"prompts_duplicated={duplicated} journal_overhead={cost['write_share']:.4f} "
          f"target=tokens_kept>=0.95,prompts_skipped=0,prompts_duplicated=0 "
          f"{'met' if met else 'missed'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
