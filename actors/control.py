"""The actor's one control client: every request of the actor (Hello, tickets,
heartbeats, weights, Bye) goes through ``ResilientControl``, which survives the learner
going away and coming back.

- retry: a request that times out is sent again with backoff (0.5 s doubling to 5 s)
  until ``transport.connect_timeout_s`` passes without an answer; ZeroMQ reconnects by
  itself, and finished groups wait in the trajectory queue meanwhile.
- Hello again: a learner that answers "hello_required" (it restarted and has not met this
  actor) gets a new Hello; so does a learner that answers again after a request timed
  out, because a retried ticket request may have been granted twice and the Hello lets
  the learner release the tickets this actor holds (learner/service.py).
- the learner's version: every reply carries ``learner_version``, the newest version the
  learner publishes; ``learner_version`` keeps the highest one since the last Hello
  (replies to concurrent requests arrive in any order, and an older one must not make a
  learner look behind the actor's weights), and a Hello's reply sets it outright, so that
  the actor notices a learner that resumed from a checkpoint behind its weights
  (actors/actor.py): a restarted learner answers "hello_required" first.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from arpo_async.core import protocol as P
from arpo_async.core.transport.control import ControlClient, TransportTimeout

log = logging.getLogger("actor")

_RETRY_S = (0.5, 5.0)  # first and longest wait between retries of an unanswered request


class ResilientControl:
    """``client`` (the DEALER socket) with retry, Hello again and the learner's version.
    ``version()`` is the engine's weights version, which every Hello reports."""

    def __init__(self, client: ControlClient, actor_id: int, version: Callable[[], int],
                 patience_s: float):
        self.client, self.actor_id = client, actor_id
        self.version, self.patience_s = version, patience_s
        self.learner_version = -1  # newest version the learner said it publishes
        self._lost_contact = False  # a request timed out: say Hello when it answers again
        # called with the learner's reply to every Hello (the prompts it has: actors/actor.py)
        self.on_hello: Callable[[Any], None] | None = None

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    def _hello_msg(self) -> P.Hello:
        return P.Hello(self.actor_id, os.getpid(), socket.gethostname(), self.version())

    async def connect(self) -> None:
        """The first handshake, retried while the learner starts (DeepSpeed start-up
        takes a while) for up to ``patience_s``."""
        deadline = time.monotonic() + self.patience_s
        while True:
            try:
                ack = await self.client.hello(self._hello_msg())
                break
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise
                log.info("actor %d: waiting for the learner at %s", self.actor_id,
                         self.endpoint)
        self.learner_version = ack.learner_version
        self._heard(ack)

    def _heard(self, reply: Any) -> None:
        if self.on_hello is not None and isinstance(reply, P.Ack) and reply.ok:
            self.on_hello(reply)

    async def request(self, msg: Any) -> Any:
        """The learner's reply to ``msg``, however many tries it takes; TransportTimeout
        after ``patience_s`` without an answer."""
        delay = _RETRY_S[0]
        t0 = time.monotonic()
        while True:
            try:
                reply = await self.client.request(msg)
                break
            except TransportTimeout:
                self._lost_contact = True
                waited = time.monotonic() - t0
                if waited > self.patience_s:
                    raise
                log.warning("actor %d: no answer to %s for %.0f s; retrying (learner down?)",
                            self.actor_id, msg.KIND, waited)
                await asyncio.sleep(delay)
                delay = min(delay * 2, _RETRY_S[1])
        said = getattr(reply, "learner_version", None)
        if isinstance(msg, P.Hello) and said is not None:
            self.learner_version = said
            self._heard(reply)
        elif said is not None:
            self.learner_version = max(self.learner_version, said)
        if getattr(reply, "reason", "") == P.AckReason.HELLO_REQUIRED:
            await self._hello("the learner restarted")
        elif self._lost_contact:
            await self._hello("the learner answers again")
        return reply

    async def _hello(self, why: str) -> None:
        self._lost_contact = False
        await self.request(self._hello_msg())
        log.info("actor %d: said hello again (%s)", self.actor_id, why)
