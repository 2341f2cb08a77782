"""The contract of a weight channel (one module each in this package: zeromq.py, nccl.py).

A channel is one room: its control messages (dataclasses with a ``KIND``, registered in
the protocol by ``register_messages``; a field named in ``TENSORS`` carries a dict of
torch tensors as raw frames, each with its own dtype, by the wire's one rule), the
learner's side (a ``WeightSender``) and the actor's side (a ``WeightReceiver``), and a
``Channel`` entry that says how each side is built. ``learner.weight_sync.channel`` names the
channel (this package's ``CHANNELS``); ZeroMQ is always served too, as every actor's
fallback.

The learner's rank 0 publishes each new version to every sender; an actor pulls at its
own safe point through its receiver, whose requests go over the actor's one control
client; the learner's service routes a request to the sender that lists its type in
``requests`` (``handle`` runs on the control thread and must not block: a reply is the
message to send, ``Encoded`` frames, or an Ack). A request whose class sets ``CHANNEL``
and that no sender of the run takes is refused as ``no_fast_weights``. Nothing here
imports torch or vLLM at module level."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


@dataclass
class Loaded:
    version: int  # the version now loaded
    paused_s: float  # seconds generation was held
    channel: str  # the channel's name ("zmq", "nccl", ...)


class Requester(Protocol):
    async def request(self, msg: Any) -> Any:
        """The learner's reply to ``msg``."""


class WeightReceiver(Protocol):
    channel: str

    async def sync(self, engine: Any, have_version: int | None = None) -> Loaded | None:
        """Load weights newer than ``have_version`` (default ``engine.version``; -1 takes
        whatever the learner publishes, e.g. an older version after it resumed from a
        checkpoint) into ``engine`` (``update_weights(tensors, version)``: host tensors of
        any dtype, cast to its own); None when there is nothing to load."""


class WeightSender(Protocol):
    channel: str
    requests: tuple[type, ...]  # the control messages this channel answers

    def publish(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Serve ``tensors`` (host tensors, each of its own dtype) as ``version`` from now
        on. They are handed over: the caller must not change them afterwards (the trainer
        hands over fresh copies)."""

    def handle(self, msg: Any) -> Any:
        """The reply to one of ``requests``."""

    def stats(self) -> dict:
        """Counters for the service snapshot (metrics.jsonl)."""

    def close(self) -> None:
        """Stop serving; what is in flight may be dropped."""


# the actor's side: (cfg, control, engine, actor_id, fallback) -> the receiver, or None to
# keep the fallback (ZeroMQ); it says why in the log
ReceiverFactory = Callable[[Any, Requester, Any, int, WeightReceiver],
                           Awaitable["WeightReceiver | None"]]


@dataclass(frozen=True)
class Channel:
    """One weight channel: its name (a ``learner.weight_sync.channel`` value), its messages, and
    how each side is built (``sender(cfg)`` raises with what is missing)."""

    name: str
    messages: tuple[type, ...]
    sender: Callable[[Any], WeightSender]
    receiver: ReceiverFactory


class WeightTransferFailed(RuntimeError):
    """A transfer into the engine did not complete (an NCCL broadcast past its deadline):
    the engine's workers may be stuck inside it, and only a new process frees them."""
