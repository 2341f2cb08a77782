"""Benchmark 4, actor efficiency: ``python bench/actor_efficiency.py`` prints and writes
bench/results/actor_efficiency.json.

Model tokens/s through the actor's full rollout path -- the real ``Actor`` (tickets over
the control channel, ``AgentRollout`` with tool parsing, entropy and scoring, a
``ToolRunner`` whose tool answers instantly, groups encoded and sent over ZeroMQ to a
learner-side ``LearnerService`` in another process) on a real vLLM engine -- against raw
vLLM generation (``AsyncLLM.generate`` called directly, same sampling parameters and
log-probs, as many requests in flight as the actor has trajectories) of the same number
of tokens, in the same process on the same engine. Target: ratio >= 0.8.

The model is the tool-calling tiny model (bench/common.py): a real Qwen3 network whose
output law makes about half the rounds end in a ``<python>`` call, so the tool path runs.
Runs alternate (actor, raw, actor, raw, ...) to share the machine's noise; the median
ratio is reported. Two diagnostics come with it: the same ratio per CPU-second of the
actor's process tree (less sensitive to other jobs on the machine), and the ratio against
raw vLLM at the number of trajectories the actor actually kept in flight (a slot waits
for the slowest leaf of its group, so the actor keeps fewer in flight than it has room
for): that one isolates the per-token overhead of the rollout path.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import pstats
import statistics
from pathlib import Path

from common import (
    SCRATCH_DIR,
    SleepTool,
    actor_window,
    build_tool_caller,
    raw_vllm,
    write_results,
)

SCRATCH = SCRATCH_DIR


def bench_config(model: str, slots: int, group_size: int, extra: list[str]):
    from arpo_async.core.config import SPINE_CONFIG, load_config

    return load_config(SPINE_CONFIG, overrides=[
        f"model.path={model}", "actors.engine=vllm", f"actors.concurrent_groups={slots}",
        "rollout.mode=grpo", f"rollout.group_size={group_size}",
        f"rollout.initial_samples={group_size}", "rollout.tool_call_limit=3",
        "sampling.max_new_tokens=64", "sampling.max_response_tokens=256",
        "tools.enabled=[python]", f"run.dir={SCRATCH}/run", *extra])


def runner(delay_s: float, concurrency: int):
    from toolenv.runner import ToolRunner

    return ToolRunner({"python": SleepTool("python", delay_s)}, cache=None, rate_per_s=0,
                      concurrency=concurrency, timeout_s=30, retries=0)


def raw_sampling(cfg, tokenizer) -> dict:
    """The parameters AgentRollout sends for a first round."""
    from toolenv.tags import STOP_TAGS

    s = cfg.sampling
    stops = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TAGS] + [tokenizer.eos_token_id]
    return {"max_tokens": s.max_new_tokens, "temperature": s.temperature, "top_p": s.top_p,
            "stop_token_ids": stops, "logprobs": s.logprobs_topk}


async def measure(cfg, engine, tokenizer, prompts, args, profile: bool) -> dict:
    """Alternating actor / raw pairs at ``cfg``'s slot count; medians of the ratios."""
    sampling = raw_sampling(cfg, tokenizer)
    inflight = cfg.actors.concurrent_groups * cfg.rollout.group_size
    reps = []
    profiler = cProfile.Profile() if profile else None
    for i in range(args.reps):
        tools = runner(0.0, cfg.tools.concurrency)
        actor = await actor_window(cfg, engine, tokenizer, tools, args.warmup, args.window,
                                   profiler if i == args.reps - 1 else None)
        await tools.close()
        raw = await raw_vllm(engine, prompts, inflight, actor["tokens"], sampling)
        # the same, at the concurrency the actor actually kept: isolates per-token overhead
        matched_n = max(1, round(actor["mean_in_flight"]))
        matched = await raw_vllm(engine, prompts, matched_n, actor["tokens"], sampling)
        reps.append({"actor": actor, "raw": raw, "raw_matched": matched,
                     "ratio": actor["tokens_per_s"] / raw["tokens_per_s"],
                     "cpu_ratio": actor["tokens_per_cpu_s"] / raw["tokens_per_cpu_s"],
                     "matched_ratio": actor["tokens_per_s"] / matched["tokens_per_s"]})
        print(f"slots {cfg.actors.concurrent_groups}: actor {actor['tokens_per_s']:.0f} tok/s "
              f"({actor['tool_calls']} tool calls, {actor['mean_in_flight']:.1f} in flight, "
              f"context {actor['prompt_tokens_per_round']:.0f}), raw {raw['tokens_per_s']:.0f} "
              f"tok/s ({inflight} in flight, context {raw['prompt_tokens_per_round']:.0f}): "
              f"ratio {reps[-1]['ratio']:.2f}; per CPU-second {reps[-1]['cpu_ratio']:.2f}; raw at "
              f"{matched_n} in flight {matched['tokens_per_s']:.0f} tok/s: ratio "
              f"{reps[-1]['matched_ratio']:.2f}", flush=True)
    return {"slots": cfg.actors.concurrent_groups, "raw_in_flight": inflight, "reps": reps,
            "ratio_median": statistics.median(r["ratio"] for r in reps),
            "cpu_ratio_median": statistics.median(r["cpu_ratio"] for r in reps),
            "matched_ratio_median": statistics.median(r["matched_ratio"] for r in reps),
            "actor_mean_in_flight": statistics.median(r["actor"]["mean_in_flight"] for r in reps),
            "profile_top": top_functions(profiler) if profiler else []}


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from actors.engines import build_engine
    from toolenv.tasks.prompts import PromptSource

    model = str(build_tool_caller(args.model))
    cfg = bench_config(model, args.slots[0], args.group_size, args.overrides)
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = await build_engine(cfg, model, 0)
    source = PromptSource(cfg, tokenizer)
    prompts = [source.next().tokens for _ in range(64)]
    results = []
    try:
        for i, slots in enumerate(args.slots):
            cfg.actors.concurrent_groups = slots
            results.append(await measure(cfg, engine, tokenizer, prompts, args,
                                         profile=args.profile and i == 0))
        no_lp = await raw_vllm(engine, prompts, args.slots[0] * args.group_size,
                               results[0]["reps"][-1]["actor"]["tokens"],
                               {**raw_sampling(cfg, tokenizer), "logprobs": None})
    finally:
        await engine.close()
    return {"model": model, "group_size": args.group_size, "window_s": args.window,
            "by_slots": results, "ratio_median": results[0]["ratio_median"],
            "raw_without_logprobs_tokens_per_s": no_lp["tokens_per_s"], "target": 0.8}


