"""Benchmark 1, asynchronous vs synchronous: ``python bench/async_vs_sync.py`` prints and
writes bench/results/async_vs_sync.json.

The same config runs twice for the same number of learner steps: synchronous
(``learner.max_staleness=0``: admission control makes the actor wait for each step's
weights before it starts the next batch, lockstep) and asynchronous
(``learner.max_staleness=1``: the actor generates batch v+1 while the learner trains on
batch v). One vLLM actor and one DeepSpeed learner rank, each pinned to its own core
(the actor's process tree, vLLM engine included, on the first core of this process's
affinity set, the learner on the second), started with the launcher's own process plan
(``supervisor.resolve`` / ``plan``). The figure is the wall time from the end of step 1
to the end of step N (start-up excluded) in each mode, and their ratio. Target: async at
least 1.6x faster; the limit is 2x, reached only when generating a batch and training on
it take equally long, so the synchronous run's per-step generation time g (its learner
wait) and training time t are reported with the bound (g + t) / max(g, t).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import time
from pathlib import Path

from common import SCRATCH_DIR, write_results

SCRATCH = Path(SCRATCH_DIR)
BASE = ["actors.num=1", "actors.engine=vllm", "actors.threads=1", "learner.threads=1",
        "learner.world_size=1", "learner.sync_every=1", "rollout.mode=grpo", "task.name=arith",
        "run.quiet=true"]


def pinned_run(overrides: list[str], run_dir: Path, timeout_s: float) -> dict:
    """Start the launcher's roles with CPU affinity, wait for the learner, summarise."""

    from arpo_async.core.config import save_config
    from arpo_async.core.dsops import prebuild_deepspeed_ops
    from arpo_async.jobs.experiments import summarize_run
    from arpo_async.jobs.tiny_model import resolve_model_path
    from arpo_async.launcher.supervisor import LaunchRequest, plan, resolve

    cfg = resolve(LaunchRequest(overrides=[*overrides, f"run.dir={run_dir}"], quiet=True),
                  model_path=resolve_model_path)
    run_dir.mkdir(parents=True, exist_ok=True)
    save_config(cfg, run_dir / "config.yaml")
    prebuild_deepspeed_ops()
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("async_vs_sync needs two cores (one for the actor, one for the learner)")
    roles = plan(cfg, run_dir / "config.yaml")
    placement = {"learner": cores[1], "actor0": cores[0]}  # vLLM binds its worker to the first
    procs = {}
    for role in roles:
        role.log.parent.mkdir(parents=True, exist_ok=True)
        core = placement[role.name]
        procs[role.name] = subprocess.Popen(
            role.cmd, env=role.env, stdout=role.log.open("wb"), stderr=subprocess.STDOUT,
            start_new_session=True, preexec_fn=lambda c=core: os.sched_setaffinity(0, {c}))
    try:
        rc = procs["learner"].wait(timeout_s)
        procs["actor0"].wait(60)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    if rc != 0:
        raise SystemExit(f"learner failed (rc {rc}); see {run_dir / 'logs' / 'learner.log'}")
    row, _ = summarize_run(run_dir, cfg.actors.concurrent_groups)
    from arpo_async.core.metrics import read_metrics

    steps = read_metrics(run_dir)[1:]
    row["gen_s_per_step"] = sum(r["wait_s"] for r in steps) / len(steps)
    row["train_s_per_step"] = sum(r["step_time_s"] - r["wait_s"] for r in steps) / len(steps)
    return row


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=16, help="learner steps per run")
    p.add_argument("--hidden", type=int, default=256, help="model hidden size (built locally)")
    p.add_argument("--layers", type=int, default=4, help="model layers")
    p.add_argument("--timeout", type=float, default=900, help="seconds per run")
    p.add_argument("--reps", type=int, default=2, help="sync/async pairs (ABBA order)")
    p.add_argument("--out", default=None, help="results file")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="config overrides for both runs (default: batch 2 groups of 8, "
                        "64-token responses)")
    a = p.parse_args(argv)
    model = SCRATCH / f"model_h{a.hidden}_l{a.layers}"
    common = [*BASE, f"model.path={model}", f"model.tiny_hidden={a.hidden}",
              f"model.tiny_layers={a.layers}", f"model.tiny_heads={max(4, a.hidden // 64)}",
              f"learner.max_steps={a.steps}", "learner.batch_groups=2",
              "actors.concurrent_groups=2", "rollout.group_size=8",
              "sampling.max_new_tokens=64", "sampling.max_response_tokens=64", *a.overrides]
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    order = [m for i in range(a.reps) for m in (("sync", "async") if i % 2 == 0
                                                 else ("async", "sync"))]  # ABBA: drift cancels
    for mode in order:
        t0 = time.time()
        eta = 0 if mode == "sync" else 1
        r = pinned_run([*common, f"learner.max_staleness={eta}"],
                       SCRATCH / f"async_vs_sync_{mode}_{int(t0)}", a.timeout)
        runs[mode].append(r)
        print(f"{mode:5s}: {a.steps - 1} steps in {r['window_s']:.2f} s (after step 1), "
              f"per step gen wait {r['gen_s_per_step']:.3f} s, train {r['train_s_per_step']:.3f} s,"
              f" staleness max {r['staleness_max']}, run {time.time() - t0:.0f} s", flush=True)
    speedups = [s["window_s"] / x["window_s"] for s, x in zip(runs["sync"], runs["async"])]
    g = statistics.median(r["gen_s_per_step"] for r in runs["sync"])
    t = statistics.median(r["train_s_per_step"] for r in runs["sync"])
    out = {"steps": a.steps, "model": str(model), "runs": runs, "speedups": speedups,
           "speedup": statistics.median(speedups), "bound": (g + t) / max(g, t), "target": 1.6}
    print(f"async vs sync: {out['speedup']:.2f}x faster for the same {a.steps - 1} steps (median "
          f"of {', '.join(f'{x:.2f}' for x in speedups)}; target >= 1.6; bound for this "
          f"balance (g + t) / max(g, t) = {out['bound']:.2f})")
    write_results("async_vs_sync", out, a.out)
    return out


if __name__ == "__main__":
    main()
