"""Vocabulary-sized memory: one SFT step and one learner step at V = 151,936, chunked
against unchunked, peak RSS and tokens/s.

The model is the tiny random Qwen3 body (hidden 128, 2 layers) built around the genuine
Qwen3 tokenizer (``python -m arpo_async.jobs.tiny_model OUT --tokenizer qwen3``), so its
output layer has Qwen3's 151,936 rows. The batch is 8 sequences of 512 tokens, a prompt of
128 (no loss) and 384 trained tokens each, token ids drawn uniformly from the tokenizer's
BPE range. Each configuration runs in a fresh process, one CPU thread per torch op pool
(``--threads``), one warm-up step and then ``--steps`` measured steps:

* SFT (``arpo_async/jobs/sft.py``, AdamW): ``full``, the loss as it was, full fp32 logits
  and ``log_softmax`` of every position ([8, 512, 151936]); ``chunk0``, the shared
  implementation (arpo_async/core/logits.py) over the trained targets in one pass;
  ``chunk512``, the same 512 targets at a time, recomputed in backward (the default).
* Learner (the real ``PolicyTrainer``, DeepSpeed ZeRO-0 on one CPU rank, tree packing:
  one group of the 8 leaves sharing the prompt): ``learner.logprob_chunk_tokens`` = 0
  (all targets in one pass) against 512 (the default); ``padded`` (a row per leaf, full
  logits) for reference.

Peak RSS: after the warm-up step (the model, the optimizer's state and the gradients then
exist) the process's high-water mark is reset to its resident size (``/proc/self/
clear_refs``); the growth of the mark over that base during the measured steps is the
step's activations and logits, not the 39M parameters. Speed: trained tokens per second,
median of the measured steps. The arithmetic bound beside it: FLOPs per trained token
(forward + backward: 6 x parameters touched; the output layer's 2 x 151,936 x 128 per
target dominates) against the machine's measured GEMM rate at the output layer's shape;
the LM head's share of the FLOPs is printed.

Target: chunked peak <= 0.25 x the unchunked peak, chunked within 1.2 x of the
unchunked time, for both SFT (against ``full``) and the learner (against chunk 0). The
ratios use the worse of the two. Last line: ``RESULT vocab_memory peak_ratio=<x>
speed_ratio=<y> target=peak_ratio<=0.25,speed_ratio<=1.2 met|missed``.
``python bench/vocab_memory.py [--steps 3] [--threads 2]``; about 6 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.common import REPO, SCRATCH_DIR, write_results  # noqa: E402

BATCH, LENGTH, PROMPT = 8, 512, 128
SFT_MODES = ("full", "chunk0", "chunk512")
LEARNER_MODES = ("tree0", "tree512", "padded")


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> int:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0,
    /proc/self/clear_refs "5"); returns that RSS, the base of the measured steps."""
    Path("/proc/self/clear_refs").write_text("5")
    return _status_kb("VmRSS")


def _peak_growth_mb(base_kb: int) -> float:
    return (_status_kb("VmHWM") - base_kb) / 1024


def _batch(model_dir: str, seed: int = 0):
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(seed)
    ids = torch.from_numpy(rng.integers(0, tok.vocab_size, (BATCH, LENGTH)))
    mask = torch.zeros(BATCH, LENGTH)
    mask[:, PROMPT:] = 1.0
    return ids, mask


def _full_loss(model, ids, mask):
    """The SFT loss as it was: full fp32 logits and log_softmax of every position."""
    import torch

    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    weight = mask[:, 1:]
    return (nll * weight).sum() / weight.sum()


def sft_child(model_dir: str, mode: str, steps: int, threads: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from arpo_async.jobs.sft import masked_lm_loss

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():  # gradients and optimizer state exist before the base
        p.grad = torch.zeros_like(p)
    opt.step()
    ids, mask = _batch(model_dir)

    def step() -> float:
        if mode == "full":
            loss = _full_loss(model, ids, mask)
        else:
            loss, _ = masked_lm_loss(model, ids, mask, chunk=int(mode.removeprefix("chunk")))
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()
        return float(loss)

    step()  # warm-up
    base = _reset_peak()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step()
        times.append(time.perf_counter() - t0)
    return {"kind": "sft", "mode": mode, "step_s": times, "step_s_median": statistics.median(times),
            "trained_tokens": int(mask[:, 1:].sum()), "loss": loss,
            "peak_rss_growth_mb": _peak_growth_mb(base)}


def _group(model_dir: str):
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup

    ids, _ = _batch(model_dir)
    rng = np.random.default_rng(1)
    n = LENGTH - PROMPT
    leaves = [Trajectory(ids[i, PROMPT:].numpy().astype(np.int32), np.ones(n, np.uint8),
                         (-rng.random(n) * 3).astype(np.float32), np.zeros(n, np.int32),
                         reward=float(i % 2)) for i in range(BATCH)]
    return TrajectoryGroup("g0", 0, "p0", ids[0, :PROMPT].numpy().astype(np.int32), leaves)


def learner_child(model_dir: str, mode: str, steps: int, threads: int) -> dict:
    import torch

    from arpo_async.core.config import SPINE_CONFIG, load_config
    from learner.batching import samples_from_groups
    from learner.dist import init_distributed
    from learner.trainer import PolicyTrainer

    init_distributed()
    torch.set_num_threads(threads)
    packing, chunk = ("padded", 0) if mode == "padded" else ("tree", int(mode[4:]))
    cfg = load_config(SPINE_CONFIG, [f"model.path={model_dir}", f"learner.packing={packing}",
                                     f"learner.logprob_chunk_tokens={chunk}",
                                     "learner.lr=1e-5", "model.max_model_len=1024"])
    trainer = PolicyTrainer(cfg, model_dir)
    samples, _ = samples_from_groups([_group(model_dir)], "soft")
    trainer.train_step(samples)  # warm-up: optimizer state and gradients now exist
    base = _reset_peak()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - t0)
    return {"kind": "learner", "mode": mode, "step_s": times,
            "step_s_median": statistics.median(times),
            "trained_tokens": BATCH * (LENGTH - PROMPT),
            "peak_rss_growth_mb": _peak_growth_mb(base)}


