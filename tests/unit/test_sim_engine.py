"""The simulated engine: its entropy law, its pacing, how rounds end, its weight updates,
and the launcher's grouping of simulated actors into processes."""

from __future__ import annotations

import asyncio
import math
import time
from pathlib import Path

import numpy as np
import pytest

from actors.engines.base import GenRequest
from actors.engines.sim_engine import EntropyTable, SimulatedEngine, load_vocab
from actors.main import parse_ids
from arpo_async.core.config import SPINE_CONFIG, load_config
from arpo_async.core.entropy import entropy_from_topk, window_entropy
from toolenv.tags import find_tool_call


def _cfg(model: Path, *overrides: str):
    """The simulated engine's config; an override without a section is one of its keys."""
    keys = [o if "." in o.split("=", 1)[0] else f"actors.engine.{o}" for o in overrides]
    return load_config(SPINE_CONFIG, overrides=["actors.engine=simulated", f"model.path={model}",
                                                "actors.engine.tokens_per_s=100000", *keys])


async def _engine(model: Path, *overrides: str, seed: int = 0) -> SimulatedEngine:
    return await SimulatedEngine.create(_cfg(model, *overrides), str(model), seed=seed)


@pytest.fixture(scope="module")
def vocab(tiny_model_dir):
    return load_vocab(str(tiny_model_dir))


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir))


def _stops(vocab) -> list[int]:
    return [vocab.tags[t][0] for t in ("</python>", "</search>", "</answer>")] + [vocab.eos]


# ----------------------------------------------------------------------------- entropy law
@pytest.mark.parametrize("k", [5, 20])
@pytest.mark.parametrize("target", [0.02, 0.3, 0.5, 0.8, 0.97])
def test_topk_estimate_equals_target_and_exact_entropy(target, k):
    v = 2048
    table = EntropyTable(v, k)
    s, log_z = table.slope(np.array([target]))
    ranks = np.arange(v)
    logp = table.logprobs(np.full(v, s[0]), np.full(v, log_z[0]), ranks)
    assert abs(np.exp(logp).sum() - 1.0) < 1e-9
    exact = -(np.exp(logp) * logp).sum() / math.log(v)
    estimate = entropy_from_topk([logp[:k].tolist()], v)[0]
    assert abs(exact - target) < 2e-3
    assert abs(estimate - exact) < 1e-9  # the tail is uniform: the estimate is exact
    assert np.all(np.diff(logp[:k]) <= 0)  # top-k listed best first


def test_sampled_ranks_follow_the_law():
    """E[-log p(rank)] over sampled ranks is the entropy (in nats), and the empirical
    frequency of rank 0 is p_0."""
    v, k = 2048, 20
    table = EntropyTable(v, k)
    rng = np.random.default_rng(0)
    for target in (0.2, 0.6):
        n = 40000
        s, log_z = table.slope(np.full(n, target))
        ranks = table.sample_ranks(s, log_z, rng)
        assert ranks.min() >= 0 and ranks.max() < v
        logp = table.logprobs(s, log_z, ranks)
        assert abs(-logp.mean() / math.log(v) - target) < 0.01
        p0 = math.exp(-log_z[0])
        assert abs((ranks == 0).mean() - p0) < 4 * math.sqrt(p0 * (1 - p0) / n) + 1e-3


# ----------------------------------------------------------------------------- rounds
async def test_round_ends_in_a_parsable_tool_call(tiny_model_dir, vocab, tokenizer):
    eng = await _engine(tiny_model_dir, "tools.enabled=[python]", "tool_call_prob=1")
    close = vocab.tags["</python>"][0]
    res = await eng.generate(GenRequest([1, 2, 3], 200, stop_token_ids=_stops(vocab), seed=4))
    assert res.finish_reason == "stop" and res.stop_reason == close and res.tokens[-1] == close
    call = find_tool_call(tokenizer.decode(res.tokens, skip_special_tokens=False))
    assert call is not None and call.name == "python" and call.args.startswith("print(")
    # "print(a+b)", both terms drawn from [0, 100) (sim_engine._tool_call): valid Python
    a, _, b = call.args.removeprefix("print(").removesuffix(")").partition("+")
    assert call.args == f"print({a}+{b})" and a.isdigit() and b.isdigit(), call.args
    assert int(a) < 100 and int(b) < 100, call.args
    assert eval(call.args.removeprefix("print"), {}) == int(a) + int(b)
    # the tool's closing tag is not a stop of this request: no tool call is made
    res = await eng.generate(GenRequest([1, 2, 3], 200, stop_token_ids=[vocab.eos], seed=4))
    assert close not in res.tokens


