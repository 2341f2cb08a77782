"""Pure logic of trajectory-level scheduling and of rounds split into segments:
``Occupancy`` (actors/rollout/base.py), the gate's interrupt (actors/engines/base.py) and the
stop strings a resumed vLLM segment must also match (``VLLMEngine._boundary_stops``)."""

from __future__ import annotations

import asyncio

import pytest

from actors.engines.base import GenResult, WeightGate
from actors.rollout import Occupancy


async def test_occupancy_counts_tasks_tool_waits_and_cancelled_tasks():
    occ = Occupancy()
    release = asyncio.Event()

    async def path():
        with occ.waiting():  # a tool call
            await release.wait()

    tasks = [occ.track(asyncio.ensure_future(path())) for _ in range(3)]
    assert occ.count == 3  # counted when spawned, before they run
    await asyncio.sleep(0)
    assert occ.count == 0  # all three wait for their tool
    never = occ.track(asyncio.ensure_future(asyncio.sleep(10)))
    never.cancel()  # cancelled before it started: still leaves
    release.set()
    await asyncio.gather(*tasks)
    await asyncio.sleep(0)
    assert occ.count == 0 and occ.area() >= 0
    with pytest.raises(RuntimeError, match="below 0"):
        occ.add(-1)


async def test_below_waits_for_the_count_to_fall():
    occ = Occupancy()
    occ.add(2)
    waiter = asyncio.create_task(occ.below(2))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    occ.add(-1)
    await asyncio.wait_for(waiter, 1)


async def test_interrupt_calls_the_stoppers_and_drain_does_not():
    for mode, want in (("interrupt", 1), ("drain", 0)):
        gate = WeightGate(mode)
        stopped = asyncio.Event()
        calls = []

        async def call(gate=gate, calls=calls, stopped=stopped, mode=mode):
            async with gate.call(stop=lambda: (calls.append(1), stopped.set())):
                await asyncio.wait_for(stopped.wait(), 0.2) if mode == "interrupt" else \
                    await asyncio.sleep(0.05)

        task = asyncio.create_task(call())
        await asyncio.sleep(0)
        async with gate.exclusive() as waited:
            assert gate.in_flight == 0 and waited < 0.2
        await task
        assert len(calls) == want and gate.interrupted == want
    with pytest.raises(ValueError, match="update_mode"):
        WeightGate("freeze")
    with pytest.raises(ValueError, match="update_mode"):  # an engine without keep refuses it
        WeightGate("keep", ("drain", "interrupt"))


async def test_keep_holds_new_calls_and_leaves_the_calls_in_flight_running():
    """keep: the engine freezes the calls in flight itself; the gate only holds new ones."""
    gate = WeightGate("keep")
    release = asyncio.Event()

    async def call():
        async with gate.call(stop=lambda: pytest.fail("keep must not stop calls")):
            await release.wait()

    task = asyncio.create_task(call())
    await asyncio.sleep(0)
    async with gate.exclusive() as waited:
        assert gate.in_flight == 1 and gate.closed and waited < 0.2
    release.set()
    await task


def test_gen_result_versions_per_token():
    assert GenResult([1, 2], [0.0, 0.0], [[], []], "stop", version=3).versions == [3, 3]
    with pytest.raises(ValueError, match="versions"):
        GenResult([1, 2], [0.0, 0.0], [[], []], "stop", version=3, versions=[3])


class _Tok:
    def decode(self, ids, skip_special_tokens=False):
        return "".join(chr(i) for i in ids)


@pytest.mark.parametrize("text, want", [
    ("x = 1</py", {"thon>": "</python>"}),
    ("x = 1<", {"/python>": "</python>", "/answer>": "</answer>"}),
    ("x = 1</python", {">": "</python>"}),
    ("x = 1", {}),
])
def test_boundary_stops(text, want):
    from actors.engines.vllm_engine import VLLMEngine

    engine = VLLMEngine.__new__(VLLMEngine)
    engine._llm = type("LLM", (), {"get_tokenizer": lambda self: _Tok()})()  # vLLM's own
    got = engine._boundary_stops(["</python>", "</answer>"], [ord(c) for c in text])
    assert got == want
