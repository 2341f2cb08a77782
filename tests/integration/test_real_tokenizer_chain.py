"""The whole chain on genuine tokenizers (their chat templates with thinking off, their
logits), for two families: Qwen3 (151,936 logits, hermes JSON calls) and Qwen3.5 (248,320
logits, XML calls read by vLLM's ``qwen3_coder`` parser): cold-start SFT steps, an
evaluation of a handful of prompts with real vLLM and the Python sandbox, and (Qwen3's
chain) RL steps through the launcher (a vLLM actor, the DeepSpeed learner, the sandbox,
ZeroMQ).

The model is the tiny Qwen3 body around that tokenizer with a scripted next-token law
(tests/integration/scripted_law.py), so that it writes a real call in the family's format:
every prompt and every tool turn ends in the empty think block's ``\\n\\n`` token, after
which it writes, nine times in ten, the call below, and otherwise ``<answer>\\boxed{78}
</answer>`` (the XML call as tokens that do not repeat, ``Law.unique_ids``: the law is
first order). Checked: the call is parsed, run in the sandbox and its output inserted as
the template renders a tool message; the learner's log-probs agree with the actor's at
step 1 (the importance ratio of every trained token within 1e-3) and after each update (a
fixed probe sequence through vLLM and through the learner at versions 1 and 2); the
rollout's entropy is normalised by ln of the tokenizer's size, as the ARPO reference
divides by ``math.log(len(self.tokenizer.get_vocab()))`` (RUC-NLPIR/ARPO
``vllm_rollout_with_tools.py``), not by the padded logits.
"""

from __future__ import annotations

import json
import math
import subprocess
from pathlib import Path

import numpy as np
import pytest
from transformers import AutoTokenizer

from arpo_async.core.config import SPINE_CONFIG, config_from_dict
from arpo_async.jobs import synthetic as syn
from arpo_async.jobs.sft import run_sft
from tests.conftest import PY, REPO, python_env
from tests.integration.scripted_law import SURE, Law, scripted_model

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ANSWER = "<answer>\\boxed{78}</answer>"
OFF = {"enable_thinking": False}
# per family: the tool syntax, a call in its format (hermes: tokens that never repeat with
# another successor as written; XML: Law.unique_ids), logits rows, tokenizer size
FAMILIES = {
    "qwen3": ("hermes", '<tool_call>\n{\n"name"\n:"python","arguments": {"code"  '
              ':"print(13*6)"\t}}\n</tool_call>', 151936, 151669),
    # (one newline: Qwen3.5's tokenizer merges no punctuation with a newline, so a first-order
    # law cannot write the template's newline after every tag; the parser reads both)
    "qwen3.5": ("qwen3_coder", "<tool_call>\n<function=python><parameter=code>print(13*6)"
                "</parameter></function></tool_call>", 248320, 248077),
}


def _tools(family: str, enabled=("python",)) -> dict:
    return {"enabled": list(enabled), "syntax": FAMILIES[family][0], "timeout_s": 10.0}


def _law(tok, call_text: str) -> Law:
    law = Law(tok)
    end = law.ids("<think>\n\n</think>\n\n")[-1]  # the last token of a prompt and a tool turn
    call = law.unique_ids(call_text, avoid={end})
    law.chain(call)
    answer = law.unique_ids(ANSWER, avoid={end, call[0]})
    law.chain(answer)
    law.choose(end, {call[0]: SURE, answer[0]: SURE - math.log(9)})  # a call 9 times in 10
    return law


def _chain(request, tmp_path_factory):
    """(family, SFT checkpoint, suite folder, SFT result): the scripted model after 2 SFT
    steps on traces in the family's call format (a learning rate small enough to keep the
    law)."""
    family = request.param
    base = request.getfixturevalue("qwen3_model_dir" if family == "qwen3"
                                   else "qwen35_model_dir")
    tmp = tmp_path_factory.mktemp("chain")
    tok = AutoTokenizer.from_pretrained(base)
    scripted_model(base, tmp / "scripted", tok, _law(tok, FAMILIES[family][1]))
    suite = tmp / "suite"
    syn.write_suite(suite, syn.SuiteSpec(seed=2, entities=40, sft=8, rl=8, heldout=4))
    res = run_sft(tmp / "scripted", suite / "sft.jsonl", tmp / "sft", steps=2, lr=1e-7,
                  batch_size=4, threads=2, max_len=1024, log=lambda line: None,
                  tools=config_from_dict({"tools": _tools(family, ("python", "search"))}
                                         ).tools, template_kwargs=OFF)
    return family, Path(res["out"]), suite, res


# Qwen3 here; Qwen3.5 in test_real_tokenizer_chain_xml.py, a file of its own so that the two
# chains (4-5 min each) run on different pytest-xdist workers.
chain = pytest.fixture(scope="module", params=["qwen3"])(_chain)


