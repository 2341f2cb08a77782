"""The policy loss's settings as learner/losses.py takes them (pure: stdlib only).

Each field is a ``learner.loss`` config key of the same name and default, described in
arpo_async/core/config/learner.py (``LossConfig``); tests/unit/test_config_rules.py checks
that the two agree, so a knob added here without its key fails there."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class LossSettings:
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float = 0.0
    is_mode: Literal["truncate", "mask", "off"] = "truncate"
    is_cap: float = 2.0
    is_mask_low: float = 0.5
    is_mask_high: float = 2.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0
    aepo_entropy_clip: bool = False
    aepo_entropy_adv_gamma: float = 0.0

    def __post_init__(self) -> None:
        if self.is_mode not in ("truncate", "mask", "off"):
            raise ValueError(f"is_mode {self.is_mode!r}: expected truncate, mask or off")
        if self.dual_clip != 0.0 and self.dual_clip <= 1.0:
            raise ValueError(f"dual_clip must be 0 (off) or > 1, got {self.dual_clip}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"eps_low {self.eps_low} must be in [0, 1), eps_high >= 0")
        if self.is_cap <= 0 or not 0 <= self.is_mask_low <= self.is_mask_high:
            raise ValueError("is_cap must be > 0 and 0 <= is_mask_low <= is_mask_high")
