"""Every message that crosses a process boundary, as a typed schema with a version:
``messages.py`` (the schemas, the reasons and exit codes, pure) and ``wire.py`` (msgpack
frames plus raw array frames, validated on decode). Import either from here. The weight
channels' messages live with their channels (arpo_async/core/weights/), which add them
with ``register_messages``."""

from __future__ import annotations

from arpo_async.core.protocol.messages import (
    MESSAGES,
    Ack,
    AckReason,
    Bye,
    ConfigReply,
    ConfigRequest,
    ExitCode,
    GrantReason,
    Heartbeat,
    Hello,
    ProtocolError,
    TicketGrant,
    TicketRequest,
    Trajectory,
    TrajectoryGroup,
    register_messages,
)
from arpo_async.core.protocol.wire import DEFAULT_MAX_BYTES, PROTOCOL_VERSION, decode, encode

__all__ = [
    "DEFAULT_MAX_BYTES", "MESSAGES", "PROTOCOL_VERSION", "Ack", "AckReason", "Bye",
    "ConfigReply", "ConfigRequest", "ExitCode", "GrantReason", "Heartbeat", "Hello",
    "ProtocolError", "TicketGrant", "TicketRequest", "Trajectory", "TrajectoryGroup",
    "decode", "encode", "register_messages",
]
