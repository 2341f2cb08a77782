"""The policy loss (pure): the loss types by ``learner.loss.type``, and the one driver
that applies any of them to a batch of token copies.

A loss type is a module here with a ``LOSS = LossType(objective, unit)`` (base.py says
the contract), registered in ``LOSSES``; its settings are a class in
arpo_async/core/config/losses.py. docs/extending.md walks through adding one.
"""

from __future__ import annotations

import torch

from learner.losses import cispo, gspo, ppo
from learner.losses.base import (KL_LIMIT, LOG_RATIO_LIMIT, LossInputs, LossType, Sequences,
                                 Terms, _f, aggregate, check_inputs, entropy_aware,
                                 entropy_moments, importance_weight, kl_k3, masked_mean,
                                 ratio_metrics, stats_from_moments)

__all__ = ["KL_LIMIT", "LOG_RATIO_LIMIT", "LOSSES", "LossInputs", "LossType", "Terms",
           "entropy_moments", "kl_k3", "loss_type", "policy_loss", "stats_from_moments"]

LOSSES: dict[str, LossType] = {"ppo": ppo.LOSS, "gspo": gspo.LOSS, "cispo": cispo.LOSS}


def loss_type(settings) -> LossType:
    """The registered loss type of ``settings.type``."""
    kind = getattr(settings, "type", "ppo")
    if kind not in LOSSES:
        raise ValueError(f"learner.loss.type {kind!r}: no such loss ({', '.join(LOSSES)})")
    return LOSSES[kind]


def policy_loss(inp: LossInputs, settings, normaliser: float | None = None,
                entropy_stats: tuple[float, float] | None = None
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Scalar loss to minimise, and metrics (masked means over this call's tokens).
    ``settings``: the ``learner.loss`` section; ``normaliser``: Z in the loss type's unit
    (None: this call's own count)."""
    s, kind = settings, loss_type(settings)
    check_inputs(inp, s, kind.unit)
    logpi = _f(inp.logprobs)
    m = _f(inp.loss_mask.detach())
    count = float(m.sum())
    # the sequence structure only where the loss reads it (torch.unique per micro-batch)
    seq = Sequences(inp.seq_ids, m) if kind.unit == "sequence" else None
    own = count if seq is None else float(seq.trained)
    if normaliser is not None and normaliser <= 0:
        raise ValueError(f"normaliser must be > 0, got {normaliser}")
    # No trained token: every sum is 0, so any Z > 0 gives a zero loss that backpropagates.
    norm = float(normaliser) if normaliser is not None else max(own, 1.0)
    mu = _f(inp.behaviour_logprobs.detach())
    prox = mu if inp.proximal_logprobs is None else _f(inp.proximal_logprobs.detach())
    adv = _f(inp.advantages.detach())
    if s.aepo_entropy_adv_gamma != 0.0:
        adv = entropy_aware(adv, inp.entropy, m, s.aepo_entropy_adv_gamma, entropy_stats)
    w, raw_w = importance_weight(prox, mu, s)
    # As verl does, bound the log-ratio so one wild token cannot overflow exp.
    log_r = (logpi - prox).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)
    obj, metrics = kind.objective(Terms(logpi=logpi, log_r=log_r, adv=adv, m=m, seq=seq), s)
    pg_loss = -aggregate(w * obj, m, seq, kind.unit) / norm
    loss = pg_loss
    metrics["kl"] = 0.0
    if inp.ref_logprobs is not None:
        # Padding/tool positions may hold anything: a finite stand-in there, and the
        # clamps keep exp() finite, so 0 * inf never turns the sum (or its gradient) nan.
        ref = torch.where(m > 0, _f(inp.ref_logprobs.detach()), 0.0)
        k3 = kl_k3(ref, logpi)
        loss = loss + s.kl_coef * aggregate(k3, m, seq, kind.unit) / norm
        metrics["kl"] = masked_mean(k3.detach(), m, count)
    if inp.entropy is not None:
        ent = _f(inp.entropy)
        if s.entropy_coef != 0.0:
            loss = loss - s.entropy_coef * aggregate(ent, m, seq, kind.unit) / norm
        metrics["entropy"] = masked_mean(ent.detach(), m, count)
    metrics |= ratio_metrics(torch.exp(log_r.detach()), log_r.detach(), w, raw_w, m, count, s)
    metrics |= {"loss": float(loss.detach()), "pg_loss": float(pg_loss.detach()),
                "tokens": count}
    return loss, metrics