def top_functions(profiler, n: int = 15) -> list[str]:
    """The actor front end's hottest functions by own time during the profiled window."""
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]  # (cc, nc, tt, ct, ...)
    total = sum(v[2] for v in stats.stats.values()) or 1.0
    return [f"{v[2] / total:6.1%} {Path(f).name}:{line} {fn}" for (f, line, fn), v in rows]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=f"{SCRATCH}/tool_caller", help="built if missing")
    p.add_argument("--slots", default="4,8", help="actors.concurrent_groups values, e.g. 4,8")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per group")
    p.add_argument("--window", type=float, default=8.0, help="seconds measured per run")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    p.add_argument("--reps", type=int, default=3, help="actor/raw pairs")
    p.add_argument("--profile", action="store_true", help="cProfile the last actor window")
    p.add_argument("--out", default=None, help="results file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    args.slots = [int(v) for v in args.slots.split(",")]
    out = asyncio.run(run(args))
    for r in out["by_slots"]:
        ratios = ", ".join(f"{x['ratio']:.2f}" for x in r["reps"])
        print(f"actor efficiency, {r['slots']} slots ({r['actor_mean_in_flight']:.1f} of "
              f"{r['raw_in_flight']} trajectories in flight): actor path / raw vLLM = "
              f"{r['ratio_median']:.2f} (median of {ratios}; target >= 0.8); per CPU-second "
              f"{r['cpu_ratio_median']:.2f}; against raw vLLM at the actor's own concurrency "
              f"{r['matched_ratio_median']:.2f}")
        for line in r["profile_top"]:
            print("  ", line)
    print(f"raw vLLM without log-probs: {out['raw_without_logprobs_tokens_per_s']:.0f} tok/s")
    write_results("actor_efficiency", out, args.out)
    return out


if __name__ == "__main__":
    main()
