"""An actor's weight channels, one module each behind one interface (base.py), picked by
``build_weight_receiver``: ZeroMQ (zeromq.py: any machine), or NCCL (nccl.py) with
``learner.weight_sync=nccl`` when the engine can receive over it and the learner lets
this actor join (same machine); otherwise the actor logs why and uses ZeroMQ. The
learner's side is learner/weights/."""

from __future__ import annotations

import logging
from typing import Any

from actors.weights.base import Requester, WeightReceiver
from actors.weights.nccl import NcclWeightReceiver
from actors.weights.zeromq import ZmqWeightReceiver

log = logging.getLogger("actor.weights")


async def build_weight_receiver(cfg: Any, control: Requester, engine: Any,
                                actor_id: int) -> WeightReceiver:
    """The channel for this actor; joins the NCCL group when that is the one."""
    zmq = ZmqWeightReceiver(control, actor_id)
    if cfg.learner.weight_sync != "nccl":
        return zmq
    if not hasattr(engine, "receive_weights_nccl"):
        log.warning("actor %d: learner.weight_sync=nccl, but the %s engine cannot receive "
                    "over NCCL; using ZeroMQ", actor_id, cfg.actors.engine)
        return zmq
    nccl = await NcclWeightReceiver.join(control, engine, actor_id, zmq,
                                         cfg.learner.nccl_timeout_s)
    return zmq if nccl is None else nccl
