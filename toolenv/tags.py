"""Parsing of the ARPO response format (pure: standard library only).

A response looks like::

    <think> reasoning ... </think>
    <python> code </python>
    <result> tool output (inserted by the actor, never sampled) </result>
    <search> query </search>
    <result> snippets </result>
    <answer> ... \\boxed{final} ... </answer>

Generation stops at a closing tool tag or at ``</answer>`` (``STOP_TAGS``); the engine
must keep the stop string in its output so ``find_tool_call`` can see which call ended
the round. Tool calls and results may sit inside ``<think>`` (ARPO's prompt lets the
model call tools while thinking); every other nesting is malformed. The bodies of tool
calls and results are opaque: a search snippet that happens to contain ``<answer>`` is
text, not a tag.

The tag of a tool is its name (``<calculator>...</calculator>`` for a tool named
``calculator``, tools.custom): every function takes the configured tool names as
``tools`` (default: python and search, the module constants). The scanner itself works on
a ``Markup``, the opaque blocks of a syntax, so the Hermes syntax (toolenv/syntax.py:
``<tool_call>`` JSON calls answered by the chat template's tool message) shares it.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache

DEFAULT_TOOLS = ("python", "search")
TOOL_TAGS = {name: (f"<{name}>", f"</{name}>") for name in DEFAULT_TOOLS}
STOP_TAGS = ["</python>", "</search>", "</answer>"]
RESERVED = frozenset({"think", "result", "answer", "tool_call", "tool_response"})
TAG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_-]*")  # a tool's name, also its ARPO tag

_FENCE_RE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?[ \t]*```\s*$", re.DOTALL)
_BOXED = "\\boxed{"


@dataclass
class ToolCall:
    name: str
    args: str  # the text the tool is called with (toolenv/base.py)
    error: str = ""  # set when the call cannot run (bad JSON, unknown tool, bad arguments)


@dataclass(frozen=True)
class Markup:
    """The opaque blocks of one tool-call syntax: calls and results (bodies are content).

    ``calls``: (kind, open, close) per call block; ``result``: (open, close) of a tool
    result; ``json_calls``: the tool's name is in the call's body, not its tag: the body is
    ``{"name": ..., "arguments": ...}``, or, with ``name_regex``, the name is that
    pattern's first group in the body (a family's own format: toolenv/vllm_syntax.py);
    ``tools``: the configured tool names.
    """

    calls: tuple[tuple[str, str, str], ...]
    result: tuple[str, str]
    tools: tuple[str, ...]
    json_calls: bool = False
    name_regex: str = ""
    result_label: tuple[str, str] = ("<result>", "</result>")  # how errors name the result


@dataclass
class _Block:
    tag: str
    start: int  # index of the opening text
    end: int  # index just past the closing text
    body: str


def tool_tags(tools: Iterable[str] | None = None) -> dict[str, tuple[str, str]]:
    """Opening and closing tag of each tool (default: python and search)."""
    return TOOL_TAGS if tools is None else {name: (f"<{name}>", f"</{name}>") for name in tools}


def stop_tags(tools: Iterable[str] | None = None) -> list[str]:
    """Where a round stops: each tool's closing tag, then ``</answer>``."""
    return [close for _, close in tool_tags(tools).values()] + ["</answer>"]


@lru_cache(maxsize=64)
def arpo_markup(tools: tuple[str, ...] = DEFAULT_TOOLS) -> Markup:
    """The ARPO tags of these tools (a tuple, so the result can be cached)."""
    calls = tuple((name, f"<{name}>", f"</{name}>") for name in tools)
    return Markup(calls=calls, result=("<result>", "</result>"), tools=tuple(tools))


def _markup(markup: Markup | None, tools: Iterable[str] | None) -> Markup:
    if markup is not None:
        return markup
    return arpo_markup(DEFAULT_TOOLS if tools is None else tuple(tools))


def find_tool_call(round_text: str, tools: Iterable[str] | None = None) -> ToolCall | None:
    """The tool call that ended a generation round, or None.

    The round must end with a closing tool tag (trailing whitespace allowed); the call is
    the body between the last matching opening tag and that closing tag. Markdown code
    fences around the body are removed; python code is dedented, other bodies stripped.
    """
    text = round_text.rstrip()
    for name, (open_tag, close_tag) in tool_tags(tools).items():
        if not text.endswith(close_tag):
            continue
        body_end = len(text) - len(close_tag)
        start = text.rfind(open_tag, 0, body_end)
        if start < 0:
            return None
        body = _strip_fence(text[start + len(open_tag):body_end])
        if name == "python":
            body = textwrap.dedent(body).strip("\n").rstrip()
        else:
            body = body.strip()
        return ToolCall(name=name, args=body)
    return None


def _strip_fence(body: str) -> str:
    match = _FENCE_RE.match(body)
    return match.group(1) if match else body


