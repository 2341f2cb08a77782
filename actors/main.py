"""Actor entry point: ``python -m actors.main --config RUN_DIR/config.yaml --actor-id I``
(or ``--actor-ids 0-63``: several simulated actors in one process).

Builds the engine, the prompt source, the tools and the rollout the config names, connects
to the learner and runs the actor loop until the learner says stop (exit 0), or until
the learner has not answered for ``transport.connect_timeout_s`` (exit 69,
``ExitCode.LEARNER_GONE``: its host vanished; the actor stops instead of waiting forever).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os

import numpy as np

from actors.actor import Actor
from actors.engines import build_engine
from actors.rollout import build_rollout
from arpo_async.core.config import load_config
from arpo_async.core.config.actors import engines_that
from arpo_async.core.keys import client_keys_for
from arpo_async.core.protocol import ExitCode
from arpo_async.core.rundir import record_exit
from arpo_async.core.transport.control import ControlClient, TransportTimeout
from arpo_async.core.transport.trajectory import TrajectorySender
from toolenv.runner import build_tools
from toolenv.tasks.prompts import PromptSource

log = logging.getLogger("actor")


def reply_limit(cfg) -> int:
    """The largest control reply this actor accepts, bytes: ``transport.max_message_mb``,
    or a full copy of the model's weights when that is larger (weights come whole over
    ZeroMQ; their size from the local checkpoint's shapes at 4 bytes a value, plus 5%)."""
    from actors.engines.base import checkpoint_shapes

    limit = int(cfg.transport.max_message_mb * 2**20)
    shapes = checkpoint_shapes(str(cfg.model.path)) or {}
    weights = sum(math.prod(s) for s in shapes.values()) * 4
    return max(limit, int(weights * 1.05) + 2**20)


async def run_actor(cfg, actor_id: int) -> None:
    engine = await build_engine(cfg, cfg.model.path, actor_id)
    tokenizer = engine.tokenizer  # the engine's own: one tokenizer per actor
    tools = None
    if cfg.tools.offered:
        tools = build_tools(cfg.tools, cfg.run.dir)
    rng = np.random.default_rng([cfg.run.seed, cfg.rollout.branch_seed + actor_id])
    source = PromptSource(cfg, tokenizer, stream=actor_id)
    rollout = build_rollout(cfg, engine, source, tokenizer, tools, rng)
    t = cfg.transport
    keys = client_keys_for(cfg)
    sender = TrajectorySender(f"tcp://{t.host}:{t.trajectory_port}", hwm=t.send_hwm,
                              timeout_s=t.send_stall_s, curve=keys)
    control = ControlClient(f"tcp://{t.host}:{t.control_port}", timeout_s=t.request_timeout_s,
                            curve=keys, max_bytes=reply_limit(cfg))
    actor = Actor(cfg, actor_id, engine, rollout, source, sender, control,
                  vocab_size=len(tokenizer), tools=tools)
    try:
        await actor.run()
    finally:
        sender.close()
        control.close()
        if tools is not None:
            await tools.close()
        await engine.close()


def parse_ids(text: str) -> list[int]:
    """"0-3,7" -> [0, 1, 2, 3, 7]."""
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ValueError(f"--actor-ids: {part!r} is not N or N-M")
        out += list(range(int(lo), int(hi or lo) + 1))
    if not out or len(set(out)) != len(out):
        raise ValueError(f"--actor-ids: {text!r} must name each actor once")
    return out


async def run_actors(cfg, actor_ids: list[int]) -> None:
    """Several actors in one process, each the ordinary actor path as a task: only for an
    engine that ``shares_process`` (the simulated engine: throughput experiments with many
    actors, actors/engines/sim_engine.py)."""
    if len(actor_ids) > 1 and not cfg.actors.engine.shares_process:
        raise ValueError(f"actors.engine is {cfg.actors.engine.type!r}: only "
                         f"{' or '.join(engines_that('shares_process'))} actors can share a "
                         "process")
    await asyncio.gather(*(run_actor(cfg, i) for i in actor_ids))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="actors.main", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config.yaml of the run")
    who = parser.add_mutually_exclusive_group(required=True)
    who.add_argument("--actor-id", type=int, help="this actor's id")
    who.add_argument("--actor-ids", help="several simulated actors in one process: 0-63 or 0,2,4")
    args = parser.parse_args(argv)
    ids = [args.actor_id] if args.actor_ids is None else parse_ids(args.actor_ids)
    name = f"actor{ids[0]}" if len(ids) == 1 else f"actors{ids[0]}-{ids[-1]}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {name} %(name)s %(message)s")
    cfg = load_config(args.config)
    cfg.run.apply_log_level()
    try:
        asyncio.run(run_actors(cfg, ids))
    except TransportTimeout as exc:
        # every request is retried until transport.connect_timeout_s of silence: the
        # learner's host vanished (or the run ended while we could not hear it); a
        # restart would only wait as long again, so stop and say so
        log.error("%s: no answer from the learner for transport.connect_timeout_s=%g s "
                  "(%s); stopping", name, cfg.transport.connect_timeout_s, exc)
        record_exit(cfg.run.dir, os.getpid(), ExitCode.LEARNER_GONE)
        return ExitCode.LEARNER_GONE
    # The learner ended the run. Said in a file, not only by the exit status: a launcher
    # that adopted this process after --resume is not its parent and cannot wait for it.
    record_exit(cfg.run.dir, os.getpid(), ExitCode.OK)
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
