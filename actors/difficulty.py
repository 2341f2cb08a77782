"""Budget by prompt difficulty: pass over prompts the recent policy always solves or never
does (issue 55 item 3; ``task.difficulty``; pure, no engine or socket).

A group whose leaves all get the same reward has advantage 0 on every token
(learner/advantages.py): it costs its generation, tool calls and a learner pass, and
teaches nothing. Knapsack RL (arXiv 2509.25849) and VIP (arXiv 2602.01601) reallocate
rollouts by prompt difficulty for 20-40% more non-zero gradients. Here the actor estimates,
from its own finished groups, how often a prompt of each task kind comes back without
reward variance (``z_k``, an exponential moving average over the kind's groups), and when
its stream offers the next prompt it passes over it with probability

    s = max_skip * max(z_kind, z_prompt),

``z_prompt`` = 1 when this very prompt's last group had no variance (prompts repeat only
in runs longer than an epoch of the data), 0 otherwise. A kind is estimated only after
``min_groups`` of its groups. Deliberate simplifications: each actor learns from its own
groups only (no exchange between actors), and the estimate is per kind, not per prompt
features, because a prompt is rarely drawn twice within a run.

Bounds. ``max_skip < 1``: every prompt is drawn with probability at least 1 - max_skip
each time the stream offers it; a prompt passed over ``max_prompt_skips`` times in a row
is taken the next time, whatever the estimate (never starved); one draw passes over at
most ``max_consecutive`` prompts (a draw always ends). A skipped prompt's stream position
belongs to the group drawn after it (the group's [data_pos, data_end), as for prompts too
long for the model), so the learner's prompt record stays exact. Skipping happens before
the ticket's group is generated and moves no token's version: the staleness bound is
untouched. The history it learns from is the actor's own groups, generated within that
bound.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


class DifficultyBudget:
    """``draw(next_prompt)`` returns the next prompt to generate and how many it passed
    over; ``observe(prompt, rewards)`` feeds a finished group back."""

    def __init__(self, settings: Any, rng: np.random.Generator):
        if not isinstance(rng, np.random.Generator):
            raise TypeError("DifficultyBudget needs a seeded numpy Generator")
        self.s, self.rng = settings, rng
        self.zero_share: dict[str, float] = {}  # EMA of "no reward variance", per kind
        self.groups: dict[str, int] = {}  # groups observed per kind
        self.flat: dict[str, bool] = {}  # per prompt id: its last group had no variance
        self.streak: dict[str, int] = {}  # per prompt id: times passed over in a row
        self.skipped: dict[str, int] = {}  # prompts passed over, per kind

    def skip_probability(self, prompt) -> float:
        """max_skip * max(z_kind, z_prompt); 0 for a prompt at its streak bound."""
        if self.streak.get(prompt.id, 0) >= self.s.max_prompt_skips:
            return 0.0
        kind = prompt.kind or "-"
        z_kind = (self.zero_share[kind] if self.groups.get(kind, 0) >= self.s.min_groups
                  else 0.0)
        z_prompt = 1.0 if self.flat.get(prompt.id, False) else 0.0
        return self.s.max_skip * max(z_kind, z_prompt)

    def draw(self, next_prompt: Callable[[], Any]) -> tuple[Any, int]:
        """(the prompt to generate, prompts passed over before it)."""
        prompt, passed = next_prompt(), 0
        while passed < self.s.max_consecutive and self.rng.random() < self.skip_probability(
                prompt):
            self.streak[prompt.id] = self.streak.get(prompt.id, 0) + 1
            kind = prompt.kind or "-"
            self.skipped[kind] = self.skipped.get(kind, 0) + 1
            prompt, passed = next_prompt(), passed + 1
        self.streak.pop(prompt.id, None)
        return prompt, passed

    def observe(self, prompt, rewards) -> None:
        """A finished group of ``prompt`` with its leaves' ``rewards``."""
        r = np.asarray(rewards, dtype=np.float64)
        flat = bool(r.size < 2 or np.ptp(r) == 0.0)
        kind = prompt.kind or "-"
        n = self.groups.get(kind, 0)
        rate = max(1.0 / (n + 1), 1.0 / self.s.window)  # the mean until `window` groups
        self.zero_share[kind] = (1 - rate) * self.zero_share.get(kind, 0.0) + rate * flat
        self.groups[kind] = n + 1
        self.flat[prompt.id] = flat

    def stats(self) -> dict[str, float]:
        """Prompts passed over, in all and per kind, and each kind's estimate."""
        out = {"difficulty/skipped": float(sum(self.skipped.values()))}
        for kind, n in self.skipped.items():
            out[f"difficulty/skipped/{kind}"] = float(n)
        for kind, z in self.zero_share.items():
            out[f"difficulty/zero_share/{kind}"] = round(z, 4)
        return out
