"""The verdict of a chaos soak (arpo_async/jobs/chaos.py), computed from the run's own
records only: summary.json, metrics.jsonl, state.json, learner_summary.json,
events.jsonl, the checkpoints, the tool cache, RUN_DIR/chaos.jsonl (what was injected,
when) and /proc.

Checks (each a row of the table and of RUN_DIR/chaos_verdict.json):

- ``finished``: the last launcher exited 0 with summary status "ok", and the learner
  wrote its summary (it ended at ``learner.max_steps`` or ``run.time_limit_s``).
- ``longest_gap``: the longest stretch between two learner steps (metrics.jsonl times)
  against its bound. Faults that overlap add up, so each gap has its own bound:
  ``step_s + learner.actor_silent_s + sum(cost of the faults acting during the gap)``.
  A fault acts from its injection for as long as it lasts (``fault_effect``), so one
  injected just before a gap counts too: ``restart_s = min(30, b * 2**(R-1)) + startup_s``
  for a killed actor or learner (b: the larger of ``actors.restart_backoff_s``
  and ``learner.restart_backoff_s``; R: the most restarts of one role, events.jsonl;
  startup_s: the role start-up allowance of the soak, ``--startup-s``); for a killed
  launcher ``restart_s + startup_s``: two start-ups one after the other, the resumed
  launcher's own and then its learner's (CI, seed 7: 30.7 s after a launcher kill on a
  loaded machine against the 28.3 s of one start-up); the stall for a
  stopped actor; the window plus one slowed call (at most ``tools.timeout_s``) for a
  slow tool; the window for a full cache folder (its
  file-size limit also stops the actors writing their weight file, so they cannot load
  new weights until it ends); 0 otherwise. ``step_s`` is the slowest step's own work
  (step_time_s - wait_s) plus the median step time.
- ``ledger``: per actor, sent = received + lost and received = trained + dropped (by
  reason); per incarnation, received <= sent; an actor that never said Bye fails.
- ``staleness``: every step's staleness_max <= learner.max_staleness.
- ``checkpoints``: every complete checkpoint folder loads in transformers.
- ``tool_cache``: diskcache's ``check()`` of the cache folder is clean.
- ``processes_left``: no process whose environment or command line names the run.
- ``retriever``: after each SIGKILL the retriever came back (restarts >= kills), and the
  run did not hang (``finished``); the search tool's errors are reported as counted.
"""

from __future__ import annotations

import json
import os
import statistics
from pathlib import Path

from arpo_async.core.files import read_jsonl_appended
from arpo_async.core.rundir import complete_checkpoints
from toolenv.cache import ToolCache

RESTART_CAP_S = 30.0  # arpo_async/launcher/supervisor.py _backoff


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def check_finished(run_dir: Path, launcher_rc: int | None) -> dict:
    summary, learner = _read(run_dir / "summary.json"), _read(run_dir / "learner_summary.json")
    ok = launcher_rc == 0 and summary.get("status") == "ok" and bool(learner) \
        and summary.get("steps", 0) > 0
    return {"ok": ok, "value": f"{summary.get('steps', 0)} steps, status "
            f"{summary.get('status', 'none')}, launcher rc {launcher_rc}",
            "steps": summary.get("steps", 0)}


def fault_effect(fault: dict, cfg, restart_s: float, startup_s: float = 0.0) -> float:
    """Seconds a fault can hold the learner's steps back, from its injection on."""
    kind = fault["kind"]
    if kind in ("actor_kill", "learner_kill"):
        return restart_s
    if kind in ("launcher_kill", "job_kill"):  # the launcher starts, then the learner
        return restart_s + startup_s
    if kind == "actor_stop":
        return float(fault.get("stall_s", 0.0))
    if kind == "slow_tool":
        delay = min(float(fault.get("delay_s", cfg.tools.timeout_s)), cfg.tools.timeout_s)
        return float(fault.get("for_s", 0.0)) + delay
    if kind == "cache_full":
        return float(fault.get("for_s", 0.0))
    return 0.0


