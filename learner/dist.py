"""The learner's process group: joining it, and the two object collectives the loop uses
(rank 0 collects the batch and hands each rank its part; rank 0 decides, every rank
follows).

Every collective has a deadline (``learner.collective_timeout_s``, the process group's
timeout): a rank whose peer is gone (its host cut off, its process stopped or killed)
fails the step within it instead of waiting forever, and ``failure_line`` says which
rank failed, on which host, with the hosts of all ranks (``rank_hosts``, gathered when
the group is joined), so the log names the machine to look at."""

from __future__ import annotations

import atexit
import logging
import os
import socket
import sys
from datetime import timedelta

import torch.distributed as dist

from arpo_async.core.dsops import prebuild_deepspeed_ops
from arpo_async.core.ports import free_port
from learner.device import dist_backend, setup_device


def init_distributed(cfg=None) -> None:
    """Join the learner's process group: NCCL on GPUs (``cluster.device=cuda``, each rank
    on ``cuda:LOCAL_RANK``), gloo on CPU and when no config is given (tests, benches)."""
    if "WORLD_SIZE" not in os.environ:  # single rank without torchrun
        port = free_port()
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1",
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "gloo"
    if cfg is None or cfg.cluster.device == "cpu":
        prebuild_deepspeed_ops()  # under the launchers' flock: never compile beside another
    if cfg is not None:
        setup_device(cfg)  # before NCCL: a rank's communicator binds its current GPU
        backend = dist_backend(cfg)
    import deepspeed  # deepspeed: heavy; reads DS_ACCELERATOR (set just above) at import

    deadline = cfg.learner.collective_deadline_s if cfg is not None else 1800.0
    deepspeed.init_distributed(dist_backend=backend, timeout=timedelta(seconds=deadline))
    # every process that joins leaves before the interpreter's teardown (close_distributed),
    # scripts and tests included; a failed rank leaves through exit_after_failure instead
    atexit.register(close_distributed)


def close_distributed() -> None:
    """Leave the process group before the interpreter exits: a gloo group torn down by
    interpreter exit instead can abort the process (``terminate called without an active
    exception``, SIGABRT) after a run that ended well, which fails a Slurm job."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def exit_after_failure(code: int) -> None:
    """End a rank of a multi-rank group with ``code``, without running the interpreter's
    exit: a gloo group's destructors can abort the process there (``terminate called
    without an active exception``, SIGABRT): always after a failed collective, and now and
    then after a run that ended well and left its group (a peer leaving at the same time),
    and the supervisor (torchrun, Slurm) would see a signal, not the code. Output is
    flushed first; a single rank needs none of this."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code))


def rank_hosts(world: int) -> list[str]:
    """The hostname of every rank, in rank order (a collective: every rank calls it)."""
    here = socket.gethostname()
    if world == 1:
        return [here]
    hosts: list = [None] * world
    dist.all_gather_object(hosts, here)
    return [str(h) for h in hosts]


def ranks_text(hosts: list[str]) -> str:
    """``0 on a, 1 on b``: the ranks and their hosts."""
    return ", ".join(f"{r} on {h}" for r, h in enumerate(hosts))


def failure_line(exc: BaseException, rank: int, hosts: list[str], deadline_s: float) -> str:
    """One line for a rank that failed: what, where, and where the other ranks are."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    where = hosts[rank] if rank < len(hosts) else socket.gethostname()
    ranks = ranks_text(hosts) or "unknown"
    return (f"learner rank {rank} on {where} failed: {type(exc).__name__}: {first} (ranks: "
            f"{ranks}; a peer gone or stalled fails a collective within "
            f"learner.collective_timeout_s={deadline_s:.0f} s)")


def scatter(obj_per_rank, rank: int, world: int):
    """Rank r gets ``obj_per_rank[r]`` (given on rank 0 only)."""
    if world == 1:
        return obj_per_rank[0]
    out = [None]
    dist.scatter_object_list(out, obj_per_rank if rank == 0 else None, src=0)
    return out[0]


def broadcast(obj, rank: int, world: int):
    """Every rank gets rank 0's ``obj``."""
    if world == 1:
        return obj
    box = [obj if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]
