"""The learner's process group: joining it, and the two object collectives the loop uses
(rank 0 collects the batch and hands each rank its part; rank 0 decides, every rank
follows)."""

from __future__ import annotations

import os

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

    deepspeed.init_distributed(dist_backend=backend)


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
