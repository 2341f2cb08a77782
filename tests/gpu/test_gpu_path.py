"""The GPU path on real CUDA: the learner's device helpers (bf16 load, flash-attention when
installed, gradient checkpointing) and its real start-up and trainer (NCCL group, a
DeepSpeed step on the GPU, host copies of the weights), vLLM's async engine on the GPU
(CUDA graphs, prefix caching, a memory fraction) with in-place weight updates, and NCCL
weight sync from the learner's NcclWeightSender into a vLLM actor on another GPU.

Marked ``gpu``: skipped without a GPU (tests/conftest.py). The NCCL test needs two GPUs
(NCCL puts one rank on one GPU). Written against vLLM 0.32; not yet run in this repo.
"""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPT, TOKENS = [5, 17, 42, 7, 99], [11, 12, 13, 14, 15, 16, 17, 18]


def _model(model_dir, state=None, device="cuda"):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if state is not None:
        missing, unexpected = model.load_state_dict(
            {k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in state.items()},
            strict=False)
        assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)
    return model.to(device).eval()


def _logprobs(model, prompt=PROMPT, tokens=TOKENS) -> np.ndarray:
    import torch

    ids = torch.tensor([prompt + tokens], device=next(model.parameters()).device)
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
    return logp.gather(-1, ids[0, 1:, None])[:, 0][len(prompt) - 1:].cpu().numpy()


