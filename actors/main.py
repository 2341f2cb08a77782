"""Actor entry point: ``python -m actors.main --config RUN_DIR/config.yaml --actor-id I``.

Builds the engine, the prompt source, the tools and the rollout the config names, connects
to the learner and runs the actor loop until the learner says stop.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

log = logging.getLogger("actor")


def build_rollout(cfg, engine, source, tokenizer, tools, rng):
    """Plain sampling without tools; the tool-interleaved rollout otherwise."""
    if not cfg.tools.enabled and cfg.rollout.mode == "grpo":
        from actors.rollout import PlainRollout

        return PlainRollout(cfg, engine, source, tokenizer, rng)
    from actors.agent_rollout import AgentRollout

    return AgentRollout(cfg, engine, source, tokenizer, tools, rng)


async def run_actor(cfg, actor_id: int) -> None:
    import numpy as np
    from transformers import AutoTokenizer

    from actors.actor import Actor
    from actors.engines import build_engine
    from arpo_async.core.keys import client_keys_for
    from arpo_async.core.transport import ControlClient, TrajectorySender
    from toolenv.tasks.prompts import PromptSource

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    engine = await build_engine(cfg, cfg.model.path, actor_id)
    tools = None
    if cfg.tools.enabled:
        from toolenv.runner import build_tools

        tools = build_tools(cfg.tools, cfg.run.dir)
    rng = np.random.default_rng([cfg.run.seed, 1000 + actor_id])
    source = PromptSource(cfg, tokenizer, stream=actor_id)
    rollout = build_rollout(cfg, engine, source, tokenizer, tools, rng)
    t = cfg.transport
    keys = client_keys_for(cfg)
    sender = TrajectorySender(f"tcp://{t.host}:{t.trajectory_port}", hwm=t.send_hwm,
                              timeout_s=t.timeout_s, curve=keys)
    control = ControlClient(f"tcp://{t.host}:{t.control_port}", timeout_s=t.timeout_s, curve=keys,
                            max_bytes=int(t.max_message_mb * 2**20))
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="actors.main", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config.yaml of the run")
    parser.add_argument("--actor-id", type=int, required=True)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s actor{args.actor_id} %(name)s %(message)s")
    from arpo_async.core.config import load_config

    asyncio.run(run_actor(load_config(args.config), args.actor_id))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
