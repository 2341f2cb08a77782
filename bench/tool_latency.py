"""Benchmark 5, tool-latency hiding: ``python bench/tool_latency.py`` prints and writes
bench/results/tool_latency.json.

Model tokens/s of the real actor (``Actor`` + ``AgentRollout`` on a real vLLM engine,
groups sent over ZeroMQ to a learner-side ``LearnerService`` process) when its tool takes
200 ms against the same actor when the tool answers at once. The tool is a sleep tool
registered in a real ``ToolRunner`` (rate limit, concurrency limit, timeout: the path
every tool call takes), so a call costs latency, not CPU -- like a remote search
service. Target: ratio >= 0.8.

While one trajectory waits for its tool, the engine keeps generating for the others; the
latency is hidden when enough trajectories are in flight to keep the engine's batch full.
So the ratio is measured at each ``--slots`` value: that many groups' worth of
trajectories in flight (``actors.max_inflight_trajectories`` = slots x group size). Runs
alternate (0 ms, 200 ms, 0 ms, ...) to share the machine's noise; medians are reported.
The model is the tool-calling tiny model of bench/common.py (about one call every two
rounds of ~26 tokens).

The last line is ``RESULT tool_latency ratio=<median ratio at the best slot count>
slots=<that count> target=0.8 met|missed`` (met when that ratio is at least 0.8).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics

from actor_efficiency import SCRATCH, bench_config, runner
from common import actor_window, build_tool_caller, write_results


async def measure(cfg, engine, tokenizer, args) -> dict:
    reps = []
    for _ in range(args.reps):
        pair = {}
        for delay in (0.0, args.delay_ms / 1000):
            tools = runner(delay, cfg.tools.concurrency)
            res = await actor_window(cfg, engine, tokenizer, tools, args.warmup, args.window)
            res["tool_latency_mean_s"] = tools.stats()["latency_mean_s"]
            await tools.close()
            pair["instant" if delay == 0 else "delayed"] = res
        pair["ratio"] = pair["delayed"]["tokens_per_s"] / pair["instant"]["tokens_per_s"]
        reps.append(pair)
        d, i = pair["delayed"], pair["instant"]
        print(f"slots {cfg.actors.concurrent_groups}: {args.delay_ms:g} ms tool "
              f"{d['tokens_per_s']:.0f} tok/s ({d['mean_in_flight']:.1f} generating, "
              f"{d['tool_calls']} calls, mean latency {1e3 * d['tool_latency_mean_s']:.0f} ms) "
              f"vs 0 ms {i['tokens_per_s']:.0f} tok/s ({i['mean_in_flight']:.1f} generating): "
              f"ratio {pair['ratio']:.2f}", flush=True)
    return {"slots": cfg.actors.concurrent_groups, "reps": reps,
            "ratio_median": statistics.median(r["ratio"] for r in reps)}


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from actors.engines import build_engine

    model = str(build_tool_caller(args.model))
    slots = [int(v) for v in args.slots.split(",")]
    cfg = bench_config(model, slots[0] * args.group_size, args.group_size, args.overrides)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = await build_engine(cfg, model, 0)
    results = []
    try:
        for n in slots:
            # n groups' worth of trajectories: actors.max_inflight_trajectories = n x M
            cfg.actors.concurrent_groups = n
            cfg.actors.max_inflight_trajectories = n * args.group_size
            results.append(await measure(cfg, engine, tokenizer, args))
    finally:
        await engine.close()
    return {"model": model, "delay_ms": args.delay_ms, "group_size": args.group_size,
            "window_s": args.window, "by_slots": results, "target": 0.8}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=f"{SCRATCH}/tool_caller", help="built if missing")
    p.add_argument("--delay-ms", type=float, default=200.0, help="latency of the slow tool")
    p.add_argument("--slots", default="4,8",
                   help="groups' worth of trajectories in flight (x group size), e.g. 4,8")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per group")
    p.add_argument("--window", type=float, default=8.0, help="seconds measured per run")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    p.add_argument("--reps", type=int, default=3, help="0 ms / slow pairs per slot count")
    p.add_argument("--out", default=None, help="results file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    out = asyncio.run(run(args))
    for r in out["by_slots"]:
        ratios = ", ".join(f"{x['ratio']:.2f}" for x in r["reps"])
        print(f"tool-latency hiding, {r['slots']} slots: tokens/s with a {args.delay_ms:g} ms "
              f"tool / with a 0 ms tool = {r['ratio_median']:.2f} (median of {ratios}; "
              f"target >= 0.8)")
    write_results("tool_latency", out, args.out)
    best = max(out["by_slots"], key=lambda r: r["ratio_median"])
    x = best["ratio_median"]
    print(f"RESULT tool_latency ratio={x:.2f} slots={best['slots']} target=0.8 "
          f"{'met' if x >= 0.8 else 'missed'}")
    return out


if __name__ == "__main__":
    main()
