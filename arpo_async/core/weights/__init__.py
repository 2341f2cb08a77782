"""Weight channels, one module each (base.py says the contract): ZeroMQ (zeromq.py: any
actor on any machine, and every actor's fallback), delta (delta.py: any actor, only the
values that changed) and NCCL (nccl.py: vLLM GPU actors on the learner's machine).
``learner.weight_sync.channel`` names one of ``CHANNELS``; a new channel is a module here
with a ``CHANNEL`` entry, added to ``CHANNELS`` (docs/extending.md).
Importing this package registers every channel's messages with the protocol."""

from __future__ import annotations

import logging
from typing import Any

from arpo_async.core.weights import delta, nccl, zeromq
from arpo_async.core.weights.base import (
    Channel,
    Loaded,
    Requester,
    WeightReceiver,
    WeightSender,
    WeightTransferFailed,
)

__all__ = ["CHANNELS", "Channel", "Loaded", "Requester", "WeightReceiver", "WeightSender",
           "WeightTransferFailed", "build_weight_receiver", "build_weight_senders"]

log = logging.getLogger("weights")

CHANNELS: dict[str, Channel] = {c.name: c for c in (zeromq.CHANNEL, delta.CHANNEL, nccl.CHANNEL)}
FALLBACK = zeromq.CHANNEL.name  # served always; what an actor uses when its channel fails


def channel(name: str) -> Channel:
    if name not in CHANNELS:
        raise ValueError(f"learner.weight_sync.channel {name!r}: no such channel "
                         f"({', '.join(CHANNELS)})")
    return CHANNELS[name]


def build_weight_senders(cfg: Any) -> list[WeightSender]:
    """The learner's channels for this run: ZeroMQ always, and the one
    ``learner.weight_sync.channel`` names (its ``sender(cfg)`` raises with what is missing)."""
    name = cfg.learner.weight_sync.channel
    senders = [CHANNELS[FALLBACK].sender(cfg)]
    if name != FALLBACK:
        senders.append(channel(name).sender(cfg))
    return senders


async def build_weight_receiver(cfg: Any, control: Requester, engine: Any,
                                actor_id: int) -> WeightReceiver:
    """This actor's channel: the one ``learner.weight_sync.channel`` names, or ZeroMQ where that
    one cannot serve this actor (its factory logs why)."""
    fallback = zeromq.ZmqWeightReceiver(control, actor_id)
    name = cfg.learner.weight_sync.channel
    if name == FALLBACK:
        return fallback
    got = await channel(name).receiver(cfg, control, engine, actor_id, fallback)
    return fallback if got is None else got
