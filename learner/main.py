"""Learner entry point: ``python -m learner.main --config RUN_DIR/config.yaml``, one
process per rank (torchrun sets RANK/WORLD_SIZE; a single rank needs no launcher).

The loop: receive B admissible groups (rank 0), attribute advantages, split the leaves
over ranks, take one importance-corrected step, publish weights every ``sync_every``
steps, checkpoint every ``checkpoint_every`` steps, write the run state
(``RUN_DIR/state.json``, atomically) and one metrics line.

``--resume`` continues from the newest complete checkpoint (learner/checkpoint.py):
weights, optimizer state, step = policy version, ledger and data positions; the
restored version is published at once so that running actors roll back to it.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import time
from pathlib import Path

log = logging.getLogger("learner")


def _init_distributed(cfg=None) -> None:
    """Join the learner's process group: NCCL on GPUs (``cluster.device=cuda``, each rank
    on ``cuda:LOCAL_RANK``), gloo on CPU and when no config is given (tests, benches)."""
    if "WORLD_SIZE" not in os.environ:  # single rank without torchrun
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "gloo"
    if cfg is None or cfg.cluster.device == "cpu":
        from arpo_async.core.dsops import prebuild_deepspeed_ops

        prebuild_deepspeed_ops()  # under the launchers' flock: never compile beside another
    if cfg is not None:
        from learner.device import dist_backend, setup_device

        setup_device(cfg)  # before NCCL: a rank's communicator binds its current GPU
        backend = dist_backend(cfg)
    import deepspeed

    deepspeed.init_distributed(dist_backend=backend)


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


def _resume_point(cfg, trainer, rank: int, world: int, run_dir: Path) -> dict | None:
    """Load the newest checkpoint into ``trainer`` (every rank); its metadata, or None."""
    from arpo_async.core import rundir as R
    from learner import checkpoint as C

    ckpt = _broadcast(R.latest_checkpoint(run_dir) if rank == 0 else None, rank, world)
    if ckpt is None:
        log.warning("--resume: no complete checkpoint in %s; starting from step 0",
                    R.checkpoints_dir(run_dir))
        return None
    meta = C.read_meta(ckpt)
    saved = (meta.get("world_size"), meta.get("zero_stage"))
    if saved != (world, cfg.learner.zero_stage):
        raise RuntimeError(f"{ckpt} was written by {saved[0]} rank(s) at ZeRO-{saved[1]}; "
                           f"resuming needs the same (now {world} at ZeRO-"
                           f"{cfg.learner.zero_stage})")
    trainer.load_checkpoint(ckpt)
    log.info("resumed from %s: step %d, policy version %d", ckpt, meta["step"],
             meta["policy_version"])
    return meta


def _service_resume(run_dir: Path, meta: dict | None) -> dict | None:
    """What LearnerService.restore needs: the checkpoint's ledger and, when the learner
    that died wrote a newer run state, that state's ledger."""
    from arpo_async.core import files as F
    from arpo_async.core import rundir as R

    if meta is None:
        return None
    state = F.read_json(run_dir / R.RUN_STATE)
    newer = state.get("ledger") if state and state.get("step", -1) >= meta["step"] else None
    return {"version": meta["policy_version"], "ledger": meta.get("ledger", {}), "newer": newer}


def _run_state(cfg, service, step: int, wall: float, restarts: int, world: int) -> dict:
    """Step, version, counters and data position: RUN_DIR/state.json and checkpoint metadata."""
    return {"step": step, "policy_version": step, "wall_time": wall, "time": time.time(),
            "learner_restarts": restarts, "world_size": world,
            "zero_stage": cfg.learner.zero_stage, "model_path": cfg.model.path,
            "ledger": service.ledger_state(), "data_position": service.data_positions(),
            "admission": service.admission.counters(), "staleness": service.filter.stats()}


def _checkpoint(cfg, trainer, rank: int, world: int, step: int, state: dict | None) -> float:
    """Write the checkpoint of ``step`` (collective); seconds taken."""
    from learner import checkpoint as C

    t0 = time.perf_counter()
    run_dir = Path(cfg.run.dir)
    tmp = _broadcast(C.prepare(run_dir, step) if rank == 0 else None, rank, world)
    trainer.save_checkpoint(tmp, cfg.model.path)
    if rank == 0:
        C.commit(run_dir, tmp, step, state, cfg.learner.keep_checkpoints)
    return time.perf_counter() - t0


