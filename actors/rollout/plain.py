"""GRPO sampling without tools: M independent samples of one round each."""

from __future__ import annotations

import asyncio

import numpy as np

from actors.engines.base import GenerationEngine, GenRequest
from actors.rollout.base import Occupancy, new_group_id
from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from toolenv.tasks.prompts import Prompt, PromptSource


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
            prompt_tokens=prompt.tokens, max_tokens=s.round_tokens(0),
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

    async def run(self, prompt: Prompt, actor_id: int, journal=None) -> TrajectoryGroup:
        """``journal`` is not kept: a sample without tools is one round, and a round in
        progress is never resumed."""
        leaves = await asyncio.gather(*[
            self.occupancy.track(asyncio.ensure_future(self._sample(prompt)))
            for _ in range(self.cfg.rollout.group_size)])
        return TrajectoryGroup(group_id=new_group_id(actor_id), actor_id=actor_id,
                               prompt_id=prompt.id,
                               prompt_tokens=np.asarray(prompt.tokens, np.int32),
                               leaves=list(leaves), mode="plain", kind=prompt.kind)