def check_gap(run_dir: Path, cfg, startup_s: float) -> dict:
    rows = sorted(read_jsonl_appended(run_dir / "metrics.jsonl"),
                  key=lambda r: r.get("time", 0))
    faults = read_jsonl_appended(run_dir / "chaos.jsonl")
    events = read_jsonl_appended(run_dir / "events.jsonl")
    restarts = max((e.get("restart", 0) for e in events if e.get("event") == "restart"),
                   default=1)
    base = max(cfg.actors.restart_backoff_s, cfg.learner.restart_backoff_s)
    backoff = min(RESTART_CAP_S, base * 2.0 ** max(restarts - 1, 0))
    restart_s = backoff + startup_s
    if len(rows) < 2:
        return {"ok": False, "value": f"{len(rows)} steps: no gap to measure"}
    times = [r["time"] for r in rows]
    work = max(r.get("step_time_s", 0) - r.get("wait_s", 0) for r in rows)
    step_s = work + statistics.median(r.get("step_time_s", 0) for r in rows)
    worst = None
    for a, b in zip(times, times[1:], strict=False):
        effects = [(f["time"], fault_effect(f, cfg, restart_s, startup_s)) for f in faults]
        cost = sum(e for t, e in effects if e > 0 and t < b and t + e > a)
        bound = step_s + cfg.learner.actor_silent_s + cost
        gap = {"gap_s": round(b - a, 1), "bound_s": round(bound, 1), "after_time": a}
        if worst is None or gap["gap_s"] - gap["bound_s"] > worst["gap_s"] - worst["bound_s"]:
            worst = gap
    longest = max(b - a for a, b in zip(times, times[1:], strict=False))
    return {"ok": worst["gap_s"] <= worst["bound_s"],
            "value": f"longest {longest:.1f} s; tightest {worst['gap_s']} s vs bound "
            f"{worst['bound_s']} s", "longest_s": round(longest, 1), "tightest": worst,
            "restart_s": round(restart_s, 1), "step_s": round(step_s, 2)}


def ledger_problems(ledger: dict, incarnations: dict) -> list[str]:
    """What breaks the ledger's equations (learner/ledger.py): per actor, sent = received
    + lost and received = trained + dropped; per incarnation (pid), the actor's sent is
    the sum over its incarnations of max(said, received) and its received their sum, and
    the incarnation that said Bye (its count is final) received no more than it sent."""
    problems = []
    for actor, led in sorted(ledger.items()):
        dropped = sum(led["dropped"].values())
        if led["sent"] < 0:
            problems.append(f"actor {actor} never said bye")
        elif led["sent"] != led["received"] + led["lost"]:
            problems.append(f"actor {actor}: sent {led['sent']} != received "
                            f"{led['received']} + lost {led['lost']}")
        if led["received"] != led["trained"] + dropped:
            problems.append(f"actor {actor}: received {led['received']} != trained "
                            f"{led['trained']} + dropped {dropped}")
        inc = incarnations.get(actor)
        if inc is None:
            problems.append(f"actor {actor}: no per-incarnation ledger")
            continue
        pairs = inc["by_pid"]
        if led["sent"] >= 0 and sum(max(s, r) for s, r in pairs.values()) != led["sent"]:
            problems.append(f"actor {actor}: incarnations {pairs} do not sum to sent "
                            f"{led['sent']}")
        if sum(r for _, r in pairs.values()) != led["received"]:
            problems.append(f"actor {actor}: incarnations {pairs} do not sum to received "
                            f"{led['received']}")
        closed = pairs.get(inc["closed"])
        if closed is not None and closed[1] > closed[0]:
            problems.append(f"actor {actor} pid {inc['closed']}: received {closed[1]} > "
                            f"sent {closed[0]} (said in its Bye)")
    if not ledger:
        problems.append("no ledger in summary.json")
    return problems


def check_ledger(run_dir: Path) -> dict:
    summary = _read(run_dir / "summary.json")
    ledger = summary.get("ledger", {})
    problems = ledger_problems(ledger, summary.get("learner", {}).get("incarnations", {}))
    totals = {"sent": 0, "received": 0, "trained": 0, "lost": 0, "dropped": {},
              "incarnations": sum(led.get("incarnations", 0) for led in ledger.values())}
    for led in ledger.values():
        for k in ("sent", "received", "trained", "lost"):
            totals[k] += max(led[k], 0)
        for reason, n in led["dropped"].items():
            totals["dropped"][reason] = totals["dropped"].get(reason, 0) + n
    # per prompt (learner/ledger.py PromptRecord): none skipped (every prompt of the stream
    # trained or dropped with a reason; none can be trained twice, and duplicates, generated
    # twice and dropped, are reported); -1: a record restored as unknown
    prompts = summary.get("prompts") or {"taken": 0, "duplicates": 0, "skipped": 0}
    if prompts.get("skipped", 0) > 0:
        problems.append(f"{prompts['skipped']} prompts skipped: never trained nor dropped")
    return {"ok": not problems, "value": "; ".join(problems) or
            f"sent {totals['sent']} = trained {totals['trained']} + dropped "
            f"{sum(totals['dropped'].values())} {totals['dropped']} + lost {totals['lost']} "
            f"({totals['incarnations']} incarnations); prompts: {prompts['taken']} taken, "
            f"{prompts['duplicates']} duplicates, {prompts['skipped']} skipped",
            **totals, "prompts": prompts}


