"""What is checked, and made, once a run's config is read and before any process starts.

``resolve_run`` is the one resolution of a run (``arpo_async.launch``, ``--slurm``,
``--dry-run``; the pipeline resolves its RL stage from what its own stages made): the
launcher's ``resolve`` (the config file and overrides, the rules of a trainable run,
CurveZMQ, the ports), then ``prepare_run`` here, which needs what the launcher must not
import (the tool classes, the model's tokenizer). The launcher then writes the result once
to RUN_DIR/config.yaml, the file every role reads.

- ``tools.custom``: each class imported and checked against the tool protocol
  (toolenv/tool_classes.py), one line naming ``tools.custom[i]`` and the path.
- ``model.path``: the tiny local model built there when missing (not on a dry run,
  which checks lengths only when the folder is there).
- ``learner.packing`` tree or flat on a model whose layers are not all full attention
  (sliding windows, Qwen3.5's linear attention): refused, naming ``padded``.
- The model's tokenizer, loaded as vLLM loads it (``AutoTokenizer``), must give text back
  as written (``family_tokenizers.round_trip_problem``): transformers 5 loads a byte-level
  tokenizer whose config names ``LlamaTokenizerFast`` (DeepSeek V3 and R1-Distill-Llama
  folders whose ``config.json`` it does not recognise) with a decoder that drops every
  space, silently; such a folder is refused in one line saying what to change.
- Lengths, once the tokenizer can be read: every prompt of the run's task, chat-templated
  as the actor sends it (system prompt, the tools block of ``tools.syntax``, question,
  ``model.chat_template_kwargs``), plus ``sampling.max_response_tokens``, against
  ``model.max_model_len``. Prompts longer than ``sampling.max_prompt_tokens`` are left out
  (the actors count them, ``prompts_skipped_too_long``); of the others, one that does not
  fit stops the run under ``sampling.on_overflow = refuse``, in one line naming the keys,
  the numbers and the longest prompt, and runs under ``cap`` (a trajectory that fills
  ``max_model_len`` ends as ``length``, counted in ``rollout/context_full``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from arpo_async.core.config import Config, ConfigError
from arpo_async.jobs.tiny_model import resolve_model_path
from arpo_async.launcher.supervisor import LaunchRequest, checked, load, with_ports
from toolenv.tasks.prompts import PromptSource
from toolenv.tool_classes import check_custom_tools


@dataclass
class LengthReport:
    prompts: int  # the prompts the run takes (not over sampling.max_prompt_tokens)
    longest: int  # tokens of the longest of them
    longest_id: str  # its id (and file row)
    room: int  # model.max_model_len - sampling.max_response_tokens
    over: int  # of them, those longer than room

    def line(self) -> str:
        return (f"{self.prompts} prompts, the longest {self.longest} tokens ({self.longest_id}); "
                f"{self.over} leave less than sampling.max_response_tokens under "
                "model.max_model_len")


def resolve_run(req: LaunchRequest, cfg: Config | None = None) -> Config:
    """The launcher's checks of ``req``'s config (``cfg``: already read) first, so that
    nothing is built for a run that cannot start; then ``prepare_run``; then the ports."""
    cfg = checked(load(req) if cfg is None else cfg)
    prepare_run(cfg, req.dry_run)
    return with_ports(cfg)


def check_tools(cfg: Config) -> None:
    """``tools.custom``: each class imported and checked; ConfigError naming the entry."""
    try:
        check_custom_tools(cfg.tools)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def prepare_run(cfg: Config, dry_run: bool = False) -> None:
    """Check ``cfg`` and resolve ``cfg.model.path``; ConfigError in one line otherwise."""
    check_tools(cfg)
    if not dry_run:
        try:
            cfg.model.path = resolve_model_path(cfg)
        except (FileNotFoundError, ValueError, OSError) as exc:
            raise ConfigError(str(exc).splitlines()[0]) from None
    check_packing(cfg)
    tokenizer = None
    if (Path(cfg.model.path) / "config.json").is_file():
        from transformers import AutoTokenizer  # transformers: heavy; the launcher imports this

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
        check_round_trip(cfg, tokenizer)
    resolve_syntax(cfg, tokenizer)
    check_lengths(cfg, tokenizer)  # a dry run checks them too when the model folder is there


def check_packing(cfg: Config) -> None:
    """ConfigError when the model's layers cannot run ``learner.packing`` tree or flat
    (arpo_async/core/architectures.py): before SFT and the first evaluation, not at the
    learner's first step. A model not in a local folder (a hub name) is left to the
    learner."""
    if cfg.learner.packing == "padded" or not (Path(cfg.model.path) / "config.json").is_file():
        return
    from transformers import AutoConfig

    from arpo_async.core.architectures import packed_tree_refusal

    refusal = packed_tree_refusal(AutoConfig.from_pretrained(cfg.model.path))
    if refusal:
        raise ConfigError(f"{refusal}; model.path={cfg.model.path}")


def check_round_trip(cfg: Config, tokenizer) -> None:
    """ConfigError when the model's tokenizer does not give text back as written."""
    from arpo_async.jobs.family_tokenizers import round_trip_problem

    if problem := round_trip_problem(tokenizer):
        raise ConfigError(
            f"model.path={cfg.model.path}: its tokenizer ({type(tokenizer).__name__}) does not "
            f"give text back ({problem}); if tokenizer.json is byte-level BPE, set "
            '"tokenizer_class": "TokenizersBackend" in its tokenizer_config.json '
            "(transformers #45488)")


