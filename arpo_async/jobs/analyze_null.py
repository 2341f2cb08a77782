"""The null test of ``python -m arpo_async.jobs.analyze entropy``: each real branch
decision against the noise of that decision.

A real decision is a round after a tool result in a sampled trajectory; ARPO reads
dH = H_post - H_init from the first k tokens of that round and of the trajectory's first
round. Its noise, given the state it is made in, is what H_post does when those k tokens
are sampled again at the same prefix (the same tokens up to and including the tool
result). So ``resample_windows`` asks the engine for R windows of k tokens at every
decision's prefix, with the rollout's stops and round limit at the sampling temperature
(H_init's noise comes from the prompt's other trajectories: null_stats). The caller
scores the windows the way it scores the real rounds (``analyze`` by its learner-side
forward pass, which overwrites the engine's log-probs; a test may keep the engine's own),
and ``null_test`` reads every estimator and short-round rule from them and hands the
numbers to ``null_stats`` (S/N with a bootstrap interval over prompts).

Replaced (issue 29): a null whose "after" window was another sample's first round cut to
the decision's length. A first round is sampled at the prompt, not at the decision's
state, and is the quieter window: it read S/N 29 where the decision's own resampling
reads 3.4, and made ``short_round=scale`` look twice as good when, position-matched, it
changes nothing.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

import numpy as np

from actors.branching import P_BAND
from actors.engines.base import ContextOverflow, GenRequest
from arpo_async.core.entropy import ESTIMATORS, SHORT_ROUNDS, round_entropy
from arpo_async.jobs.null_stats import N_BOOT, Decision, Trajectory, signal_to_noise

AUTHORS_TOPK = 10  # the reference code's logprobs=10 (vllm_rollout_with_tools.py)
RULES = SHORT_ROUNDS  # rollout.short_round's values


def rounds_of(mask: np.ndarray) -> list[tuple[int, int]]:
    """(start, end) of each run of model tokens (mask 1) in a response, in order."""
    out, start = [], None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


def by_prompt(leaves: list[dict]) -> list[list[dict]]:
    """The records (the same objects) grouped by prompt: a prompt's samples are
    consecutive; records without a model token are left out."""
    groups: list[list[dict]] = []
    for leaf in leaves:
        if not rounds_of(leaf["mask"]):
            continue
        if not groups or groups[-1][0]["prompt"] != leaf["prompt"]:
            groups.append([])
        groups[-1].append(leaf)
    return groups


# ----------------------------------------------------------------------------- resampling


def window_request(cfg, stop_ids: list[int], stop_strings: list[str]
                   ) -> Callable[[list[int], int, int], GenRequest | None]:
    """Requests for a k-token window at a prefix (``used`` response tokens before it) as
    the rollout samples the round there: its stops, temperature, top-p and round limit
    (``PathStepper.round``: the response budget left, at most round_max_tokens, and what
    ``model.max_model_len`` leaves), so a round the budget cut is resampled cut the same;
    None when nothing fits. No log-probs: ``analyze`` scores every window itself."""
    s, k = cfg.sampling, cfg.rollout.entropy_window

    def request(prefix: list[int], used: int, seed: int) -> GenRequest | None:
        n = min(k, s.round_tokens(used), cfg.model.max_model_len - len(prefix))
        if n < 1:
            return None
        return GenRequest(prompt_tokens=list(prefix), max_tokens=n,
                          temperature=s.temperature, top_p=s.top_p,
                          stop_token_ids=list(stop_ids), stop=list(stop_strings),
                          logprobs_topk=0, seed=seed)
    return request


def _record(prefix: list[int], res, window: int) -> dict:
    """A window as a record ``score_entropies`` and ``null_test`` read, with the engine's
    own log-probs (nan where it gave none)."""
    n = min(window, len(res.tokens))
    nats = list(res.entropies[:n]) if res.entropies else [math.nan] * n
    return {"prompt": list(prefix), "tokens": list(res.tokens[:n]),
            "mask": np.ones(n, np.uint8), "top": [list(t) for t in res.top_logprobs[:n]],
            "sampled": np.asarray(res.logprobs[:n], np.float64),
            "nats": np.asarray(nats, np.float64)}


async def resample_windows(engine, leaves: list[dict], repeats: int, window: int,
                           request: Callable[[list[int], int, int], GenRequest | None],
                           seed: int = 0, concurrency: int = 64) -> int:
    """Sample ``repeats`` windows at each decision's prefix; adds to each record
    ``null_post``: per round after the first, its windows (None where nothing fit).
    Seeds come from ``seed``, so a seeded engine repeats itself. Returns the number of
    windows asked for."""
    rng = np.random.default_rng([seed, 29])
    jobs: list[tuple[list[int], int, list, int]] = []  # (prefix, used, where, index)
    for leaf in leaves:
        starts = [s for s, _ in rounds_of(leaf["mask"])[1:]]
        leaf["null_post"] = [[None] * repeats for _ in starts]
        for s, slots in zip(starts, leaf["null_post"]):
            prefix = list(leaf["prompt"]) + [int(t) for t in leaf["tokens"][:s]]
            jobs += [(prefix, s, slots, i) for i in range(repeats)]
    seeds = rng.integers(0, 2**31, len(jobs))
    gate = asyncio.Semaphore(concurrency)

    async def one(prefix: list[int], used: int, where: list, i: int, seed_: int) -> None:
        req = request(prefix, used, int(seed_))
        if req is None:
            return
        async with gate:
            try:
                res = await engine.generate(req)
            except ContextOverflow:
                return
        where[i] = _record(prefix, res, window)

    await asyncio.gather(*(one(*job, sd) for job, sd in zip(jobs, seeds)))
    return len(jobs)


def windows_of(leaves: list[dict]) -> list[dict]:
    """Every resampled window, to be scored."""
    return [w for leaf in leaves for ws in leaf.get("null_post", []) for w in ws
            if w is not None]


# ----------------------------------------------------------------------------- the test


def _h(rec: dict, start: int, end: int, est: str, rule: str, topk: int, vocab: int,
       window: int) -> float:
    """H of the round rec[start:end] as the rollout would read it with ``est`` and
    ``rule`` (per token: ``top`` log-probs, ``sampled`` log-prob, ``nats``)."""
    k = AUTHORS_TOPK if est == "reference" else topk
    top = [list(row[:k]) for row in rec["top"][start:end]]
    return round_entropy(top, list(rec["sampled"][start:end]), list(rec["nats"][start:end]),
                         estimator=est, vocab_size=vocab, window=window, short_round=rule)


def _resampled(windows: list, est: str, rule: str, topk: int, vocab: int, window: int
               ) -> tuple[float, ...]:
    """H of each window that would make a decision (under ``skip``, a full window only)."""
    return tuple(_h(w, 0, len(w["tokens"]), est, rule, topk, vocab, window) for w in windows
                 if w is not None and w["tokens"]
                 and not (rule == "skip" and len(w["tokens"]) < window))


def decisions_of(group: list[dict], est: str, rule: str, topk: int, vocab: int,
                 window: int) -> list[Trajectory]:
    """One prompt's records as trajectories: H_init and the real decisions, each with
    its resampled windows' H. ``skip`` drops a short round's decision, and every decision
    of a trajectory whose first round was short (the rollout makes none there)."""
    out = []
    for leaf in group:
        (s0, e0), *after = rounds_of(leaf["mask"])
        if rule == "skip" and e0 - s0 < window:
            continue
        h_init = _h(leaf, s0, e0, est, rule, topk, vocab, window)
        decisions = []
        for (s, e), windows in zip(after, leaf.get("null_post", [[] for _ in after])):
            if rule == "skip" and e - s < window:
                continue
            decisions.append(Decision(_h(leaf, s, e, est, rule, topk, vocab, window) - h_init,
                                      _resampled(windows, est, rule, topk, vocab, window)))
        out.append(Trajectory(h_init, tuple(decisions)))
    return out


def _real(dh: list[float], alpha: float, beta: float) -> dict:
    """The real decisions' dH and P = clip(alpha + beta * dH, 0, 1)."""
    a = np.asarray(dh, dtype=np.float64)
    if not a.size:
        return {"n": 0}
    p = np.clip(alpha + beta * a, 0.0, 1.0)
    return {"n": int(a.size), "dh_mean": float(a.mean()), "p_std": float(p.std()),
            "outside_band": float(np.mean(np.abs(p - 0.5) > P_BAND))}


