"""The one interface of the learner's weight channels (ZeroMQ: zeromq.py, NCCL: nccl.py).

Rank 0 publishes each new version to every channel; the actors pull at their own safe
points with control requests, which the service routes to the channel that declares
them in ``requests``. ``handle`` runs on the control thread and must not block: a reply
is the message to send (``Encoded`` frames for the weights themselves), or an Ack."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch


class WeightSender(Protocol):
    channel: str  # "zmq" or "nccl"
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
