"""The learner's loop, one rank of it, as named steps:

    collect     rank 0 takes B admissible groups, attributes advantages, splits them
                into ``learner.minibatches`` mini-batches of whole groups and each
                mini-batch over the ranks (balanced by tokens); every rank gets its part
    train       one update: minibatches x ppo_epochs importance-corrected optimizer
                steps (learner/trainer.py); the step count (= policy version) moves on
                by one per rollout batch, whatever the number of optimizer steps
    publish     every ``learner.sync_every`` steps, the new weights with their version
    checkpoint  every ``learner.checkpoint_every`` steps (and at the end), atomically
    record      ``RUN_DIR/state.json`` (the run state, atomically) and one metrics line

The run ends at ``learner.max_steps``, when ``run.time_limit_s`` is up or when the groups
trained have executed ``run.tool_call_budget`` tool calls; rank 0 then
stops the actors and writes ``RUN_DIR/learner_summary.json`` with the exact ledger.

Resume (``--resume``): the newest complete checkpoint (learner/checkpoint.py) gives the
weights, optimizer state, step = policy version, ledger and data positions; the restored
version is published at once so that running actors roll back to it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import torch

from arpo_async.core.faults import FAULT_HOLD_CHECKPOINT, fault_value
from arpo_async.core.files import atomic_write_json, read_json
from arpo_async.core.keys import server_keys_for
from arpo_async.core.metrics import MetricsWriter, append_jsonl, probe_sequence
from arpo_async.core.rundir import RUN_STATE, checkpoints_dir, latest_checkpoint
from learner import checkpoint as C
from learner.batching import balanced_split, samples_from_groups
from learner.dist import broadcast, init_distributed, rank_hosts, ranks_text, scatter
from learner.rollout_metrics import rollout_metrics, variance_metrics
from learner.service import LearnerService
from learner.trainer import PolicyTrainer, split_minibatches
from learner.trees import TreeSampler

log = logging.getLogger("learner")


def resume_point(cfg, trainer, rank: int, world: int, run_dir: Path) -> dict | None:
    """Load the newest checkpoint into ``trainer`` (every rank); its metadata, or None."""
    ckpt = broadcast(latest_checkpoint(run_dir) if rank == 0 else None, rank, world)
    if ckpt is None:
        log.warning("--resume: no complete checkpoint in %s; starting from step 0",
                    checkpoints_dir(run_dir))
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


def service_resume(run_dir: Path, meta: dict | None) -> dict | None:
    """What LearnerService.restore needs: the checkpoint's ledger and, when the learner
    that died wrote a newer run state, that state's ledger."""
    if meta is None:
        return None
    state = read_json(run_dir / RUN_STATE)
    newer = state.get("ledger") if state and state.get("step", -1) >= meta["step"] else None
    return {"version": meta["policy_version"], "ledger": meta.get("ledger", {}), "newer": newer}




def write_checkpoint(cfg, trainer, rank: int, world: int, step: int, state: dict | None) -> float:
    """Write the checkpoint of ``step`` (collective); seconds taken."""
    t0 = time.perf_counter()
    run_dir = Path(cfg.run.dir)
    tmp = broadcast(C.prepare(run_dir, step) if rank == 0 else None, rank, world)
    trainer.save_checkpoint(tmp, cfg.model.path)
    if rank == 0 and fault_value(FAULT_HOLD_CHECKPOINT) == str(step):
        log.warning("fault point %s: holding the checkpoint of step %d unfinished in %s",
                    FAULT_HOLD_CHECKPOINT, step, tmp)
        while True:
            time.sleep(60)
    if rank == 0:
        C.commit(run_dir, tmp, step, state, cfg.learner.keep_checkpoints)
    return time.perf_counter() - t0


def metrics_row(service, step: int, groups: list, stats: dict, train: dict,
                declared: dict[str, str] | None = None) -> dict:
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
            **rollout_metrics(groups, declared), **variance_metrics(groups), **train,
            "service": snap}


