"""The learner's weight channels, one module each behind one interface (base.py), built
by ``build_weight_senders``: ZeroMQ always (zeromq.py: any actor, and the fallback of an
NCCL actor), NCCL too with ``learner.weight_sync=nccl`` (nccl.py: vLLM GPU actors on
this machine). The actors' side is actors/weights/."""

from __future__ import annotations

from learner.weights.base import WeightSender
from learner.weights.nccl import NcclWeightSender
from learner.weights.zeromq import ZmqWeightSender


def build_weight_senders(cfg) -> list[WeightSender]:
    """The channels of this run; NcclWeightSender.create raises with what is missing."""
    senders: list[WeightSender] = [ZmqWeightSender()]
    if cfg.learner.weight_sync == "nccl":
        senders.append(NcclWeightSender.create(cfg))
    return senders
