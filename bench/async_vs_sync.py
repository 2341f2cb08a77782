"""Benchmark 1, asynchronous vs synchronous: ``python bench/async_vs_sync.py`` prints and
writes bench/results/async_vs_sync.json; its last line is
``RESULT async_vs_sync plain_speedup=<x> arpo_speedup=<y> target=1.6 met|missed``.

The same config runs for the same number of learner steps in two modes: synchronous
(``learner.max_staleness=0``: admission control makes the actor wait for each step's
weights before it starts the next batch, lockstep) and asynchronous
(``learner.max_staleness=1``: the actor generates batch v+1 while the learner trains on
batch v). One vLLM actor and one DeepSpeed learner rank, each pinned to its own core
(the actor's process tree, vLLM engine included, on the first core of this process's
affinity set, the learner on the second), started with the launcher's own process plan
(``supervisor.resolve`` / ``plan``).

Figures, per workload:
- wall time from the end of step 1 to the end of step N (start-up excluded) per run;
  speed-up = median synchronous wall time / median asynchronous wall time;
- the bound it is measured against: the lockstep runs give per-step generation time g
  (the learner's wait for its batch, weight fetch and load included) and training time t
  (the rest of the step: train, publish); overlapping the two can at best make a step
  take max(g, t) instead of g + t, so bound = (g + t) / max(g, t) (2 when g = t);
- share of the bound reached: (speed-up - 1) / (bound - 1), and speed-up / bound;
- the noise: runs go in A-B-B-A order (sync, async, async, sync; ``--repeats`` blocks of
  it) so that slow drift of the shared machine cancels; each mode's min / median / max
  wall time and each pair's ratio (first sync with first async, and so on) are reported.

The bound counts only the overlap of generation with training. A share above 1 means
the asynchronous run also generated a batch faster than lockstep did: in lockstep every
batch ends in a tail (the engine waits for the last leaf's tool call and generation while
the other slots are empty), then the actor waits for the weights' round trip before it
starts again; asynchronously a finished group's slot takes the next prompt at once. So
the async step is also compared with max(g, t) directly.

Workloads (``--workload``):
- ``plain``: GRPO on the arithmetic task with the random tiny model (hidden 256, 4 layers,
  chosen so that g and t are about equal on the 2-core VM); batch 2 groups of 8, 64-token
  responses, no tools offered (the plain sampling rollout): no tool waits, no forks.
- ``arpo-tools``: ARPO (entropy branching: 4 initial samples per prompt, forks after tool
  results up to 8 leaves) with the tool-calling tiny model of bench/common.py (the same
  sizes; about one round in two ends in ``<python>...</python>``) and a tool answering
  after ``--tool-delay-ms`` (``BenchSleepTool``, a custom tool under the name ``python``,
  so every call takes the real ``ToolRunner`` path but costs latency, not CPU, like a
  remote tool), or with ``--tool python`` the real sandboxed Python tool. Trajectories
  wait on tools and fork: in lockstep those waits are on the critical path of each step.

``--set key=value`` (repeatable) is appended to every run's config, both modes and both
workloads, to compare actor or learner options under the same measurement.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from common import SCRATCH_DIR, SleepTool, build_tool_caller, ensure_tiny, write_results

SCRATCH = Path(SCRATCH_DIR)
BENCH = Path(__file__).resolve().parent
TARGET = 1.6
DELAY_ENV = "ARPO_BENCH_TOOL_DELAY_S"  # how the bench tells the actor's tool its latency
BASE = ["actors.num=1", "actors.engine=vllm", "actors.threads=1", "learner.threads=1",
        "learner.world_size=1", "learner.sync_every=1", "task.name=arith",
        "learner.batch_groups=2", "actors.concurrent_groups=2", "rollout.group_size=8"]


class BenchSleepTool(SleepTool):
    """``SleepTool`` as a ``tools.custom`` class (constructed without arguments, in the
    actor process): named ``python`` so the tool-calling model's tags reach it; its
    latency comes from the environment the bench gives the run's processes."""

    name = "python"
    description = "Runs Python code (benchmark stand-in: answers after a fixed delay)."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}}

    def __init__(self):
        super().__init__("python", float(os.environ.get(DELAY_ENV, "0.2")))


def workload_overrides(name: str, a) -> list[str]:
    """The config of one workload (both modes), model built here when missing."""
    sizes = [f"model.tiny_hidden={a.hidden}", f"model.tiny_layers={a.layers}",
             f"model.tiny_heads={max(4, a.hidden // 64)}", f"learner.max_steps={a.steps}"]
    if name == "plain":
        model = SCRATCH / f"model_h{a.hidden}_l{a.layers}"  # the launcher builds it
        return [*BASE, *sizes, f"model.path={model}", "rollout.mode=grpo", "tools.enabled=[]",
                "sampling.max_response_tokens=64"]
    model = SCRATCH / f"tool_caller_h{a.hidden}_l{a.layers}"
    ensure_tiny(model.with_name(model.name + "-base"), a.hidden, a.layers)  # its sizes
    build_tool_caller(model)
    tool = (["tools.enabled=[python]", "tools.custom=[]"] if a.tool == "python" else
            ["tools.enabled=[]", "tools.custom=[async_vs_sync:BenchSleepTool]"])
    return [*BASE, *sizes, f"model.path={model}", "rollout.mode=arpo",
            "rollout.initial_samples=4", "rollout.tool_call_limit=3", *tool,
            f"sampling.max_response_tokens={a.arpo_tokens}"]


