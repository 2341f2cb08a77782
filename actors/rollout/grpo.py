"""GRPO's group: all M global samples at once, never a fork. The rounds after tool
results are still measured as ARPO would (dH, P in ``decisions`` and the ``branch/*``
metrics), so GRPO runs show what ARPO would have decided on the same trajectories."""

from __future__ import annotations

from actors.rollout.arpo import ARPOPolicy


class GRPOPolicy(ARPOPolicy):
    """``BranchSettings.from_config`` gives GRPO N = M and no branching."""
