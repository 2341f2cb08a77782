"""Typed run configuration: loaded from YAML, overridden by dotted ``key=value``
arguments, validated once.

Every number that changes learning or throughput is a field of a section with a one-line
description and its unit; each role's sections have their own module (``actors``,
``learner``, ``tools``, ``cluster``, ``run``), composed into ``Config`` here. Unknown keys
and wrong types are rejected with the key's full dotted path (``ConfigError:
learner.batch_grups: unknown key``). The launcher resolves the config once and writes it
to ``run_dir/config.yaml``; every process reads that file.
"""

from __future__ import annotations

import types
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from arpo_async.core.config.actors import (
    ENGINE,
    ROLLOUT,
    ActorsConfig,
    AepoRollout,
    ArpoRollout,
    GrpoRollout,
    RolloutConfig,
    SamplingConfig,
    SimulatedEngine,
    StratifiedRollout,
    TransformersEngine,
    VllmEngine,
    engines_that,
)
from arpo_async.core.config.base import ConfigError, _Section
from arpo_async.core.config.cluster import ClusterConfig, RemoteActorsConfig, TransportConfig
from arpo_async.core.config.learner import WEIGHT_SYNC, LearnerConfig, NcclSync, ZmqSync
from arpo_async.core.config.losses import IMPORTANCE, LOSS, LOSS_TYPES, LossConfig, PPOLoss
from arpo_async.core.config.run import MetricsConfig, ModelConfig, PipelineConfig, RunConfig
from arpo_async.core.config.tools import (
    PYTHON,
    PYTHON_STATES,
    McpHttpServer,
    McpStdioServer,
    PythonSession,
    PythonStateless,
    SearchConfig,
    TaskConfig,
    ToolsConfig,
)
from arpo_async.core.files import atomic_write_text

__all__ = [
    "ActorsConfig", "ClusterConfig", "Config", "ConfigError", "LearnerConfig", "LOSS_TYPES",
    "LossConfig", "PPOLoss",
    "McpHttpServer", "McpStdioServer", "MetricsConfig", "ModelConfig", "PipelineConfig",
    "PYTHON_STATES", "PythonSession", "PythonStateless", "NcclSync", "ZmqSync", "SearchConfig",
    "RENAMED", "RemoteActorsConfig", "RolloutConfig", "ROLLOUT", "GrpoRollout", "ArpoRollout",
    "AepoRollout", "StratifiedRollout",
    "RunConfig", "SamplingConfig", "SimulatedEngine", "TaskConfig", "ToolsConfig",
    "TransformersEngine", "VllmEngine", "set_value",
    "TransportConfig", "config_from_dict", "describe", "load_config", "save_config",
    "total_actors", "CONFIG_DIR", "DEFAULT_CONFIG", "SPINE_CONFIG",
]

CONFIG_DIR = Path(__file__).resolve().parents[3] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "default.yaml"  # the whole job (pipeline): SFT, ARPO, eval
SPINE_CONFIG = CONFIG_DIR / "spine.yaml"  # the RL stage alone, small: tests and benchmarks


