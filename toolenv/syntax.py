"""Tool-call syntaxes (``tools.syntax``): how a call is written, where a round stops, how the
result enters the token stream, and how a finished response is checked.

- ``ArpoSyntax``: ARPO's tags (toolenv/tags.py): ``<python>code</python>``, results as
  ``<result>...</result>`` token ids, one tag per configured tool.
- ``HermesSyntax`` (toolenv/hermes.py): ``<tool_call>{"name": ..., "arguments": {...}}
  </tool_call>``, results as the chat template's ``tool`` message.
- ``VllmParserSyntax`` (toolenv/vllm_syntax.py): a model family's own format read by
  vLLM's parser (``tools.syntax`` = its name, or ``auto``), results as the family's
  template renders them.

A round stops at the first end of call, so each round makes one call (ARPO decides about
branching after every result); with ``tools.parallel_calls`` > 1 (templated syntaxes) a
round stops at the end of the assistant's turn and makes every call in it, and the branch
decision follows the last of their results (toolenv/hermes.py). The final answer is
``<answer>...\\boxed{}</answer>`` in every syntax, so rewards and evaluation read them all
the same way.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any, Protocol

from toolenv.base import ToolSpec
from toolenv.builtin import builtin_class
from toolenv.hermes import CALL_CLOSE, CALL_OPEN, HermesSyntax, _Checks
from toolenv.mcp_tools import mcp_specs
from toolenv.tags import (
    DEFAULT_TOOLS,
    Markup,
    ToolCall,
    arpo_markup,
    control_texts,
    defuse,
    find_tool_call,
    format_result,
    stop_tags,
)
from toolenv.tool_classes import load_tool_class

__all__ = ["CALL_CLOSE", "CALL_OPEN", "ArpoSyntax", "HermesSyntax", "ToolSyntax",
           "build_syntax", "tool_specs"]
log = logging.getLogger(__name__)


class ToolSyntax(Protocol):
    name: str  # "arpo" | "hermes" | a vLLM parser's name (toolenv/vllm_syntax.py)
    templated: bool  # calls and results through the chat template (all but arpo)
    markup: Markup  # the opaque blocks (pure data: rewards take this, not the syntax)
    stop_strings: list[str]  # where a round stops (tool-call ends and </answer>)

    def find_call(self, round_text: str) -> ToolCall | None: ...

    def find_calls(self, round_text: str) -> list[ToolCall]: ...  # the rollout's reader

    def result_text(self, text: str) -> str: ...

    def results_text(self, texts: list[str]) -> str: ...  # one turn's results, in order

    def result_ids(self, text: str) -> list[int]: ...

    def call_text(self, name: str, args: str) -> str: ...

    def prompt(self, system: str | None) -> tuple[str | None, list[dict] | None]: ...

    template_kwargs: dict  # extra chat-template arguments (model.chat_template_kwargs)


class ArpoSyntax(_Checks):
    """ARPO's tags; a custom tool's tag is its name."""

    name = "arpo"
    templated = False

    def __init__(self, specs: Iterable[ToolSpec], tokenizer: Any = None,
                 template_kwargs: dict | None = None):
        self.specs = {s.name: s for s in specs}
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.literals = control_texts(tokenizer)  # what untrusted text must not contain
        # python and search keep their tags when not enabled: a call to one is answered
        # "unknown tool" by the runner (as before custom tools), never read as text.
        self.markup = arpo_markup(tuple(dict.fromkeys([*DEFAULT_TOOLS, *self.specs])))
        self.stop_strings = stop_tags(self.markup.tools)

    def find_call(self, round_text: str) -> ToolCall | None:
        return find_tool_call(round_text, self.markup.tools)

    def find_calls(self, round_text: str) -> list[ToolCall]:
        return [c] if (c := self.find_call(round_text)) is not None else []

    def results_text(self, texts: list[str]) -> str:
        (text,) = texts  # one call per round
        return self.result_text(text)

    def result_text(self, text: str) -> str:
        """``<result>`` block of the output, its control tokens defused (tags.defuse)."""
        return format_result(defuse(text, self.literals))

    def result_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(self.result_text(text), add_special_tokens=False)

    def call_text(self, name: str, args: str) -> str:
        return f"<{name}>{args}</{name}>"

    def prompt(self, system: str | None) -> tuple[str | None, list[dict] | None]:
        """The system prompt, with a line for each tool the built-in prompts do not
        describe (python and search are; an MCP server's description is defused, as a
        result is); no ``tools=`` for the template."""
        extra = [f"<{s.name}>...</{s.name}>: {defuse(s.description, self.literals)}"
                 for s in self.specs.values() if s.name not in DEFAULT_TOOLS]
        if not extra:
            return system, None
        lines = "Tools: " + " ".join(extra)
        return (f"{system}\n{lines}" if system else lines), None


def tool_specs(cfg: Any) -> list[ToolSpec]:
    """What the model is told about the configured tools (``tools.enabled``, then
    ``tools.custom``, read from their classes: nothing is constructed; then the ``tools.mcp``
    servers' tools, from their listing: toolenv/mcp_tools.py)."""
    classes = [builtin_class(name) for name in cfg.enabled]
    classes += [load_tool_class(path) for path in cfg.custom]
    specs = [ToolSpec.of(cls) for cls in classes]
    if getattr(cfg, "mcp", None):
        specs += mcp_specs(cfg)
    return specs


def build_syntax(cfg: Any, tokenizer: Any, template_kwargs: dict | None = None) -> Any:
    """The syntax ``cfg.syntax`` (a ``ToolsConfig``) names, over the configured tools;
    ``template_kwargs`` go to every chat-template rendering (prompts and tool turns).
    ``auto`` and a vLLM parser's name: toolenv/vllm_syntax.py (imports vLLM)."""
    specs, calls = tool_specs(cfg), getattr(cfg, "parallel_calls", 1)
    if cfg.syntax == "arpo":
        return ArpoSyntax(specs, tokenizer, template_kwargs)
    name = cfg.syntax
    if name != "hermes":
        from toolenv.vllm_syntax import VllmParserSyntax, detect_parser

        name = detect_parser(tokenizer) if name == "auto" else name
        if cfg.syntax == "auto":
            log.info("tools.syntax=auto: %s (read from the chat template)", name)
        if name != "hermes":
            return VllmParserSyntax(specs, tokenizer, name, template_kwargs, calls)
    return HermesSyntax(specs, tokenizer, template_kwargs, calls)
