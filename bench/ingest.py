"""Benchmark 3, learner ingest: ``python bench/ingest.py`` prints and writes
bench/results/ingest.json.

1. Ingest rate: ARPO-sized groups (16 leaves x 1024 response tokens, a quarter of them
   tool tokens, 128 prompt tokens; 8 global samples and 8 forks that copy their parent's
   prefix, sent once on the wire) pushed by a producer process through the real
   ``TrajectorySender`` (it encodes each group) to the learner's real ``LearnerService``
   in this process, which receives, decodes, validates and admits them (staleness filter,
   ledger), then turns each batch into training tensors (``samples_from_groups`` with soft
   advantages, ``balanced_split``, ``collate``). Figure: groups per second through all of
   it, and each stage's cost measured on its own in-process (decode, admit, batch).
2. 64 simulated actors (one process, ``actors.engine.actors_per_process=64``) against a real
   learner (``learner.main`` training the tiny model) started by ``arpo_async.launch``:
   whether any message is lost (every actor's sent == received == trained + dropped) and
   how often the learner waits for data (steps that waited > 50 ms, and the fraction of
   the run spent waiting).

The last line is ``RESULT ingest lost_groups=<n> groups_per_s=<ingest rate> target=0
met|missed``: ``lost_groups`` sums, over the simulated actors, |sent - received| +
|received - trained - dropped| (an actor that never said Bye has sent = -1, so it counts
too); met when it is 0 and all of them connected. The rate has no target.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from common import REPO, SCRATCH_DIR, ensure_tiny, free_port, write_results


def make_group(seed: int, leaves: int = 16, tokens: int = 1024, prompt: int = 128):
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup

    rng = np.random.default_rng(seed)
    out = []
    for i in range(leaves):
        mask = np.ones(tokens, np.uint8)
        mask[rng.integers(0, tokens, tokens // 4)] = 0
        out.append(Trajectory(
            tokens=rng.integers(0, 2048, tokens, dtype=np.int32), loss_mask=mask,
            logprobs=np.where(mask > 0, -rng.exponential(2, tokens), 0).astype(np.float32),
            versions=np.where(mask > 0, 0, -1).astype(np.int32), reward=float(rng.random()),
            score=float(rng.random() > 0.5), parent=-1 if i < 8 else int(rng.integers(8)),
            branch_point=0 if i < 8 else int(rng.integers(tokens // 2)), tool_calls=2))
        leaf = out[-1]
        if leaf.parent >= 0:  # a fork copies its parent's prefix, as the rollout's do
            for name in ("tokens", "loss_mask", "logprobs", "versions"):
                getattr(leaf, name)[:leaf.branch_point] = \
                    getattr(out[leaf.parent], name)[:leaf.branch_point]
    return TrajectoryGroup(group_id=f"g{seed}", actor_id=0, prompt_id=f"p{seed % 50}",
                           prompt_tokens=rng.integers(0, 2048, prompt, dtype=np.int32),
                           leaves=out, mode="arpo")


def producer_main(endpoint: str, count: int) -> None:
    """Process target: push ``count`` groups as fast as the sender allows."""
    import asyncio

    from arpo_async.core.transport.trajectory import TrajectorySender

    groups = [make_group(i) for i in range(8)]

    async def run() -> None:
        sender = TrajectorySender(endpoint, hwm=16, timeout_s=120)
        for i in range(count):
            g = groups[i % len(groups)]
            g.group_id = f"g{i}"
            await sender.send(g)
        sender.close(linger_s=60)

    asyncio.run(run())


def stage_costs(batch: int, reps: int = 20) -> dict:
    """Seconds per group of each learner-side stage, in-process (no socket)."""
    from arpo_async.core.protocol import decode, encode
    from arpo_async.core.staleness import StalenessFilter
    from learner.batching import balanced_split, collate, samples_from_groups

    frames = [bytes(f) for f in encode(make_group(1))]
    flt = StalenessFilter(10**6)
    t0 = time.perf_counter()
    groups = [decode(frames) for _ in range(reps * batch)]
    t_decode = (time.perf_counter() - t0) / len(groups)
    t0 = time.perf_counter()
    for g in groups:
        flt.check(1, g.min_version())
    t_admit = (time.perf_counter() - t0) / len(groups)
    t0 = time.perf_counter()
    for r in range(reps):
        samples, _ = samples_from_groups(groups[r * batch:(r + 1) * batch], "soft")
        for part in balanced_split(samples, 1):
            collate(part, 0)
    t_batch = (time.perf_counter() - t0) / len(groups)
    return {"decode_ms": 1e3 * t_decode, "admit_ms": 1e3 * t_admit,
            "batch_ms": 1e3 * t_batch, "bytes_per_group": sum(len(f) for f in frames)}


def ingest_rate(count: int, batch: int) -> dict:
    from arpo_async.core.config import SPINE_CONFIG, load_config
    from learner.batching import balanced_split, collate, samples_from_groups
    from learner.service import LearnerService

    cfg = load_config(SPINE_CONFIG, overrides=[f"transport.trajectory_port={free_port()}",
                                 f"transport.control_port={free_port()}", "actors.num=1",
                                 "learner.max_staleness=1000000", f"learner.batch_groups={batch}"])
    service = LearnerService(cfg)
    proc = mp.get_context("spawn").Process(
        target=producer_main, args=(f"tcp://127.0.0.1:{cfg.transport.trajectory_port}", count))
    proc.start()
    done, t0 = 0, None
    try:
        while done < count:
            groups = service.collect(min(batch, count - done), timeout_s=120)
            if t0 is None:  # from the first batch on: the producer's start-up is excluded
                t0, first = time.perf_counter(), len(groups)
            samples, _ = samples_from_groups(groups, "soft")
            for part in balanced_split(samples, 1):
                collate(part, 0)
            service.mark_trained(groups)
            done += len(groups)
        seconds = time.perf_counter() - t0
    finally:
        proc.join(60)
        rejected = dict(service.receiver.rejected)
        service.control.stop()
        service.receiver.close()
    return {"groups": count, "batch_groups": batch, "seconds": seconds,
            "groups_per_s": (count - first) / seconds, "rejected": rejected}


def many_actors(actors: int, steps: int, model: str, run_dir: str) -> dict:
    from arpo_async.core.config import SPINE_CONFIG
    from arpo_async.core.metrics import read_metrics
    from arpo_async.jobs.experiments import summarize_run

    # the RL stage alone: without --config the launcher runs the default job (data, SFT,
    # RL, evaluation), as it has since configs/spine.yaml was split off
    cmd = [sys.executable, "-m", "arpo_async.launch", "--quiet", "--config", str(SPINE_CONFIG),
           f"run.dir={run_dir}", f"model.path={model}", "actors.engine=simulated",
           f"actors.num={actors}",
           f"actors.engine.actors_per_process={actors}", f"learner.max_steps={steps}",
           "learner.batch_groups=8", "learner.max_staleness=2", "rollout.mode=arpo",
           "rollout.group_size=8", "rollout.initial_samples=4", "actors.max_restarts=0"]
    res = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    if res.returncode != 0:
        raise SystemExit(f"64-actor run failed: {res.stderr[-2000:]}")
    row, _ = summarize_run(run_dir, 4)
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    ledger = summary["ledger"]
    lost = {a: led for a, led in ledger.items() if led["received"] != led["sent"]
            or led["trained"] + sum(led["dropped"].values()) != led["sent"]}
    waits = [r["wait_s"] for r in read_metrics(run_dir)[1:]]
    return {"actors": actors, "connected": len(ledger), "steps": row["steps"],
            "sent": sum(led["sent"] for led in ledger.values()),
            "received": sum(led["received"] for led in ledger.values()),
            "trained": sum(led["trained"] for led in ledger.values()), "lost": lost,
            "lost_groups": sum(abs(led["sent"] - led["received"]) + abs(
                led["received"] - led["trained"] - sum(led["dropped"].values()))
                for led in ledger.values()),
            "steps_waiting_gt_50ms": sum(w > 0.05 for w in waits), "steps_measured": len(waits),
            "learner_wait_frac": row["learner_wait_frac"],
            "learner_busy_frac": row["learner_busy_frac"],
            "groups_per_s": row["groups_per_s"], "actor_idle_frac": row["actor_idle_frac"],
            "actor_blocked_frac": row["actor_blocked_frac"]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--groups", type=int, default=400, help="groups pushed for the rate")
    p.add_argument("--batch", type=int, default=4, help="groups per learner batch")
    p.add_argument("--actors", type=int, default=64, help="simulated actors")
    p.add_argument("--steps", type=int, default=20, help="learner steps with them")
    p.add_argument("--out", default=None, help="results file")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads, as learner.threads (2 OpenMP threads on a busy 2-core "
                        "box made each torch.zeros in collate cost ~10 ms)")
    a = p.parse_args(argv)
    import torch

    torch.set_num_threads(a.threads)
    out = {"stages": stage_costs(a.batch)}
    s = out["stages"]
    print(f"per group ({s['bytes_per_group'] / 1e6:.2f} MB): decode {s['decode_ms']:.2f} ms, "
          f"admit {s['admit_ms']:.3f} ms, batch {s['batch_ms']:.2f} ms", flush=True)
    out["rate"] = ingest_rate(a.groups, a.batch)
    print(f"ingest: {out['rate']['groups_per_s']:.0f} groups/s received, decoded, admitted and "
          f"batched (16 leaves x 1024 tokens; {a.groups} groups, batches of {a.batch})",
          flush=True)
    model = str(ensure_tiny(f"{SCRATCH_DIR}/model_h128_l2"))
    run_dir = f"{SCRATCH_DIR}/ingest_{a.actors}actors_{int(time.time())}"
    out["many_actors"] = m = many_actors(a.actors, a.steps, model, run_dir)
    print(f"{m['actors']} simulated actors: {m['connected']} connected, sent {m['sent']}, "
          f"received {m['received']}, trained {m['trained']}, lost {len(m['lost'])} actors' "
          f"accounts; learner waited > 50 ms on {m['steps_waiting_gt_50ms']} of "
          f"{m['steps_measured']} steps ({100 * m['learner_wait_frac']:.1f}% of the time)")
    write_results("ingest", out, a.out)
    met = m["lost_groups"] == 0 and m["connected"] == m["actors"]
    print(f"RESULT ingest lost_groups={m['lost_groups']} "
          f"groups_per_s={out['rate']['groups_per_s']:.0f} target=0 "
          f"{'met' if met else 'missed'}")
    return out


if __name__ == "__main__":
    main()
