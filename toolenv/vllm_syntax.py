"""Tool calls in a model family's own format, read by vLLM's parser (``tools.syntax`` =
a parser name, or ``auto``).

vLLM ships a maintained parser per model family (``vllm/tool_parsers/``). This syntax uses
one to read the call that ended a round, and the model's own chat template for
everything written into the token stream, token in token out, as ``HermesSyntax`` does:

- **where a round stops**: the family's end-of-call marker (``STOPS``: ``</tool_call>``
  for the XML formats, ``<｜tool▁calls▁end｜>`` for DeepSeek V3.1), a single token in
  these tokenizers, so the engine stops on its id;
- **the call**: the round must end with that marker; vLLM's parser extracts the call
  (never ``eval``: the parsers here convert values with ``json`` and
  ``ast.literal_eval``; ``bench/parsers.py`` counts code evaluated under an audit hook);
  then this project checks what the parsers do not: one call, a configured tool, and
  arguments that meet the tool's JSON schema. A call that fails is answered with its
  error (``ToolCall.error``), as a serving stack's tool executor would, and the
  trajectory goes on;
- **the result**: the template's text from the end of the call to the next assistant
  header, rendered with a call in the assistant message (``<|im_end|>...<tool_response>``
  for Qwen3.5, ``<|observation|><tool_response>`` for GLM, ``<｜end▁of▁sentence｜>
  <｜tool▁output▁begin｜>`` for DeepSeek); refused when it does not start at a token
  boundary, as for hermes;
- **a demonstration's call** (``call_text``, SFT traces): the template's own rendering of
  the call.

``auto`` reads the template (``detect_parser``). Supported: the parsers in ``STOPS``,
each tested on its family's real tokenizer and template (tests/unit/test_vllm_syntax.py,
docs/tools.md). Several calls in one turn (``tools.parallel_calls`` > 1) as for hermes:
the round ends at the tool turn's first token, the parser reads every call of the turn
(DeepSeek's block of several calls included), the results follow as the template renders
several tool messages. With ``tools.parallel_calls=1`` a round stops at the first end of
call and a turn of several calls is refused with an error the model reads.
vLLM is imported when such a syntax is built (about 10 s), never by the other syntaxes.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from toolenv.base import ToolSpec
from toolenv.hermes import _SENTINEL, HermesSyntax
from toolenv.tags import Markup, ToolCall, defuse, defuse_json

MAX_CALL_CHARS = 65_536  # a longer call is refused unread (seconds of parsing at 200k)
DS_CALLS_OPEN, DS_CALLS_CLOSE = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
# parser name -> (where the call block opens, where it ends: the round's stop)
STOPS = {
    "qwen3_coder": ("<tool_call>", "</tool_call>"),
    "qwen3_xml": ("<tool_call>", "</tool_call>"),
    "glm45": ("<tool_call>", "</tool_call>"),
    "glm47": ("<tool_call>", "</tool_call>"),
    "deepseek_v31": (DS_CALLS_OPEN, DS_CALLS_CLOSE),
}
# the tool's name in a call block's body (tags.tools_used reads it; Markup.name_regex)
NAME_REGEX = {
    "qwen3_coder": r"<function=([^>\n]+)>", "qwen3_xml": r"<function=([^>\n]+)>",
    "glm45": r"^\s*([^<\s]+)", "glm47": r"^\s*([^<\s]+)",
    "deepseek_v31": r"<｜tool▁call▁begin｜>\s*([^<\s]+?)\s*<｜tool▁sep｜>",
}
# what a template writes for a call, most specific first -> the parser that reads it
_DETECT = (("<function=", "qwen3_coder"), ("<arg_key>", "glm47"),
           ("tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>", "deepseek_v31"),
           ("<tool_call>", "hermes"))
_TOOLS_BLOCK = ("\n\n# Tools\n\nYou may call these functions:\n<tools>{tools}\n</tools>\n\n"
                "Call one per turn, written like this:\n{example}")


class SyntaxConfigError(ValueError):
    """``tools.syntax`` names a parser this project does not support, or ``auto`` cannot
    tell the model's format."""