# Keys renamed, split or folded so that each has one meaning, and values whose meaning is
# gone ("key=value"): what to write instead. Refused before validation, in one line naming
# the new key, so that an old YAML file or override never runs with a different meaning.
RENAMED: dict[str, str] = {
    "transport.timeout_s": "split; use transport.request_timeout_s (an actor's control "
    "request is retried after it) and transport.send_stall_s (a blocked trajectory send is "
    "logged after it)",
    "sampling.max_new_tokens": "folded with sampling.round_limit; use sampling.round_max_tokens "
    "(tokens one round may ask for, a sample without tools being one round; null: the "
    "remaining response budget)",
    "sampling.round_limit": "folded with sampling.max_new_tokens; use sampling.round_max_tokens "
    "(null: as round_limit=budget; N: as round_limit=max_new_tokens with max_new_tokens=N)",
    "learner.micro_batches": "renamed; use learner.min_micro_batches (at least this many; "
    "tree/flat packing adds more when learner.max_tokens_per_microbatch needs them)",
    "sampling.max_prompt_tokens=0": "0 no longer means no limit; use null",
    "sampling.on_overflow=skip": "removed; set sampling.max_prompt_tokens to "
    "model.max_model_len - sampling.max_response_tokens (longer prompts are skipped)",
    "pipeline.eval_temperature=-1": "-1 no longer means sampling.temperature; use null",
    "run.quiet": "removed; pass --quiet to python -m arpo_async.launch (how one invocation "
    "shows progress, not part of the run)",
    **{f"tools.{old}": f"moved; use tools.python.{new} (the python tool's own section)"
       for old, new in (("python_cpu_s", "cpu_s"), ("python_memory_mb", "memory_mb"),
                        ("python_max_procs", "max_procs"), ("python_max_output", "max_output"),
                        ("allow_unsandboxed", "allow_unsandboxed"), ("python_pool", "pool"),
                        ("python_preload", "preload"), ("python_state", "state"),
                        ("python_max_sessions", "max_sessions (with state: session)"),
                        ("python_session_idle_s", "session_idle_s (with state: session)"),
                        ("python_checkpoint_mb", "checkpoint_mb (with state: session)"))},
    "tools.retriever_url": "moved; use tools.search.retriever_url (the search tool's own "
    "section)",
    "tools.search_topk": "moved; use tools.search.topk",
    "tools.search_snippet_chars": "moved; use tools.search.snippet_chars",
    "learner.loss.is_mode": "moved; use learner.loss.importance.mode",
    "learner.loss.is_cap": "moved; use learner.loss.importance.cap (with mode: truncate)",
    "learner.loss.is_mask_low": "moved; use learner.loss.importance.low (with mode: mask)",
    "learner.loss.is_mask_high": "moved; use learner.loss.importance.high (with mode: mask)",
    "learner.nccl_buffer_mb": "moved; use learner.weight_sync.buffer_mb (with channel: nccl)",
    "learner.nccl_timeout_s": "moved; use learner.weight_sync.timeout_s (with channel: nccl)",
    **{f"actors.{key}": f"moved; use actors.engine.{key} (with type: vllm)"
       for key in ("kv_cache_gib", "gpu_memory_utilization", "tensor_parallel",
                   "enable_prefix_caching", "cuda_graphs", "max_logprobs")},
    **{f"sim.{key}": f"moved; use actors.engine.{key} (with type: simulated)"
       # (python_code came after the move: no sim.python_code ever existed)
       for key in SimulatedEngine.model_fields if key not in ("type", "python_code")},
}
# tagged unions by the field that holds them: the member's tag is dropped from error paths
UNIONS = {"loss": LOSS, "python": PYTHON, "weight_sync": WEIGHT_SYNC,
          "importance": IMPORTANCE, "engine": ENGINE, "rollout": ROLLOUT}


