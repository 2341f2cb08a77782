"""Rollouts: how an actor turns one prompt into one trajectory group.

A ``Rollout`` is the pluggable piece of the actor: the plain group sampler here (M
independent samples, no tools) and the tool-interleaved ARPO/AEPO/GRPO rollouts share
the interface. Every token of a leaf carries its behaviour log-prob and the policy
version of the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import uuid
from typing import Protocol

import numpy as np

from actors.engines.base import GenerationEngine, GenRequest
from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from toolenv.tasks.prompts import Prompt, PromptSource


class Rollout(Protocol):
    async def run(self, prompt: Prompt, actor_id: int) -> TrajectoryGroup: ...


def new_group_id(actor_id: int) -> str:
    return f"a{actor_id}-{uuid.uuid4().hex[:12]}"


class PlainRollout:
    """M independent samples of one round each (GRPO sampling without tools)."""

    def __init__(self, cfg, engine: GenerationEngine, source: PromptSource, tokenizer,
                 rng: np.random.Generator):
        self.cfg, self.engine, self.source, self.tokenizer, self.rng = (
            cfg, engine, source, tokenizer, rng)
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
            stop=self.stop, logprobs_topk=s.logprobs_topk, seed=int(self.rng.integers(2**31))))
        text = self.tokenizer.decode(res.tokens, skip_special_tokens=False)
        reward, score = self.source.score(text, prompt)
        n = len(res.tokens)
        return Trajectory(tokens=np.asarray(res.tokens, np.int32), loss_mask=np.ones(n, np.uint8),
                          logprobs=np.asarray(res.logprobs, np.float32),
                          versions=np.full(n, res.version, np.int32), reward=reward, score=score,
                          finish_reason=res.finish_reason)

    async def run(self, prompt: Prompt, actor_id: int) -> TrajectoryGroup:
        leaves = await asyncio.gather(*[self._sample(prompt)
                                        for _ in range(self.cfg.rollout.group_size)])
        return TrajectoryGroup(group_id=new_group_id(actor_id), actor_id=actor_id,
                               prompt_id=prompt.id,
                               prompt_tokens=np.asarray(prompt.tokens, np.int32),
                               leaves=list(leaves), mode="plain")
