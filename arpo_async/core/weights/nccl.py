"""The NCCL weight channel (``learner.weight_sync.channel=nccl``): vLLM GPU actors on the
learner's own machine.

Why: over ZeroMQ every actor receives a full copy through a socket, writes it to a file
in /dev/shm and vLLM reloads the file; for a 14B model that is tens of seconds per actor
(docs/scale-out.md). Over NCCL the learner streams the weights GPU to GPU (NVLink or PCIe)
into the vLLM workers, which load them in place through vLLM's weight-transfer engine
(``vllm/distributed/weight_transfer/nccl_engine.py``, vLLM 0.32).

How it fits the asynchronous design: each actor still pulls at its own safe point.
- join (``NcclJoinRequest``, once per actor): only from the same machine (kernel boot id);
  the learner binds a rendezvous port and answers with the group's geometry; a sender
  thread then forms a two-party group: learner rank 0 plus the actor's tensor-parallel
  workers (NCCL allows one rank per GPU, so the actor's GPUs must differ from the
  learner's). The engine joins it (``init_weight_transfer(reply)``).
- update (``NcclWeightsRequest``, sent by the engine once its calls are drained or
  frozen): the learner answers with the header of its newest published version and queues
  the broadcast of exactly that version on the actor's group; the engine's workers
  receive it (``receive_weights_nccl``: the receive is the engine's,
  actors/engines/vllm_weights.py; this channel does the control only).

The sender thread runs one transfer at a time. It copies the published host snapshot
(the same host tensors ZeroMQ serves) into two GPU staging buffers on a copy stream and
broadcasts each packed chunk on an NCCL stream, so the training stream is never blocked.
Chunks follow vLLM's packing rule (``plan_chunks``), which the receiving workers apply to
the header. A transfer that does not finish within ``learner.weight_sync.timeout_s`` (the actor
died) is aborted with ``ncclCommAbort`` and the actor's group is forgotten: it falls back
to ZeroMQ or, after a restart, joins again. On the actor, a learner that dropped the
group turns it to ZeroMQ for good; a transfer that never completes leaves the workers
inside NCCL, so the actor exits to be restarted.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, ClassVar

from arpo_async.core import protocol as P
from arpo_async.core.host import machine_id
from arpo_async.core.transport.control import expect
from arpo_async.core.weights.base import (
    Channel,
    Loaded,
    Requester,
    WeightReceiver,
    WeightTransferFailed,
)

log = logging.getLogger("weights.nccl")


@dataclass
class NcclJoinRequest:
    """A vLLM GPU actor asks to receive weights over NCCL."""

    KIND: ClassVar[str] = "nccl_join"
    CHANNEL: ClassVar[str] = "nccl"  # a weight channel's request (learner/service.py routes)
    actor_id: int
    machine_id: str  # the kernel boot id: equal only on the same machine
    workers: int = 1  # the actor's vLLM worker processes (tensor parallel size)


@dataclass
class NcclJoinReply:
    """``ok``: join the group now (what vLLM's NCCL weight-transfer init info needs); else
    ``reason`` says why the actor keeps ZeroMQ."""

    KIND: ClassVar[str] = "nccl_join_reply"
    ok: bool
    reason: str = ""
    master_address: str = ""
    master_port: int = 0
    world_size: int = 0
    buffer_bytes: int = 0
    num_buffers: int = 0


@dataclass
class NcclWeightsRequest:
    """Sent at the actor's safe point: weights newer than ``have_version``, over NCCL."""

    KIND: ClassVar[str] = "nccl_weights_request"
    CHANNEL: ClassVar[str] = "nccl"
    actor_id: int
    have_version: int


@dataclass
class NcclWeightsHeader:
    """What the broadcast that follows carries, in order (vLLM's update info)."""

    KIND: ClassVar[str] = "nccl_weights_header"
    version: int
    names: list[str] = field(default_factory=list)
    dtype_names: list[str] = field(default_factory=list)
    shapes: list[list[int]] = field(default_factory=list)


MESSAGES = (NcclJoinRequest, NcclJoinReply, NcclWeightsRequest, NcclWeightsHeader)
P.register_messages(*MESSAGES)


class NcclUnavailable(RuntimeError):
    """This actor cannot (or can no longer) receive weights over NCCL."""


# ----------------------------------------------------------------------------- pure helpers


_FLOAT_DTYPES = ("float32", "float16", "bfloat16")


# ----------------------------------------------------------------------------- pure helpers


def weight_header(tensors: dict) -> tuple[list, list, list]:
    """(names, torch dtype names, shapes) of a published snapshot, in its order, each
    dtype the tensor's own."""
    names, dtypes, shapes = [], [], []
    for name, t in tensors.items():
        kind = str(t.dtype).removeprefix("torch.")
        if kind not in _FLOAT_DTYPES:
            raise ValueError(f"weights[{name!r}]: dtype {kind} cannot be sent over NCCL")
        names.append(name)
        dtypes.append(kind)
        shapes.append([int(d) for d in t.shape])
    return names, dtypes, shapes


def plan_chunks(sizes: list[int], buffer_bytes: int) -> list[list[int]]:
    """Indices per packed chunk, by vLLM's rule (``packed_tensor.pack_tensors`` and the
    consumer): add tensors in order, close the chunk once its bytes exceed the buffer."""
    chunks, current, total = [], [], 0
    for i, size in enumerate(sizes):
        current.append(i)
        total += size
        if total > buffer_bytes:
            chunks.append(current)
            current, total = [], 0
    if current:
        chunks.append(current)
    return chunks


def free_listen_socket(host: str) -> socket.socket:
    """A bound, listening TCP socket on a free port (the rendezvous store's server)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return sock


@dataclass
class _Snapshot:
    version: int
    header: NcclWeightsHeader
    tensors: list  # host tensors, in header order


class TransferTimeout(RuntimeError):
    pass


# ----------------------------------------------------------------------------- learner


class NcclWeightSender:
    """The learner's side (rank 0), a ``WeightSender``: ``handle`` runs on the control
    thread and never blocks; transfers run on the sender thread."""

    channel = "nccl"
    requests = (NcclJoinRequest, NcclWeightsRequest)

    def __init__(self, device_index: int, buffer_bytes: int, timeout_s: float,
                 num_buffers: int = 2, address: str = "127.0.0.1", start: bool = True):
        """``start=False`` leaves the sender thread (the CUDA side) unstarted: jobs queue
        up in ``_jobs``, which is how the control logic is tested without a GPU."""
        self.device_index, self.buffer_bytes = device_index, buffer_bytes
        self.timeout_s, self.num_buffers, self.address = timeout_s, num_buffers, address
        self.machine = machine_id()
        self._lock = threading.Lock()
        self._snapshot: _Snapshot | None = None
        self._members: set[int] = set()  # actors joined or joining
        self._groups: dict[int, object] = {}  # actor id -> PyNcclCommunicator (sender thread)
        self._jobs: queue.Queue = queue.Queue()
        self._counts = {"joins": 0, "transfers": 0, "aborted": 0, "bytes": 0, "seconds": 0.0}
        self._thread = threading.Thread(target=self._run, name="nccl-weights", daemon=True)
        if start:
            self._thread.start()

    @classmethod
    def create(cls, cfg) -> NcclWeightSender:
        """For ``learner.weight_sync.channel=nccl``; raises with what is missing."""
        try:  # torch, vllm: the NCCL path only (vllm from the gpu extra)
            import torch
            from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator  # noqa
        except ImportError as exc:
            raise RuntimeError(f"learner.weight_sync.channel=nccl needs vLLM (its NCCL "
                               f"wrapper) in the learner's environment: {exc}") from None
        if not torch.cuda.is_available():
            raise RuntimeError("learner.weight_sync.channel=nccl needs CUDA in the learner "
                               "process; use learner.weight_sync.channel=zmq on machines "
                               "without GPUs")
        return cls(int(os.environ.get("LOCAL_RANK", "0")),
                   cfg.learner.weight_sync.buffer_mb * 2**20, cfg.learner.weight_sync.timeout_s)

    # ------------------------------------------------------------- control thread
    def publish(self, version: int, tensors: dict) -> None:
        """The newest weights; the tensors must not change afterwards."""
        names, dtypes, shapes = weight_header(tensors)
        snap = _Snapshot(version, NcclWeightsHeader(version, names, dtypes, shapes),
                         [tensors[n] for n in names])
        with self._lock:
            self._snapshot = snap

    def stats(self) -> dict:
        """Joins, transfers, aborted transfers, bytes and seconds sent."""
        return dict(self._counts)

    def handle(self, msg):
        if isinstance(msg, NcclJoinRequest):
            return self._join(msg)
        if isinstance(msg, NcclWeightsRequest):
            return self._offer(msg)
        return P.Ack(ok=False, reason=f"nccl weights: unexpected {type(msg).__name__}")

    def _join(self, msg: NcclJoinRequest) -> NcclJoinReply:
        if msg.machine_id != self.machine:
            return NcclJoinReply(ok=False, reason="actor runs on another machine")
        if not 1 <= msg.workers <= 64:
            return NcclJoinReply(ok=False, reason=f"bad worker count {msg.workers}")
        sock = free_listen_socket(self.address)
        world = 1 + msg.workers
        with self._lock:
            self._members.add(msg.actor_id)
        self._jobs.put(("join", msg.actor_id, sock, world))
        return NcclJoinReply(ok=True, master_address=self.address,
                               master_port=sock.getsockname()[1], world_size=world,
                               buffer_bytes=self.buffer_bytes, num_buffers=self.num_buffers)

    def _offer(self, msg: NcclWeightsRequest):
        with self._lock:
            snap, member = self._snapshot, msg.actor_id in self._members
        if snap is None or snap.version <= msg.have_version:
            return P.Ack(ok=True, learner_version=-1 if snap is None else snap.version)
        if not member:
            return P.Ack(ok=False, reason="no NCCL group for this actor (aborted or never "
                                          "joined)")
        self._jobs.put(("send", msg.actor_id, snap))
        return snap.header

    def close(self) -> None:
        self._jobs.put(None)
        if self._thread.is_alive():
            self._thread.join(5.0)

    # ------------------------------------------------------------- sender thread
    def _run(self) -> None:
        import torch

        torch.cuda.set_device(self.device_index)
        self._copy_stream = torch.cuda.Stream()
        self._nccl_stream = torch.cuda.Stream()
        self._buffers: list = []
        while (job := self._jobs.get()) is not None:
            kind, actor_id = job[0], job[1]
            try:
                if kind == "join":
                    self._form_group(actor_id, *job[2:])
                else:
                    self._transfer(actor_id, job[2])
            except Exception as exc:  # one actor's failure must not stop the channel
                log.error("nccl weights: %s for actor %d failed: %s", kind, actor_id, exc)
                self._forget(actor_id, abort=isinstance(exc, TransferTimeout))
        for actor_id in list(self._groups):
            self._forget(actor_id, abort=False)

    def _form_group(self, actor_id: int, sock: socket.socket, world: int) -> None:
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup
        from vllm.utils.nccl import unpinned_nccl_env

        self._forget(actor_id, abort=False, keep_member=True)  # a restarted actor rejoins
        pg = StatelessProcessGroup.create(host=self.address, port=sock.getsockname()[1],
                                          rank=0, world_size=world, listen_socket=sock,
                                          store_timeout=int(self.timeout_s))
        with unpinned_nccl_env():
            self._groups[actor_id] = PyNcclCommunicator(pg, device=self.device_index)
        self._counts["joins"] += 1
        log.info("nccl weights: actor %d joined (group of %d)", actor_id, world)

    def _transfer(self, actor_id: int, snap: _Snapshot) -> None:
        import torch

        comm = self._groups.get(actor_id)
        if comm is None:
            raise RuntimeError("no group (join failed)")
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        sizes = [t.nbytes for t in snap.tensors]
        chunks = plan_chunks(sizes, self.buffer_bytes)
        cap = max(sum(sizes[i] for i in c) for c in chunks)
        if not self._buffers or self._buffers[0].numel() < cap:
            self._buffers = [torch.empty(cap, dtype=torch.uint8, device=self.device_index)
                             for _ in range(self.num_buffers)]
        done = [None] * self.num_buffers
        for k, chunk in enumerate(chunks):
            slot = k % self.num_buffers
            if done[slot] is not None:  # the slot's previous broadcast must have left
                _wait(done[slot], deadline)
            buf, offset = self._buffers[slot], 0
            with torch.cuda.stream(self._copy_stream):
                for i in chunk:
                    buf[offset:offset + sizes[i]].copy_(_bytes_view(snap.tensors[i]))
                    offset += sizes[i]
                copied = torch.cuda.Event()
                copied.record(self._copy_stream)
            self._nccl_stream.wait_event(copied)
            comm.broadcast(buf[:offset], src=0, stream=self._nccl_stream)
            done[slot] = torch.cuda.Event()
            done[slot].record(self._nccl_stream)
        for event in done:
            if event is not None:
                _wait(event, deadline)
        self._counts["transfers"] += 1
        self._counts["bytes"] += sum(sizes)
        self._counts["seconds"] += time.perf_counter() - t0
        log.info("nccl weights: v%d to actor %d, %.1f MB in %.2f s", snap.version, actor_id,
                 sum(sizes) / 1e6, time.perf_counter() - t0)

    def _forget(self, actor_id: int, abort: bool, keep_member: bool = False) -> None:
        comm = self._groups.pop(actor_id, None)
        if not keep_member:
            with self._lock:
                self._members.discard(actor_id)
        if comm is None:
            return
        try:
            if abort:  # frees a broadcast that waits for a peer that is gone
                self._counts["aborted"] += 1
                comm.nccl.ncclCommAbort(comm.comm)
                comm.disabled = True
            else:
                comm.destroy()
        except Exception as exc:  # best effort: the group is unusable either way
            log.warning("nccl weights: closing actor %d's group: %s", actor_id, exc)


def _bytes_view(t):
    """A host tensor's bytes as a flat uint8 tensor (no copy)."""
    import torch

    if t.numel() == 0:  # an empty tensor's stride cannot be reinterpreted
        return torch.empty(0, dtype=torch.uint8)
    return t.contiguous().reshape(-1).view(torch.uint8)


def _wait(event, deadline: float) -> None:
    """Poll a CUDA event until it completes; TransferTimeout at the deadline (a blocking
    synchronize would wait forever for a peer that died)."""
    while not event.query():
        if time.monotonic() > deadline:
            raise TransferTimeout("broadcast did not complete (actor gone?)")
        time.sleep(0.0005)


# ----------------------------------------------------------------------------- actor


class NcclWeightReceiver:
    """The actor's side, a ``WeightReceiver`` over NCCL, with ``fallback`` (ZeroMQ) once
    NCCL is gone."""

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
        reply = await control.request(NcclJoinRequest(actor_id, machine_id(),
                                                        engine.nccl_workers))
        if not isinstance(reply, NcclJoinReply) or not reply.ok:
            reason = getattr(reply, "reason", type(reply).__name__)
            log.warning("actor %d: no NCCL weight sync (%s); using ZeroMQ", actor_id, reason)
            return None
        try:
            await engine.init_weight_transfer(reply)
        except Exception as exc:  # e.g. NCCL refuses two ranks on one GPU: say so, keep going
            log.error("actor %d: joining the learner's NCCL group failed (%s); using ZeroMQ",
                      actor_id, exc)
            return None
        log.info("actor %d: NCCL weight sync with the learner (group of %d)", actor_id,
                 reply.world_size)
        return cls(control, actor_id, fallback, timeout_s)

    async def _header(self, have_version: int) -> NcclWeightsHeader | None:
        reply = await self.control.request(NcclWeightsRequest(self.actor_id, have_version))
        try:
            return expect(reply, NcclWeightsHeader, "nccl weights request")
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
            except WeightTransferFailed as exc:
                # The workers wait inside an NCCL collective that will not complete, and
                # every later engine call would queue behind it: only a new process (the
                # launcher restarts this actor) frees the GPU.
                log.critical("actor %d: %s; exiting so that the actor is restarted",
                             self.actor_id, exc)
                os._exit(P.ExitCode.RESTART)
            else:
                return None if got is None else Loaded(*got, self.channel)
        return await self.fallback.sync(engine, have_version)


# ----------------------------------------------------------------------------- the channel


def _sender(cfg: Any) -> NcclWeightSender:
    return NcclWeightSender.create(cfg)


async def _receiver(cfg: Any, control: Requester, engine: Any, actor_id: int,
                    fallback: WeightReceiver) -> WeightReceiver | None:
    if not hasattr(engine, "receive_weights_nccl"):
        log.warning("actor %d: learner.weight_sync.channel=nccl, but the %s engine cannot receive "
                    "over NCCL; using ZeroMQ", actor_id, cfg.actors.engine.type)
        return None
    return await NcclWeightReceiver.join(control, engine, actor_id, fallback,
                                         cfg.learner.weight_sync.timeout_s)


CHANNEL = Channel("nccl", MESSAGES, _sender, _receiver)