def resolve_syntax(cfg: Config, tokenizer=None) -> None:
    """``tools.syntax=auto``: the parser the model's chat template calls for, written into
    the config (so RUN_DIR/config.yaml and every role say which) and printed; left for
    each role to read when the model folder is not here (a hub name)."""
    if cfg.tools.syntax != "auto" or not (Path(cfg.model.path) / "config.json").is_file():
        return
    from toolenv.vllm_syntax import SyntaxConfigError, detect_parser

    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)

    try:
        cfg.tools.syntax = detect_parser(tokenizer)
    except SyntaxConfigError as exc:
        raise ConfigError(str(exc)) from None
    print(f"tools.syntax=auto: {cfg.tools.syntax} (read from {cfg.model.path}'s chat "
          "template)", flush=True)


def check_lengths(cfg: Config, tokenizer=None) -> LengthReport | None:
    """Every prompt of ``cfg.task`` (encoded as the actor encodes it) + the response
    budget against ``model.max_model_len``; ConfigError under ``on_overflow = refuse``.
    None when the model folder or the task's data is not there yet (a hub name, the
    pipeline before its data stage)."""
    if tokenizer is None:
        if not (Path(cfg.model.path) / "config.json").is_file():
            return None
        from transformers import AutoTokenizer  # transformers: heavy; the launcher imports this

        tokenizer = AutoTokenizer.from_pretrained(cfg.model.path)
    if cfg.task.name == "file" and not Path(cfg.task.data).is_file():
        return None
    try:
        source = PromptSource(cfg, tokenizer)
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None
    s, limit = cfg.sampling, cfg.model.max_model_len
    room = limit - s.max_response_tokens
    lengths = [(len(source.encode(p).tokens), p) for p in source.items]
    # the prompts the run takes: longer than sampling.max_prompt_tokens are left out
    taken = [(n, p) for n, p in lengths if n <= (s.max_prompt_tokens or n)]
    if not taken:
        raise ConfigError(f"sampling.max_prompt_tokens={s.max_prompt_tokens}: every prompt "
                          "is longer")
    longest, prompt = max(taken, key=lambda x: x[0])
    row = prompt.meta.get("row")
    report = LengthReport(len(taken), longest,
                          prompt.id + (f", {cfg.task.data} row {row}" if row is not None else ""),
                          room, sum(n > room for n, _ in taken))
    if report.over and s.on_overflow == "refuse":
        raise ConfigError(
            f"the longest prompt ({report.longest_id}) is {longest} tokens: + "
            f"sampling.max_response_tokens={s.max_response_tokens} = "
            f"{longest + s.max_response_tokens} > model.max_model_len={limit} ({report.over} "
            f"of {report.prompts} prompts); raise model.max_model_len, lower "
            f"sampling.max_response_tokens, set sampling.max_prompt_tokens={room} (leave them "
            "out) or sampling.on_overflow=cap (a trajectory that fills max_model_len ends as "
            "length)")
    return report