def _perturbed(model_dir, seed: int) -> dict[str, np.ndarray]:
    import torch

    model = _model(model_dir, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    return {n: (p.detach() + 0.05 * torch.randn(p.shape, generator=gen)).numpy()
            for n, p in model.named_parameters()}


def _assert_loaded(actor_lp, model_dir, new_state):
    """The actor's log-probs match the new weights, not the old ones (bf16 engine vs an
    fp32 reference: compared by which one is closer, and within bf16 noise)."""
    new = _logprobs(_model(model_dir, new_state))
    old = _logprobs(_model(model_dir))
    err_new, err_old = np.abs(actor_lp - new).mean(), np.abs(actor_lp - old).mean()
    assert err_new < 0.1 and err_new < err_old / 3, (err_new, err_old)


def test_learner_device_helpers_train_on_the_gpu(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from arpo_async.core.config import config_from_dict
    from arpo_async.core.logits import causal_lm_logprobs
    from learner.batching import LeafSample, collate
    from learner.device import (
        attn_implementation,
        model_load_kwargs,
        prepare_model,
        setup_device,
        to_device,
    )

    cfg = config_from_dict({"cluster": {"device": "cuda"}, "model": {"dtype": "bfloat16"},
                            "learner": {"gradient_checkpointing": True}})
    device = setup_device(cfg)
    kwargs = model_load_kwargs(cfg)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, **kwargs).to(device)
    assert next(model.parameters()).dtype == torch.bfloat16
    assert model.config._attn_implementation == attn_implementation(cfg)[0]
    prepare_model(model, cfg)
    model.train()
    samples = [LeafSample(np.array(PROMPT, np.int32), np.array(TOKENS[:n], np.int32),
                          np.ones(n, np.float32), np.zeros(n, np.float32),
                          np.ones(n, np.float32), np.zeros(n, np.int32)) for n in (3, 8)]
    batch = to_device(collate(samples, pad_id=0), device)
    logp = causal_lm_logprobs(model, batch.input_ids, attention_mask=batch.attention_mask,
                              chunk=512).logp
    loss = -(logp * batch.weight).sum()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


# The learner's own start-up and trainer on the GPU, in a process of its own (it joins a
# torch.distributed group): NCCL backend, bf16 load, a DeepSpeed step on cuda, weights
# copied back to the host for the broadcast, the probe's log-probs.
_GPU_TRAINER = r"""
import json, sys
import numpy as np
import torch
import torch.distributed as dist
from arpo_async.core.config import config_from_dict
from learner.dist import init_distributed
from learner.batching import LeafSample

model = sys.argv[1]
cfg = config_from_dict({"cluster": {"device": "cuda"}, "model": {"path": model,
                        "dtype": "bfloat16"}, "learner": {"lr": 0.01}})
init_distributed(cfg)
from learner.trainer import PolicyTrainer
trainer = PolicyTrainer(cfg, model)
before = trainer.full_state()
rng = np.random.default_rng(0)
samples = [LeafSample(rng.integers(1, 500, 5).astype(np.int32),
                      rng.integers(1, 500, 12).astype(np.int32), np.ones(12, np.float32),
                      np.full(12, -3.0, np.float32), rng.standard_normal(12).astype(np.float32),
                      np.zeros(12, np.int32)) for _ in range(3)]
metrics = trainer.train_step(samples)
after = trainer.full_state()
param = next(trainer.engine.module.parameters())
print(json.dumps({
    "backend": dist.get_backend(), "device": str(param.device), "dtype": str(param.dtype),
    "attn": trainer.engine.module.config._attn_implementation,
    "state_dtypes": sorted({str(a.dtype) for a in after.values()}),
    "changed": sum(not torch.equal(before[k], after[k]) for k in after),
    "grad_norm": metrics["grad_norm"],
    "probe": trainer.sequence_logprobs([1, 2, 3], [4, 5, 6]),
}))
"""


def test_learner_trains_on_the_gpu_over_nccl(tiny_model_dir):
    import json
    import subprocess

    from tests.conftest import PY, REPO, python_env

    env = python_env() | {"DS_ACCELERATOR": "cuda"}
    res = subprocess.run([PY, "-c", _GPU_TRAINER, str(tiny_model_dir)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["backend"] == "nccl" and out["device"].startswith("cuda")
    assert out["dtype"] == "torch.bfloat16"  # loaded in the training dtype on GPU
    assert out["state_dtypes"] == ["torch.bfloat16"]  # the dtype travels with each tensor
    assert out["changed"] > 0 and np.isfinite(out["grad_norm"]) and out["grad_norm"] > 0
    assert len(out["probe"]) == 3 and all(np.isfinite(out["probe"]))


async def test_vllm_engine_on_gpu_generates_and_updates_in_place(tiny_model_dir):
    from actors.engines.base import GenRequest
    from actors.engines.vllm_engine import VLLMEngine

    engine = await VLLMEngine.create(tiny_model_dir, dtype="bfloat16", max_model_len=512,
                                     gpu_memory_utilization=0.3, enforce_eager=False,
                                     enable_prefix_caching=True, seed=0)
    try:
        res = await engine.generate(GenRequest(prompt_tokens=PROMPT, max_tokens=16,
                                               logprobs_topk=5))
        assert res.tokens and len(res.logprobs) == len(res.tokens) == len(res.top_logprobs)
        state = _perturbed(tiny_model_dir, seed=1)
        paused = await engine.update_weights(state, 1)
        assert engine.version == 1 and paused < 30
        _assert_loaded(np.array(await engine.sequence_logprobs(PROMPT, TOKENS)),
                       tiny_model_dir, state)
    finally:
        await engine.close()


async def test_nccl_weight_sync_into_a_vllm_actor_on_another_gpu(tiny_model_dir):
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL weight sync needs two GPUs (one NCCL rank per GPU)")
    from actors.engines.vllm_engine import VLLMEngine
    from arpo_async.core.config import config_from_dict
    from arpo_async.core.weights import build_weight_receiver
    from arpo_async.core.weights.nccl import NcclWeightReceiver, NcclWeightSender
    from arpo_async.core.weights.zeromq import WeightsRequest

    # learner rank 0 on GPU 1, the actor's vLLM worker on GPU 0; small chunks so that a
    # transfer takes several packed broadcasts and reuses both staging buffers
    server = NcclWeightSender(device_index=1, buffer_bytes=256 * 1024, timeout_s=120)
    engine = await VLLMEngine.create(tiny_model_dir, dtype="bfloat16", max_model_len=512,
                                     gpu_memory_utilization=0.3, weight_transfer="nccl")

    class Direct:  # the control channel, without sockets: straight to the server
        async def request(self, msg):
            assert not isinstance(msg, WeightsRequest), "weights must not go over ZeroMQ here"
            return server.handle(msg)

    try:
        cfg = config_from_dict({"cluster": {"device": "cuda"},
                                "learner": {"weight_sync": {"channel": "nccl", "timeout_s": 120}}})
        sync = await build_weight_receiver(cfg, Direct(), engine, actor_id=0)
        assert isinstance(sync, NcclWeightReceiver)
        assert await sync.sync(engine) is None  # nothing published yet
        for version, seed in [(1, 1), (2, 2)]:
            state = _perturbed(tiny_model_dir, seed)
            bf16 = {n: torch.from_numpy(a).to(torch.bfloat16) for n, a in state.items()}
            server.publish(version, bf16)
            got = await sync.sync(engine)
            assert (got.version, got.channel, engine.version) == (version, "nccl", version)
            _assert_loaded(np.array(await engine.sequence_logprobs(PROMPT, TOKENS)),
                           tiny_model_dir, state)
        assert await sync.sync(engine) is None
        stats = server.stats()
        assert stats["transfers"] == 2 and stats["aborted"] == 0
        assert stats["bytes"] == 2 * sum(t.nbytes for t in bf16.values())
    finally:
        await engine.close()
        server.close()


async def test_vllm_keep_tags_each_token_with_the_weights_that_sampled_it_on_gpu(
        tiny_model_dir):
    """actors.update_mode=keep on CUDA (CUDA graphs, vLLM's scheduling there): the workers'
    token counts at the freeze must be exact there too (checked on CPU token by token in
    tests/integration/test_engines.py). A planted effect: the call starts on sharp weights
    (the output layer x 20) and the update zeroes the output layer, so every token the new
    weights sample has log-prob exactly -log V, whatever KV it attends over; the version
    switch must fall exactly where those tokens begin."""
    import asyncio
    import math

    from actors.engines.base import GenRequest
    from actors.engines.vllm_engine import VLLMEngine

    engine = await VLLMEngine.create(tiny_model_dir, dtype="bfloat16", max_model_len=512,
                                     gpu_memory_utilization=0.3, enforce_eager=False, seed=0,
                                     update_mode="keep")
    try:
        state = _perturbed(tiny_model_dir, seed=2)
        sharp = {n: a * 20 if n == "lm_head.weight" else a for n, a in state.items()}
        flat = {n: a * 0 if n == "lm_head.weight" else a for n, a in state.items()}
        await engine.update_weights(sharp, 1)
        limit = 512 - len(PROMPT) - 1
        call = asyncio.create_task(engine.generate(GenRequest(
            PROMPT, max_tokens=limit, ignore_eos=True, logprobs_topk=1, seed=3)))
        while engine._gate.in_flight < 1:
            await asyncio.sleep(0.001)
        await engine.generate(GenRequest(PROMPT + [5], max_tokens=8, ignore_eos=True))
        await engine.update_weights(flat, 2)
        res = await call
        k = res.versions.index(2)
        assert 1 <= k < limit and res.versions == [1] * k + [2] * (limit - k)
        uniform = -math.log(len(engine_vocab(tiny_model_dir)))
        lp = np.asarray(res.logprobs)
        assert np.all(np.abs(lp[k:] - uniform) < 1e-2), lp[k:k + 4]
        assert np.all(np.abs(lp[:k] - uniform) > 1e-2), lp[max(0, k - 4):k]
        assert engine.stats()["kept_calls"] >= 1 and engine.stats()["recomputed_tokens"] == 0
    finally:
        await engine.close()


def engine_vocab(model_dir) -> range:
    import json
    from pathlib import Path

    return range(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
