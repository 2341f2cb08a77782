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
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

TOOL_TAGS = {"python": ("<python>", "</python>"), "search": ("<search>", "</search>")}
STOP_TAGS = ["</python>", "</search>", "</answer>"]

_TAG_RE = re.compile(r"<(/?)(think|python|search|result|answer)>")
_OPAQUE = ("python", "search", "result")  # bodies are content, not markup
_FENCE_RE = re.compile(r"^\s*```[A-Za-z0-9_+-]*[ \t]*\n(.*?)\n?[ \t]*```\s*$", re.DOTALL)
_BOXED = "\\boxed{"


@dataclass
class ToolCall:
    name: str
    args: str


@dataclass
class _Block:
    tag: str
    start: int  # index of "<tag>"
    end: int  # index just past "</tag>"
    body: str


def find_tool_call(round_text: str) -> ToolCall | None:
    """The tool call that ended a generation round, or None.

    The round must end with a closing tool tag (trailing whitespace allowed); the call is
    the body between the last matching opening tag and that closing tag. Markdown code
    fences around the body are removed; python code is dedented, queries stripped.
    """
    text = round_text.rstrip()
    for name, (open_tag, close_tag) in TOOL_TAGS.items():
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


def _scan(text: str) -> tuple[list[_Block], str]:
    """Top-level and think-nested blocks in order, plus the first format error ("" if none).

    Opaque blocks (tool calls, results) are skipped whole, so tags inside them are ignored.
    """
    blocks: list[_Block] = []
    think_start = -1
    pos = 0
    while True:
        match = _TAG_RE.search(text, pos)
        if match is None:
            break
        closing, tag = match.group(1) == "/", match.group(2)
        if tag in _OPAQUE or tag == "answer":
            if closing:
                return blocks, f"</{tag}> without <{tag}>"
            if tag == "answer" and think_start >= 0:
                return blocks, "<answer> inside <think>"
            close_tag = f"</{tag}>"
            close = text.find(close_tag, match.end())
            if close < 0:
                return blocks, f"unclosed <{tag}>"
            end = close + len(close_tag)
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


def validate_format(text: str) -> tuple[bool, str]:
    """Check a whole response: (ok, reason). The reason names the first problem.

    Rules: tags balanced and not nested (tool calls and results may sit inside
    <think>); every <result> directly follows a tool call; exactly one
    <answer>...</answer>, at the end (only whitespace after it), holding a balanced
    \\boxed{...}.
    """
    blocks, error = _scan(text)
    if error:
        return False, error
    answers = [b for b in blocks if b.tag == "answer"]
    if len(answers) != 1:
        return False, f"expected exactly one <answer> block, found {len(answers)}"
    if text[answers[0].end:].strip():
        return False, "text after </answer>"
    ordered = sorted(blocks, key=lambda b: b.start)
    for prev, block in zip([None, *ordered], ordered):
        if block.tag != "result":
            continue
        if prev is None or prev.tag not in TOOL_TAGS or text[prev.end:block.start].strip():
            return False, "<result> not directly after a tool call"
    if extract_answer(text) is None:
        return False, "answer has no \\boxed{...}"
    return True, "ok"


def tools_used(text: str) -> set[str]:
    """Names of the tools called in a response (calls inside results do not count)."""
    blocks, _ = _scan(text)
    return {b.tag for b in blocks if b.tag in TOOL_TAGS}


def format_result(text: str) -> str:
    """Wrap a tool's output for insertion after its call.

    A literal ``</result>`` in the output is defused (``</ result>``) so the block cannot
    be closed early by what a tool printed.
    """
    return "\n<result>\n" + text.replace("</result>", "</ result>") + "\n</result>\n"
