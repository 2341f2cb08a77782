"""The learner's side of the remote-actor handshake: ``ConfigRequest`` -> ``ConfigReply``.

An actor on another machine (arpo_async/launcher/remote.py) asks the learner's control
port for the run's resolved config and an actor id, so every learning setting comes from
the one file the learner runs with."""

from __future__ import annotations

import logging
import time

import yaml

from arpo_async.core import protocol as P

log = logging.getLogger("learner.config_server")


class ConfigServer:
    """Answers ``ConfigRequest`` on the learner: the resolved config and an actor id.

    An explicit id that an actor on another machine is using now (heard from within
    ``silent_s``) is refused, so two machines never report under one ledger entry.
    """

    def __init__(self, cfg, silent_s: float | None = None):
        self.cfg, self._yaml = cfg, ""  # the text, made at the first request (if any)
        self.first_id = cfg.actors.num  # local actors are 0..num-1
        self.silent_s = silent_s or float(getattr(cfg.learner, "actor_silent_s", 30.0))
        self.owners: dict[int, str] = {}  # actor id -> host that asked for it

    def handle(self, msg, last_seen: dict[int, float], now: float | None = None):
        """``last_seen``: actor id -> time.time() of its last message (the ledger)."""
        now = time.time() if now is None else now
        if msg.actor_id < 0:
            taken = set(last_seen) | set(self.owners)
            actor_id = self.first_id
            while actor_id in taken:
                actor_id += 1
        else:
            actor_id = msg.actor_id
            owner = self.owners.get(actor_id, "the launcher" if actor_id < self.first_id else "")
            alive = now - last_seen.get(actor_id, float("-inf")) < self.silent_s
            if alive and owner and owner != msg.host:
                return P.Ack(ok=False, reason=f"actor id {actor_id} is in use by {owner}; "
                                              "pick another --actor-id or omit it")
        self.owners[actor_id] = msg.host
        log.info("config sent to %s (pid %d) as actor %d", msg.host, msg.pid, actor_id)
        return P.ConfigReply(config_yaml=self.config_yaml, actor_id=actor_id)

    @property
    def config_yaml(self) -> str:
        """The resolved config as the learner runs it (what RUN_DIR/config.yaml holds)."""
        if not self._yaml:
            self._yaml = yaml.safe_dump(self.cfg.model_dump(mode="json"), sort_keys=False)
        return self._yaml
