"""Where processes run and how they talk: ``transport`` (ZeroMQ) and ``cluster`` (devices,
machines, remote actors)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from arpo_async.core.config.base import _Section


class TransportConfig(_Section):
    host: str = Field("127.0.0.1", description="address the learner binds")
    trajectory_port: int = Field(0, description="trajectory channel port (0: pick a free port)")
    control_port: int = Field(0, description="control/weights channel port (0: pick a free port)")
    send_hwm: int = Field(4, ge=1, description="groups queued in an actor before send blocks")
    recv_hwm: int = Field(64, ge=1, description="groups queued at the learner socket")
    max_message_mb: float = Field(
        256.0, description="largest accepted message, MiB (an actor accepts a weights reply "
        "as large as a float32 copy of its local checkpoint whatever this says)")
    request_timeout_s: float = Field(
        30.0, gt=0, description="an actor's control request (ticket, weights, heartbeat) with "
        "no reply for this long is retried with backoff, seconds (until "
        "transport.connect_timeout_s of silence)")
    send_stall_s: float = Field(
        30.0, gt=0, description="an actor's trajectory send blocked this long (the learner "
        "behind or down) is logged and counted as a stall, again after each further such "
        "wait; the group is kept and the send goes on waiting, seconds")
    connect_timeout_s: float = Field(
        900.0, description="how long an actor waits for an answer from the learner, at start "
        "or after its host vanished, seconds; then the actor stops (exit code 69)")
    insecure: bool = Field(False, description="allow a non-loopback bind without CurveZMQ keys")


class RemoteActorsConfig(_Section):
    """Actors on another machine, started there by hand (``launch actor --connect``)."""

    host: str = Field(description="name or address of the machine that runs these actors")
    actors: int = Field(1, ge=1, description="actor processes on that machine")
    gpus: list[int] = Field(
        default_factory=list, description="GPU ids there, actors.engine.tensor_parallel per "
        "vLLM actor (device cuda)")


class ClusterConfig(_Section):
    """Placement: which device, which GPUs, which machines (``arpo_async/launcher/plan.py``)."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="where learner and actors compute")
    learner_gpus: list[int] = Field(
        default_factory=list, description="GPU ids of the learner ranks on each learner machine, "
        "one rank per id ([]: 0..world_size-1, or every hostfile slot)")
    actor_gpus: list[int] = Field(
        default_factory=list, description="GPU ids on this machine for the local actors, "
        "actors.engine.tensor_parallel consecutive ids per vLLM actor, one per other actor")
    hostfile: str = Field(
        "", description="DeepSpeed hostfile ('HOST slots=N' lines) spreading the learner over "
        "machines ('' = this machine only)")
    master_addr: str = Field(
        "", description="learner rendezvous address for DeepSpeed/torchrun ('' = first "
        "hostfile host, or 127.0.0.1)")
    master_port: int = Field(0, ge=0, description="learner rendezvous port (0: pick a free one)")
    learner_address: str = Field(
        "", description="address remote actors use to reach the learner's rank 0 ('' = "
        "transport.host, or the first hostfile host when that is a wildcard)")
    remote_actors: list[RemoteActorsConfig] = Field(
        default_factory=list, description="actors started on other machines with "
        "`python -m arpo_async.launch actor --connect tcp://HOST:PORT`")
