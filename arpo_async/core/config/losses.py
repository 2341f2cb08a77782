"""``learner.loss``: the policy loss, one settings class per loss type, chosen by ``type``.

The keys every loss shares (the proximal policy, advantage attribution, the importance
weight, KL and entropy terms) are ``_LossBase``'s; each type adds its own. A type's own
clip, ``eps_low`` and ``eps_high``, is declared in each class because it means another
clip in each (a token ratio's, a sequence ratio's, an IS weight's), so a switch of
``type`` never carries it: ``learner.loss.type=gspo`` over a PPO preset runs GSPO's
default clip, and a clip written beside the type (in YAML, or as an override after the
switch) is that type's (``Tagged.shared``; tests/unit/test_loss_switch.py). These classes
are the only declaration of a loss's knobs: the learner hands the validated section to
the loss function (learner/losses/), which reads the attributes it needs. A new loss type
is a class here, added to ``LOSS_TYPES``, and its module under learner/losses/
(docs/extending.md).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

from pydantic import Field, field_validator, model_validator

from arpo_async.core.config.base import Tagged, _Section


_MODE = ("truncate: min(w, cap); mask: w outside [low, high] drops the token, else 1; "
         "off: 1")


class TruncateIS(_Section):
    mode: Literal["truncate"] = Field("truncate", description=_MODE)
    cap: float = Field(2.0, gt=0, description="C: truncation cap of the IS weight")


class MaskIS(_Section):
    mode: Literal["mask"] = Field("mask", description=_MODE)
    low: float = Field(0.5, ge=0, description="lower bound of exp(prox - mu)")
    high: float = Field(2.0, description="upper bound of exp(prox - mu)")

    @model_validator(mode="after")
    def _bounds(self):
        if self.low > self.high:
            raise ValueError(f"learner.loss.importance.low {self.low} > high {self.high}")
        return self


class NoIS(_Section):
    mode: Literal["off"] = Field("off", description=_MODE)


IMPORTANCE_MODES: dict[str, type[_Section]] = {"truncate": TruncateIS, "mask": MaskIS,
                                               "off": NoIS}
IMPORTANCE = Tagged("learner.loss.importance", "mode", IMPORTANCE_MODES, "truncate",
                    "importance mode")
ImportanceConfig = IMPORTANCE.annotation


class LossNeeds(NamedTuple):
    """What the learner computes for a loss beside the policy's log-probs: the loss
    declares it (``_LossBase.needs``), the trainer reads it, never the knob names."""

    entropy: bool  # token entropies of the current policy
    entropy_grad: bool  # ... with their gradient (an entropy term in the loss)
    batch_entropy: bool  # the whole step's entropy mean and std (over micro-batches, ranks)
    reference: bool  # a frozen reference policy's log-probs (a KL term)


class _LossBase(_Section):
    proximal: Literal["recompute", "bypass"] = Field(
        "bypass", description="proximal log-probs: learner forward pass, or behaviour log-probs"
    )
    advantage: Literal["soft", "hard", "tree", "tree_grpo"] = Field(
        "soft", description="advantage attribution: soft (ARPO's, GRPO's when nothing "
        "branched), hard (each shared segment trained once), tree (TreeRL's node advantage: "
        "global plus local baseline), tree_grpo (Tree-GRPO's group plus tree z-scores); "
        "learner/advantages.py")
    importance: ImportanceConfig = Field(
        default_factory=lambda: TruncateIS(), description="the importance weight w_t = "
        "exp(prox - mu) (learner.loss.importance.mode: truncate, mask or off, each with its "
        "own keys)")
    kl_coef: float = Field(
        0.0, description="k3 KL to a frozen copy of the initial weights, loaded on the "
        "learner when > 0 (0 in ARPO and AEPO)")
    entropy_coef: float = Field(0.0, description="entropy bonus (0 in ARPO)")
    aepo_entropy_adv_gamma: float = Field(
        0.0, description="AEPO: entropy-aware advantage gamma")

    @property
    def needs(self) -> LossNeeds:
        """What this loss needs computed (a type whose objective needs more overrides it):
        the entropy bonus needs entropies with their gradient, AEPO's entropy-aware
        advantage entropies and their batch moments, the KL term the reference."""
        return LossNeeds(entropy=bool(self.entropy_coef or self.aepo_entropy_adv_gamma),
                         entropy_grad=self.entropy_coef != 0.0,
                         batch_entropy=self.aepo_entropy_adv_gamma != 0.0,
                         reference=self.kl_coef != 0.0)


class PPOLoss(_LossBase):
    """Token-level clipped ratio (PPO, with DAPO's asymmetric clip, dual clip and AEPO's
    entropy-balanced clip): ARPO's and AEPO's loss (learner/losses/ppo.py)."""

    type: Literal["ppo"] = Field("ppo", description="the loss: ppo")
    eps_low: float = Field(0.2, ge=0, lt=1, description="PPO clip below 1")
    eps_high: float = Field(0.28, ge=0, description="PPO clip above 1")
    dual_clip: float = Field(
        0.0, description="dual-clip constant c for A<0 (0: off, else > 1; 3 typical)")
    aepo_entropy_clip: bool = Field(False, description="AEPO: entropy-balanced clipping")

    @field_validator("dual_clip")
    @classmethod
    def _dual_clip(cls, value: float) -> float:
        if value != 0.0 and value <= 1.0:
            raise ValueError(f"must be 0 (off) or > 1, got {value}")
        return value


class GSPOLoss(_LossBase):
    """Sequence-level ratio and clip (GSPO, arXiv 2507.18071; learner/losses/gspo.py)."""

    type: Literal["gspo"] = Field("gspo", description="the loss: gspo")
    eps_low: float = Field(
        3e-4, ge=0, lt=1, description="GSPO: clip of the sequence ratio below 1 (paper 3e-4)")
    eps_high: float = Field(
        4e-4, ge=0, description="GSPO: clip of the sequence ratio above 1 (paper 4e-4)")


class CISPOLoss(_LossBase):
    """Clipped IS-weight REINFORCE (CISPO, MiniMax-M1, arXiv 2506.13585;
    learner/losses/cispo.py)."""

    type: Literal["cispo"] = Field("cispo", description="the loss: cispo")
    eps_low: float = Field(
        1.0, ge=0, le=1, description="CISPO: the IS weight's clip below 1 (1: no lower bound, "
        "as in the paper)")
    eps_high: float = Field(
        0.28, ge=0, description="CISPO: the IS weight's clip above 1 (the paper tunes only "
        "this one)")


LOSS_TYPES: dict[str, type[_LossBase]] = {"ppo": PPOLoss, "gspo": GSPOLoss,
                                          "cispo": CISPOLoss}


LOSS = Tagged("learner.loss", "type", LOSS_TYPES, "ppo", "loss type")
LossConfig = LOSS.annotation

