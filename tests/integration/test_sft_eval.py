"""Cold-start SFT and the evaluation harness with real parts: a tiny model built here,
traces from the synthetic suite (real tools), torch training, the sandbox, the BM25
retriever process, the transformers and vLLM engines, and the endpoint engine against a
local aiohttp server of the OpenAI completions shape (backed by the real model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from aiohttp import web

from actors.engines.base import GenRequest
from actors.engines.endpoint_engine import EndpointEngine
from actors.engines.hf_engine import HFEngine
from arpo_async.core.config import config_from_dict
from arpo_async.core.files import read_jsonl
from arpo_async.jobs import synthetic as syn
from arpo_async.jobs.evaluate import evaluate, evaluate_async
from arpo_async.jobs.sft import encode_trace, load_traces, masked_lm_loss, mean_loss, run_sft
from toolenv.tasks import suite as gen

pytestmark = pytest.mark.integration

SPEC = gen.SuiteSpec(seed=1, entities=600, sft=300, rl=6, heldout=12)
EVAL_OVERRIDES = {"sampling": {"max_response_tokens": 200},
                  "tools": {"search": {"topk": SPEC.topk, "snippet_chars": SPEC.snippet_chars}},
                  "actors": {"engine": {"kv_cache_gib": 0.25}}}


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("suite")
    syn.write_suite(out, SPEC)
    return out


@pytest.fixture(scope="module")
def base_model(suite, tmp_path_factory) -> Path:
    from arpo_async.jobs.tiny_model import build_tiny_model

    traces = read_jsonl(suite / "sft.jsonl")
    return build_tiny_model(tmp_path_factory.mktemp("m") / "base", hidden=64, layers=2,
                            heads=2, vocab=1024, corpus=syn.chat_texts(traces))


@pytest.fixture(scope="module")
def tokenizer(base_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(base_model)


@pytest.fixture(scope="module")
def sft_run(base_model, suite, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("sft") / "ckpt"
    return run_sft(base_model, suite / "sft.jsonl", out, steps=250, lr=3e-3, batch_size=16,
                   threads=2, log=lambda line: None)


def _cfg(model: Path, **extra) -> object:
    tree = json.loads(json.dumps(EVAL_OVERRIDES))
    tree["model"] = {"path": str(model)}
    for key, value in extra.items():
        tree.setdefault(key, {}).update(value)
    return config_from_dict(tree)


# ------------------------------------------------------------------ SFT


def test_tool_tokens_are_masked_and_model_tokens_are_not(suite, tokenizer):
    trace = next(t for t in read_jsonl(suite / "sft.jsonl") if t["kind"] == "combo")
    ids, mask = encode_trace(tokenizer, trace)
    decode = lambda sel: tokenizer.decode(sel, skip_special_tokens=False)  # noqa: E731
    n_prompt = mask.index(1)
    model_text = decode([t for t, m in zip(ids, mask) if m])
    tool_text = decode([t for t, m in zip(ids[n_prompt:], mask[n_prompt:]) if not m])
    assert model_text == "".join(s["text"] for s in trace["segments"] if s["role"] == "model") \
        + tokenizer.eos_token
    assert tool_text == "".join(s["text"] for s in trace["segments"] if s["role"] == "tool")
    # Token in, token out: the tool segment is exactly what the actor appends.
    tool_seg = trace["segments"][1]["text"]
    start = n_prompt + len(tokenizer.encode(trace["segments"][0]["text"], add_special_tokens=False))
    assert ids[start:start + len(tokenizer.encode(tool_seg, add_special_tokens=False))] == \
        tokenizer.encode(tool_seg, add_special_tokens=False)


def test_loss_is_the_mean_over_model_targets_without_full_logits(suite, tokenizer, base_model):
    """The chunked loss equals the masked mean of the full-vocabulary cross-entropy, tool
    targets excluded, in value and gradient; a tool target that becomes a model target
    changes it."""
    from transformers import AutoModelForCausalLM

    from arpo_async.jobs.sft import collate

    data = load_traces(suite / "sft.jsonl", tokenizer, 512)[:2]
    ids, mask = collate(data, tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32)
    loss, m = masked_lm_loss(model, ids, mask, chunk=16)
    loss.backward()
    grad = model.get_output_embeddings().weight.grad.clone()
    model.zero_grad()
    logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    weight = mask[:, 1:]
    ref = (nll * weight).sum() / weight.sum()
    ref.backward()
    assert torch.allclose(loss, ref, atol=1e-6) and m["tokens"] == float(weight.sum())
    assert torch.allclose(grad, model.get_output_embeddings().weight.grad, atol=1e-7)
    hits = ((logp.argmax(-1) == ids[:, 1:]).float() * weight).sum() / weight.sum()
    assert m["accuracy"] == pytest.approx(float(hits))
    tool = ((mask[:, 1:] == 0) & (torch.arange(ids.shape[1] - 1) > 60)).nonzero()
    assert len(tool)
    more = mask.clone()
    more[tool[0, 0], tool[0, 1] + 1] = 1
    with torch.no_grad():
        assert not torch.allclose(masked_lm_loss(model, ids, more)[0], loss)


def test_short_sft_lowers_model_token_loss_and_saves_a_checkpoint(sft_run, base_model, suite,
                                                                   tokenizer):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    data = load_traces(suite / "sft.jsonl", tokenizer, 512)[:64]
    out = Path(sft_run["out"])
    before = AutoModelForCausalLM.from_pretrained(base_model, dtype=torch.float32).eval()
    after = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    loss_before = mean_loss(before, data, tokenizer.pad_token_id)
    loss_after = mean_loss(after, data, tokenizer.pad_token_id)
    assert sft_run["steps"] == 250
    assert loss_after < 0.5 * loss_before, (loss_before, loss_after)
    assert sft_run["loss_last"] < sft_run["loss_first"]
    assert AutoTokenizer.from_pretrained(out).encode("<python>") == tokenizer.encode("<python>")
    assert not out.with_name(out.name + ".tmp").exists()


def test_sft_rejects_a_bad_row_naming_it(tmp_path, tokenizer):
    from arpo_async.jobs.sft import SFTDataError

    bad = tmp_path / "bad.jsonl"
    row = {"question": "q", "segments": [{"text": "x", "role": "user"}]}
    bad.write_text(json.dumps(row) + "\n")
    with pytest.raises(SFTDataError, match=r"bad.jsonl: row 1: segment 0"):
        load_traces(bad, tokenizer, 512)


# ------------------------------------------------------------------ evaluation


def _check_summary(summary: dict, n: int, k: int, items_path: Path | None = None) -> None:
    assert summary["n"] == n and summary["k"] == k
    assert 0.0 <= summary["pass@1"] <= summary[f"pass@{k}"] <= 1.0
    if items_path is not None:
        items = [json.loads(line) for line in items_path.read_text().splitlines()]
        assert len(items) == n and all(len(it["responses"]) == k for it in items)
        # GRPO leaves share nothing, so every call a response made went through the runner.
        calls = sum(sum(it["tool_calls"]) for it in items)
        assert calls == summary["tools"]["calls"]
        assert summary["tool_calls_per_sample"] == pytest.approx(calls / (n * k), abs=1e-3)


def test_evaluate_synthetic_with_vllm_and_real_tools(sft_run, suite, tmp_path):
    pytest.importorskip("vllm")
    cfg = _cfg(Path(sft_run["out"]))
    summary = evaluate(cfg, suite / "heldout.jsonl", k=2, limit=6, out_dir=tmp_path,
                       engine="vllm", corpus=suite / "corpus.jsonl", log=lambda line: None)
    _check_summary(summary, 6, 2, tmp_path / "items.jsonl")
    assert set(summary["per_kind"]) == set(gen.KINDS)
    # After SFT the model calls the tools that the task kind needs.
    tools = summary["tools"]
    assert tools.get("python.calls", 0) > 0 and tools.get("search.calls", 0) > 0
    assert summary["format_ok"] > 0.5
    assert json.loads((tmp_path / "summary.json").read_text())["pass@1"] == summary["pass@1"]


@pytest.mark.parametrize("name", ["gsm8k_test.jsonl", "hotpotqa_test.jsonl"])
def test_evaluate_public_sets_with_tools(name, data_dir, sft_run, suite, tmp_path):
    cfg = _cfg(Path(sft_run["out"]))
    summary = evaluate(cfg, data_dir / name, k=2, limit=5, out_dir=tmp_path,
                       engine="transformers", corpus=suite / "corpus.jsonl",
                       log=lambda line: None)
    _check_summary(summary, 5, 2, tmp_path / "items.jsonl")
    assert set(summary["per_kind"]) == {"math" if "gsm8k" in name else "qa"}
    assert "tool_calls_per_question" in summary


def test_evaluate_skips_and_names_prompts_too_long_for_the_model(data_dir, sft_run, tmp_path):
    from toolenv.tasks.data import DataError

    # MATH-500 problems run past a 192-token context: skipped, counted, named; the rest
    # is evaluated
    cfg = _cfg(Path(sft_run["out"]), sampling={"max_response_tokens": 48})
    cfg.model.max_model_len = 192
    summary = evaluate(cfg, data_dir / "math500_test.jsonl", k=1, limit=8, out_dir=tmp_path,
                       engine="transformers", log=lambda line: None)
    rows = [json.loads(line) for line in (tmp_path / "items.jsonl").read_text().splitlines()]
    skipped = [r for r in rows if r.get("skipped") == "too_long"]
    assert summary["skipped_too_long"] == len(skipped) > 0 and summary["failed"] == 0
    assert summary["n"] == 8 - len(skipped) > 0
    assert all(r["prompt_tokens"] > 191 and r["row"] >= 1 for r in skipped)
    # refused up front with the flag, naming the file and the row, before any model loads
    with pytest.raises(DataError, match=rf"math500_test.jsonl: row {skipped[0]['row']}: "):
        evaluate(cfg, data_dir / "math500_test.jsonl", k=1, limit=8, engine="vllm",
                 refuse_too_long=True, log=lambda line: None)


async def test_one_failing_request_is_counted_and_the_rest_goes_on():
    from types import SimpleNamespace

    import numpy as np

    from arpo_async.jobs.evaluate import _run_items

    class Rollout:  # a fake: the second prompt's engine request fails
        async def run(self, prompt, actor_id):
            if prompt.id == "b":
                raise ValueError("prompt of 934 tokens (+1) exceeds model.max_model_len=512")
            leaf = SimpleNamespace(tokens=np.array([1, 2]), loss_mask=np.array([1, 1]),
                                   score=1.0, reward=1.0, tool_calls=0, finish_reason="stop")
            return SimpleNamespace(leaves=[leaf])

    source = SimpleNamespace(encode=lambda p: p)
    tok = SimpleNamespace(decode=lambda ids, skip_special_tokens=False: "x")
    prompts = [SimpleNamespace(id=i, kind="math", question="q", answers=["1"], meta={"row": n},
                               tokens=[])
               for n, i in enumerate("abc", 1)]
    lines: list[str] = []
    items, tokens = await _run_items(Rollout(), source, prompts, {}, tok, 2, lines.append)
    assert [r["id"] for r in items] == ["a", "b", "c"] and tokens == 4
    assert "error" in items[1] and items[1]["row"] == 2 and "max_model_len" in items[1]["error"]
    assert any("b: failed" in line for line in lines)


# ------------------------------------------------------------------ endpoint engine


def _fake_completions_app(engine: HFEngine, tok, token_ids: bool = True) -> web.Application:
    """The OpenAI /v1/completions shape (vLLM extensions included), backed by the real
    transformers engine; ``token_ids=False`` answers with token text like plain servers."""

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

    async def completions(request: web.Request) -> web.Response:
        body = await request.json()
        if body.get("model") != "tiny":
            return web.json_response({"error": "unknown model"}, status=404)
        prompt = body["prompt"]
        if body.get("echo"):
            lps = await engine.sequence_logprobs(prompt[:1], prompt[1:])
            return web.json_response({"choices": [{"text": "", "finish_reason": "length",
                                                   "logprobs": {"token_logprobs": [None, *lps]}}]})
        res = await engine.generate(GenRequest(
            prompt_tokens=prompt, max_tokens=body["max_tokens"], temperature=body["temperature"],
            top_p=body["top_p"], stop_token_ids=body.get("stop_token_ids", []),
            stop=body.get("stop", []), logprobs_topk=body["logprobs"], seed=body.get("seed")))
        names = ([f"token_id:{t}" for t in res.tokens] if token_ids
                 else [tok.decode([t]) for t in res.tokens])
        top = [{f"token_id:{j}": v for j, v in enumerate(vals)} for vals in res.top_logprobs]
        choice = {"index": 0, "text": tok.decode(res.tokens), "finish_reason": res.finish_reason,
                  "stop_reason": res.stop_reason,
                  "logprobs": {"tokens": names, "token_logprobs": res.logprobs,
                               "top_logprobs": top}}
        return web.json_response({"object": "text_completion", "choices": [choice]})

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_post("/v1/completions", completions)
    return app


async def _serve(app: web.Application) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    return runner, f"http://{host}:{port}"


async def test_endpoint_engine_matches_the_model_it_serves(sft_run, tokenizer):
    hf = await HFEngine.create(sft_run["out"], seed=0, max_model_len=512)
    prompt = gen.make_tasks(SPEC, "heldout")[1]
    ids = tokenizer.apply_chat_template(
        [{"role": "system", "content": gen.SYSTEM_PROMPT},
         {"role": "user", "content": prompt.question}], tokenize=True,
        add_generation_prompt=True, return_dict=False)
    stop = tokenizer.convert_tokens_to_ids(["</python>", "</search>", "</answer>"])
    req = GenRequest(prompt_tokens=list(ids), max_tokens=40, stop_token_ids=stop, seed=123,
                     logprobs_topk=5)
    runner, url = await _serve(_fake_completions_app(hf, tokenizer))
    endpoint = await EndpointEngine.create(url, tokenizer)
    try:
        assert endpoint.model == "tiny"
        direct, served = await hf.generate(req), await endpoint.generate(req)
        assert served.tokens == direct.tokens and served.finish_reason == direct.finish_reason
        assert served.logprobs == pytest.approx(direct.logprobs, abs=1e-6)
        assert len(served.top_logprobs) == len(direct.top_logprobs)
        for got, want in zip(served.top_logprobs, direct.top_logprobs):
            assert got == pytest.approx(want, abs=1e-6)
        assert endpoint.exact_tokens
        seq = await endpoint.sequence_logprobs(list(ids), direct.tokens)
        assert seq == pytest.approx(await hf.sequence_logprobs(list(ids), direct.tokens), abs=1e-5)
        with pytest.raises(NotImplementedError):
            await endpoint.update_weights({}, 1)
    finally:
        await endpoint.close()
        await runner.cleanup()

    runner, url = await _serve(_fake_completions_app(hf, tokenizer, token_ids=False))
    endpoint = await EndpointEngine.create(url, tokenizer)
    try:  # a server that returns token text: ids recovered by encoding, flagged inexact
        served = await endpoint.generate(req)
        assert not endpoint.exact_tokens
        assert tokenizer.decode(served.tokens) == tokenizer.decode(direct.tokens)
    finally:
        await endpoint.close()
        await runner.cleanup()
        await hf.close()


async def test_evaluate_through_an_endpoint(sft_run, suite, tokenizer, tmp_path):
    hf = await HFEngine.create(sft_run["out"], seed=0, max_model_len=512)
    runner, url = await _serve(_fake_completions_app(hf, tokenizer))
    try:
        summary = await evaluate_async(_cfg(Path(sft_run["out"])), suite / "heldout.jsonl", k=2,
                                       limit=3, out_dir=tmp_path, endpoint=url,
                                       corpus=suite / "corpus.jsonl", log=lambda line: None)
    finally:
        await runner.cleanup()
        await hf.close()
    assert summary["engine"] == "endpoint"
    _check_summary(summary, 3, 2, tmp_path / "items.jsonl")
    shutil.rmtree(tmp_path / "tool_cache", ignore_errors=True)