def pinned_run(overrides: list[str], run_dir: Path, timeout_s: float, env: dict) -> dict:
    """Start the launcher's roles with CPU affinity, wait for the learner, summarise."""
    from arpo_async.core.config import save_config
    from arpo_async.core.dsops import prebuild_deepspeed_ops
    from arpo_async.core.metrics import read_metrics
    from arpo_async.jobs.experiments import summarize_run
    from arpo_async.jobs.preflight import resolve_run
    from arpo_async.launcher.supervisor import LaunchRequest, plan

    cfg = resolve_run(LaunchRequest(overrides=[*overrides, f"run.dir={run_dir}"], quiet=True))
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    prebuild_deepspeed_ops()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("async_vs_sync needs two cores (one for the actor, one for the learner)")
    placement = {"learner": cores[1], "actor0": cores[0]}  # vLLM binds its worker to the first
    procs = {}
    roles, _ = plan(cfg, run_dir / "config.yaml")  # what the launcher starts
    for role in roles:
        role.log.parent.mkdir(parents=True, exist_ok=True)
        core = placement[role.name]
        procs[role.name] = subprocess.Popen(  # the environment as the launcher gives it
            role.cmd, env={**os.environ, **role.env, **env}, stdout=role.log.open("wb"),
            stderr=subprocess.STDOUT, start_new_session=True,
            preexec_fn=lambda c=core: os.sched_setaffinity(0, {c}))
    try:
        rc = wait_learner(procs, timeout_s, run_dir)
        procs["actor0"].wait(60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        raise SystemExit(f"learner failed (rc {rc}); see {run_dir / 'logs' / 'learner.log'}")
    row, _ = summarize_run(run_dir, cfg.actors.concurrent_groups)
    steps = read_metrics(run_dir)[1:]  # step 1 carries the start-up
    if not steps:
        raise SystemExit(f"{run_dir}: fewer than 2 learner steps; see its logs/")
    n, leaves = len(steps), sum(r["leaves"] for r in steps)
    row["gen_s_per_step"] = sum(r["wait_s"] for r in steps) / n
    row["train_s_per_step"] = sum(r["step_time_s"] - r["wait_s"] for r in steps) / n
    row["tool_calls_per_leaf"] = sum(r.get("tool_calls", 0) for r in steps) / max(leaves, 1)
    row["forks_per_group"] = (sum(r.get("branch/forks", 0) for r in steps)
                              / max(sum(r["groups"] for r in steps), 1))
    row["tokens_per_leaf"] = sum(r["tokens"] for r in steps) / max(leaves, 1)
    return row


def wait_learner(procs: dict, timeout_s: float, run_dir: Path) -> int:
    """The learner's exit status; an actor that fails first ends the run at once (the
    learner would wait for it until its time limit)."""
    deadline = time.monotonic() + timeout_s
    while (rc := procs["learner"].poll()) is None:
        actor_rc = procs["actor0"].poll()
        if actor_rc not in (None, 0):
            raise SystemExit(f"actor failed (rc {actor_rc}); see {run_dir / 'logs' / 'actor0.log'}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{run_dir}: the learner took over {timeout_s:.0f} s")
        time.sleep(0.5)
    return rc


def abba(repeats: int) -> list[str]:
    return ["sync", "async", "async", "sync"] * repeats


def measure(name: str, overrides: list[str], a, env: dict) -> list[dict]:
    """The A-B-B-A runs of one workload, in the order they ran."""
    runs = []
    for mode in abba(a.repeats):
        t0 = time.time()
        eta = 0 if mode == "sync" else 1
        r = pinned_run([*overrides, f"learner.max_staleness={eta}"],
                       SCRATCH / f"async_vs_sync_{name}_{mode}_{int(t0)}", a.timeout, env)
        r["mode"] = mode
        runs.append(r)
        print(f"{name} {mode:5s}: {a.steps - 1} steps in {r['window_s']:.2f} s (after step 1), "
              f"per step gen wait {r['gen_s_per_step']:.3f} s, train {r['train_s_per_step']:.3f}"
              f" s, staleness max {r['staleness_max']}, tool calls/leaf "
              f"{r['tool_calls_per_leaf']:.2f}, forks/group {r['forks_per_group']:.2f}, "
              f"tokens/leaf {r['tokens_per_leaf']:.0f}, run {time.time() - t0:.0f} s", flush=True)
    return runs


def spread(values: list[float]) -> dict:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def figures(runs: list[dict], repeats: int) -> dict:
    """Speed-up, the bound the lockstep runs measured, the share of it reached, noise."""
    wall = {m: [r["window_s"] for r in runs if r["mode"] == m] for m in ("sync", "async")}
    sync = [r for r in runs if r["mode"] == "sync"]
    g = statistics.median(r["gen_s_per_step"] for r in sync)
    t = statistics.median(r["train_s_per_step"] for r in sync)
    speedup = statistics.median(wall["sync"]) / statistics.median(wall["async"])
    bound = (g + t) / max(g, t)
    steps = runs[0]["steps"] - 1  # the window's steps
    return {"speedup": speedup, "bound": bound,
            "async_step_s": statistics.median(wall["async"]) / steps,
            "share": (speedup - 1) / (bound - 1) if bound > 1 else math.nan,
            "speedup_over_bound": speedup / bound, "g": g, "t": t, "repeats": repeats,
            "pair_ratios": [s / x for s, x in zip(wall["sync"], wall["async"])],
            "wall_s": {m: spread(v) for m, v in wall.items()}, "runs": runs}


def report(name: str, f: dict, steps: int) -> None:
    w = f["wall_s"]
    print(f"{name}: async {f['speedup']:.2f}x faster for the same {steps - 1} steps; bound "
          f"(g + t) / max(g, t) = ({f['g']:.2f} + {f['t']:.2f}) / {max(f['g'], f['t']):.2f} = "
          f"{f['bound']:.2f}; share of the bound (speedup - 1) / (bound - 1) = "
          f"{f['share']:.2f}, speedup / bound = {f['speedup_over_bound']:.2f}; async step "
          f"{f['async_step_s']:.2f} s against max(g, t) {max(f['g'], f['t']):.2f} s")
    print(f"{name}: wall s sync min/median/max {w['sync']['min']:.1f}/{w['sync']['median']:.1f}/"
          f"{w['sync']['max']:.1f}, async {w['async']['min']:.1f}/{w['async']['median']:.1f}/"
          f"{w['async']['max']:.1f}; paired ratios "
          f"{', '.join(f'{x:.2f}' for x in f['pair_ratios'])}", flush=True)


def parse_args(argv: list[str] | None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--workload", choices=["plain", "arpo-tools", "both"], default="both")
    p.add_argument("--steps", type=int, default=16, help="learner steps per run")
    p.add_argument("--repeats", type=int, default=1,
                   help="A-B-B-A blocks per workload (sync, async, async, sync)")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (built locally)")
    p.add_argument("--layers", type=int, default=4, help="model layers")
    p.add_argument("--tool", choices=["sleep", "python"], default="sleep",
                   help="arpo-tools: the bench's sleep tool or the real sandboxed Python tool")
    p.add_argument("--tool-delay-ms", type=float, default=200.0,
                   help="arpo-tools: latency of the sleep tool, ms")
    p.add_argument("--arpo-tokens", type=int, default=128,
                   help="arpo-tools: sampling.max_response_tokens (tool results included)")
    p.add_argument("--timeout", type=float, default=600, help="seconds per run")
    p.add_argument("--set", dest="extra", action="append", default=[], metavar="key=value",
                   help="config override appended to every run (repeatable)")
    p.add_argument("--out", default=None, help="results file")
    a = p.parse_args(argv)
    if any(kv.split("=", 1)[0] == "learner.max_staleness" for kv in a.extra):
        p.error("--set learner.max_staleness: the two modes set it (0 and 1)")
    return a


def main(argv: list[str] | None = None) -> dict:
    a = parse_args(argv)
    names = ["plain", "arpo-tools"] if a.workload == "both" else [a.workload]
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH),
                                                        os.environ.get("PYTHONPATH")])),
           DELAY_ENV: str(a.tool_delay_ms / 1000)}  # the roles import BenchSleepTool
    results = {}
    for name in names:
        overrides = [*workload_overrides(name, a), *a.extra]
        results[name] = figures(measure(name, overrides, a, env), a.repeats)
        results[name]["overrides"] = overrides
        report(name, results[name], a.steps)
    plain = results.get("plain", {}).get("speedup", math.nan)
    arpo = results.get("arpo-tools", {}).get("speedup", math.nan)
    met = plain >= TARGET and arpo >= TARGET  # nan (a workload not run) is not met
    out = {"steps": a.steps, "workloads": results, "target": TARGET, "met": met,
           "tool": a.tool, "tool_delay_ms": a.tool_delay_ms, "set": a.extra}
    write_results("async_vs_sync", out, a.out)
    print(f"RESULT async_vs_sync plain_speedup={plain:.2f} arpo_speedup={arpo:.2f} "
          f"target={TARGET} {'met' if met else 'missed'}")
    return out


if __name__ == "__main__":
    main()