async def test_round_ends_in_an_answer_or_length(tiny_model_dir, vocab, tokenizer):
    eng = await _engine(tiny_model_dir, "tool_call_prob=0", "round_tokens_min=30",
                        "round_tokens_max=30")
    res = await eng.generate(GenRequest([5, 6], 100, stop_token_ids=_stops(vocab),
                                        logprobs_topk=20, seed=1))
    text = tokenizer.decode(res.tokens, skip_special_tokens=False)
    assert res.finish_reason == "stop" and text.endswith("</answer>")
    assert "\\boxed{" in text.split("<answer>")[1]
    assert text.count("<") == 2  # free text never contains a tag of its own
    assert len(res.logprobs) == len(res.top_logprobs) == len(res.tokens)
    assert all(len(t) == 20 for t in res.top_logprobs) and max(res.logprobs) <= 0
    assert max(res.tokens) < len(tokenizer) and min(res.tokens) >= 0
    short = await eng.generate(GenRequest([5, 6], 10, stop_token_ids=_stops(vocab), seed=1))
    assert short.finish_reason == "length" and len(short.tokens) == 10
    assert short.tokens == res.tokens[:10]  # same seed, same draw


async def test_end_of_round_shares(tiny_model_dir, vocab):
    """tool_call_prob applies only when a tool can be called; eos_prob always."""
    eng = await _engine(tiny_model_dir, "tools.enabled=[python]", "tool_call_prob=0.5",
                        "eos_prob=0.2")
    ends = {"tool": 0, "eos": 0, "answer": 0}
    for seed in range(400):
        for stops in (_stops(vocab), _stops(vocab)[1:]):  # with and without </python>
            res = await eng.generate(GenRequest([1, 2], 200, stop_token_ids=stops, seed=seed))
            last = res.tokens[-1]
            key = ("tool" if last == vocab.tags["</python>"][0] else
                   "eos" if last == vocab.eos else "answer")
            ends[key] += 1
    # with </python>: 50% tool, 20% eos, 30% answer; without: 0%, 20%, 80%
    assert abs(ends["tool"] / 800 - 0.25) < 0.05
    assert abs(ends["eos"] / 800 - 0.20) < 0.05
    assert abs(ends["answer"] / 800 - 0.55) < 0.05


async def test_entropy_rises_after_a_tool_result(tiny_model_dir, vocab):
    eng = await _engine(tiny_model_dir, "entropy=0.3", "entropy_after_tool=0.8",
                        "entropy_noise=0")
    after = [1, 2, 3, *vocab.tool_result_end, 198]
    for prompt, want in (([1, 2, 3], 0.3), (after, 0.8)):
        res = await eng.generate(GenRequest(prompt, 40, stop_token_ids=_stops(vocab),
                                            logprobs_topk=20, seed=2))
        h = window_entropy(entropy_from_topk(res.top_logprobs, vocab.size), 20, "mean")
        assert abs(h - want) < 3e-3, (prompt, h)


