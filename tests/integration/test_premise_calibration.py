"""The outcome test of ARPO's premise (``analyze branching``) calibrated on worlds whose
answer is known: the real AgentRollout, fork mechanics, reward and estimator over the
simulated engine, where a post-tool state is *settled* (every continuation answers at
once and the same: discordance 0) or *open* (continuations call tools again or answer at
random: discordance well above 0), decided by a hash of the state.

* null world: the entropy of the round after the result (actors.engine.entropy_after_tool 0.425 or
  0.575) comes from a second, independent hash: it says nothing about the outcome, so the
  useful-fork ratio's 90% interval must cover 1;
* planted world: open states get the high entropy, settled ones the low: the ratio must
  be clearly above 1 (its interval's low end above 1).

The Python tool is a fake (sums the snippet's two numbers; every fourth sum "raises") so
the test stays fast; its ok/error kinds exercise the by-kind breakdown."""

from __future__ import annotations

import dataclasses
import json
import zlib

import numpy as np
import pytest

from actors.engines.sim_engine import SimulatedEngine
from arpo_async.core.config import SPINE_CONFIG, load_config
from arpo_async.jobs.analyze_branching import probe_prompts, result_kind, summarize
from toolenv.base import ToolResult
from toolenv.runner import ToolRunner

pytestmark = [pytest.mark.integration]

LOW, HIGH = 0.425, 0.575  # post-tool entropy; first rounds 0.5: dH = +-1.5 over 20 tokens
PROMPTS, K, ROOTS = 32, 8, 8


class FakePython:
    name, version = "python", "fake-1"
    description, parameters = "sums", {"type": "object"}

    async def call(self, args: str) -> ToolResult:
        a, _, b = args.removeprefix("print(").removesuffix(")").partition("+")
        total = int(a) + int(b)
        if total % 4 == 0:
            return ToolResult("Traceback: ZeroDivisionError", ok=False, error="exception")
        return ToolResult(str(total), ok=True)


class PlantedEngine:
    """Simulated engines chosen per request by the state it continues from (see the module
    docstring). A settled state's rounds come from an engine that never calls a tool, with
    a seed from the state, so every continuation is the same answer."""

    def __init__(self, engines: dict, end: tuple[int, ...], planted: bool):
        self.engines, self.end, self.planted = engines, end, planted
        self.version, self.calls = 0, 0

    def _state(self, tokens: list[int]) -> int | None:
        n = len(self.end)
        for i in range(len(tokens) - n, -1, -1):
            if tuple(tokens[i:i + n]) == self.end:
                return zlib.crc32(np.asarray(tokens[:i + n], np.int64).tobytes())
        return None

    async def generate(self, req):
        self.calls += 1
        h = self._state(req.prompt_tokens)
        if h is None:
            return await self.engines["first"].generate(req)
        settled = np.random.default_rng([h, 1]).random() < 0.5
        high = (not settled) if self.planted else np.random.default_rng([h, 2]).random() < 0.5
        engine = self.engines[("settled" if settled else "open", HIGH if high else LOW)]
        if settled:
            req = dataclasses.replace(req, seed=h % 2**31)
        return await engine.generate(req)

    async def close(self) -> None:
        return None


def _cfg(model, data, *extra):
    return load_config(SPINE_CONFIG, overrides=[
        "actors.engine=simulated", f"model.path={model}",
        *(f"actors.engine.{kv}" for kv in ("tokens_per_s=10000000", "round_tokens_min=20",
                                           "round_tokens_max=30", "entropy=0.5",
                                           "entropy_noise=0.05")),
        "tools.enabled=[python]", "rollout.tool_call_limit=3",
        "rollout.entropy_estimator=tail_corrected", "rollout.entropy_reduce=sum",
        "rollout.alpha=0.5", "rollout.beta=0.2", "sampling.max_response_tokens=320",
        "sampling.round_max_tokens=null", "model.max_model_len=1024", "task.name=file",
        f"task.data={data}", *extra])


async def _world(tmp_path, model, planted: bool, resume=None, n: int = PROMPTS):
    from transformers import AutoTokenizer

    from arpo_async.jobs.evaluate import eval_config
    from toolenv.tasks.prompts import PromptSource
    from toolenv.tasks.suite import SYSTEM_PROMPT

    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": f"What is {i} + 3?",
                                        "answer": str(i % 7 + 3), "ability": "math"}) + "\n"
                            for i in range(n)))
    cfg = eval_config(_cfg(model, data), data, K)
    engines = {"first": await SimulatedEngine.create(
        _cfg(model, data, "actors.engine.tool_call_prob=0.9"), str(model), seed=0)}
    for kind, prob in (("settled", 0.0), ("open", 0.5)):
        for h in (LOW, HIGH):
            engines[(kind, h)] = await SimulatedEngine.create(
                _cfg(model, data, f"actors.engine.tool_call_prob={prob}",
                     f"actors.engine.entropy_after_tool={h}"),
                str(model), seed=0)
    engine = PlantedEngine(engines, engines["first"].vocab.tool_result_end, planted)
    tok = AutoTokenizer.from_pretrained(str(model))
    source = PromptSource(cfg, tok)
    prompts = source.items[:n]
    for p in prompts:
        p.system_prompt = p.system_prompt or SYSTEM_PROMPT
        source.encode(p)
    tools = ToolRunner({"python": FakePython()}, None, rate_per_s=0, concurrency=64,
                       timeout_s=5.0, retries=0)
    records = await probe_prompts(cfg, engine, source, tok, tools, prompts, K, ROOTS, seed=3,
                                  resume=resume, settings={"planted": planted},
                                  log=lambda _: None)
    return records, engine


