"""How an actor receives new weights: the channel the config chooses, behind one call.

- ``ZmqWeights``: fetch the full weights over the learner's control socket (any machine)
  and load them with ``engine.update_weights`` (``load_update``: with their bfloat16 names).
- ``NcclWeights`` (``learner.weight_sync=nccl``): a vLLM GPU actor on the learner's own
  machine joins an NCCL group with the learner once (vLLM's weight-transfer engine,
  ``vllm/distributed/weight_transfer/nccl_engine.py``), then at each safe point asks for
  the header of the newest version and receives the broadcast straight into its GPU
  workers (``VLLMEngine.receive_weights_nccl``): no socket copy, no file, no reload.

``build_weight_sync`` picks the channel. NCCL is only possible on the learner's machine
(same kernel boot id) with an engine that supports it; otherwise the actor logs why and
uses ZeroMQ, and an NCCL failure later (the learner aborted a stuck transfer) also falls
back to ZeroMQ. Either way ``sync`` returns what was loaded, or None when nothing newer.

The pure helpers (``init_info_from``, ``update_info_from``) build exactly
the dicts vLLM's ``NCCLWeightTransferInitInfo``/``UpdateInfo`` take, and are unit-tested
against those classes on CPU.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Protocol

from arpo_async.core import protocol as P
from arpo_async.core.host import machine_id

log = logging.getLogger("actor.weights")



@dataclass
class WeightSyncResult:
    version: int  # the version now loaded
    paused_s: float  # seconds generation was held
    channel: str  # "zmq" or "nccl"


class WeightSync(Protocol):
    channel: str

    async def sync(self, engine: Any, have_version: int | None = None) -> WeightSyncResult | None:
        """Load weights newer than ``have_version`` (default ``engine.version``; -1 takes
        whatever the learner publishes, e.g. an older version after it resumed from a
        checkpoint); None when there is nothing to load."""


class NcclUnavailable(RuntimeError):
    """This actor cannot (or can no longer) receive weights over NCCL."""


class NcclTransferFailed(RuntimeError):
    """A broadcast did not complete: the vLLM workers may be stuck inside NCCL."""




def init_info_from(reply: P.NcclJoinReply) -> dict:
    """vLLM ``NCCLWeightTransferInitInfo`` for this actor's workers: ranks 1..world-1
    after the learner's rank 0, packed transfers with the learner's buffer geometry."""
    return {"master_address": reply.master_address, "master_port": reply.master_port,
            "rank_offset": 1, "world_size": reply.world_size, "packed": True,
            "packed_buffer_size_bytes": reply.buffer_bytes,
            "packed_num_buffers": reply.num_buffers}


def update_info_from(header: P.NcclWeightsHeader) -> dict:
    """vLLM ``NCCLWeightTransferUpdateInfo``: what the broadcast carries, in order."""
    if not (len(header.names) == len(header.dtype_names) == len(header.shapes)):
        raise ValueError(f"weights header v{header.version}: {len(header.names)} names, "
                         f"{len(header.dtype_names)} dtypes, {len(header.shapes)} shapes")
    return {"names": list(header.names), "dtype_names": list(header.dtype_names),
            "shapes": [list(s) for s in header.shapes]}


async def load_update(engine: Any, update: P.WeightsUpdate) -> float:
    """``engine.update_weights`` with the update's bfloat16 names (the uint16 arrays that
    carry bfloat16 bits); seconds paused. A float32 update has none to pass, so engines
    and wrappers without the argument keep working for it."""
    if update.bf16_names:
        return await engine.update_weights(update.tensors, update.version,
                                           bf16_names=list(update.bf16_names))
    return await engine.update_weights(update.tensors, update.version)


class ZmqWeights:
    channel = "zmq"

    def __init__(self, control: Any, actor_id: int):
        self.control, self.actor_id = control, actor_id

    async def sync(self, engine: Any, have_version: int | None = None) -> WeightSyncResult | None:
        have = engine.version if have_version is None else have_version
        update = await self.control.fetch_weights(have, self.actor_id)
        if update is None or update.version == engine.version or (
                update.version < engine.version and have >= engine.version):
            return None
        paused = await load_update(engine, update)
        return WeightSyncResult(update.version, paused, self.channel)


class NcclWeights:
    channel = "nccl"

    def __init__(self, control: Any, actor_id: int, fallback: ZmqWeights, timeout_s: float):
        self.control, self.actor_id = control, actor_id
        self.fallback, self.timeout_s = fallback, timeout_s
        self.broken = ""  # why NCCL stopped; ZeroMQ from then on

    async def _header(self, have_version: int) -> P.NcclWeightsHeader | None:
        reply = await self.control.request(P.NcclWeightsRequest(self.actor_id, have_version))
        if isinstance(reply, P.NcclWeightsHeader):
            return reply
        if isinstance(reply, P.Ack) and reply.ok:
            return None
        reason = reply.reason if isinstance(reply, P.Ack) else type(reply).__name__
        raise NcclUnavailable(f"learner: {reason}")

    async def sync(self, engine: Any, have_version: int | None = None) -> WeightSyncResult | None:
        have = engine.version if have_version is None else have_version
        if not self.broken:
            try:
                got = await engine.receive_weights_nccl(lambda: self._header(have),
                                                        self.timeout_s)
            except NcclUnavailable as exc:
                self.broken = str(exc)
                log.error("actor %d: NCCL weight sync stopped (%s); using ZeroMQ from now on",
                          self.actor_id, exc)
            except NcclTransferFailed as exc:
                # The workers wait inside an NCCL collective that will not complete, and
                # every later engine call would queue behind it: only a new process (the
                # launcher restarts this actor) frees the GPU.
                log.critical("actor %d: %s; exiting so that the actor is restarted",
                             self.actor_id, exc)
                os._exit(P.ExitCode.RESTART)
            else:
                return None if got is None else WeightSyncResult(*got, self.channel)
        return await self.fallback.sync(engine, have_version)


async def build_weight_sync(cfg: Any, control: Any, engine: Any, actor_id: int) -> WeightSync:
    """The channel for this actor (see the module docstring); joins the NCCL group when
    that is the one."""
    zmq = ZmqWeights(control, actor_id)
    if cfg.learner.weight_sync != "nccl":
        return zmq
    if not hasattr(engine, "receive_weights_nccl"):
        log.warning("actor %d: learner.weight_sync=nccl, but the %s engine cannot receive "
                    "over NCCL; using ZeroMQ", actor_id, cfg.actors.engine)
        return zmq
    reply = await control.request(P.NcclJoinRequest(actor_id, machine_id(),
                                                    engine.nccl_workers))
    if not isinstance(reply, P.NcclJoinReply) or not reply.ok:
        reason = getattr(reply, "reason", type(reply).__name__)
        log.warning("actor %d: no NCCL weight sync (%s); using ZeroMQ", actor_id, reason)
        return zmq
    try:
        await engine.init_weight_transfer(init_info_from(reply))
    except Exception as exc:  # e.g. NCCL refuses two ranks on one GPU: say so, keep going
        log.error("actor %d: joining the learner's NCCL group failed (%s); using ZeroMQ",
                  actor_id, exc)
        return zmq
    log.info("actor %d: NCCL weight sync with the learner (group of %d)", actor_id,
             reply.world_size)
    return NcclWeights(control, actor_id, zmq, cfg.learner.nccl_timeout_s)