async def test_sft_then_evaluation_with_a_call_in_the_sandbox(chain, tmp_path):
    from arpo_async.jobs.evaluate import evaluate_async
    from toolenv.syntax import build_syntax

    family, ckpt, suite, sft = chain
    _, call, rows, _ = FAMILIES[family]
    assert sft["steps"] == 2 and math.isfinite(sft["loss_last"]) and sft["peak_rss_mb"] > 0
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == rows
    cfg = config_from_dict({"model": {"path": str(ckpt), "max_model_len": 1024,
                                      "chat_template_kwargs": OFF},
                            "sampling": {"max_response_tokens": 300},
                            "actors": {"engine": {"kv_cache_gib": 0.25}},
                            "tools": _tools(family)})
    summary = await evaluate_async(cfg, suite / "heldout.jsonl", k=1, out_dir=tmp_path / "eval",
                                   log=lambda line: None)
    assert summary["n"] == 4 and summary["failed"] == summary["skipped_too_long"] == 0
    tools = summary["tools"]  # run in the sandbox (the others were served by the cache)
    assert tools["executed"] >= 1 and tools["python.calls"] >= 1 and tools["errors"] == 0
    assert summary["tool_calls_per_sample"] > 0
    tok = AutoTokenizer.from_pretrained(ckpt)
    turn = build_syntax(cfg.tools, tok, OFF).result_text("78")
    assert turn.startswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n78\n</tool_response>")
    items = [json.loads(line) for line in (tmp_path / "eval" / "items.jsonl").open()]
    responses = [r for item in items for r in item["responses"]]
    # parsed, run in the sandbox (print(13*6) -> 78), inserted as the template's tool turn
    assert any(r.startswith(call + turn) for r in responses), responses


def test_rl_steps_through_the_launcher_agree_at_step_one(chain, tmp_path):
    family, ckpt, suite, _ = chain
    run_dir = tmp_path / "rl"
    overrides = [
        f"run.dir={run_dir}", "run.probe_logprobs=true", f"model.path={ckpt}",
        "model.max_model_len=1024", "model.chat_template_kwargs={enable_thinking: false}",
        "actors.num=1", "actors.engine.kv_cache_gib=0.25", "task.name=file",
        f"task.data={suite / 'rl.jsonl'}", "tools.enabled=[python]",
        f"tools.syntax={FAMILIES[family][0]}",
        "rollout.mode=arpo", "rollout.group_size=4", "rollout.initial_samples=2",
        "rollout.tool_call_limit=2", "sampling.round_max_tokens=null",
        "sampling.max_response_tokens=300", "learner.max_steps=3", "learner.batch_groups=1",
        # lockstep: step 3 trains only groups sampled on v2, so the actor loads (and
        # probes) v1 and v2 before the run can end, whatever the timing
        "learner.max_staleness=0",
        "learner.loss.proximal=recompute", "learner.lr=1e-3"]
    res = subprocess.run([PY, "-m", "arpo_async.launch", "--config", str(SPINE_CONFIG),
                          "--quiet", *overrides], cwd=REPO, env=python_env(),
                         capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "ok"
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert sum(r["tool_calls"] for r in rows) >= 1  # the calls ran in the sandbox
    # step 1: every trained token's learner log-prob (before the update) against the
    # actor's behaviour log-prob: exp(prox - mu) within 1e-3 of 1
    first = rows[0]
    assert 1 - 1e-3 <= first["loss/is_raw_weight_min"] <= first["loss/is_raw_weight_max"] \
        <= 1 + 1e-3, first
    learner = {r["version"]: r["logprobs"] for r in map(
        json.loads, (run_dir / "learner_probe.jsonl").read_text().splitlines())}
    actor = {r["version"]: r["logprobs"] for r in map(
        json.loads, (run_dir / "actor0_probe.jsonl").read_text().splitlines())}
    assert {1, 2} <= set(actor)  # probed when the actor loads each published version
    for version in (1, 2):
        np.testing.assert_allclose(actor[version], learner[version], atol=1e-3, rtol=0)
    # the updates reached vLLM (Qwen3.5's 248,320 near-uniform logits move by ~1e-4)
    assert not np.allclose(actor[1], actor[2], atol=1e-6, rtol=0)


def test_round_entropy_is_normalised_as_the_reference_does(chain):
    """ARPO's reference: ``vocab_size = len(self.tokenizer.get_vocab())``,
    ``entropy_norm_factor = math.log(vocab_size)``: 151,669 for Qwen3's tokenizer, the
    rows of the output layer (151,936) include Qwen's padding (Qwen3.5: 248,077 and
    248,320)."""
    from actors.rollout import POLICIES, build_rollout
    from toolenv.tasks.prompts import PromptSource

    family, ckpt, suite, _ = chain
    _, _, rows, size = FAMILIES[family]
    tok = AutoTokenizer.from_pretrained(ckpt)
    cfg = config_from_dict({"model": {"path": str(ckpt), "max_model_len": 1024,
                                      "chat_template_kwargs": OFF}, "tools": _tools(family),
                            "task": {"name": "file", "data": str(suite / "rl.jsonl")}})
    rollout = build_rollout(cfg, None, PromptSource(cfg, tok), tok, None,
                           np.random.default_rng(0), POLICIES[cfg.rollout.mode])
    assert rollout.stepper.vocab == len(tok.get_vocab()) == size
    assert json.loads((ckpt / "config.json").read_text())["vocab_size"] == rows
