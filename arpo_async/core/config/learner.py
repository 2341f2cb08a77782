"""The learner's section, ``learner`` (its ``learner.loss`` is in losses.py; its weight
channel, ``learner.weight_sync``, is one class per channel here)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from arpo_async.core.config.base import Tagged, _Section
from arpo_async.core.config.losses import LossConfig, PPOLoss


_CHANNEL = ("weights to actors (arpo_async/core/weights/): zmq, ZeroMQ copies (any host); "
            "delta, only the values that changed since the actor's version, over ZeroMQ "
            "(any host; pays when model.dtype is bfloat16); nccl, NCCL broadcast to vLLM "
            "GPU actors on the learner's node (others still use ZeroMQ)")


class ZmqSync(_Section):
    channel: Literal["zmq"] = Field("zmq", description=_CHANNEL)


class NcclSync(_Section):
    channel: Literal["nccl"] = Field("nccl", description=_CHANNEL)
    buffer_mb: int = Field(
        1024, ge=1, description="packed broadcast buffer, MiB (two in flight)")
    timeout_s: float = Field(
        300.0, gt=0, description="abort an actor's transfer after this long, s")


class DeltaSync(_Section):
    channel: Literal["delta"] = Field("delta", description=_CHANNEL)
    keep: int = Field(
        4, ge=1, description="step deltas the learner keeps: an actor this many versions "
        "behind or fewer gets the steps (while they weigh less than a full copy), one "
        "further behind a full copy")


WEIGHT_SYNC_CHANNELS: dict[str, type[_Section]] = {"zmq": ZmqSync, "delta": DeltaSync,
                                                   "nccl": NcclSync}
WEIGHT_SYNC = Tagged("learner.weight_sync", "channel", WEIGHT_SYNC_CHANNELS, "zmq",
                     "weight channel")
WeightSyncConfig = WEIGHT_SYNC.annotation


class LearnerConfig(_Section):
    max_steps: int = Field(20, ge=1, description="learner optimizer steps")
    batch_groups: int = Field(2, ge=1, description="B: prompt groups per learner step")
    sync_every: int = Field(1, ge=1, description="learner steps between weight broadcasts")
    max_staleness: int = Field(1, ge=0, description="eta: versions an actor may lag")
    lr: float = Field(1e-4, description="AdamW learning rate")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, description="gradient norm clip")
    min_micro_batches: int = Field(
        1, ge=1, description="forward/backward micro-batches per optimizer step per rank, at "
        "least (gradient accumulation within one mini-batch): padded packing uses this many, "
        "tree/flat packing more when learner.max_tokens_per_microbatch needs them")
    minibatches: int = Field(
        1, ge=1, description="optimizer steps per rollout batch: each rank's part is split "
        "by groups into this many mini-batches, one step each, as verl's ppo_mini_batch_size "
        "(ARPO: 128 prompts / 16 = 8); the policy version still advances once per batch")
    ppo_epochs: int = Field(
        1, ge=1, description="passes over the rollout batch's mini-batches (verl ppo_epochs); "
        "optimizer steps per batch = minibatches * ppo_epochs")
    zero_stage: int = Field(0, ge=0, le=3, description="DeepSpeed ZeRO stage")
    deepspeed_config: str = Field(
        "", description="DeepSpeed JSON merged into the generated config (ZeRO tuning, offload)"
    )
    world_size: int = Field(1, ge=1, description="learner processes (torchrun ranks)")
    threads: int = Field(1, ge=1, description="torch CPU threads per learner rank")
    checkpoint_every: int = Field(0, ge=0, description="learner steps between checkpoints (0: off)")
    checkpoint_every_tool_calls: int = Field(
        0, ge=0, description="also a checkpoint at the step whose trained groups bring the "
        "executed tool calls past each multiple of this (0: off): a learning curve against "
        "tool cost (bench/arpo_vs_grpo.py); keep_checkpoints must hold them")
    keep_checkpoints: int = Field(
        2, ge=1, description="newest checkpoints kept in run_dir/checkpoints"
    )
    max_restarts: int = Field(
        2, ge=0, description="restarts of a dead learner (from its newest checkpoint) before the "
        "run fails"
    )
    restart_backoff_s: float = Field(
        2.0, ge=0, description="delay before restarting a dead learner, seconds; doubles per "
        "restart, at most 30")
    shutdown_wait_s: float = Field(
        30.0, ge=0, description="at the end of a run, how long the learner waits for the "
        "actors' Bye (and longer for actors still heard from), seconds")
    actor_silent_s: float = Field(
        15.0, gt=0, description="an actor not heard from for this long, seconds, is not counted "
        "alive and its tickets are released"
    )
    wait_timeout_s: float = Field(600.0, description="fail if no trajectory arrives for this long")
    collective_timeout_s: float = Field(
        0.0, ge=0, description="deadline of every collective between learner ranks, seconds "
        "(0: wait_timeout_s + straggler_wait_s + 600, longer than rank 0 can spend collecting "
        "a batch); a rank whose peer is gone (its host cut off, its process stopped) fails "
        "within it, with a line naming the ranks' hosts, instead of hanging")
    straggler_wait_s: float = Field(
        300.0, ge=0, description="with a batch ready, how long at most a step waits for the "
        "groups it would make stale: those whose tickets were granted on weights max_staleness "
        "versions behind, still generating (the long trajectories). They are trained first "
        "when they arrive; a group that has not arrived by then is dropped as stale on "
        "arrival, as with 0 (never wait)")
    weight_sync: WeightSyncConfig = Field(
        default_factory=lambda: ZmqSync(), description="the weight channel to the actors "
        "(learner.weight_sync.channel: zmq, delta or nccl, each with its own keys)")
    attn_implementation: Literal["auto", "sdpa", "flash_attention_2", "eager"] = Field(
        "auto", description="learner attention kernel (auto: flash_attention_2 on GPU when "
        "flash-attn is installed and dtype is 16-bit, else sdpa)")
    gradient_checkpointing: bool = Field(
        False, description="recompute activations in backward: less memory on long sequences, "
        "about a third more compute")
    packing: Literal["tree", "flat", "padded"] = Field(
        "tree", description="learner batches: tree (each group one packed sequence, prompt and "
        "shared prefixes computed once, tree attention mask), flat (leaves concatenated, no "
        "padding) or padded (one right-padded row per leaf)")
    max_tokens_per_microbatch: int = Field(
        16384, ge=0, description="tree/flat packing: tokens per micro-batch at most (a larger "
        "group gets one of its own); micro-batches = max(min_micro_batches, what this needs); "
        "0: no limit")
    logprob_chunk_tokens: int = Field(
        512, ge=0, description="the learner's log-probs and entropies over the vocabulary this "
        "many tokens at a time, recomputed in backward (0: all at once; cold-start SFT has "
        "pipeline.sft_logprob_chunk_tokens)")
    packed_attention: Literal["auto", "dense", "tiles", "flex", "varlen"] = Field(
        "auto", description="tree/flat attention: dense 4D mask (sdpa/eager), tiles (one sdpa "
        "per segment over its ancestors), flex (FlexAttention block mask, GPU), varlen (flat "
        "with flash-attention 2); auto: tiles on CPU, flex or varlen on GPU")
    trees_every: int = Field(
        20, ge=0, description="keep every N-th trained group (N in groups; 0: off) as a tree "
        "file under run_dir/trees, the newest 200 files and 64 MiB at most, for "
        "`python -m arpo_async.jobs.analyze trees`")
    loss: LossConfig = Field(default_factory=PPOLoss)

    @model_validator(mode="after")
    def _minibatches_fit(self):
        if self.minibatches > self.batch_groups:
            raise ValueError(f"learner.minibatches={self.minibatches} > learner.batch_groups="
                             f"{self.batch_groups}: mini-batches are made of whole groups, so "
                             "some optimizer steps would have nothing to train on")
        return self

    @property
    def collective_deadline_s(self) -> float:
        """``collective_timeout_s``, or (0) longer than rank 0 can wait for a batch."""
        return self.collective_timeout_s or self.wait_timeout_s + self.straggler_wait_s + 600.0