def extract_answer(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` inside the last ``<answer>...</answer>``.

    Braces nest (``\\boxed{\\frac{1}{2}}`` gives ``\\frac{1}{2}``). None when there is no
    closed answer block or no balanced ``\\boxed{...}`` inside it.
    """
    start = text.rfind("<answer>")
    if start < 0:
        return None
    end = text.find("</answer>", start)
    if end < 0:
        return None
    return last_boxed(text[start + len("<answer>"):end])


def last_boxed(text: str) -> str | None:
    """The content of the last balanced ``\\boxed{...}`` in ``text``, or None."""
    pos = text.rfind(_BOXED)
    while pos >= 0:
        content = _balanced(text, pos + len(_BOXED))
        if content is not None:
            return content
        pos = text.rfind(_BOXED, 0, pos)
    return None


def _balanced(text: str, start: int) -> str | None:
    """Text from ``start`` up to the brace that closes an already-open ``{``."""
    depth = 1
    for i in range(start, len(text)):
        char = text[i]
        if char == "{":
            depth += 1
        elif char == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


@lru_cache(maxsize=64)
def _lexicon(markup: Markup) -> tuple[re.Pattern, dict[str, tuple[str, bool, str, str, str]]]:
    """The scanner's regex and, per literal: (block kind, closing?, close text, open
    label, close label). Longer literals first, so a prefix never shadows its extension."""
    table: dict[str, tuple[str, bool, str, str, str]] = {}
    for tag in ("think", "answer"):
        table[f"<{tag}>"] = (tag, False, f"</{tag}>", f"<{tag}>", f"</{tag}>")
        table[f"</{tag}>"] = (tag, True, f"</{tag}>", f"<{tag}>", f"</{tag}>")
    for kind, open_, close in markup.calls:
        table[open_] = (kind, False, close, open_, close)
        table[close] = (kind, True, close, open_, close)
    (r_open, r_close), (l_open, l_close) = markup.result, markup.result_label
    table[r_open] = ("result", False, r_close, l_open, l_close)
    table.setdefault(r_close, ("result", True, r_close, l_open, l_close))
    pattern = re.compile("|".join(re.escape(t) for t in sorted(table, key=len, reverse=True)))
    return pattern, table


def _scan(text: str, markup: Markup) -> tuple[list[_Block], str]:
    """Top-level and think-nested blocks in order, plus the first format error ("" if none).

    Opaque blocks (tool calls, results) are skipped whole, so tags inside them are ignored.
    """
    pattern, table = _lexicon(markup)
    blocks: list[_Block] = []
    think_start = -1
    pos = 0
    while True:
        match = pattern.search(text, pos)
        if match is None:
            break
        tag, closing, close_text, open_label, close_label = table[match.group(0)]
        if tag != "think":
            if closing:
                return blocks, f"{close_label} without {open_label}"
            if tag == "answer" and think_start >= 0:
                return blocks, "<answer> inside <think>"
            close = text.find(close_text, match.end())
            if close < 0:
                return blocks, f"unclosed {open_label}"
            end = close + len(close_text)
            blocks.append(_Block(tag, match.start(), end, text[match.end():close]))
            pos = end
            continue
        # <think> ... </think>: may hold tool calls and results, never another think.
        if not closing:
            if think_start >= 0:
                return blocks, "nested <think>"
            think_start = match.start()
        else:
            if think_start < 0:
                return blocks, "</think> without <think>"
            blocks.append(_Block("think", think_start, match.end(), ""))
            think_start = -1
        pos = match.end()
    if think_start >= 0:
        return blocks, "unclosed <think>"
    return blocks, ""


def validate_format(text: str, tools: Iterable[str] | None = None,
                    markup: Markup | None = None) -> tuple[bool, str]:
    """Check a whole response: (ok, reason). The reason names the first problem.

    Rules: tags balanced and not nested (tool calls and results may sit inside
    <think>); every result directly follows a tool call; exactly one
    <answer>...</answer>, at the end (only whitespace after it), holding a balanced
    \\boxed{...}. ``markup`` (a syntax's blocks) takes precedence over ``tools``.
    """
    markup = _markup(markup, tools)
    blocks, error = _scan(text, markup)
    if error:
        return False, error
    answers = [b for b in blocks if b.tag == "answer"]
    if len(answers) != 1:
        return False, f"expected exactly one <answer> block, found {len(answers)}"
    if text[answers[0].end:].strip():
        return False, "text after </answer>"
    kinds = {kind for kind, _, _ in markup.calls}
    ordered = sorted(blocks, key=lambda b: b.start)
    for prev, block in zip([None, *ordered], ordered):
        if block.tag != "result":
            continue
        if prev is None or prev.tag not in kinds or text[prev.end:block.start].strip():
            return False, f"{markup.result_label[0]} not directly after a tool call"
    if extract_answer(text) is None:
        return False, "answer has no \\boxed{...}"
    return True, "ok"


def tools_used(text: str, tools: Iterable[str] | None = None,
               markup: Markup | None = None) -> set[str]:
    """Names of the tools called in a response (calls inside results do not count; a
    JSON call counts when it names a configured tool)."""
    markup = _markup(markup, tools)
    blocks, _ = _scan(text, markup)
    kinds = {kind for kind, _, _ in markup.calls}
    calls = [b for b in blocks if b.tag in kinds]
    if not markup.json_calls:
        return {b.tag for b in calls}
    if markup.name_regex:
        found = (re.search(markup.name_regex, b.body) for b in calls)
        names = {m.group(1) for m in found if m}
    else:
        names = {json_call_name(b.body) for b in calls}
    return names & set(markup.tools)


def json_call_name(body: str) -> str:
    """The ``name`` of a JSON tool call, or "" when the body is not one."""
    try:
        obj = json.loads(body)
    except ValueError:
        return ""
    name = obj.get("name") if isinstance(obj, dict) else None
    return name if isinstance(name, str) else ""


def control_texts(tokenizer: object) -> tuple[str, ...]:
    """The texts a tokenizer turns into control tokens wherever they appear: its special
    tokens and every added token, special or not (``<|im_start|>`` is added but not in
    the tiny tokenizer's ``all_special_tokens``; ARPO's tags are added, not special).
    Longest first. Texts of one character or of whitespace only are left out: no break
    can split them, and they are not chat control (docs/tools.md states the limit)."""
    found = set(getattr(tokenizer, "all_special_tokens", None) or ())
    for token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).values():
        found.add(getattr(token, "content", str(token)))
    if hasattr(tokenizer, "get_added_vocab"):
        found |= set(tokenizer.get_added_vocab())
    return tuple(sorted((t for t in found if len(t) > 1 and t.strip()),
                        key=lambda t: (-len(t), t)))


@lru_cache(maxsize=64)
def _literal_pattern(literals: frozenset[str]) -> re.Pattern | None:
    # a literal of one character cannot be split, and one of spaces would grow forever
    ordered = sorted((t for t in literals if len(t) > 1 and t.strip(" ")),
                     key=lambda t: (-len(t), t))
    return re.compile("|".join(map(re.escape, ordered))) if ordered else None


def _break(literal: str) -> str:
    """``</tag>`` -> ``</ tag>``, ``<|im_end|>`` -> ``< |im_end|>``: still readable, no
    longer the literal (the convention ``format_result`` set for ``</result>``)."""
    cut = 2 if literal.startswith("</") else 1
    return literal[:cut] + " " + literal[cut:]


def defuse(text: str, literals: Iterable[str]) -> str:
    """Untrusted text (a tool's output, an MCP tool's description) with every occurrence
    of ``literals`` (``control_texts`` of the tokenizer, plus a syntax's closing tags)
    broken by a space, so the tokenizer reads it as text and never as a control token
    that would end the turn or forge one. The one owner of this rule: every path that
    encodes untrusted text (rollout, SFT, prompt) calls it. Repeated until nothing
    matches (breaking one literal can leave an overlapping one whole), so it is
    idempotent: a trace's already defused output defuses to itself."""
    pattern = _literal_pattern(frozenset(literals))
    if pattern is None:
        return text
    for _ in range(len(text) + 2):  # each pass breaks at least one match for good
        out = pattern.sub(lambda m: _break(m.group(0)), text)
        if out == text:
            return out
        text = out
    raise ValueError("defuse: the literals keep re-forming each other (a literal with "
                     "inner spaces?)")


def defuse_json(obj: object, literals: Iterable[str]) -> object:
    """``defuse`` on every string (keys and values) of a JSON-like object: a tool's
    schema as it reaches the prompt."""
    if isinstance(obj, str):
        return defuse(obj, literals)
    if isinstance(obj, dict):
        return {defuse_json(k, literals): defuse_json(v, literals) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [defuse_json(v, literals) for v in obj]
    return obj


def format_result(text: str) -> str:
    """Wrap a tool's output for insertion after its call.

    A literal ``</result>`` in the output is defused (``</ result>``) so the block cannot
    be closed early by what a tool printed; ``ArpoSyntax.result_text`` first defuses the
    tokenizer's control tokens too.
    """
    return "\n<result>\n" + defuse(text, ("</result>",)) + "\n</result>\n"


def unwrap_result(block: str) -> str:
    """The tool output inside a ``format_result`` block (``</ result>`` stays defused)."""
    head, tail = "\n<result>\n", "\n</result>\n"
    if not (block.startswith(head) and block.endswith(tail)):
        raise ValueError(f"not a formatted result: {block[:40]!r}")
    return block[len(head):len(block) - len(tail)]
