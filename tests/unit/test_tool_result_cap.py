"""The one result cap (``tools.max_result_chars``) every tool's result goes through in
the runner, and the pure parts of the MCP hardening (issue 36): the bounded line reader of
toolenv/mcp_transport.py, its decoding, and the input-schema check of toolenv/mcp_tools.py.
The servers themselves are in tests/integration/test_mcp_hardening.py."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from arpo_async.core.config import ToolsConfig
from toolenv.base import ToolResult, cap_text
from toolenv.cache import ToolCache
from toolenv.tool_classes import schema_problem
from toolenv.mcp_transport import LineReader, Oversized, parse
from toolenv.runner import ToolRunner


class Loud:
    """A custom tool whose answer is as long as its args say (an error from "fail ...")."""

    name, version, description = "loud", "v1", "answers at length"
    parameters = {"type": "object", "properties": {"n": {"type": "integer"}}}

    async def call(self, args: str) -> ToolResult:
        fail, _, n = args.rpartition(" ")
        return ToolResult("y" * int(n), ok=not fail, error="boom" if fail else "")


def test_cap_text_by_hand():
    assert cap_text("abc", 3) == ("abc", False)
    assert cap_text("abcd", 3) == ("abc\n... [result truncated at 3 characters]", True)


def test_the_config_default_is_the_runners():
    assert ToolsConfig().max_result_chars == 8192
    assert ToolRunner({}, None, 0, 1, 1.0, 0).max_result_chars == 8192


async def test_every_result_is_capped_counted_and_cached_capped(tmp_path):
    cache = ToolCache(tmp_path)
    runner = ToolRunner({"loud": Loud()}, cache, rate_per_s=0, concurrency=1, timeout_s=5,
                        retries=0, max_result_chars=10)
    try:
        short = await runner.call("loud", "10")
        assert (short.text, short.truncated) == ("y" * 10, False)
        long = await runner.call("loud", "5000000")
        assert long.truncated
        assert long.text == "y" * 10 + "\n... [result truncated at 10 characters]"
        assert cache.get("loud", "v1", "5000000") == long.text  # never cached whole
        hit = await runner.call("loud", "5000000")
        assert hit.cached and hit.text == long.text
        failed = await runner.call("loud", "fail 99")  # an error's text is capped too
        assert not failed.ok and failed.truncated and len(failed.text) < 60
        stats = runner.stats()
        assert (stats["truncated"], stats["loud.truncated"], stats["loud.calls"]) == (2, 2, 4)
    finally:
        await runner.close()


async def test_a_cached_entry_from_a_larger_cap_is_capped_when_read(tmp_path):
    cache = ToolCache(tmp_path)
    cache.set("loud", "v1", "50", "y" * 50)
    runner = ToolRunner({"loud": Loud()}, cache, rate_per_s=0, concurrency=1, timeout_s=5,
                        retries=0, max_result_chars=10)
    try:
        hit = await runner.call("loud", "50")
        assert hit.cached and hit.text.startswith("y" * 10 + "\n... [result truncated")
    finally:
        await runner.close()


def test_the_runner_refuses_a_cap_below_one():
    with pytest.raises(ValueError, match="max_result_chars >= 1"):
        ToolRunner({}, None, 0, 1, 1.0, 0, max_result_chars=0)


# ---------------------------------------------------------------- the bounded line reader
lines_st = st.lists(st.binary(max_size=300).map(lambda b: b.replace(b"\n", b"")), max_size=8)


@settings(max_examples=200, deadline=None)
@given(lines=lines_st, cuts=st.lists(st.integers(0, 3000), max_size=12),
       limit=st.integers(1, 200))
def test_lines_come_out_whole_or_oversized_however_the_stream_is_cut(lines, cuts, limit):
    stream = b"".join(line + b"\n" for line in lines)
    reader, out, start = LineReader(limit), [], 0
    for cut in sorted(c for c in cuts if c <= len(stream)) + [len(stream)]:
        out += reader.feed(stream[start:cut])
        start = cut
    assert len(out) == len(lines)
    for line, got in zip(lines, out):
        if len(line) <= limit:
            assert got == line
        else:
            assert isinstance(got, Oversized) and got.size == len(line)
            assert line.startswith(got.head) and line.endswith(got.tail)


def test_an_oversized_answer_names_its_request_first_or_last():
    filler = b'"' + b"x" * 5000 + b'"'
    python_sdk = b'{"jsonrpc":"2.0","id":7,"result":{"text":' + filler + b"}}\n"
    ts_sdk = b'{"result":{"text":' + filler + b',"id":3},"jsonrpc":"2.0","id":"r-9"}\n'
    nested_only = b'{"result":{"text":' + filler + b',"id":3}}\n'
    reader = LineReader(1000)
    found = [item.request_id() for item in reader.feed(python_sdk + ts_sdk + nested_only)]
    assert found == [7, "r-9", None]
    error = parse(LineReader(100).feed(python_sdk)[0], 100).message
    assert error.id == 7 and "over the limit of 100 bytes" in error.error.message


def test_bytes_that_are_not_utf8_cost_a_character_or_the_line():
    good = json.dumps({"jsonrpc": "2.0", "id": 1, "result": {"content": []}}).encode()
    inside = good.replace(b"[]", b'[{"type": "text", "text": "a\xffb"}]')
    assert parse(b"\xff\xfe not json", 100).__class__.__name__ == "ValidationError"
    assert parse(inside, 1000).message.result["content"][0]["text"] == "a\ufffdb"
    assert parse(b"   ", 100) is None


# ---------------------------------------------------------------- input schemas
@pytest.mark.parametrize("schema, needle", [
    ({"type": "object", "properties": {"q": {"type": "string", "pattern": "(?P<"}}}, "regex"),
    ({"type": "object", "properties": {"q": {"type": "strin"}}}, "SchemaError"),
    ({"type": "object", "properties": {"q": {"$ref": "#/$defs/nowhere"}}}, "PointerToNowhere"),
    ({"type": "object", "properties": {"q": {"minimum": "a"}}}, "SchemaError"),
    ({"type": "object", "properties": 5}, "SchemaError"),
    ({"type": "object", "patternProperties": {"[": {}}}, "regex"),
    ({"type": "array"}, 'type "object"'),
    ([], 'type "object"'),
])
def test_a_schema_calls_cannot_be_checked_against_is_named(schema, needle):
    assert needle in schema_problem(schema)


def test_a_custom_tool_with_such_a_schema_is_refused_before_the_run():
    from toolenv.tool_classes import tool_class_problem

    class Bad(Loud):
        parameters = {"type": "object", "properties": {"q": {"type": "strin"}}}

    assert tool_class_problem(Loud) == ""
    assert tool_class_problem(Bad).startswith("parameters: a JSON schema that calls cannot")


def test_usable_schemas_pass():
    assert schema_problem({"type": "object", "properties": {
        "q": {"type": "string", "pattern": "^a+$", "default": {"pattern": "("}},
        "r": {"$ref": "#/$defs/r"}}, "$defs": {"r": {"type": "integer"}}}) == ""
    assert schema_problem({"type": "object", "properties": {}}) == ""