async def test_seeds_and_bad_prompts(tiny_model_dir, vocab):
    a = await _engine(tiny_model_dir, seed=0)
    b = await _engine(tiny_model_dir, seed=1)
    req = GenRequest([1, 2], 50, stop_token_ids=_stops(vocab), seed=9)
    assert (await a.generate(req)).tokens != (await b.generate(req)).tokens
    with pytest.raises(ValueError, match="empty"):
        await a.generate(GenRequest([], 5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        await a.generate(GenRequest([1, vocab.size], 5))
    with pytest.raises(ValueError, match="max_model_len"):
        await a.generate(GenRequest([1] * 600, 5))


# ----------------------------------------------------------------------------- pacing
async def test_pacing_per_sequence_and_engine_cap(tiny_model_dir, vocab):
    eng = await _engine(tiny_model_dir, "tokens_per_s=400", "round_tokens_min=60",
                        "round_tokens_max=60", "chunk_tokens=4")
    req = GenRequest([1, 2], 40, seed=3)  # 40 tokens at 400/s: 0.1 s
    t0 = time.perf_counter()
    await asyncio.gather(*(eng.generate(req) for _ in range(4)))
    alone = time.perf_counter() - t0
    assert 0.09 <= alone < 0.6
    capped = await _engine(tiny_model_dir, "tokens_per_s=400", "round_tokens_min=60",
                           "round_tokens_max=60", "chunk_tokens=4",
                           "engine_tokens_per_s=400")
    t0 = time.perf_counter()
    await asyncio.gather(*(capped.generate(req) for _ in range(4)))  # 160 tokens at 400/s
    assert time.perf_counter() - t0 >= 0.36


# ----------------------------------------------------------------------------- weights
@pytest.mark.parametrize("mode", ["drain", "interrupt"])
async def test_update_checks_names_and_drains_or_interrupts_calls_in_flight(tiny_model_dir,
                                                                              mode):
    from safetensors.numpy import load_file

    eng = await _engine(tiny_model_dir, "tokens_per_s=500", "round_tokens_min=50",
                        "round_tokens_max=50", "update_s=0.05", "chunk_tokens=4",
                        f"actors.update_mode={mode}")
    weights = load_file(str(next(Path(tiny_model_dir).glob("*.safetensors"))))
    with pytest.raises(ValueError, match="missing"):
        await eng.update_weights(dict(list(weights.items())[1:]), 1)
    bad = dict(weights)
    name = next(iter(bad))
    bad[name] = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match="shape"):
        await eng.update_weights(bad, 1)
    assert eng.version == 0
    gen = asyncio.create_task(eng.generate(GenRequest([1, 2], 40, seed=1)))  # 0.08 s
    await asyncio.sleep(0.01)
    paused = await eng.update_weights(weights, 1)
    res = await gen
    assert eng.version == 1 and len(res.versions) == len(res.tokens) == 40
    assert paused >= 0.05 + eng.last_update["drain_s"] - 1e-6
    if mode == "drain":  # the update waited for the call: all of it is version 0
        assert res.versions == [0] * 40 and res.interruptions == 0
        assert eng.last_update["drain_s"] > 0.03
    else:  # stopped at a chunk boundary (4 tokens, 8 ms), resumed under version 1
        k = res.versions.index(1)
        assert 0 < k < 40 and res.versions == [0] * k + [1] * (40 - k)
        assert res.interruptions == 1 and res.version == 1
        assert eng.last_update["drain_s"] < 0.03
    after = await eng.generate(GenRequest([1, 2], 5, seed=1))
    assert after.version == 1


# ----------------------------------------------------------------------------- hosting
def test_parse_ids():
    assert parse_ids("0-3,7") == [0, 1, 2, 3, 7]
    for bad in ("", "a", "1-2,2", "3-x"):
        with pytest.raises(ValueError, match="--actor-ids"):
            parse_ids(bad)


def test_launcher_groups_simulated_actors(tmp_path):
    from arpo_async.launcher.supervisor import plan

    cfg = load_config(SPINE_CONFIG, overrides=["actors.engine=simulated", "actors.num=5",
                                 "actors.engine.actors_per_process=2", f"run.dir={tmp_path}"])
    roles, _ = plan(cfg, tmp_path / "config.yaml")
    assert [r.name for r in roles] == ["learner", "actors0-1", "actors2-3", "actors4-4"]
    assert roles[3].cmd[1:] == ["-m", "actors.main", "--config",
                                str(tmp_path / "config.yaml"), "--actor-ids", "4-4"]
    cfg.actors.engine = "vllm"  # real engines: one process per actor
    roles, _ = plan(cfg, tmp_path / "c.yaml")
    assert [r.name for r in roles][1:] == [f"actor{i}" for i in range(5)]


def test_simulated_actors_starting_together_load_the_tokenizer_once(tiny_model_dir, monkeypatch):
    """64 simulated actors of one process start at once, each loading its vocabulary in a
    worker thread: one load, the others wait for it (concurrent first imports of
    transformers raised ImportError in the ingest bench)."""
    import threading
    import time

    import transformers

    from actors.engines import sim_engine

    sim_engine._load_vocab.cache_clear()
    inside, most, calls = [0], [0], []
    real = transformers.AutoTokenizer.from_pretrained

    def slow(path, *a, **kw):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        calls.append(path)
        time.sleep(0.2)  # every other thread arrives while this one loads
        inside[0] -= 1
        return real(path, *a, **kw)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", slow)
    start = threading.Barrier(8)
    got = []

    def actor():
        start.wait()
        got.append(sim_engine.load_vocab(str(tiny_model_dir)))

    threads = [threading.Thread(target=actor) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sim_engine._load_vocab.cache_clear()
    assert len(calls) == 1 and most[0] == 1 and len(got) == 8
    assert all(v is got[0] for v in got) and got[0].tokenizer is not None