class Config(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    actors: ActorsConfig = Field(default_factory=ActorsConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    rollout: RolloutConfig = Field(default_factory=lambda: ArpoRollout(), description="the "
                                   "rollout (rollout.mode: grpo, arpo or aepo; aepo has its own "
                                   "keys)")
    learner: LearnerConfig = Field(default_factory=LearnerConfig)
    transport: TransportConfig = Field(default_factory=TransportConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    tools: ToolsConfig = Field(default_factory=ToolsConfig)
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
        if self.sampling.top_p < 1.0 and (loss.importance.mode != "off"
                                          or loss.proximal == "recompute"):
            raise ConfigError(
                f"sampling.top_p={self.sampling.top_p}: the actor records log-probs "
                "renormalised over the nucleus while the learner computes full-vocabulary ones, "
                "so the importance weights (learner.loss.importance.mode) and recomputed ratios "
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
        if ln.weight_sync.channel == "nccl" and self.cluster.device != "cuda":
            raise ValueError("learner.weight_sync.channel=nccl needs cluster.device=cuda")
        p = self.pipeline
        if p.enabled and p.sft and not (p.sft_time_s or p.sft_steps):
            raise ValueError("pipeline.sft needs pipeline.sft_time_s or pipeline.sft_steps > 0")
        if ro.entropy_estimator == "reference" and self.sampling.logprobs_topk != 10:
            raise ValueError("rollout.entropy_estimator=reference is the authors' formula over "
                             "their top 10 log-probs; it needs sampling.logprobs_topk=10, got "
                             f"{self.sampling.logprobs_topk}")
        if ro.initial_samples > ro.group_size:
            raise ValueError("rollout.initial_samples must be <= rollout.group_size")
        eng = self.actors.engine
        if self.tools.syntax != "arpo" and eng.arpo_tags_only:
            raise ValueError(f"tools.syntax={self.tools.syntax}: the {eng.type} engine writes "
                             f"ARPO tags only (actors.engine={eng.type}); use tools.syntax=arpo "
                             "with it")
        if self.tools.parallel_calls > 1 and self.tools.syntax == "arpo":
            raise ValueError("tools.parallel_calls > 1 needs a templated tools.syntax (hermes, "
                             "auto or a vLLM parser's name): ARPO's tags make one call a round")
        if self.actors.update_mode == "keep" and not eng.keeps_kv_cache:
            raise ValueError("actors.update_mode=keep freezes requests with their KV cache "
                             f"({'/'.join(engines_that('keeps_kv_cache'))} only); "
                             f"actors.engine={eng.type} takes drain or interrupt")
        return self


def _set_dotted(tree: dict, dotted: str, raw: str) -> None:
    """Apply the override ``dotted=raw`` (the value read as YAML) to a raw config tree."""
    # YAML parsing gives ints, floats, bools and lists from the command line; YAML 1.1's
    # other booleans (off, on, yes, no) stay words: importance.mode=off means "off" (a bool field
    # still reads them as booleans).
    value = yaml.safe_load(raw) if raw != "" else ""
    if isinstance(value, bool) and raw.strip().lower() not in ("true", "false"):
        value = raw.strip()
    set_value(tree, dotted, value)


def set_value(tree: dict, dotted: str, value: Any) -> None:
    """Set ``dotted`` to ``value`` in a raw config tree, tagged unions understood:
    - a bare tag on the way (``actors.engine: simulated``) opens as that member's section;
    - a section's tag set to another member (``rollout.mode=grpo``,
      ``actors.engine.type=transformers``) keeps the keys the two members share and drops
      the others, a key of the same name that means something else in the new member
      included (``learner.loss.eps_low``: ``Tagged.retag``);
    - a union set to a bare tag starts that member afresh (``actors.engine=simulated``),
      unless it names the tag the section already has (its keys stay)."""
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        nxt = node.setdefault(part, {})
        if isinstance(nxt, (str, bool)) and part in UNIONS:  # a bare tag: its section
            nxt = node[part] = UNIONS[part].section(nxt)
        if not isinstance(nxt, dict):
            raise ConfigError(f"{dotted}: {part} is not a section")
        node = nxt
    last = parts[-1]
    owner = parts[-2] if len(parts) > 1 else None
    union = UNIONS.get(owner)
    if (union is not None and last == union.tag and value in union.members
            and node.get(last, union.default) != value):
        retagged = union.retag(node, value)
        node.clear()
        node.update(retagged)
        return
    old = node.get(last)
    if (last in UNIONS and isinstance(old, dict) and isinstance(value, str)
            and old.get(UNIONS[last].tag, UNIONS[last].default) == value):
        return  # the tag a union section already has: its keys stay
    node[last] = value


def _format_error(err: ValidationError) -> str:
    first = err.errors()[0]
    # a tagged union puts the member's tag in the path (learner.loss.ppo.eps_low): drop it
    loc = [p for i, p in enumerate(first["loc"])
           if not (i and first["loc"][i - 1] in UNIONS
                   and p in UNIONS[first["loc"][i - 1]].members)]
    key = ".".join(str(p) for p in loc)
    if not key:  # a cross-field rule: its message names the keys
        return first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        return f"{key}: unknown key"
    if first["type"] == "value_error":  # a section's own rule: its message says what is wrong
        msg = first["msg"].removeprefix("Value error, ")
        return msg if msg.startswith((key + ".", key + "[")) else f"{key}: {msg}"
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
    _refuse_renamed(tree)  # before the overrides, which may not fit an old file's shape
    given: list[str] = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value")
        key, raw = item.split("=", 1)
        _set_dotted(tree, key.strip(), raw)
        # a switch of member drops the keys the new one does not share (Tagged.retag): an
        # override given before it, of a key the new member has, would be lost without a word
        lost = [k for k in given if _dropped(tree, k)]
        if lost:
            raise ConfigError(f"{lost[0]}: dropped by the later override {item.strip()} (a "
                              "switch of tag keeps only the keys two members share, a bare "
                              "tag starts afresh); give it after that override")
        given.append(key.strip())
    return config_from_dict(tree)


def _dropped(tree: dict, dotted: str) -> bool:
    """Whether the raw tree lacks ``dotted`` though the union section it belongs to takes
    that key: a switch of member dropped it, as a key that means something else there."""
    *path, last = dotted.split(".")
    node: Any = tree
    for part in path:
        if not isinstance(node, dict) or part not in node:
            return False  # its section went: a key of the new member's defaults
        node = node[part]
        if isinstance(node, (str, bool)) and part in UNIONS:  # a bare tag: its section
            node = {UNIONS[part].tag: node}
    union = UNIONS.get(path[-1]) if path else None
    if union is None or not isinstance(node, dict) or last in node:
        return False
    kind = union.kind(node)
    return isinstance(kind, str) and last in getattr(union.members.get(kind), "model_fields", ())


def _value_text(value: Any) -> str | None:
    """A scalar as a RENAMED "key=value" entry writes it (-1.0 and -1 alike: "-1")."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"{value:g}"
    return value if isinstance(value, str) else None


def _renamed(tree: dict, prefix: str = "") -> list[str]:
    """The RENAMED entries ``tree`` still uses, each as "old: what to use instead"."""
    found = []
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, dict):
            found += _renamed(value, key + ".")
        for old in (key, f"{key}={_value_text(value)}"):
            if old in RENAMED:
                found.append(f"{old}: {RENAMED[old]}")
    return found


def _refuse_renamed(tree: dict[str, Any]) -> None:
    """ConfigError in one line naming the first old key and what to write instead."""
    old = _renamed(tree)
    if old:
        also = [o.split(": ", 1)[0] for o in old[1:]]
        raise ConfigError(old[0] + (f"; also {', '.join(also)}" if also else ""))


def config_from_dict(tree: dict[str, Any]) -> Config:
    _refuse_renamed(tree)
    try:
        return Config.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_error(err)) from None


def save_config(cfg: Config, path: str | Path) -> None:
    atomic_write_text(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def _members(ann) -> tuple[type[BaseModel], ...]:
    """The section classes behind a field: one, the members of a tagged union, or none."""
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return (ann,)
    if typing.get_origin(ann) is typing.Annotated:
        ann = typing.get_args(ann)[0]
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        return tuple(a for a in typing.get_args(ann)
                     if isinstance(a, type) and issubclass(a, BaseModel))
    return ()


def describe(model: type[BaseModel] = Config, prefix: str = "") -> list[str]:
    """One line per field: dotted key, default, description (used by --help). A tagged
    union's keys are listed once when every type has them alike, else once per type."""
    lines = []
    for name, field in model.model_fields.items():
        members = _members(field.annotation)
        if len(members) == 1:
            lines += describe(members[0], f"{prefix}{name}.")
        elif members:
            per = [describe(m, f"{prefix}{name}.") for m in members]
            common = [line for line in per[0] if all(line in p for p in per[1:])]
            lines += common
            tag = UNIONS[name].tag
            for m, own in zip(members, per):
                kind = m.model_fields[tag].default
                lines += [f"{line} [{tag}={kind}]" for line in own if line not in common]
        else:
            default = field.default_factory() if field.default_factory else field.default
            lines.append(f"  {prefix}{name} = {default!r}: {field.description}")
    return lines


def total_actors(cfg: Config) -> int:
    """Local and remote actors together (what the learner waits for at start)."""
    return cfg.actors.num + sum(r.actors for r in cfg.cluster.remote_actors)
