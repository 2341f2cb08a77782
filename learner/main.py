"""Learner entry point: ``python -m learner.main --config RUN_DIR/config.yaml``, one
process per rank (torchrun sets RANK/WORLD_SIZE; a single rank needs no launcher).

The loop: receive B admissible groups (rank 0), attribute advantages, split the leaves
over ranks, take one importance-corrected step, publish weights every ``sync_every``
steps, log one metrics line.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("learner")


def _init_distributed() -> None:
    if "WORLD_SIZE" not in os.environ:  # single rank without torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")


def _scatter(obj_per_rank, rank: int, world: int):
    import torch.distributed as dist

    if world == 1:
        return obj_per_rank[0]
    out = [None]
    dist.scatter_object_list(out, obj_per_rank if rank == 0 else None, src=0)
    return out[0]


def _broadcast(obj, rank: int, world: int):
    import torch.distributed as dist

    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def run(cfg) -> dict:
    import torch

    from arpo_async.keys import server_keys_for
    from arpo_async.metrics import MetricsWriter, append_jsonl, probe_sequence
    from learner.batching import balanced_split, samples_from_groups
    from learner.service import LearnerService
    from learner.trainer import PolicyTrainer

    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.run.seed)
    _init_distributed()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = Path(cfg.run.dir)
    log.info("rank %d/%d: building the DeepSpeed engine (ZeRO-%d)", rank, world,
             cfg.learner.zero_stage)
    trainer = PolicyTrainer(cfg, cfg.model.path)
    service = LearnerService(cfg, keys=server_keys_for(cfg)) if rank == 0 else None
    writer = MetricsWriter(run_dir) if rank == 0 else None
    probe = probe_sequence(trainer.engine.module.config.vocab_size)
    t_start = time.time()

    def publish(version: int) -> float:
        t0 = time.perf_counter()
        state = trainer.full_state()
        if service is not None:
            bf16 = list(state) if cfg.model.dtype == "bfloat16" else []
            service.publish(version, state, bf16_names=bf16)
        if cfg.run.probe_logprobs:
            lp = trainer.sequence_logprobs(*probe)
            if rank == 0:
                append_jsonl(run_dir / "learner_probe.jsonl", {"version": version, "logprobs": lp})
        return time.perf_counter() - t0

    publish(0)
    if rank == 0:
        log.info("learner ready: trajectories on %s, control on %s", service.receiver.endpoint,
                 service.control.endpoint)
    time_up = (lambda: cfg.run.time_limit_s > 0 and time.time() - t_start > cfg.run.time_limit_s)
    step, broadcast_s = 0, 0.0
    while step < cfg.learner.max_steps:
        t0 = time.perf_counter()
        parts, stats, groups = None, {}, []
        if rank == 0:
            groups = service.collect(cfg.learner.batch_groups, cfg.learner.wait_timeout_s, time_up)
            if groups:
                samples, stats = samples_from_groups(groups, cfg.learner.loss.advantage)
                parts = balanced_split(samples, world)
        go = _broadcast(bool(groups), rank, world)
        if not go:
            log.info("time limit reached after %d steps", step)
            break
        wait_s = time.perf_counter() - t0
        train = trainer.train_step(_scatter(parts, rank, world))
        step += 1
        if rank == 0:
            service.mark_trained(groups)
        if step % cfg.learner.sync_every == 0 or step == cfg.learner.max_steps:
            broadcast_s = publish(step)
        if rank == 0:
            snap = service.snapshot()
            stale = snap["staleness"]
            writer.write({
                "step": step, "policy_version": step, "wall_time": time.time() - t_start,
                "reward_mean": stats["reward_mean"], "score_mean": stats["score_mean"],
                "groups": len(groups), "leaves": stats["leaves"],
                "tokens": sum(g.num_tokens() for g in groups),
                "model_tokens": stats["model_tokens"],
                "staleness_max": max(step - 1 - g.min_version() for g in groups),
                "staleness_mean": sum(step - 1 - g.min_version() for g in groups) / len(groups),
                "dropped_stale": snap["dropped_stale"], "actors_alive": service.actors_alive(),
                "wait_s": wait_s, "step_time_s": time.perf_counter() - t0,
                "broadcast_time_s": broadcast_s, "tool_calls": sum(g.tool_calls_executed
                                                                  for g in groups),
                **train, "service": snap,
            })
    result = {"steps": step, "wall_time_s": time.time() - t_start}
    if rank == 0:
        result["ledger"] = service.shutdown(wait_s=cfg.transport.timeout_s)
        result["service"] = service.snapshot()
        writer.close()
        (run_dir / "learner_summary.json").write_text(json.dumps(result, indent=1))
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="learner.main", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config.yaml of the run")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from arpo_async.config import load_config

    run(load_config(args.config))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
