"""Rollouts: how an actor turns one prompt into one trajectory group.

A ``Rollout`` is the pluggable piece of the actor: the plain group sampler here (M
independent samples, no tools) and the tool-interleaved ARPO/AEPO/GRPO rollouts share
the interface. Every token of a leaf carries its behaviour log-prob and the policy
version of the weights that sampled it.

``Occupancy`` counts a rollout's trajectories that are generating (spawned and not
finished, and not waiting for a tool): the actor's trajectory-level scheduler
(actors/actor.py) starts the next group whenever the count falls below its target.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Protocol

import numpy as np

from actors.engines.base import GenerationEngine, GenRequest
from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from toolenv.tasks.prompts import Prompt, PromptSource


class Rollout(Protocol):
    occupancy: Occupancy

    async def run(self, prompt: Prompt, actor_id: int) -> TrajectoryGroup:
        """Counts the group's first trajectories in ``occupancy`` before its first await."""


class Occupancy:
    """Trajectories generating now, the time average of that count, and a wait for it to
    fall below a target. All changes happen on the event loop."""

    def __init__(self) -> None:
        self.count = 0
        self._since = self._t0 = time.monotonic()
        self._area = 0.0
        self._changed = asyncio.Event()

    def add(self, n: int) -> None:
        now = time.monotonic()
        self._area += self.count * (now - self._since)
        self._since = now
        self.count += n
        if self.count < 0:
            raise RuntimeError("occupancy below 0: a trajectory left twice")
        self._changed.set()

    def track(self, task: asyncio.Future) -> asyncio.Future:
        """Count ``task`` as generating until it is done (however it ends, even cancelled
        before it started)."""
        self.add(1)
        task.add_done_callback(lambda _: self.add(-1))
        return task

    @contextlib.contextmanager
    def waiting(self):
        """A tool call: the trajectory is not generating meanwhile."""
        self.add(-1)
        try:
            yield
        finally:
            self.add(1)

    async def below(self, target: int) -> None:
        while self.count >= target:
            self._changed.clear()
            await self._changed.wait()

    def area(self) -> float:
        """Integral of the count over time since this object was made (trajectory-s)."""
        return self._area + self.count * (time.monotonic() - self._since)

    def mean(self) -> float:
        """Time-averaged count since this object was made."""
        return self.area() / max(time.monotonic() - self._t0, 1e-9)


def new_group_id(actor_id: int) -> str:
    return f"a{actor_id}-{uuid.uuid4().hex[:12]}"


class PlainRollout:
    """M independent samples of one round each (GRPO sampling without tools)."""

    def __init__(self, cfg, engine: GenerationEngine, source: PromptSource, tokenizer,
                 rng: np.random.Generator):
        self.cfg, self.engine, self.source, self.tokenizer, self.rng = (
            cfg, engine, source, tokenizer, rng)
        self.occupancy = Occupancy()
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        answer = tokenizer.encode("</answer>", add_special_tokens=False)
        # a tag that is several tokens (a real tokenizer) stops as a string
        self.stop_ids = eos + (answer if len(answer) == 1 else [])
        self.stop = [] if len(answer) == 1 else ["</answer>"]

    async def _sample(self, prompt: Prompt) -> Trajectory:
        s = self.cfg.sampling
        res = await self.engine.generate(GenRequest(
            prompt_tokens=prompt.tokens, max_tokens=min(s.max_new_tokens, s.max_response_tokens),
            temperature=s.temperature, top_p=s.top_p, stop_token_ids=self.stop_ids,
            # no entropy is read here: the sampled tokens' own log-probs are all it needs
            stop=self.stop, logprobs_topk=0, seed=int(self.rng.integers(2**31))))
        text = self.tokenizer.decode(res.tokens, skip_special_tokens=False)
        reward, score = self.source.score(text, prompt)
        n = len(res.tokens)
        return Trajectory(tokens=np.asarray(res.tokens, np.int32), loss_mask=np.ones(n, np.uint8),
                          logprobs=np.asarray(res.logprobs, np.float32),
                          versions=np.asarray(res.versions, np.int32), reward=reward, score=score,
                          finish_reason=res.finish_reason)

    async def run(self, prompt: Prompt, actor_id: int) -> TrajectoryGroup:
        leaves = await asyncio.gather(*[
            self.occupancy.track(asyncio.ensure_future(self._sample(prompt)))
            for _ in range(self.cfg.rollout.group_size)])
        return TrajectoryGroup(group_id=new_group_id(actor_id), actor_id=actor_id,
                               prompt_id=prompt.id,
                               prompt_tokens=np.asarray(prompt.tokens, np.int32),
                               leaves=list(leaves), mode="plain")
