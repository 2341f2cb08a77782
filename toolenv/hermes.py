"""The hermes syntax (``tools.syntax=hermes``): a call is ``<tool_call>{"name": ...,
"arguments": {...}}</tool_call>``, the format Qwen2.5/Qwen3 and most instruct models are
trained on; the result is the chat template's ``tool`` message, and the tool schemas reach
the prompt through the template's ``tools=`` argument.

The result turn, token in token out: the template renders a conversation whose assistant
message holds a sentinel, then the tool message, then the generation prompt; the text
after the sentinel (the end of the assistant turn, the tool message, the next assistant
header) is the result, tokenised on its own. That is the same as the template's own
tokenisation of those turns only when the text starts at a token boundary (ChatML and Qwen
start it with ``<|im_end|>``, a special token); this is checked when the syntax is built,
so a template for which it fails is refused rather than misaligned. The history is never
re-tokenised. ``_Checks`` (format checks and the tools a response used) is shared with
ARPO's syntax (toolenv/syntax.py); toolenv/vllm_syntax.py builds on ``HermesSyntax``.

Several calls in one turn (``tools.parallel_calls`` > 1): the round does not stop at the
end of a call but at the end of the assistant's turn, the first token of the template's
tool turn (``end_of_turn``: ``<|im_end|>`` for ChatML and Qwen), which the model writes
itself; every call in the turn is read (``find_calls``), and their results are inserted as
the template renders several tool messages, from after that token (``results_text``). A
demonstration's call (``call_text``) then ends with that token too, so SFT teaches it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

from toolenv.base import ToolSpec
from toolenv.tags import (
    Markup,
    ToolCall,
    control_texts,
    defuse,
    defuse_json,
    tools_used,
    validate_format,
)

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_SENTINEL = "\u2063ARPO-SENTINEL\u2063"  # text no model or tool writes
_CLOSING_TAG = re.compile(r"</[A-Za-z_][A-Za-z0-9_-]*>")
_BLOCK = re.compile(re.escape(CALL_OPEN) + "(.*?)" + re.escape(CALL_CLOSE), re.S)
# The tools block of Qwen2.5/Qwen3's chat template, for templates that ignore tools=.
_TOOLS_INTRO = ("\n\n# Tools\n\nYou may call one or more functions to assist with the user "
                "query.\n\nYou are provided with function signatures within <tools></tools> "
                "XML tags:\n<tools>")
_TOOLS_OUTRO = ("\n</tools>\n\nFor each function call, return a json object with function "
                "name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


class _Checks:
    markup: Markup
    template_kwargs: dict

    def validate_format(self, text: str) -> tuple[bool, str]:
        return validate_format(text, markup=self.markup)

    def tools_used(self, text: str) -> set[str]:
        return tools_used(text, markup=self.markup)


class HermesSyntax(_Checks):
    """JSON calls in ``<tool_call>``, results as the chat template's tool message."""

    name = "hermes"
    templated = True
    call_open, call_close = CALL_OPEN, CALL_CLOSE

    def __init__(self, specs: Iterable[ToolSpec], tokenizer: Any,
                 template_kwargs: dict | None = None, max_calls: int = 1):
        if max_calls < 1:
            raise ValueError(f"tools.parallel_calls={max_calls}: must be >= 1")
        self.specs = {s.name: s for s in specs}
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.max_calls = max_calls
        self.literals = self._dangerous()
        pre, post = self._result_frame()
        self.markup = Markup(calls=(("tool_call", self.call_open, self.call_close),),
                             result=(pre, post), tools=tuple(self.specs), json_calls=True,
                             result_label=("<tool message>", "<end of tool message>"))
        self.template_renders_tools = self._renders_tools()
        # parallel calls: the round ends where the template's tool turn starts
        self.end_of_turn = self._end_of_turn(pre) if max_calls > 1 else ""
        self.stop_strings = [self.end_of_turn or self.call_close, "</answer>"]

    # ------------------------------------------------------------------ the template
    def _render(self, messages: list[dict], tools: list[dict] | None = None,
                generation: bool = False) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=generation,
            **self.template_kwargs)

    def _turn(self, content: str) -> str:
        return self._turns([content])

    def _turns(self, contents: list[str]) -> str:
        """The template's text after the assistant's content: end of turn, one tool
        message per entry of ``contents``, the next assistant header."""
        text = self._render([{"role": "user", "content": "?"},
                             {"role": "assistant", "content": _SENTINEL},
                             *({"role": "tool", "content": c} for c in contents)],
                            generation=True)
        at = text.find(_SENTINEL)
        if at < 0:
            raise ValueError("tools.syntax=hermes: the chat template drops the assistant "
                             "message's content")
        return text[at + len(_SENTINEL):]

    def _result_frame(self) -> tuple[str, str]:
        turn = self._turn(_SENTINEL)
        at = turn.find(_SENTINEL)
        if at < 0:
            raise ValueError("tools.syntax=hermes: the chat template does not render the "
                             "tool message's content (no tool role?)")
        pre, post = turn[:at], turn[at + len(_SENTINEL):]
        whole = self.tokenizer.encode(self._render([{"role": "user", "content": "?"},
                                                    {"role": "assistant", "content": "x"},
                                                    {"role": "tool", "content": "1"}],
                                                   generation=True), add_special_tokens=False)
        alone = self.tokenizer.encode(self._turn("1"), add_special_tokens=False)
        if not pre.strip() or whole[len(whole) - len(alone):] != alone:
            raise ValueError(f"tools.syntax=hermes: the chat template's tool turn {pre!r} does "
                             "not start at a token boundary (a special token such as "
                             "<|im_end|>), so its ids alone differ from the template's")
        return pre, post

    def _end_of_turn(self, pre: str) -> str:
        """The tool turn's first token (the model writes it to end a turn of calls):
        refused unless it is a control token that starts ``pre`` at a token boundary."""
        ids = self.tokenizer.encode(pre, add_special_tokens=False)
        first = self.tokenizer.decode(ids[:1], skip_special_tokens=False)
        if (not pre.startswith(first) or first not in control_texts(self.tokenizer)
                or self.tokenizer.encode(pre[len(first):], add_special_tokens=False) != ids[1:]):
            raise ValueError(f"tools.parallel_calls: the chat template's tool turn {pre!r} "
                             "does not start with an end-of-turn token the model can write")
        return first

    def _dangerous(self) -> tuple[str, ...]:
        """Texts untrusted text must not contain (tags.defuse): the tokenizer's special and
        added tokens, closing tags of the template's tool turn (they would end the result
        early), and ``</result>``: SFT traces keep outputs in ARPO's blocks, where it is
        already defused, so the rollout defuses it too and both insert the same ids."""
        found = set(control_texts(self.tokenizer)) | {"</result>"}
        found |= set(_CLOSING_TAG.findall(self._turn(_SENTINEL).split(_SENTINEL)[-1]))
        return tuple(sorted(found, key=lambda t: (-len(t), t)))

    def _renders_tools(self) -> bool:
        messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
        tools = [s.chat_tool() for s in self.specs.values()]
        return bool(tools) and self._render(messages, tools) != self._render(messages)

    # ------------------------------------------------------------------ the protocol
    def results_text(self, texts: list[str]) -> str:
        """The inserted text for the results of one turn's calls, in order: the template's
        tool messages (with parallel calls, from after ``end_of_turn``, which the model
        wrote); control tokens in each output defused, as arpo's ``</result>`` is, so
        printed text cannot end the turn or forge one."""
        turn = self._turns([defuse(t, self.literals) for t in texts])
        return turn[len(self.end_of_turn):]

    def result_text(self, text: str) -> str:
        return self.results_text([text])

    def result_ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(self.result_text(text), add_special_tokens=False)

    def call_text(self, name: str, args: str) -> str:
        spec = self.specs[name]
        props = list(spec.parameters.get("properties", {}))
        arguments = {props[0]: args} if len(props) == 1 else json.loads(args)
        body = json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False)
        return f"{CALL_OPEN}\n{body}\n{CALL_CLOSE}{self.end_of_turn}"

    def prompt(self, system: str | None) -> tuple[str | None, list[dict] | None]:
        """(system prompt, ``tools=`` for the template). A template that ignores
        ``tools=`` (the tiny model's ChatML) gets Qwen's tools block in the system prompt.
        The schemas' text (an MCP server's) is defused, as a result is."""
        tools = [defuse_json(s.chat_tool(), self.literals) for s in self.specs.values()]
        if not tools or self.template_renders_tools:
            return system, tools or None
        block = "".join("\n" + json.dumps(t, ensure_ascii=False) for t in tools)
        return (system or "") + _TOOLS_INTRO + block + _TOOLS_OUTRO, None

    def find_call(self, round_text: str) -> ToolCall | None:
        """The JSON call that ended the round; a call that cannot run carries ``error``
        (what the model is told, as a serving stack's tool executor would say)."""
        text = round_text.rstrip()
        if not text.endswith(CALL_CLOSE):
            return None
        start = text.rfind(CALL_OPEN, 0, len(text) - len(CALL_CLOSE))
        if start < 0:
            return ToolCall("", text[-200:], f"Error: {CALL_CLOSE} without {CALL_OPEN}; write "
                            f'{CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}')
        return self._read(text[start + len(CALL_OPEN):len(text) - len(CALL_CLOSE)].strip())

    def find_calls(self, round_text: str) -> list[ToolCall]:
        """Every call of the turn the round ended (``find_call``'s one with
        ``tools.parallel_calls=1``); calls past ``max_calls`` are answered with an error."""
        if self.max_calls == 1:
            return [c] if (c := self.find_call(round_text)) is not None else []
        text = round_text.rstrip()
        if not text.endswith(self.end_of_turn):
            return []  # the turn ended with an answer, or the round ran out of tokens
        text = text[:-len(self.end_of_turn)].rstrip()
        if not text.endswith(self.call_close):
            return []
        return self._limited(self._turn_calls(text))

    def _turn_calls(self, text: str) -> list[ToolCall]:
        bodies = _BLOCK.findall(text[text.find(CALL_OPEN):]) if CALL_OPEN in text else []
        if not bodies:
            return [self.find_call(text)]  # </tool_call> without <tool_call>: its error
        return [self._read(body.strip()) for body in bodies]

    def _limited(self, calls: list[ToolCall]) -> list[ToolCall]:
        """The first ``max_calls`` calls; each further one answered with an error."""
        over = f"Error: at most {self.max_calls} tool calls per turn"
        return calls[:self.max_calls] + [ToolCall(c.name, c.args, over)
                                         for c in calls[self.max_calls:]]

    def _read(self, body: str) -> ToolCall:
        try:
            obj = json.loads(body)
        except ValueError as exc:
            return ToolCall("", body, f"Error: the tool call is not valid JSON ({exc}); "
                            'write {"name": ..., "arguments": {...}}')
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return ToolCall("", body, 'Error: a tool call is {"name": ..., "arguments": {...}}')
        return self._checked(obj["name"], obj.get("arguments", {}), body)

    def _checked(self, name: str, arguments: Any, body: str) -> ToolCall:
        """The call to ``name`` with ``arguments`` (parsed), or an error naming what is
        wrong: an unknown tool, arguments the tool's schema rejects, a schema that cannot
        be checked."""
        spec = self.specs.get(name)
        if spec is None:
            known = ", ".join(self.specs) or "none"
            return ToolCall(name, body, f"Error: unknown tool {name!r} (available: {known})")
        try:
            problem = _argument_problem(spec, arguments)
        except Exception as exc:  # a schema jsonschema cannot use: the call fails, not the rollout
            first = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
            return ToolCall(name, body, f"Error: the schema of {name} cannot be checked ({first})")
        if problem:
            return ToolCall(name, body, f"Error: invalid arguments for {name}: {problem}")
        return ToolCall(name, spec.call_text(arguments))


def _argument_problem(spec: ToolSpec, arguments: Any) -> str:
    if not isinstance(arguments, dict):
        return f"arguments must be a JSON object, got {type(arguments).__name__}"
    import jsonschema  # jsonschema: heavy (about 0.5 s), for hermes calls only

    error = jsonschema.exceptions.best_match(
        jsonschema.validators.validator_for(spec.parameters)(spec.parameters)
        .iter_errors(arguments))
    if error is None:
        return ""
    where = "/".join(str(p) for p in error.absolute_path)
    return f"{where}: {error.message}" if where else error.message
