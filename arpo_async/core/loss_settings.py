"""The policy loss's settings, defined once (pure: stdlib only).

``learner.loss`` in the config is built from these fields, with their defaults and
descriptions (arpo_async/core/config.py, ``LossConfig``), and learner/losses.py takes a
``LossSettings`` as it is: a knob added here is a config key, validated at start-up."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


def _knob(default, doc: str):
    return field(default=default, metadata={"doc": doc})


@dataclass(frozen=True)
class LossSettings:
    eps_low: float = _knob(0.2, "PPO clip below 1")
    eps_high: float = _knob(0.28, "PPO clip above 1")
    dual_clip: float = _knob(0.0, "dual-clip constant c for A<0 (0: off, else > 1; 3 typical)")
    is_mode: Literal["truncate", "mask", "off"] = _knob(
        "truncate", "importance weight: truncated, mask outside [lo, hi], or 1")
    is_cap: float = _knob(2.0, "C: truncation cap of the IS weight")
    is_mask_low: float = _knob(0.5, "mask mode: lower bound of exp(prox - mu)")
    is_mask_high: float = _knob(2.0, "mask mode: upper bound of exp(prox - mu)")
    kl_coef: float = _knob(0.0, "k3 KL to a frozen copy of the initial weights, loaded on "
                           "the learner when > 0 (0 in ARPO and AEPO)")
    entropy_coef: float = _knob(0.0, "entropy bonus (0 in ARPO)")
    aepo_entropy_clip: bool = _knob(False, "AEPO: entropy-balanced clipping")
    aepo_entropy_adv_gamma: float = _knob(0.0, "AEPO: entropy-aware advantage gamma")

    def __post_init__(self) -> None:
        if self.is_mode not in ("truncate", "mask", "off"):
            raise ValueError(f"is_mode {self.is_mode!r}: expected truncate, mask or off")
        if self.dual_clip != 0.0 and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"eps_low {self.eps_low} must be in [0, 1), eps_high >= 0")
        if self.is_cap <= 0 or not 0 <= self.is_mask_low <= self.is_mask_high:
            raise ValueError("is_cap must be > 0 and 0 <= is_mask_low <= is_mask_high")