def detect_parser(tokenizer: Any) -> str:
    """The parser for the tokenizer's chat template (``tools.syntax=auto``)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if isinstance(template, dict):
        template = template.get("tool_use") or template.get("default") or ""
    for marker, parser in _DETECT:
        if marker in template:
            return parser
    raise SyntaxConfigError(
        "tools.syntax=auto: the model's chat template writes no tool-call format this "
        f"project knows; set tools.syntax to one of arpo, hermes, {', '.join(STOPS)}")


class VllmParserSyntax(HermesSyntax):
    """A family's own calls, read by vLLM's parser ``parser``; results as its template's
    tool turn."""

    templated = True

    def __init__(self, specs: Iterable[ToolSpec], tokenizer: Any, parser: str,
                 template_kwargs: dict | None = None, max_calls: int = 1):
        if parser not in STOPS:
            raise SyntaxConfigError(f"tools.syntax={parser}: not a supported parser (arpo, "
                                    f"hermes, auto, {', '.join(STOPS)})")
        specs = list(specs)
        if not specs:
            raise SyntaxConfigError(f"tools.syntax={parser}: no tools configured")
        self.name, self.parser_name = parser, parser
        self.call_open, self.call_close = STOPS[parser]
        self._example = specs[0]
        self._args_as_text = False  # DeepSeek's template takes arguments as a JSON string
        super().__init__(specs, tokenizer, template_kwargs, max_calls)
        pre, post = self.markup.result
        self.markup = Markup(calls=(("tool_call", self.call_open, self.call_close),),
                             result=(pre, post), tools=tuple(self.specs), json_calls=True,
                             name_regex=NAME_REGEX[parser],
                             result_label=("<tool message>", "<end of tool message>"))
        self._parser, self._request = self._make_parser()

    # ------------------------------------------------------------------ the template
    def _call_message(self, spec: ToolSpec, arguments: dict, n: int = 1) -> dict:
        """An assistant message of ``n`` calls to ``spec`` with ``arguments``."""
        args: Any = json.dumps(arguments, ensure_ascii=False) if self._args_as_text else arguments
        return {"role": "assistant", "content": "",
                "tool_calls": [{"type": "function", "id": f"call_{i}",
                                "function": {"name": spec.name, "arguments": args}}
                               for i in range(n)]}

    def _example_args(self) -> dict:
        props = list(self._example.parameters.get("properties", {})) or ["input"]
        return {props[0]: "1"}

    def _conversation(self, contents: list[str]) -> list[dict]:
        return [{"role": "user", "content": "?"},
                self._call_message(self._example, self._example_args(), len(contents)),
                *({"role": "tool", "content": c} for c in contents)]

    def _render_call(self, messages: list[dict], generation: bool) -> str:
        """Renders a conversation holding a call; a template that takes the arguments as
        a JSON string (DeepSeek's) is tried that way after the object fails."""
        try:
            return self._render(messages, generation=generation)
        except Exception:
            if self._args_as_text:
                raise
            self._args_as_text = True
            for m in messages:
                for call in m.get("tool_calls", []):
                    call["function"]["arguments"] = json.dumps(call["function"]["arguments"],
                                                               ensure_ascii=False)
            return self._render(messages, generation=generation)

    def _turns(self, contents: list[str]) -> str:
        """The template's text after the last call's end marker: the end of the assistant
        turn, one tool message per entry of ``contents``, the next assistant header."""
        text = self._render_call(self._conversation(contents), generation=True)
        limit = len(text)
        for content in reversed(contents):  # where the first tool message's content is
            limit = text.rfind(content, 0, limit) if content else limit
        at = text.rfind(self.call_close, 0, limit)
        if at < 0:
            raise SyntaxConfigError(f"tools.syntax={self.parser_name}: the chat template does "
                                    f"not write {self.call_close!r} at the end of a call")
        return text[at + len(self.call_close):]

    def _result_frame(self) -> tuple[str, str]:
        turn = self._turn(_SENTINEL)
        at = turn.find(_SENTINEL)
        if at < 0:
            raise SyntaxConfigError(f"tools.syntax={self.parser_name}: the chat template does "
                                    "not render the tool message's content")
        pre, post = turn[:at], turn[at + len(_SENTINEL):]
        whole = self.tokenizer.encode(self._render_call(self._conversation(["1"]), True),
                                      add_special_tokens=False)
        alone = self.tokenizer.encode(self._turn("1"), add_special_tokens=False)
        if not pre.strip() or whole[len(whole) - len(alone):] != alone:
            raise SyntaxConfigError(
                f"tools.syntax={self.parser_name}: the chat template's tool turn {pre!r} does "
                "not start at a token boundary, so its ids alone differ from the template's")
        return pre, post

    def _make_parser(self) -> tuple[Any, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.tool_parsers import ToolParserManager

        tools = [s.chat_tool() for s in self.specs.values()]
        parser = ToolParserManager.get_tool_parser(self.parser_name)(self.tokenizer, tools)
        # the request carries the schemas the parser types the values by (its only use)
        request = ChatCompletionRequest(model="arpo_async", tools=tools,
                                        messages=[{"role": "user", "content": "?"}])
        return parser, request

    # ------------------------------------------------------------------ the protocol
    def call_text(self, name: str, args: str) -> str:
        """The template's rendering of a call (a demonstration's, SFT), from its opening
        marker to its end marker."""
        spec = self.specs[name]
        props = list(spec.parameters.get("properties", {}))
        arguments = {props[0]: args} if len(props) == 1 else json.loads(args)
        text = self._render_call([{"role": "user", "content": "?"},
                                  self._call_message(spec, arguments)], generation=False)
        end = text.rfind(self.call_close)
        start = text.rfind(self.call_open, 0, end)
        return text[start:end + len(self.call_close)] + self.end_of_turn

    def prompt(self, system: str | None) -> tuple[str | None, list[dict] | None]:
        """(system prompt, ``tools=``): the template's tools block where it renders one;
        else the schemas and an example call, written by the template, in the system
        prompt (DeepSeek V3.1's template has no tools block)."""
        tools = [defuse_json(s.chat_tool(), self.literals) for s in self.specs.values()]
        if self.template_renders_tools:
            return system, tools
        example = self.call_text(self._example.name,
                                 self._example.call_text(self._example_args()))
        block = _TOOLS_BLOCK.format(
            tools="".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools),
            example=defuse(example, ()))
        return (system or "") + block, None

    def find_call(self, round_text: str) -> ToolCall | None:
        """The call that ended the round (None: the round ended otherwise); a call that
        cannot run carries ``error``."""
        text = round_text.rstrip()
        if not text.endswith(self.call_close):
            return None
        start = text.rfind(self.call_open, 0, len(text) - len(self.call_close))
        if start < 0:
            return ToolCall("", text[-200:], f"Error: {self.call_close} without "
                            f"{self.call_open}; write the call as the tools block shows")
        return self._parsed(text[start:], one=True)[0]

    def _turn_calls(self, text: str) -> list[ToolCall]:
        start = text.find(self.call_open)
        if start < 0:
            return [self.find_call(text)]  # an end of call without its opening: the error
        return self._parsed(text[start:], one=False)

    def _parsed(self, body: str, one: bool) -> list[ToolCall]:
        """The calls vLLM's parser reads in ``body`` (``one``: exactly one allowed)."""
        if len(body) > MAX_CALL_CHARS:  # the parsers' regexes slow down past this
            return [ToolCall("", body[:200], f"Error: the tool call is longer than "
                             f"{MAX_CALL_CHARS} characters")]
        try:
            found = self._parser.extract_tool_calls(body, self._request)
        except Exception as exc:  # a parser bug must not end the rollout: the call fails
            return [ToolCall("", body, f"Error: the tool call could not be read "
                             f"({type(exc).__name__})")]
        calls = list(found.tool_calls or []) if found.tools_called else []
        if not calls:
            return [ToolCall("", body, "Error: the tool call could not be read; write it as "
                             "the tools block shows")]
        if one and len(calls) > 1:
            return [ToolCall("", body, "Error: one tool call per turn")]
        return [self._checked_text(c.function.name or "", c.function.arguments, body)
                for c in calls]

    def _checked_text(self, name: str, arguments: str, body: str) -> ToolCall:
        """The parser's arguments (JSON text) through HermesSyntax's checks."""
        try:
            args = json.loads(arguments or "{}")
        except ValueError as exc:
            return ToolCall(name, body, f"Error: invalid arguments for {name}: {exc}")
        return self._checked(name, args, body)