class LearnerLoop:
    """One learner rank. Rank 0 also runs the service (sockets, admission, ledger) and
    writes the run's files; the other ranks follow its decisions."""

    def __init__(self, cfg, resume: bool = False):
        self.cfg, self.run_dir = cfg, Path(cfg.run.dir)
        torch.set_num_threads(cfg.learner.threads)
        torch.manual_seed(cfg.run.seed)
        init_distributed(cfg)
        self.rank, self.world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        self.hosts = rank_hosts(self.world)
        if self.world > 1:
            log.info("learner ranks: %s", ranks_text(self.hosts))
        log.info("rank %d/%d: building the DeepSpeed engine (ZeRO-%d)", self.rank, self.world,
                 cfg.learner.zero_stage)
        self.trainer = PolicyTrainer(cfg, cfg.model.path)
        self.meta = (resume_point(cfg, self.trainer, self.rank, self.world, self.run_dir)
                     if resume else None)
        model_cfg = self.trainer.engine.module.config
        self.service = LearnerService(
            cfg, keys=server_keys_for(cfg), vocab_size=model_cfg.vocab_size,
            max_tokens=getattr(model_cfg, "max_position_embeddings", None),
            resume=service_resume(self.run_dir, self.meta)) if self.rank == 0 else None
        self.writer = (MetricsWriter(self.run_dir, wandb=cfg.metrics,
                                     config=cfg.model_dump(mode="json"))
                       if self.rank == 0 else None)
        self.probe = probe_sequence(model_cfg.vocab_size)
        every = cfg.learner.trees_every  # a sample of the trained groups, for people to see
        self.trees = (TreeSampler(self.run_dir, every, cfg.learner.loss.advantage,
                                  self.trainer.tokenizer)
                      if self.rank == 0 and every else None)
        meta = self.meta or {}
        self.step = self.first_step = meta.get("step", 0)
        self.restarts = meta.get("learner_restarts", 0) + 1 if self.meta else 0
        self.t_start = time.time() - meta.get("wall_time", 0.0)
        self.t_first_step: float | None = None  # end of this process's first step
        self.tool_calls = meta.get("tool_calls_trained", 0)  # run.tool_call_budget
        self.checkpointed = self.step  # the step of the newest checkpoint written
        self.broadcast_s = 0.0
        self.state: dict | None = None

    # ------------------------------------------------------------------ the loop
    def run(self) -> dict:
        self.publish(self.step)  # a resumed learner serves its restored version to the actors
        if self.service is not None:
            log.info("learner ready at step %d: trajectories on %s, control on %s", self.step,
                     self.service.receiver.endpoint, self.service.control.endpoint)
        while self.step < self.cfg.learner.max_steps:
            t0 = time.perf_counter()
            batch = self.collect()
            if batch is None:
                log.info("time limit or tool-call budget reached; the groups out were trained: "
                         "%d steps", self.step)
                break
            part, groups, stats = batch
            wait_s = time.perf_counter() - t0
            calls_before = self.tool_calls
            train = self.train(part, groups)
            if self._due(self.cfg.learner.sync_every):
                self.broadcast_s = self.publish(self.step)
            self.state = self.run_state()
            due = (self._due(self.cfg.learner.checkpoint_every)
                   or self._calls_crossed(calls_before))
            # the tool calls are counted on rank 0 only: every rank writes or none does
            due = broadcast(due, self.rank, self.world)
            checkpoint_s = self.checkpoint() if due else 0.0
            self.record(groups, stats, train, {
                "wait_s": wait_s, "step_time_s": time.perf_counter() - t0,
                "broadcast_time_s": self.broadcast_s, "checkpoint_time_s": checkpoint_s})
            if self.t_first_step is None:
                self.t_first_step = time.time()
        lc = self.cfg.learner
        if ((lc.checkpoint_every or lc.checkpoint_every_tool_calls)
                and self.checkpointed != self.step and self.first_step < self.step):
            self.checkpoint()  # the run ended between checkpoints: keep its last step too
        return self.finish()

    # ------------------------------------------------------------------ the steps
    def collect(self):
        """(this rank's part, the groups, their statistics), or None when the run is over."""
        parts, stats, groups = None, {}, []
        if self.rank == 0:
            lc = self.cfg.learner
            # the time limit or tool-call budget closes admission; the groups out are
            # still trained, then collect returns none and the run ends
            groups = self.service.collect(lc.batch_groups, lc.wait_timeout_s, self.time_up)
            if groups:
                samples, stats = samples_from_groups(groups, lc.loss.advantage)
                # mini-batches first, then ranks: every optimizer step trains on groups
                minis = [balanced_split(m, self.world)
                         for m in split_minibatches(samples, lc.minibatches)]
                parts = [[m[r] for m in minis] for r in range(self.world)]
        if not broadcast(bool(groups), self.rank, self.world):
            return None
        return scatter(parts, self.rank, self.world), groups, stats

    def train(self, part, groups: list) -> dict:
        """One update on this rank's part (``learner.minibatches`` x ``ppo_epochs``
        optimizer steps); the step count, and with it the policy version, moves on by one."""
        metrics = self.trainer.train_step(part)
        self.step += 1
        self.tool_calls += sum(g.tool_calls_executed for g in groups)
        if self.service is not None:
            self.service.mark_trained(groups)
        if self.trees is not None:
            self.trees.offer(groups, self.step)  # decodes only the groups it keeps
        return metrics

    def publish(self, version: int) -> float:
        """Send the weights of ``version`` to the actors; seconds taken."""
        t0 = time.perf_counter()
        state = self.trainer.full_state()
        if self.service is not None:
            self.service.publish(version, state)
        if self.cfg.run.probe_logprobs:
            lp = self.trainer.sequence_logprobs(*self.probe)
            if self.rank == 0:
                append_jsonl(self.run_dir / "learner_probe.jsonl",
                             {"version": version, "logprobs": lp})
        return time.perf_counter() - t0

    def checkpoint(self) -> float:
        self.checkpointed = self.step
        return write_checkpoint(self.cfg, self.trainer, self.rank, self.world, self.step,
                                self.state)

    def run_state(self) -> dict | None:
        """Step, version, counters and data positions: RUN_DIR/state.json and checkpoint
        metadata (rank 0; None elsewhere)."""
        if self.service is None:
            return None
        svc, lc = self.service, self.cfg.learner
        return {"step": self.step, "policy_version": self.step,
                "wall_time": time.time() - self.t_start, "time": time.time(),
                "learner_restarts": self.restarts, "world_size": self.world,
                "tool_calls_trained": self.tool_calls,
                "zero_stage": lc.zero_stage, "model_path": self.cfg.model.path,
                "ledger": svc.ledger_state(), "data_position": svc.data_positions(),
                "admission": svc.admission.counters(), "staleness": svc.filter.stats()}

    def record(self, groups: list, stats: dict, train: dict, timings: dict) -> None:
        """The run state and the metrics line of this step (rank 0)."""
        if self.service is None:
            return
        atomic_write_json(self.run_dir / RUN_STATE, self.state, sort_keys=True)
        self.writer.write(metrics_row(self.service, self.step, groups, stats, train,
                                      self.cfg.rollout.STATS) | {
            "wall_time": time.time() - self.t_start, **timings,
            "learner_restarts": self.restarts})

    def finish(self) -> dict:
        """Stop the actors, close the files; the run's result (rank 0 writes it)."""
        result = {"steps": self.step, "wall_time_s": time.time() - self.t_start,
                  "learner_restarts": self.restarts,
                  "resumed_from": self.meta["step"] if self.meta else None}
        if self.service is not None:
            result["ledger"] = self.service.shutdown(wait_s=self.cfg.learner.shutdown_wait_s)
            result["actors_not_back"] = self.service.not_back
            result["service"] = self.service.snapshot()
            self.writer.close()
            atomic_write_json(self.run_dir / "learner_summary.json", result, sort_keys=True)
        return result

    # ------------------------------------------------------------------ helpers
    def time_up(self) -> bool:
        """The time limit is reached, or the tool-call budget spent."""
        budget = self.cfg.run.tool_call_budget
        if budget and self.tool_calls >= budget:
            return True
        limit = self.cfg.run.time_limit_s
        if limit <= 0:
            return False
        if self.cfg.run.time_limit_from == "first_step":
            return self.t_first_step is not None and time.time() - self.t_first_step > limit
        return time.time() - self.t_start > limit

    def _calls_crossed(self, before: int) -> bool:
        """This step's groups brought the trained tool calls past a multiple of
        ``learner.checkpoint_every_tool_calls`` (rank 0's count; the caller broadcasts)."""
        every = self.cfg.learner.checkpoint_every_tool_calls
        return bool(every) and self.tool_calls // every > before // every

    def _due(self, every: int) -> bool:
        """Every ``every`` steps (0: never) and at the last step."""
        return bool(every) and (self.step % every == 0
                                or self.step == self.cfg.learner.max_steps)