def gemm_child(threads: int) -> dict:
    """The machine's fp32 GEMM rate at the output layer's shape (512 x 128 @ 128 x V)."""
    import torch

    torch.set_num_threads(threads)
    a, w = torch.randn(512, 128), torch.randn(151936, 128)
    a @ w.T
    t0 = time.perf_counter()
    reps = 5
    for _ in range(reps):
        a @ w.T
    dt = (time.perf_counter() - t0) / reps
    return {"gflops": 2 * 512 * 128 * 151936 / dt / 1e9}


def flops_per_trained_token(model_dir: str) -> dict:
    """Forward + backward FLOPs per trained token, the LM head's share (config only)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    h, v, layers = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    body = layers * (h * q + 2 * h * kv + q * h + 3 * h * cfg["intermediate_size"])
    attn = layers * 2 * LENGTH * q  # scores and values, about half the length on average
    head = h * v
    per_position = 6 * (body + attn)
    # every position runs the body; only trained targets run the head
    ratio = BATCH * LENGTH / (BATCH * (LENGTH - PROMPT))
    total = per_position * ratio + 6 * head
    return {"flops_per_trained_token": total, "lm_head_share": 6 * head / total,
            "vocab": v, "hidden": h}


# ----------------------------------------------------------------------------- driver
def _child(args: list[str]) -> dict:
    res = subprocess.run([sys.executable, __file__, "--child", *args], cwd=REPO,
                         capture_output=True, text=True, timeout=1800,
                         env={**os.environ, "OMP_NUM_THREADS": args[-1]})
    if res.returncode != 0:
        raise RuntimeError(res.stdout[-2000:] + res.stderr[-4000:])
    return json.loads(res.stdout.strip().splitlines()[-1])


def _model() -> str:
    from arpo_async.jobs.tiny_model import build_tiny_model

    path = Path(SCRATCH_DIR) / "tiny_qwen3_tokenizer"
    if not path.exists():
        build_tiny_model(path, tokenizer_dir="qwen3")
    return str(path)


def _print(r: dict, flops: dict, gflops: float) -> None:
    tps = r["trained_tokens"] / r["step_s_median"]
    bound = gflops * 1e9 / flops["flops_per_trained_token"]
    print(f"{r['kind']:7s} {r['mode']:8s} step {r['step_s_median']:6.2f} s (min "
          f"{min(r['step_s']):.2f}, max {max(r['step_s']):.2f})  {tps:6.0f} trained tok/s "
          f"(bound {bound:.0f} at {gflops:.0f} GFLOP/s: {tps / bound:.2f})  peak RSS "
          f"+{r['peak_rss_growth_mb']:.0f} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="measured steps per configuration")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, *rest = a.child
        if kind == "gemm":
            out = gemm_child(int(rest[0]))
        else:
            fn = sft_child if kind == "sft" else learner_child
            out = fn(rest[0], rest[1], int(rest[2]), int(rest[3]))
        print(json.dumps(out))
        return
    model = _model()
    flops = flops_per_trained_token(model)
    gflops = _child(["gemm", str(a.threads)])["gflops"]
    print(f"V={flops['vocab']}, hidden {flops['hidden']}: "
          f"{flops['flops_per_trained_token'] / 1e6:.0f} MFLOP per trained token (forward + "
          f"backward), LM head {flops['lm_head_share']:.1%} of it; GEMM at the head's shape "
          f"{gflops:.0f} GFLOP/s", flush=True)
    rows = {}
    for kind, modes in (("sft", SFT_MODES), ("learner", LEARNER_MODES)):
        for mode in modes:
            r = _child([kind, model, mode, str(a.steps), str(a.threads)])
            rows[(kind, mode)] = r
            _print(r, flops, gflops)

    def ratios(kind: str, chunked: str, unchunked: str) -> tuple[float, float]:
        c, u = rows[(kind, chunked)], rows[(kind, unchunked)]
        return (c["peak_rss_growth_mb"] / max(u["peak_rss_growth_mb"], 1e-9),
                c["step_s_median"] / u["step_s_median"])

    sft_peak, sft_speed = ratios("sft", "chunk512", "full")
    ln_peak, ln_speed = ratios("learner", "tree512", "tree0")
    print(f"SFT chunked/full: peak {sft_peak:.3f}x, time {sft_speed:.2f}x; learner chunk "
          f"512/0: peak {ln_peak:.3f}x, time {ln_speed:.2f}x")
    peak, speed = max(sft_peak, ln_peak), max(sft_speed, ln_speed)
    write_results("vocab_memory", {"rows": list(rows.values()), "flops": flops,
                                   "gemm_gflops": gflops, "sft": [sft_peak, sft_speed],
                                   "learner": [ln_peak, ln_speed]}, a.out)
    met = peak <= 0.25 and speed <= 1.2
    print(f"RESULT vocab_memory peak_ratio={peak:.3f} speed_ratio={speed:.2f} "
          f"target=peak_ratio<=0.25,speed_ratio<=1.2 {'met' if met else 'missed'}")


if __name__ == "__main__":
    main()
