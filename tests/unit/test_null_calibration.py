"""The null test of ``analyze entropy`` calibrated where its answer is known.

The real ``SimulatedEngine`` (actors/engines/sim_engine.py) draws every token's law from
a target entropy plus per-token noise; a subclass here lets the target after a tool
result move by an amount fixed by the decision's prefix (a state that plants a rise of
its own) and the noise after a tool result differ from the noise before. Trajectories of
two rounds with a tool result between are sampled from it, then the same engine resamples
the windows (``analyze_null.resample_windows``) and ``null_test`` reads them with the
engine's own log-probs, every estimator and short-round rule. Three worlds:

* null: after a tool result the same law as before: S/N about 1 (its post-tool-only
  variant about 2 = 1 + var(H_init) / var(H_post), the answer known for that one);
* planted: each state shifts the entropy after the result (std 0.15 per token): S/N far
  above 1 (about 1 + 1.44 / 0.04 = 37 for the exact sum over 8 tokens);
* the old null's blind spot: a constant rise with four times the noise after tool
  results, no state effect: S/N about 1, where the replaced null (other samples' first
  rounds) reads about (16 + 1) / 2 = 8.5, because it measured the quieter first-round
  window.

Deterministic: seeded engine, seeded requests, seeded bootstrap.
"""

from __future__ import annotations

import asyncio
import math
import zlib

import numpy as np
import pytest

from actors.engines.base import GenRequest
from actors.engines.sim_engine import SimulatedEngine, Vocab
from arpo_async.core.config.actors import SimulatedEngine as SimSettings
from arpo_async.jobs.analyze_null import (
    _h,
    by_prompt,
    decisions_of,
    null_line,
    null_test,
    resample_windows,
    rounds_of,
    windows_of,
)

V, K, TOPK, R = 4096, 8, 10, 8  # vocabulary, entropy window, top-k, resampled windows
PYTHON, PYTHON_END, EOS, RESULT_END = 10, 11, 1, 20
STOPS = [PYTHON_END, EOS]
RESULT = [30, 31, RESULT_END]  # a tool result's tokens, ending in "</result>"


def _vocab() -> Vocab:
    tags = {"<python>": (PYTHON,), "</python>": (PYTHON_END,), "<search>": (12,),
            "</search>": (13,), "<answer>": (14,), "</answer>": (15,)}
    return Vocab(size=V, filler=np.arange(100, 1000), eos=EOS, tags=tags,
                 tool_result_end=(RESULT_END,),
                 encode=lambda s: tuple(100 + ord(c) % 64 for c in s))


class StateLawEngine(SimulatedEngine):
    """After a tool result: target entropy + ``spread`` * z(prefix), z a standard normal
    fixed by the prefix (the decision's state), and per-token noise ``noise_after``."""

    def __init__(self, sim: SimSettings, seed: int, spread: float, noise_after: float):
        super().__init__(sim, _vocab(), ["python"], seed, 0, 100_000, None)
        self.spread, self.noise_after = spread, noise_after
        self._law = sim

    def _after_tool(self, prompt: list[int]) -> bool:
        # generate() calls _logprobs right after this, with no await between: the law of
        # this round is set here, from its prefix
        after = super()._after_tool(prompt)
        z = np.random.default_rng(zlib.crc32(np.asarray(prompt, np.int64).tobytes()))
        shift = self.spread * float(z.standard_normal()) if after else 0.0
        self.sim = self._law.model_copy(update={
            "entropy_after_tool": self._law.entropy_after_tool + shift,
            "entropy_noise": self.noise_after if after else self._law.entropy_noise})
        return after


def _request(prefix: list[int], used: int, seed: int, max_tokens: int = K) -> GenRequest:
    return GenRequest(prompt_tokens=list(prefix), max_tokens=max_tokens,
                      stop_token_ids=STOPS, logprobs_topk=TOPK, seed=seed, entropy=True)


def _append(leaf: dict, res, model: bool) -> None:
    n = len(res) if not model else len(res.tokens)
    if model:
        leaf["tokens"] += res.tokens
        leaf["top"] += [list(t) for t in res.top_logprobs]
        leaf["sampled"] += list(res.logprobs)
        leaf["nats"] += list(res.entropies)
    else:  # tool tokens: never scored
        leaf["tokens"] += list(res)
        leaf["top"] += [[] for _ in res]
        leaf["sampled"] += [math.nan] * n
        leaf["nats"] += [math.nan] * n
    leaf["mask"] += [int(model)] * n


async def _world(spread: float, noise_after: float, after: float, prompts: int = 48,
                 samples: int = 2, seed: int = 0) -> list[dict]:
    """Trajectories (round, tool result, round) of ``prompts`` x ``samples``, with the
    resampled windows of each decision and prompt; log-probs as the engine gave them."""
    sim = SimSettings(tokens_per_s=1e9, chunk_tokens=1000, round_tokens_min=K,
                    round_tokens_max=2 * K, tool_call_prob=1.0, entropy=0.4,
                    entropy_after_tool=after, entropy_noise=0.05)
    engine = StateLawEngine(sim, seed, spread, noise_after)
    rng = np.random.default_rng(seed)
    leaves = []
    for p in range(prompts):
        for _ in range(samples):
            leaf = {"prompt": [200 + p, 201, 202], "tokens": [], "mask": [], "top": [],
                    "sampled": [], "nats": []}
            first = await engine.generate(_request(leaf["prompt"], 0,
                                                   int(rng.integers(2**31)), 64))
            _append(leaf, first, True)
            _append(leaf, RESULT, False)
            second = await engine.generate(_request(leaf["prompt"] + leaf["tokens"], 0,
                                                    int(rng.integers(2**31)), 64))
            _append(leaf, second, True)
            leaf["sampled"], leaf["nats"] = np.array(leaf["sampled"]), np.array(leaf["nats"])
            leaves.append(leaf)
    await resample_windows(engine, leaves, R, K, _request, seed=seed)
    return leaves


