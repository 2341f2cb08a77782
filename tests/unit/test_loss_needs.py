"""A loss declares what it needs computed (``learner.loss`` ``needs``); the trainer, the
forward passes and the loss's input check read that, never the knob names."""

from __future__ import annotations

import re
from pathlib import Path

from arpo_async.core.config.losses import CISPOLoss, GSPOLoss, LossNeeds, PPOLoss

ROOT = Path(__file__).resolve().parents[2]


def test_needs_follow_the_settings():
    assert PPOLoss().needs == LossNeeds(False, False, False, False)
    assert PPOLoss(entropy_coef=0.01).needs == LossNeeds(True, True, False, False)
    assert GSPOLoss(aepo_entropy_adv_gamma=0.2).needs == LossNeeds(True, False, True, False)
    assert CISPOLoss(kl_coef=0.1).needs == LossNeeds(False, False, False, True)
    # AEPO's entropy-balanced clip acts on the ratio, not on entropies: nothing to compute
    assert PPOLoss(aepo_entropy_clip=True).needs == LossNeeds(False, False, False, False)


def test_the_learner_asks_needs_not_knob_names():
    """Outside the loss driver (learner/losses/__init__.py applies the terms), no learner
    module decides what to compute from a loss knob's name."""
    knobs = re.compile(r"(?<!`)\b[a-z_]+\.(entropy_coef|aepo_entropy_adv_gamma|kl_coef)\b")
    for name in ("trainer.py", "strategies.py", "logprobs.py", "losses/base.py"):
        code = [line for line in (ROOT / "learner" / name).read_text().splitlines()
                if not line.lstrip().startswith("#")]
        hits = [line.strip() for line in code if knobs.search(line)]
        assert not hits, f"learner/{name}: {hits}"
