"""What the rollout asks the engine for per round (``sampling.topk_window_only``): top-k
log-probs over the entropy window only or on every token, and, under the exact
estimator, whole vectors over the window only whatever the key says (whole vectors on
every token of a round would be the vocabulary's size per token). Through the real
rollout (actors/rollout/) with a scripted engine that records each request."""

from __future__ import annotations

import numpy as np
import pytest
from transformers import AutoTokenizer

from actors.engines.base import GenResult
from actors.rollout import POLICIES, build_rollout
from arpo_async.core.config import config_from_dict
from toolenv.base import ToolResult
from toolenv.tasks.prompts import PromptSource

CALL = "<python>print(1)</python>"
WINDOW, TOPK = 4, 5


class RecordingEngine:
    """Every round calls python (a tool result follows, so the next round is read);
    records (logprobs_topk, topk_window, entropy) of each request."""

    version = 0
    max_model_len = 4096

    def __init__(self, tok):
        self.ids = tok.encode(CALL, add_special_tokens=False)
        self.asked: list[tuple[int, int, bool]] = []

    async def generate(self, req) -> GenResult:
        self.asked.append((req.logprobs_topk, req.topk_window, req.entropy))
        n = len(self.ids)
        top = [[-0.1 * (j + 1) for j in range(TOPK)]] * n
        return GenResult(self.ids, [-0.1] * n, top, "stop", stop_reason="</python>",
                         entropies=[1.0] * n if req.entropy else [])


class EchoTool:
    async def call(self, name, args):
        return ToolResult("1", ok=True)


async def _asked(tok, estimator: str, window_only: bool) -> list[tuple[int, int, bool]]:
    cfg = config_from_dict({
        "rollout": {"mode": "arpo", "group_size": 4, "initial_samples": 2,
                    "tool_call_limit": 2, "entropy_window": WINDOW,
                    "entropy_estimator": estimator},
        "sampling": {"max_response_tokens": 400, "logprobs_topk": TOPK,
                     "topk_window_only": window_only},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    source = PromptSource(cfg, tok)
    engine = RecordingEngine(tok)
    rollout = build_rollout(cfg, engine, source, tok, EchoTool(), np.random.default_rng(0),
                            POLICIES["arpo"])
    await rollout.run(source.next(), actor_id=0)
    return engine.asked


@pytest.mark.parametrize("window_only", [True, False])
async def test_top_k_is_asked_over_the_window_or_on_every_token(tiny_model_dir, window_only):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    asked = await _asked(tok, "tail_corrected", window_only)
    read = [a for a in asked if a[0] > 0]
    assert read and all(a == (TOPK, WINDOW if window_only else 0, False) for a in read)
    # rounds whose entropy is not read ask for the sampled token's log-prob only, in one
    # request (no window to split at)
    unread = [a for a in asked if a[0] == 0]
    assert unread and all(a == (0, 0, False) for a in unread)


@pytest.mark.parametrize("window_only", [True, False])
async def test_whole_vectors_are_asked_over_the_window_only(tiny_model_dir, window_only):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    asked = await _asked(tok, "exact", window_only)
    read = [a for a in asked if a[2]]
    assert read and all(a == (0, WINDOW, True) for a in read)
    assert all(a == (0, 0, False) for a in asked if not a[2])
