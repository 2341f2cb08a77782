"""The learner's version as the actor's control client keeps it (actors/control.py): the
highest since the last Hello, whatever order replies to concurrent requests arrive in,
and a Hello's reply outright (a learner that resumed behind the actor)."""

from __future__ import annotations

from arpo_async.core import protocol as P
from actors.control import ResilientControl


class Client:
    """Answers each request with the next reply of a script (pure logic: no socket)."""

    endpoint = "tcp://nowhere:1"

    def __init__(self, replies):
        self.replies, self.sent = list(replies), []

    async def request(self, msg):
        self.sent.append(msg)
        return self.replies.pop(0)


def ack(version: int, reason: str = "") -> P.Ack:
    return P.Ack(ok=not reason, reason=reason, learner_version=version)


async def test_an_older_reply_arriving_late_does_not_lower_the_learners_version():
    client = Client([ack(5), ack(3), ack(6)])
    control = ResilientControl(client, 0, lambda: 5, patience_s=1.0)
    for _ in range(3):
        await control.request(P.Heartbeat(0, 5, {}))
        assert control.learner_version >= 5
    assert control.learner_version == 6


async def test_a_restarted_learner_behind_the_actor_is_seen_after_its_hello():
    # the restarted learner does not know the actor: "hello_required", then the Hello's
    # reply says the version it resumed at
    client = Client([ack(7), ack(3, P.AckReason.HELLO_REQUIRED), ack(3)])
    control = ResilientControl(client, 0, lambda: 7, patience_s=1.0)
    await control.request(P.Heartbeat(0, 7, {}))
    assert control.learner_version == 7
    await control.request(P.Heartbeat(0, 7, {}))
    assert isinstance(client.sent[-1], P.Hello)
    assert control.learner_version == 3