def _metrics_row(service, step: int, groups: list, stats: dict, train: dict) -> dict:
    """The metrics.jsonl line of a step (timings are added by the loop)."""
    snap = service.snapshot()
    lags = [step - 1 - g.min_version() for g in groups]
    return {"step": step, "policy_version": step,
            "reward_mean": stats["reward_mean"], "score_mean": stats["score_mean"],
            "groups": len(groups), "leaves": stats["leaves"],
            "tokens": sum(g.num_tokens() for g in groups), "model_tokens": stats["model_tokens"],
            "staleness_max": max(lags), "staleness_mean": sum(lags) / len(lags),
            "dropped_stale": snap["dropped_stale"], "actors_alive": service.actors_alive(),
            "tool_calls": sum(g.tool_calls_executed for g in groups),
            **train, "service": snap}


def run(cfg, resume: bool = False) -> dict:
    import torch

    from arpo_async.core.files import atomic_write_json
    from arpo_async.core.keys import server_keys_for
    from arpo_async.core.metrics import MetricsWriter, append_jsonl, probe_sequence
    from arpo_async.core.rundir import RUN_STATE
    from learner.batching import balanced_split, samples_from_groups
    from learner.service import LearnerService
    from learner.trainer import PolicyTrainer

    torch.set_num_threads(cfg.learner.threads)
    torch.manual_seed(cfg.run.seed)
    _init_distributed(cfg)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    run_dir = Path(cfg.run.dir)
    log.info("rank %d/%d: building the DeepSpeed engine (ZeRO-%d)", rank, world,
             cfg.learner.zero_stage)
    trainer = PolicyTrainer(cfg, cfg.model.path)
    meta = _resume_point(cfg, trainer, rank, world, run_dir) if resume else None
    model_cfg = trainer.engine.module.config
    service = LearnerService(cfg, keys=server_keys_for(cfg), vocab_size=model_cfg.vocab_size,
                             max_tokens=getattr(model_cfg, "max_position_embeddings", None),
                             resume=_service_resume(run_dir, meta)) if rank == 0 else None
    writer = MetricsWriter(run_dir) if rank == 0 else None
    probe = probe_sequence(model_cfg.vocab_size)
    step = meta["step"] if meta else 0
    first_step = step
    restarts = meta.get("learner_restarts", 0) + 1 if meta else 0
    t_start = time.time() - (meta["wall_time"] if meta else 0.0)

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

    publish(step)  # a resumed learner serves its restored version to the running actors
    if rank == 0:
        log.info("learner ready at step %d: trajectories on %s, control on %s", step,
                 service.receiver.endpoint, service.control.endpoint)

    def time_up() -> bool:
        return cfg.run.time_limit_s > 0 and time.time() - t_start > cfg.run.time_limit_s

    broadcast_s = 0.0
    every = cfg.learner.checkpoint_every
    while step < cfg.learner.max_steps:
        t0 = time.perf_counter()
        parts, stats, groups = None, {}, []
        if rank == 0:
            groups = [] if time_up() else service.collect(cfg.learner.batch_groups,
                                                          cfg.learner.wait_timeout_s, time_up)
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
        state = (_run_state(cfg, service, step, time.time() - t_start, restarts, world)
                 if rank == 0 else None)
        checkpoint_s = (_checkpoint(cfg, trainer, rank, world, step, state)
                        if every and (step % every == 0 or step == cfg.learner.max_steps) else 0.0)
        if rank == 0:
            atomic_write_json(run_dir / RUN_STATE, state, sort_keys=True)
            writer.write(_metrics_row(service, step, groups, stats, train) | {
                "wall_time": time.time() - t_start, "wait_s": wait_s,
                "step_time_s": time.perf_counter() - t0, "broadcast_time_s": broadcast_s,
                "checkpoint_time_s": checkpoint_s, "learner_restarts": restarts})
    if every and step % every and first_step < step < cfg.learner.max_steps:
        # the time limit ended the run between checkpoints: keep its final weights as well
        _checkpoint(cfg, trainer, rank, world, step, state)
    result = {"steps": step, "wall_time_s": time.time() - t_start, "learner_restarts": restarts,
              "resumed_from": meta["step"] if meta else None}
    if rank == 0:
        result["ledger"] = service.shutdown(wait_s=cfg.transport.timeout_s)
        result["service"] = service.snapshot()
        writer.close()
        atomic_write_json(run_dir / "learner_summary.json", result, sort_keys=True)
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="learner.main", description=__doc__)
    parser.add_argument("--config", required=True, help="resolved config.yaml of the run")
    parser.add_argument("--resume", action="store_true",
                        help="continue from the newest checkpoint in run_dir/checkpoints")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from arpo_async.core.config import load_config

    run(load_config(args.config), resume=args.resume)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