def _null(leaves: list[dict]) -> dict:
    return null_test(leaves, K, TOPK, V, alpha=0.5, beta=0.2, n_boot=400)


def _old_null_ratio(leaves: list[dict], est: str) -> float:
    """The replaced instrument: var(real dH) / var(other sample's first round - H_init)."""
    real, null = [], []
    for group in by_prompt(leaves):
        for i, leaf in enumerate(group):
            (s0, e0), (s1, e1) = rounds_of(leaf["mask"])[:2]
            h0 = _h(leaf, s0, e0, est, "as_is", TOPK, V, K)
            real.append(_h(leaf, s1, e1, est, "as_is", TOPK, V, K) - h0)
            for j, other in enumerate(group):
                if j != i:
                    o0, o1 = rounds_of(other["mask"])[0]
                    null.append(_h(other, o0, min(o1, o0 + e1 - s1), est, "as_is",
                                   TOPK, V, K) - h0)
    return float(np.var(real) / np.var(null))


LAWS = {"null": (0.0, 0.05, 0.4),  # (state spread, noise after a result, entropy after)
        "planted": (0.15, 0.05, 0.4), "noisy_after": (0.0, 0.2, 0.6)}


@pytest.fixture(scope="module")
def worlds() -> dict:
    """Each world's trajectories and its null test, computed once."""
    out = {}
    for name, law in LAWS.items():
        leaves = asyncio.run(_world(*law))
        out[name] = {"leaves": leaves, "null": _null(leaves)}
    return out


def test_resampling_covers_every_decision(worlds):
    leaves = worlds["null"]["leaves"]
    assert all(len(leaf["null_post"]) == 1 and len(leaf["null_post"][0]) == R
               for leaf in leaves)
    assert len(windows_of(leaves)) == 96 * R
    w = leaves[0]["null_post"][0][0]
    prefix = leaves[0]["prompt"] + leaves[0]["tokens"][:rounds_of(leaves[0]["mask"])[1][0]]
    assert w["prompt"] == prefix and len(w["tokens"]) == K and w["prompt"][-1] == RESULT_END


@pytest.mark.parametrize("est", ["reference", "tail_corrected", "exact"])
def test_null_world_reads_one(worlds, est):
    null = worlds["null"]["null"]
    for key in (est, f"{est}+scale", f"{est}+skip"):  # every round is a full window here
        row = null[key]
        assert row["decisions"] == 96 and row["real"]["n"] == 96
        assert 0.6 < row["signal_to_noise"] < 1.6 and row["ci"][0] < 1.0, (key, row)
        # the post-tool window's noise alone: 1 + var(H_init) / var(H_post), here ~2
        assert 1.3 < row["signal_to_noise_post_only"] < 3.2, (key, row)


@pytest.mark.parametrize("est", ["reference", "tail_corrected", "exact"])
def test_planted_rise_reads_far_above_one(worlds, est):
    row = worlds["planted"]["null"][est]
    assert row["signal_to_noise"] > 5 and row["ci"][0] > 5, row
    assert row["signal_to_noise_post_only"] > row["signal_to_noise"]


@pytest.mark.parametrize("est", ["tail_corrected", "exact"])
def test_noise_after_tools_is_noise_where_the_old_null_saw_signal(worlds, est):
    row = worlds["noisy_after"]["null"][est]
    assert 0.6 < row["signal_to_noise"] < 1.6 and row["ci"][0] < 1.0, row
    # the replaced null: "signal" from noise
    assert _old_null_ratio(worlds["noisy_after"]["leaves"], est) > 3


def test_null_line_and_determinism(worlds):
    a = worlds["planted"]["null"]
    assert null_test(worlds["planted"]["leaves"], K, TOPK, V, 0.5, 0.2, n_boot=400) == a
    line = null_line(a, R)
    assert line.startswith("null test (8 windows resampled") and "exact S/N" in line


def test_decisions_by_hand():
    """Exact estimator, entropies chosen so H is known: nats = ln V per token is a
    normalised entropy of 1, so H = the number of tokens read (up to the window)."""
    one = math.log(V)

    def rec(n_tokens: int, mask=None) -> dict:
        mask = mask or [1] * n_tokens
        return {"prompt": [5], "tokens": [100] * len(mask), "mask": np.array(mask),
                "top": [[] for _ in mask], "sampled": np.zeros(len(mask)),
                "nats": np.where(np.array(mask) == 1, one, np.nan)}

    leaf = rec(0, [1] * 9 + [0, 0] + [1] * 3)  # first round 9 tokens, post-tool round 3
    leaf["null_post"] = [[rec(2), rec(8), None]]
    (t,) = decisions_of([leaf], "exact", "as_is", TOPK, V, K)
    (d,) = t.decisions
    assert t.h_init == pytest.approx(8) and d.dh == pytest.approx(3 - 8)
    assert d.h_post == pytest.approx((2, 8))
    (t,) = decisions_of([leaf], "exact", "scale", TOPK, V, K)
    assert t.decisions[0].dh == pytest.approx(0.0)
    assert t.decisions[0].h_post == pytest.approx((8, 8))
    (t,) = decisions_of([leaf], "exact", "skip", TOPK, V, K)
    assert t.decisions == ()  # a short round makes no decision
