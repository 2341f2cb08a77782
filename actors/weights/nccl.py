"""An actor's NCCL weight channel (``learner.weight_sync=nccl``; the learner's side:
learner/weights/nccl.py).

A vLLM GPU actor on the learner's own machine joins an NCCL group with the learner once
(vLLM's weight-transfer engine, ``vllm/distributed/weight_transfer/nccl_engine.py``),
then at each safe point asks for the header of the newest version and receives the
broadcast straight into its GPU workers (``VLLMEngine.receive_weights_nccl``): no socket
copy, no file, no reload. A learner that drops the group (it aborted a stuck transfer)
turns the actor to ZeroMQ for good; a transfer that never completes leaves the workers
inside NCCL, so the actor exits to be restarted.

The pure helpers (``init_info_from``, ``update_info_from``) build exactly the dicts
vLLM's ``NCCLWeightTransferInitInfo``/``UpdateInfo`` take, and are unit-tested against
those classes on CPU.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from actors.weights.base import Loaded, Requester, WeightReceiver
from arpo_async.core import protocol as P
from arpo_async.core.host import machine_id
from arpo_async.core.transport.control import expect

log = logging.getLogger("actor.weights")


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


class NcclWeightReceiver:
    """A ``WeightReceiver`` (actors/weights/base.py) over NCCL, with ``fallback`` (ZeroMQ)
    once NCCL is gone."""

    channel = "nccl"

    def __init__(self, control: Requester, actor_id: int, fallback: WeightReceiver,
                 timeout_s: float):
        self.control, self.actor_id = control, actor_id
        self.fallback, self.timeout_s = fallback, timeout_s
        self.broken = ""  # why NCCL stopped; ZeroMQ from then on

    @classmethod
    async def join(cls, control: Requester, engine: Any, actor_id: int,
                   fallback: WeightReceiver, timeout_s: float) -> NcclWeightReceiver | None:
        """Join the learner's NCCL group; None (with the reason logged) when the learner
        refuses (another machine, no NCCL there) or the group cannot be formed."""
        reply = await control.request(P.NcclJoinRequest(actor_id, machine_id(),
                                                        engine.nccl_workers))
        if not isinstance(reply, P.NcclJoinReply) or not reply.ok:
            reason = getattr(reply, "reason", type(reply).__name__)
            log.warning("actor %d: no NCCL weight sync (%s); using ZeroMQ", actor_id, reason)
            return None
        try:
            await engine.init_weight_transfer(init_info_from(reply))
        except Exception as exc:  # e.g. NCCL refuses two ranks on one GPU: say so, keep going
            log.error("actor %d: joining the learner's NCCL group failed (%s); using ZeroMQ",
                      actor_id, exc)
            return None
        log.info("actor %d: NCCL weight sync with the learner (group of %d)", actor_id,
                 reply.world_size)
        return cls(control, actor_id, fallback, timeout_s)

    async def _header(self, have_version: int) -> P.NcclWeightsHeader | None:
        reply = await self.control.request(P.NcclWeightsRequest(self.actor_id, have_version))
        try:
            return expect(reply, P.NcclWeightsHeader, "nccl weights request")
        except P.ProtocolError as exc:
            raise NcclUnavailable(f"learner: {exc}") from None

    async def sync(self, engine: Any, have_version: int | None = None) -> Loaded | None:
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
                return None if got is None else Loaded(*got, self.channel)
        return await self.fallback.sync(engine, have_version)