def check_staleness(run_dir: Path, cfg) -> dict:
    rows = read_jsonl_appended(run_dir / "metrics.jsonl")
    worst = max((r.get("staleness_max", 0) for r in rows), default=0)
    return {"ok": bool(rows) and worst <= cfg.learner.max_staleness,
            "value": f"max {worst} <= {cfg.learner.max_staleness}", "max": worst}


def check_checkpoints(run_dir: Path) -> dict:
    # torch, transformers: heavy; only this check loads a model
    import torch
    from transformers import AutoModelForCausalLM

    bad, good = [], 0
    for ckpt in complete_checkpoints(run_dir):
        try:
            AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32)
            good += 1
        except Exception as exc:  # any failure to load is the finding
            bad.append(f"{ckpt.name}: {type(exc).__name__}: {str(exc)[:120]}")
    return {"ok": good > 0 and not bad, "value": "; ".join(bad) or f"{good} loaded",
            "loaded": good}


def check_cache(cache_dir: Path) -> dict:
    if not (cache_dir / "cache.db").is_file():
        return {"ok": True, "value": "no cache written"}
    with ToolCache(cache_dir) as cache:
        warnings = [str(w) for w in cache.check()]
        stats = cache.disk_stats()
    return {"ok": not warnings, "value": "; ".join(warnings)[:300] or
            f"check() clean, {stats['entries']} entries", "entries": stats["entries"]}


def run_processes(marker: str, run_dir: Path, exclude: set[int]) -> list[dict]:
    """Processes whose environment carries ``marker`` or whose command line names the
    run folder (bwrap sandboxes are started with a cleared environment but hide the run
    folder by name), except ``exclude`` (the soak itself)."""
    found = []
    needle, where = marker.encode(), str(run_dir).encode()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            env = Path(f"/proc/{name}/environ").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state in ("Z", "X"):
            continue
        if needle in env or where in cmd:
            found.append({"pid": int(name), "cmd": cmd.replace(b"\0", b" ").decode(
                errors="replace")[:160]})
    return found


def ancestors(pid: int) -> set[int]:
    """``pid`` and the processes above it (a ``flock`` wrapper names the run dir too)."""
    out = set()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
    return out


def check_processes(marker: str, run_dir: Path, exclude: set[int]) -> dict:
    left = run_processes(marker, run_dir, exclude)
    return {"ok": not left, "value": f"{len(left)} left" + (f": {left[:3]}" if left else ""),
            "left": left}


def check_retriever(run_dir: Path, restarts: int, finished: bool) -> dict:
    kills = sum(1 for f in read_jsonl_appended(run_dir / "chaos.jsonl")
                if f["kind"] == "retriever_kill")
    svc = _read(run_dir / "summary.json").get("learner", {})
    errors = sum(v for k, v in svc.items() if k.endswith("/tools/search.errors"))
    calls = sum(v for k, v in svc.items() if k.endswith("/tools/search.calls"))
    timeouts = sum(v for k, v in svc.items() if k.endswith("/tools/search.timeouts"))
    return {"ok": restarts >= kills and finished,
            "value": f"{kills} kills, {restarts} restarts; search calls {calls:.0f}, errors "
            f"{errors:.0f}, timeouts {timeouts:.0f} (last learner's view)",
            "kills": kills, "restarts": restarts, "search_errors": errors}


def verdict(run_dir: Path, cfg, launcher_rc: int | None, startup_s: float, cache_dir: Path,
            retriever_restarts: int, marker: str, exclude: set[int]) -> dict:
    checks = {"finished": check_finished(run_dir, launcher_rc)}
    checks["longest_gap"] = check_gap(run_dir, cfg, startup_s)
    checks["ledger"] = check_ledger(run_dir)
    checks["staleness"] = check_staleness(run_dir, cfg)
    checks["checkpoints"] = check_checkpoints(run_dir)
    checks["tool_cache"] = check_cache(cache_dir)
    checks["processes_left"] = check_processes(marker, run_dir, exclude)
    checks["retriever"] = check_retriever(run_dir, retriever_restarts,
                                          checks["finished"]["ok"])
    faults: dict[str, int] = {}
    for f in read_jsonl_appended(run_dir / "chaos.jsonl"):
        faults[f["kind"]] = faults.get(f["kind"], 0) + 1
    return {"ok": all(c["ok"] for c in checks.values()), "faults": faults, "checks": checks}


def table(result: dict) -> str:
    lines = [f"{'check':<16}{'':6}detail", "-" * 78]
    for name, c in result["checks"].items():
        lines.append(f"{name:<16}{'ok' if c['ok'] else 'FAIL':<6}{c['value']}")
    lines.append("-" * 78)
    lines.append("faults: " + ", ".join(f"{k} {v}" for k, v in sorted(result["faults"].items())))
    lines.append(f"verdict: {'PASS' if result['ok'] else 'FAIL'}")
    return "\n".join(lines)
