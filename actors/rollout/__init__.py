"""Rollouts: how an actor turns one prompt into one trajectory group.

``build_rollout`` is the one builder (the actor, evaluation, the analyses and the benches
use it): plain sampling without tools (``plain.py``), else the tool-interleaved rollout
(``agent.py``: the path stepper of ``path.py`` under the group policy ``rollout.mode``
names in ``POLICIES``). A new group policy is one module (``policy.py`` is its contract)
and one line here; docs/extending.md walks through it.
"""

from __future__ import annotations

import numpy as np

from actors.rollout.aepo import AEPOPolicy
from actors.rollout.arpo import ARPOPolicy
from actors.rollout.base import Occupancy, Rollout, new_group_id
from actors.rollout.grpo import GRPOPolicy
from actors.rollout.plain import PlainRollout
from actors.rollout.policy import GroupPolicy, Spawn
from actors.rollout.stratified import StratifiedPolicy

__all__ = ["AEPOPolicy", "ARPOPolicy", "GRPOPolicy", "POLICIES", "GroupPolicy", "Occupancy",
           "PlainRollout", "Rollout", "Spawn", "StratifiedPolicy", "build_rollout", "new_group_id"]

POLICIES: dict[str, type[GroupPolicy]] = {
    "grpo": GRPOPolicy,
    "arpo": ARPOPolicy,
    "aepo": AEPOPolicy,
    "stratified": StratifiedPolicy,
}


def build_rollout(cfg, engine, source, tokenizer, tools, rng: np.random.Generator,
                  policy: type[GroupPolicy] | None = None) -> Rollout:
    """The rollout ``cfg`` names: plain GRPO sampling when no tool is offered, else the
    tool-interleaved rollout under ``policy`` (default: ``POLICIES[rollout.mode]``)."""
    if policy is None and not cfg.tools.offered and cfg.rollout.mode == "grpo":
        return PlainRollout(cfg, engine, source, tokenizer, rng)
    from actors.rollout.agent import AgentRollout  # it imports torch: not for --help

    return AgentRollout(cfg, engine, source, tokenizer, tools, rng,
                        policy or POLICIES[cfg.rollout.mode])