def null_test(leaves: list[dict], window: int, topk: int, vocab: int, alpha: float,
              beta: float, seed: int = 0, n_boot: int = N_BOOT) -> dict:
    """For each estimator (``reference`` at the authors' top 10, ``tail_corrected`` at
    ``topk``, ``exact``) and short-round rule: the real decisions, S/N against their own
    resampling noise with its 90% interval over prompts, and ``p_noise_std``, the std of P
    that resampling alone gives at a fixed state (beta * sqrt(mean var(H_post | prefix)))."""
    out, groups = {}, by_prompt(leaves)
    for est in ESTIMATORS:
        for rule in RULES:
            prompts = [decisions_of(g, est, rule, topk, vocab, window) for g in groups]
            values, metrics = signal_to_noise(prompts, np.random.default_rng([seed, 1]),
                                              n_boot)
            post = values["post_var_mean"]
            row = {"real": _real([d.dh for p in prompts for t in p for d in t.decisions],
                                 alpha, beta),
                   **values, **metrics,
                   "p_noise_std": beta * math.sqrt(post) if post is not None else None}
            out[est if rule == "as_is" else f"{est}+{rule}"] = row
    return out


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}"


def null_line(null: dict, repeats: int) -> str:
    """One line, short rounds as they are: S/N against both windows' resampling noise
    with its 90% interval, and against the post-tool window's alone."""
    parts = []
    for est in ESTIMATORS:
        row = null.get(est, {})
        if row.get("signal_to_noise") is None:
            continue
        lo, hi = row["ci"]
        parts.append(f"{est} S/N {row['signal_to_noise']:.2f} (90% CI {_fmt(lo)}-{_fmt(hi)}; "
                     f"post-tool window's noise only {_fmt(row['signal_to_noise_post_only'])})")
    head = f"null test ({repeats} windows resampled at each decision's prefix; 1 = noise): "
    return head + ("; ".join(parts) if parts else "no decisions to compare")
