"""Requests per round (issue 31, item 4): the entropy window's top-k log-probs as a second
engine request per round, or top-k on every token in one request. Prints and writes
bench/results/round_requests.json.

The default job's rollout (actors/rollout: ARPO's group policy, 8 leaves per prompt, the
window entropy read on the first round and after every tool result, real tools: sandboxed
Python and the BM25 retriever over the suite's corpus) runs ``--prompts`` RL prompts of
the default suite on one real vLLM engine loaded with a trained model (``--model``: a
finished default job's SFT folder), ``--concurrency`` groups at a time, in each arm in
turn on the same engine (A-B-B-A ..., ``--reps`` pairs):

- ``window``: ``sampling.topk_window_only = true``: a round's first
  ``rollout.entropy_window`` tokens with top-k log-probs, and a round longer than that as
  a second request from prompt + the window (``VLLMEngine.generate``'s segments);
- ``every``: ``sampling.topk_window_only = false``: top-k on every token, one request per
  round.

A warm-up pass fills the tool cache first, so every arm's tool calls cost the same (a
cache hit). Per arm run: model tokens sampled per second of wall time; prompt tokens the
engine processed per token sampled (``prompt_tokens`` / ``sampled_tokens`` of the engine's
stats: the prefill per token that item 4 is about); engine requests per round; CPU seconds
per 1,000 tokens of this process (vLLM's front end: output processing, the candidates'
log-prob objects, the rollout) and of its children (the engine core, the sandbox, the
retriever). Figure: ``every / window`` tokens/s, the median over the pairs (each pair run
back to back on the same engine, so the machine's load is shared). Target: >= 1.0, i.e.
one request per round pays on this model and config (set ``sampling.topk_window_only =
false``); below it, keep the split. The prefill it saves is printed next to it.

    python bench/round_requests.py --model runs/default/sft [--prompts 48] [--reps 2]
        [--concurrency 8] [--config configs/default.yaml] [key=value ...]

The last line is ``RESULT round_requests every_vs_window=<x> target=1.0 met|missed``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import resource
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from common import REPO, tree_cpu_s, write_results

ARMS = {"window": True, "every": False}


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def run_arm(cfg, engine, source, tokenizer, tools, prompts, concurrency: int,
                  seed: int) -> dict:
    """All ``prompts`` through the rollout ``cfg`` describes, ``concurrency`` at a time."""
    from actors.rollout import build_rollout

    rollout = build_rollout(cfg, engine, source, tokenizer, tools,
                            np.random.default_rng([seed, 0xB0]))
    slots = asyncio.Semaphore(concurrency)
    before = engine.stats()

    async def one(prompt) -> None:
        async with slots:
            await rollout.run(source.encode(prompt), actor_id=0)

    cpu_self, cpu_tree = _self_cpu(), tree_cpu_s()
    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    cpu_self, cpu_tree = _self_cpu() - cpu_self, tree_cpu_s() - cpu_tree
    after = engine.stats()
    sampled = after["sampled_tokens"] - before["sampled_tokens"]
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    requests = after["requests"] - before["requests"]
    calls = after["rounds"] - before["rounds"]
    return {"wall_s": round(wall, 2), "sampled_tokens": int(sampled),
            "tokens_per_s": round(sampled / wall, 1),
            "prefill_per_sampled": round(prompt_tokens / max(1, sampled), 3),
            "requests": int(requests), "rounds": int(calls),
            "requests_per_round": round(requests / max(1, calls), 3),
            "frontend_cpu_s_per_1k": round(1000 * cpu_self / max(1, sampled), 3),
            "children_cpu_s_per_1k": round(1000 * (cpu_tree - cpu_self) / max(1, sampled), 3)}


async def main_async(args) -> dict:
    from transformers import AutoTokenizer

    from actors.engines import build_engine
    from arpo_async.core.config import config_from_dict, load_config
    from toolenv.retriever_server import RetrieverProcess
    from toolenv.runner import build_tools
    from toolenv.tasks.prompts import PromptSource
    from toolenv.tasks.suite import suite_noise

    base = load_config(args.config, args.overrides)
    data = Path(base.pipeline.data_dir)
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(RetrieverProcess(data / "corpus.jsonl",
                                                   **suite_noise(data / "corpus.jsonl"))).url
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="arpo_rr_")))

        def arm_cfg(window_only: bool):
            tree = base.model_dump(mode="json")
            tree["model"]["path"] = str(args.model)
            tree["task"].update(name="file", data=str(data / "rl.jsonl"))
            tree["tools"]["search"]["retriever_url"] = url
            tree["sampling"]["topk_window_only"] = window_only
            return config_from_dict(tree)

        cfgs = {arm: arm_cfg(flag) for arm, flag in ARMS.items()}
        tokenizer = AutoTokenizer.from_pretrained(args.model)
        source = PromptSource(cfgs["window"], tokenizer)
        prompts = source.items[:args.prompts]
        tools = build_tools(cfgs["window"].tools, work)
        engine = await build_engine(cfgs["window"], str(args.model))
        runs: dict[str, list[dict]] = {arm: [] for arm in ARMS}
        try:
            print(f"warm-up: {len(prompts)} prompts (fills the tool cache)", flush=True)
            await run_arm(cfgs["window"], engine, source, tokenizer, tools, prompts,
                          args.concurrency, seed=0)
            order = [a for r in range(args.reps)
                     for a in (("window", "every") if r % 2 == 0 else ("every", "window"))]
            for i, arm in enumerate(order):
                got = await run_arm(cfgs[arm], engine, source, tokenizer, tools, prompts,
                                    args.concurrency, seed=1 + i // 2)
                runs[arm].append(got)
                print(f"{arm:>6}: {got}", flush=True)
        finally:
            await engine.close()
            await tools.close()
    pairs = [e["tokens_per_s"] / w["tokens_per_s"]
             for w, e in zip(runs["window"], runs["every"])]
    med = {arm: {k: statistics.median(r[k] for r in rs) for k in rs[0]}
           for arm, rs in runs.items()}
    return {"model": str(args.model), "prompts": len(prompts),
            "concurrency": args.concurrency, "runs": runs, "median": med,
            "every_vs_window_pairs": [round(p, 3) for p in pairs],
            "every_vs_window": round(statistics.median(pairs), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "runs/default/sft"))
    ap.add_argument("--config", default=str(REPO / "configs/default.yaml"))
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--concurrency", type=int, default=8, help="groups in flight")
    ap.add_argument("--reps", type=int, default=2, help="pairs of runs (A-B-B-A ...)")
    ap.add_argument("--out", default=None)
    ap.add_argument("overrides", nargs="*", help="dotted key=value config overrides")
    args = ap.parse_args()
    res = asyncio.run(main_async(args))
    for arm, m in res["median"].items():
        print(f"{arm:>6} (median): {m['tokens_per_s']:.0f} tok/s, prefill "
              f"{m['prefill_per_sampled']:.2f} per token sampled, "
              f"{m['requests_per_round']:.2f} requests per round, CPU per 1k tokens "
              f"{m['frontend_cpu_s_per_1k']:.2f} s front end + "
              f"{m['children_cpu_s_per_1k']:.2f} s engine/tools")
    print(f"every / window tokens/s per pair: {res['every_vs_window_pairs']}")
    write_results("round_requests", res, args.out)
    x = res["every_vs_window"]
    print(f"RESULT round_requests every_vs_window={x:.3f} target=1.0 "
          f"{'met' if x >= 1.0 else 'missed'}")


if __name__ == "__main__":
    main()