async def test_null_world_covers_one_and_planted_world_exceeds_it(tiny_model_dir, tmp_path):
    null, _ = await _world(tmp_path, tiny_model_dir, planted=False)
    planted, _ = await _world(tmp_path, tiny_model_dir, planted=True)
    res_null, res_planted = summarize(null, seed=0), summarize(planted, seed=0)
    print("null", {k: res_null[k] for k in ("useful_fork_ratio", "ci_low", "ci_high",
                                            "top_third_ratio", "top_ci_low", "top_ci_high",
                                            "states", "d_mean", "corr_dh_d")})
    print("planted", {k: res_planted[k] for k in ("useful_fork_ratio", "ci_low", "ci_high",
                                                  "top_third_ratio", "top_ci_low", "top_ci_high",
                                                  "states", "d_mean", "corr_dh_d")})
    for res in (res_null, res_planted):
        assert res["prompts"] == PROMPTS and res["states"] >= 40, res
        assert 0.1 < res["d_mean"] < 0.6 and 0.3 < res["p_mean"] < 0.7, res
        assert {"python:ok", "python:error"} <= set(res["corr_by_kind"]), res["corr_by_kind"]
        assert set(res["corr_by_tool"]) == {"python"}
        assert res["fork_vs_global"] > 0
    assert res_null["ci_low"] <= 1.0 <= res_null["ci_high"], res_null
    assert res_planted["ci_low"] > 1.15 and res_planted["useful_fork_ratio"] > 1.3, res_planted
    assert res_planted["corr_dh_d"] > 0.4 > abs(res_null["corr_dh_d"])
    # the sharpest allocation by dH (fork only at its top third) is calibrated the same way
    assert res_null["top_ci_low"] <= 1.0 <= res_null["top_ci_high"], res_null
    assert res_planted["top_ci_low"] > res_planted["ci_low"], res_planted
    for rec in planted:  # every probed state: K continuations, P and dH from the rollout
        assert len(rec["global"]) == K and len(rec["global_calls"]) == K
        for s in rec["states"]:
            assert len(s["rewards"]) == K and s["root"] < ROOTS and s["tool"] == "python"
            assert s["p"] == pytest.approx(min(1, max(0, 0.5 + 0.2 * s["dh"])))
            assert 1 <= s["call_index"] <= 3 and len(s["calls"]) == K
            assert all(0 <= c <= 3 - s["call_index"] for c in s["calls"])
            assert 0 <= s["h_max"] <= 1  # one token's normalised entropy
    # the rules screen on the same states: in the planted world the oracle and ARPO's P
    # beat random placement; in the null world no entropy rule does. The two worlds differ
    # only in the entropy drawn after a result (the outcomes are the same), and their class
    # structure is real (states at the tool-call limit end alike), so ``stratum`` finds
    # the same thing in both: it must not move with entropy
    sp, sn = res_planted["screen"], res_null["screen"]
    print("screen planted", {k: (round(v["ratio"], 3), v["perm_p"]) for k, v in sp.items()})
    print("screen null", {k: (round(v["ratio"], 3), v["perm_p"]) for k, v in sn.items()})
    assert res_planted["screen_missing"] == [] and sp["random"]["ratio"] == pytest.approx(1)
    assert sp["oracle"]["ci_low"] > 1 and sp["arpo"]["ci_low"] > 1
    assert sp["arpo"]["perm_p"] < 0.01 and sp["max_token"]["perm_p"] < 0.01
    assert sn["oracle"]["ci_low"] > 1
    for name in ("arpo", "max_token", "prompt_pq"):
        assert sn[name]["perm_p"] > 0.05, (name, sn[name])
    assert sn["stratum"]["ratio"] == pytest.approx(sp["stratum"]["ratio"])


async def test_a_rerun_reads_finished_prompts_back(tiny_model_dir, tmp_path):
    resume = tmp_path / "out" / "branching_prompts.jsonl"
    first, engine = await _world(tmp_path, tiny_model_dir, True, resume, n=4)
    assert engine.calls > 0 and len(resume.read_text().splitlines()) == 4 + 1
    with resume.open("a") as fh:
        fh.write('{"index": 5, "glo')  # a line cut by a kill: ignored, prompt 5 redone
    again, engine = await _world(tmp_path, tiny_model_dir, True, resume, n=4)
    assert engine.calls == 0 and again == first  # nothing sampled twice
    more, engine = await _world(tmp_path, tiny_model_dir, True, resume, n=6)
    assert more[:4] == first and len(more) == 6 and engine.calls > 0  # two new prompts
    whole = [x for x in resume.read_text().splitlines()[1:] if x.endswith("}")]
    assert sorted(json.loads(x)["index"] for x in whole) == [0, 1, 2, 3, 4, 5]
    fresh, _ = await _world(tmp_path, tiny_model_dir, True, None, n=6)
    assert fresh == more  # prompt i draws from its own seed: resumed = sampled in one go
    _, engine = await _world(tmp_path, tiny_model_dir, False, resume, n=4)
    assert engine.calls > 0  # other settings: the file starts again


def test_result_kinds():
    assert result_kind("python", "print(1)", True, "1") == "ok"
    assert result_kind("python", "1/0", False, "ZeroDivisionError") == "error"
    q = "population of Vel Bira"
    assert result_kind("search", q, True, "Vel Bira is a city. Its population is 5.") == \
        "asked_entity"
    assert result_kind("search", q, True, "Kos Havi is a city.") == "other_entity"
    assert result_kind("search", "what is this", True, "anything") == "no_entity"
    assert result_kind(None, "", None, "") == "unknown"
