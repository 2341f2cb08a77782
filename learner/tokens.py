"""The learner's token ledger (pure): how many of the model tokens that reached it were
trained, and whether the groups trained look like the groups generated.

Every checked group that arrives is counted once as received, with its model tokens
(loss-mask ones, every leaf) and its tool calls; it then ends as trained or dropped with a
reason ("stale", "shutdown", ...), exactly like the group ledger (learner/ledger.py).
Groups that were generated and never arrived (lost with a dead actor) are counted by that
ledger, in groups; their tokens are unknown here.

Bias: dropping groups by a property correlated with length trains on a skewed sample
(stale drops hit the long trajectories). ``ks`` is the two-sample Kolmogorov-Smirnov
distance between the model-token lengths of the groups received and of those trained,
over the run and over the last ``window`` steps: 0 when the trained groups are a fair
sample of what arrived, 1 when the two never overlap.
"""

from __future__ import annotations

from collections import Counter

import numpy as np


def model_tokens(group) -> int:
    """Model tokens of a group: loss-mask tokens over its leaves (shared prefixes of a
    tree counted in each leaf, as the actors count them)."""
    return int(sum(int(leaf.loss_mask.sum()) for leaf in group.leaves))


def ks_distance(a, b) -> float:
    """Two-sample Kolmogorov-Smirnov statistic: the largest gap between the empirical
    distribution functions of ``a`` and ``b`` (0.0 when either is empty)."""
    a, b = np.sort(np.asarray(a, dtype=float)), np.sort(np.asarray(b, dtype=float))
    if a.size == 0 or b.size == 0:
        return 0.0
    grid = np.concatenate([a, b])
    fa = np.searchsorted(a, grid, side="right") / a.size
    fb = np.searchsorted(b, grid, side="right") / b.size
    return float(np.max(np.abs(fa - fb)))


class TokenLedger:
    """Model tokens received, trained and dropped (by reason); group lengths for the
    KS distance, per step for a window."""

    def __init__(self, window: int = 20):
        self.window = window
        self.received = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()
        self._received_lengths: list[int] = []
        self._trained_lengths: list[int] = []
        self._steps: list[tuple[list[int], list[int]]] = []  # (received, trained) per step
        self._step_received: list[int] = []

    def receive(self, group) -> None:
        n = model_tokens(group)
        self.received += n
        self._received_lengths.append(n)
        self._step_received.append(n)

    def drop(self, group, reason: str) -> None:
        self.dropped[reason] += model_tokens(group)

    def train(self, groups) -> None:
        """The groups of one step: closes the step's window entry."""
        lengths = [model_tokens(g) for g in groups]
        self.trained += sum(lengths)
        self._trained_lengths += lengths
        self._steps = (self._steps + [(self._step_received, lengths)])[-self.window:]
        self._step_received = []

    def figures(self) -> dict:
        """For metrics.jsonl and summary.json."""
        recent_rx = [n for rx, _ in self._steps for n in rx]
        recent_tr = [n for _, tr in self._steps for n in tr]
        return {"received": self.received, "trained": self.trained,
                "dropped": dict(self.dropped),
                "yield": self.trained / self.received if self.received else 1.0,
                "ks_run": ks_distance(self._received_lengths, self._trained_lengths),
                f"ks_last{self.window}": ks_distance(recent_rx, recent_tr)}


PREFILL_KEYS = ("prompt_tokens", "cached_tokens", "recomputed_tokens", "sampled_tokens")


def prefill_figures(actor_stats) -> dict:
    """The other side of the ledger: what the engines computed to generate. Summed over
    the actors' last reported engine counters (``engine/*`` of their heartbeats; an actor
    that restarted reports its current incarnation's only): prompt tokens the engine took
    in, those its prefix cache served, context prefilled again after an interrupting
    weight update, and tokens sampled; ``prefill_per_sampled`` = (prompt - cached) /
    sampled, ``recomputed_per_sampled`` = recomputed / sampled. {} before any actor
    reported them (the simulated engine does not)."""
    total = {k: 0.0 for k in PREFILL_KEYS}
    seen = False
    for stats in actor_stats:
        for k in PREFILL_KEYS:
            value = (stats or {}).get(f"engine/{k}")
            if isinstance(value, (int, float)):
                total[k] += value
                seen = True
    if not seen or total["sampled_tokens"] <= 0:
        return {}
    sampled = total["sampled_tokens"]
    return {**{k: int(v) for k, v in total.items()},
            "prefill_per_sampled": (total["prompt_tokens"] - total["cached_tokens"]) / sampled,
            "recomputed_per_sampled": total["recomputed_tokens"] / sampled}

