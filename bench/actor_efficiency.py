"""Benchmark 4, actor efficiency: ``python bench/actor_efficiency.py`` prints and writes
bench/results/actor_efficiency.json.

Model tokens/s through the actor's full rollout path -- the real ``Actor`` (tickets over
the control channel, trajectory-level scheduling, ``AgentRollout`` with tool parsing,
entropy and scoring, a ``ToolRunner`` whose tool answers instantly, groups encoded and
sent over ZeroMQ to a learner-side ``LearnerService`` in another process) on a real vLLM
engine -- against raw vLLM generation (``AsyncLLM.generate`` called directly, as many
requests in flight as the actor's target of trajectories) of the same number of tokens,
in the same process on the same engine. Raw vLLM runs twice per repetition:

- with the actor's own sampling parameters: each round's first ``rollout.entropy_window``
  tokens with top-20 log-probs, the rest with the sampled token's log-prob only (two
  requests per round when it is longer than the window, as the actor sends it). Target:
  actor / raw >= 0.9;
- with top-20 log-probs on every token (the request the actor sent before it asked for
  top-k over the window only), which the window-only actor should beat.

Also measured: the trajectories generating (``Occupancy``: started, not finished, not
waiting for a tool) averaged over the window, against the target
``actors.max_inflight_trajectories`` (target >= 85%); the same ratio per CPU-second of the
actor's process tree; group slots (``max_inflight_trajectories=0``, each of
``concurrent_groups`` slots waits for its group's slowest leaf) for comparison; and, with
``--prefix-caching both``, the same with vLLM's prefix caching on (hit rate from vLLM's
``num_cached_tokens``).

The model is the tool-calling tiny model (bench/common.py): a real Qwen3 network whose
output law makes about half the rounds end in a ``<python>`` call, so the tool path runs.
Runs alternate (actor, raw, raw top-20, actor, ...) to share the machine's noise; medians
are reported. The last line is ``RESULT actor_efficiency ratio=<actor/raw, scheduler,
prefix caching as configured> generating_share=<mean generating / target> target=...``.
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
RAW_MAX_TOKENS = 64  # a raw request's tokens (the actor's rounds run to a stop or the budget)


def bench_config(model: str, target: int, group_size: int, extra: list[str],
                 prefix: bool = False, slots: int = 32):
    from arpo_async.core.config import SPINE_CONFIG, load_config

    return load_config(SPINE_CONFIG, overrides=[
        f"model.path={model}", "actors.engine=vllm", f"actors.max_inflight_trajectories={target}",
        f"actors.engine.enable_prefix_caching={str(prefix).lower()}",
        f"actors.concurrent_groups={max(1, slots // group_size)}",
        "rollout.mode=grpo", f"rollout.group_size={group_size}",
        f"rollout.initial_samples={group_size}", "rollout.tool_call_limit=3",
        "sampling.round_max_tokens=null", "sampling.max_response_tokens=256",
        "tools.enabled=[python]", f"run.dir={SCRATCH}/run", *extra])


def runner(delay_s: float, concurrency: int):
    from toolenv.runner import ToolRunner

    return ToolRunner({"python": SleepTool("python", delay_s)}, cache=None, rate_per_s=0,
                      concurrency=concurrency, timeout_s=30, retries=0)


def raw_sampling(cfg, tokenizer) -> dict:
    """The parameters of a raw request: AgentRollout's for a round, capped at
    ``RAW_MAX_TOKENS``."""
    from toolenv.tags import STOP_TAGS

    s = cfg.sampling
    stops = [tokenizer.convert_tokens_to_ids(t) for t in STOP_TAGS] + [tokenizer.eos_token_id]
    return {"max_tokens": RAW_MAX_TOKENS, "temperature": s.temperature, "top_p": s.top_p,
            "stop_token_ids": stops, "logprobs": s.logprobs_topk}


async def measure(cfg, engine, tokenizer, prompts, args, label: str, profile: bool) -> dict:
    """Alternating actor / raw / raw-top-20 runs at ``cfg``; medians of the ratios."""
    sampling = raw_sampling(cfg, tokenizer)
    window = cfg.rollout.entropy_window
    target = cfg.actors.max_inflight_trajectories or (cfg.actors.concurrent_groups
                                                     * cfg.rollout.group_size)
    reps = []
    profiler = cProfile.Profile() if profile else None
    for i in range(args.reps):
        tools = runner(0.0, cfg.tools.concurrency)
        actor = await actor_window(cfg, engine, tokenizer, tools, args.warmup, args.window,
                                   profiler if i == args.reps - 1 else None)
        await tools.close()
        raw = await raw_vllm(engine, prompts, target, actor["tokens"], sampling, window=window)
        top20 = await raw_vllm(engine, prompts, target, actor["tokens"], sampling)
        reps.append({"actor": actor, "raw": raw, "raw_top20": top20,
                     "ratio": actor["tokens_per_s"] / raw["tokens_per_s"],
                     "cpu_ratio": actor["tokens_per_cpu_s"] / raw["tokens_per_cpu_s"],
                     "top20_ratio": actor["tokens_per_s"] / top20["tokens_per_s"],
                     "generating_share": actor["generating_mean"] / target})
        hit = actor["engine"].get("prefix_cache_hit_rate", 0.0)
        print(f"{label}: actor {actor['tokens_per_s']:.0f} tok/s ({actor['tool_calls']} tool "
              f"calls, {actor['generating_mean']:.1f} of {target} generating, context "
              f"{actor['prompt_tokens_per_round']:.0f}, prefix-cache hits {hit:.0%}), raw "
              f"{raw['tokens_per_s']:.0f} tok/s: ratio {reps[-1]['ratio']:.2f} (per CPU-s "
              f"{reps[-1]['cpu_ratio']:.2f}); raw top-20 on every token "
              f"{top20['tokens_per_s']:.0f} tok/s: ratio {reps[-1]['top20_ratio']:.2f}",
              flush=True)
    med = lambda key: statistics.median(r[key] for r in reps)  # noqa: E731
    return {"label": label, "target": target, "reps": reps, "ratio_median": med("ratio"),
            "ratio_range": [min(r["ratio"] for r in reps), max(r["ratio"] for r in reps)],
            "cpu_ratio_median": med("cpu_ratio"), "top20_ratio_median": med("top20_ratio"),
            "generating_share_median": med("generating_share"),
            "prefix_cache_hit_rate": reps[-1]["actor"]["engine"].get("prefix_cache_hit_rate"),
            "profile_top": top_functions(profiler) if profiler else []}


async def run(args) -> dict:
    from transformers import AutoTokenizer

    from actors.engines import build_engine
    from toolenv.tasks.prompts import PromptSource

    model = str(build_tool_caller(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model)
    results = []
    prefix = {"off": [False], "on": [True], "both": [False, True]}[args.prefix_caching]
    no_lp = None
    for pc in prefix:
        cfg = bench_config(model, args.target, args.group_size, args.overrides, prefix=pc)
        engine = await build_engine(cfg, model, 0)
        source = PromptSource(cfg, tokenizer)
        prompts = [source.next().tokens for _ in range(64)]
        tag = "prefix caching on" if pc else "prefix caching off"
        try:
            results.append(await measure(cfg, engine, tokenizer, prompts, args,
                                         f"scheduler {args.target}, {tag}",
                                         profile=args.profile and not results))
            if args.compare_slots and not pc:
                every = bench_config(model, args.target, args.group_size,
                                     [*args.overrides, "sampling.topk_window_only=false"])
                results.append(await measure(every, engine, tokenizer, prompts, args,
                                             f"scheduler {args.target}, top-20 on every "
                                             f"token, {tag}", profile=False))
                slots = bench_config(model, 0, args.group_size, args.overrides, prefix=pc,
                                     slots=args.target)
                results.append(await measure(slots, engine, tokenizer, prompts, args,
                                             f"group slots {slots.actors.concurrent_groups}"
                                             f"x{args.group_size}, {tag}", profile=False))
            if no_lp is None:
                no_lp = await raw_vllm(engine, prompts, args.target,
                                       results[0]["reps"][-1]["actor"]["tokens"],
                                       {**raw_sampling(cfg, tokenizer), "logprobs": None})
        finally:
            await engine.close()
    main_run = results[-1] if args.prefix_caching == "on" else results[0]
    return {"model": model, "group_size": args.group_size, "window_s": args.window,
            "runs": results, "ratio_median": main_run["ratio_median"],
            "generating_share_median": main_run["generating_share_median"],
            "raw_without_logprobs_tokens_per_s": no_lp["tokens_per_s"],
            "target": {"ratio": 0.9, "generating_share": 0.85}}


def top_functions(profiler, n: int = 15) -> list[str]:
    """The actor front end's hottest functions by own time during the profiled window."""
    stats = pstats.Stats(profiler)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:n]  # (cc, nc, tt, ct, ...)
    total = sum(v[2] for v in stats.stats.values()) or 1.0
    return [f"{v[2] / total:6.1%} {Path(f).name}:{line} {fn}" for (f, line, fn), v in rows]


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=f"{SCRATCH}/tool_caller", help="built if missing")
    p.add_argument("--target", type=int, default=32,
                   help="actors.max_inflight_trajectories (trajectory-level scheduling)")
    p.add_argument("--group-size", type=int, default=8, help="trajectories per group")
    p.add_argument("--compare-slots", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure group slots (max_inflight_trajectories=0)")
    p.add_argument("--prefix-caching", choices=["off", "on", "both"], default="both")
    p.add_argument("--window", type=float, default=8.0, help="seconds measured per run")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds before measuring")
    p.add_argument("--reps", type=int, default=3, help="actor/raw repetitions")
    p.add_argument("--profile", action="store_true", help="cProfile the last actor window")
    p.add_argument("--out", default=None, help="results file")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    args = p.parse_args(argv)
    out = asyncio.run(run(args))
    for r in out["runs"]:
        ratios = ", ".join(f"{x['ratio']:.2f}" for x in r["reps"])
        print(f"actor efficiency, {r['label']}: actor / raw vLLM (same parameters) = "
              f"{r['ratio_median']:.2f} (median of {ratios}; target >= 0.9); / raw with "
              f"top-20 on every token {r['top20_ratio_median']:.2f}; per CPU-second "
              f"{r['cpu_ratio_median']:.2f}; generating {r['generating_share_median']:.0%} of "
              f"{r['target']} (target >= 85%)")
        for line in r["profile_top"]:
            print("  ", line)
    print(f"raw vLLM without log-probs: {out['raw_without_logprobs_tokens_per_s']:.0f} tok/s")
    write_results("actor_efficiency", out, args.out)
    x, g = out["ratio_median"], out["generating_share_median"]
    met = x >= 0.9 and g >= 0.85
    print(f"RESULT actor_efficiency ratio={x:.2f} generating_share={g:.2f} "
          f"target=ratio>=0.9,generating_share>=0.85 {'met' if met else 'missed'}")
    return out


if __name__ == "__main__":
    main()
