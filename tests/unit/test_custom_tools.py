"""Your own tools (tools.custom): the example calculator through the real runner (cache,
timeout, retries, metrics), and the start-up errors for a bad import path, a class that
is not a tool and a duplicate name, each one line from the launcher's --dry-run."""

from __future__ import annotations

import textwrap

import pytest

from arpo_async.core.config import ConfigError, ToolsConfig, load_config
from arpo_async.jobs.preflight import prepare_run
from toolenv.runner import build_tools

CALC = "examples.tools.calculator:Calculator"
SPINE = "configs/spine.yaml"

# Classes that are almost tools, in a module the tests put on sys.path.
ALMOST = '''
import asyncio
from toolenv.base import ToolResult

class Base:
    name, description, version = "slow", "Sleeps, then answers.", "1"
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}

class Slow(Base):
    async def call(self, args):
        await asyncio.sleep(float(args))
        return ToolResult("done", ok=True)

class Flaky(Base):
    name, failures = "flaky", [1, 1]
    async def call(self, args):
        if self.failures:
            self.failures.pop()
            return ToolResult("HTTP 503", ok=False, error="http_503", transient=True)
        return ToolResult("fine", ok=True)

class SyncCall(Base):
    def call(self, args):
        return ToolResult("x", ok=True)

class NoSchema(Slow):
    parameters = None

class NeedsArgs(Slow):
    def __init__(self, url):
        self.url = url

class Breaks(Slow):
    def __init__(self):
        raise RuntimeError("no database at localhost:5432")

class Python(Slow):
    name = "python"

not_a_class = 3
'''


@pytest.fixture
def almost(tmp_path, monkeypatch):
    (tmp_path / "almost_tools.py").write_text(textwrap.dedent(ALMOST))
    monkeypatch.syspath_prepend(str(tmp_path))
    return "almost_tools"


async def test_example_tool_through_the_runner(tmp_path):
    runner = build_tools(ToolsConfig(custom=[CALC]), tmp_path)
    try:
        assert (await runner.call("calculator", "2*(3+4)")).text == "14"
        again = await runner.call("calculator", "2*(3+4)")
        bad = await runner.call("calculator", "__import__('os')")
    finally:
        await runner.close()
    assert again.cached and again.text == "14"
    assert not bad.ok and bad.text.startswith("ValueError: not arithmetic")
    stats = runner.stats()
    assert {k: stats[f"calculator.{k}"] for k in ("calls", "cache_hits", "errors")} == {
        "calls": 3, "cache_hits": 1, "errors": 1}
    assert stats["executed"] == 2


async def test_custom_tools_get_the_runners_timeout_and_retries(tmp_path, almost):
    cfg = ToolsConfig(custom=[f"{almost}:Slow", f"{almost}:Flaky"], timeout_s=0.3, retries=2)
    runner = build_tools(cfg, tmp_path)
    runner.backoff_s = 0.0
    try:
        late = await runner.call("slow", "30")  # would sleep 30 s: the timeout fires
        flaky = await runner.call("flaky", "")
    finally:
        await runner.close()
    assert late.error == "timeout" and flaky.ok and flaky.text == "fine"
    stats = runner.stats()
    assert (stats["slow.timeouts"], stats["retries"], stats["flaky.errors"]) == (1, 2, 0)


def test_rejected_calls_are_counted_not_run(tmp_path):
    runner = build_tools(ToolsConfig(custom=[CALC]), tmp_path)
    result = runner.reject("calculator", "Error: invalid arguments")
    runner.reject("made_up", "Error: unknown tool")
    stats = runner.stats()
    assert not result.ok and result.text == "Error: invalid arguments"
    assert (stats["calls"], stats["errors"], stats["invalid_calls"], stats["executed"]) == (
        2, 2, 2, 0)
    assert stats["calculator.errors"] == 1 and stats["invalid.calls"] == 1  # no made_up.* key
    runner.cache.close()


@pytest.mark.parametrize(("entry", "message"), [
    ("no_such_module:Tool", "tools.custom[0]=no_such_module:Tool: cannot import no_such_module "
     "(ModuleNotFoundError: No module named 'no_such_module')"),
    ("{m}:Missing", "tools.custom[0]={m}:Missing: module {m} has no Missing"),
    ("{m}", "tools.custom[0]={m}: expected module:Class"),
    ("{m}:not_a_class", "tools.custom[0]={m}:not_a_class: not_a_class is not a class"),
    ("{m}:SyncCall", "tools.custom[0]={m}:SyncCall: SyncCall does not follow the tool protocol "
     "(toolenv/base.py): call must be an async method"),
    ("{m}:NoSchema", "parameters must be a JSON schema"),
    ("{m}:NeedsArgs", "the class must be constructible without arguments"),
    ("{m}:Python", "tools.custom[0]={m}:Python: tool name 'python' is already taken by "
     "tools.enabled (python)"),
])
def test_bad_custom_tools_fail_at_start_up_in_one_line(almost, entry, message, capsys):
    from arpo_async.launch import main

    entry, message = entry.format(m=almost), message.format(m=almost)
    rc = main(["--dry-run", "--config", SPINE, "tools.enabled=[python]",
               f"tools.custom=[{entry}]"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: tools.custom[0]=") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_two_custom_tools_with_one_name(almost):
    cfg = load_config(SPINE, [f"tools.custom=[{almost}:Slow, {almost}:Slow]"])
    with pytest.raises(ConfigError, match=rf"^tools.custom\[1\]={almost}:Slow: tool name 'slow' "
                       rf"is already taken by tools.custom \({almost}:Slow\)$"):
        prepare_run(cfg, dry_run=True)


def test_reading_a_config_imports_no_tool_class():
    """Only the form of a tools.custom entry is checked while a config is read; the class
    is imported where the run is resolved (a config file names any module)."""
    cfg = load_config(SPINE, ["tools.custom=[no_such_module_anywhere:Tool]"])
    assert cfg.tools.custom == ["no_such_module_anywhere:Tool"]
    with pytest.raises(ConfigError, match=r"^tools.custom\[0\]=not_a_path: expected module:Class$"):
        load_config(SPINE, ["tools.custom=[not_a_path]"])


def test_a_constructor_that_fails_is_one_line(tmp_path, almost):
    with pytest.raises(ConfigError, match=rf"^tools.custom\[0\]={almost}:Breaks: constructing "
                       r"Breaks\(\) failed \(RuntimeError: no database at localhost:5432\)$"):
        build_tools(ToolsConfig(custom=[f"{almost}:Breaks"]), tmp_path)


def test_a_custom_tool_gets_its_tag_and_its_schema(tiny_model_dir):
    from transformers import AutoTokenizer

    from toolenv.syntax import build_syntax

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    arpo = build_syntax(ToolsConfig(enabled=["python"], custom=[CALC]), tok)
    assert arpo.stop_strings == ["</python>", "</search>", "</calculator>", "</answer>"]
    assert arpo.find_call("<calculator> 2+3 </calculator>").args == "2+3"
    assert "<calculator>...</calculator>: Evaluate" in arpo.prompt("S")[0]
    hermes = build_syntax(ToolsConfig(custom=[CALC], syntax="hermes"), tok)
    call = hermes.find_call('<tool_call>{"name": "calculator", "arguments": '
                            '{"expression": "2+3"}}</tool_call>')
    assert (call.name, call.args, call.error) == ("calculator", "2+3", "")
    assert '"name": "calculator"' in hermes.prompt("S")[0]


class _Scripted:
    """An engine that calls the calculator, then answers with what the result said."""

    version = 0

    def __init__(self, syn):
        self.syn, self.tok = syn, syn.tokenizer
        self.prompt_len = None  # the first request is the bare prompt

    async def generate(self, req):
        from actors.engines.base import GenResult

        self.prompt_len = self.prompt_len or len(req.prompt_tokens)
        if len(req.prompt_tokens) == self.prompt_len:
            reply = self.syn.call_text("calculator", "2*(3+4)")
        else:  # answer with the first number the tool result holds
            after = self.tok.decode(req.prompt_tokens[self.prompt_len:])
            number = after.split(self.syn.markup.result[0], 1)[1].strip().split("<")[0]
            reply = "<answer>\\boxed{" + number.strip() + "}</answer>"
        ids = self.tok.encode(reply, add_special_tokens=False)
        stop = next(s for s in self.syn.stop_strings if reply.endswith(s))
        return GenResult(ids, [0.0] * len(ids), [[0.0]] * len(ids), "stop", stop_reason=stop)

    async def close(self):
        pass


@pytest.mark.parametrize("syntax", ["arpo", "hermes"])
async def test_evaluation_with_a_custom_tool_in_both_syntaxes(tiny_model_dir, tmp_path,
                                                              monkeypatch, syntax):
    """jobs/evaluate.py end to end (prompts, rollout, runner, scoring, summary) with a
    scripted engine: the calculator is called once per sample, its result read, and both
    syntaxes score and count alike."""
    import json

    from arpo_async.jobs import evaluate as ev

    data = tmp_path / "q.jsonl"
    data.write_text(json.dumps({"id": 0, "question": "What is 2*(3+4)?", "answer": "14",
                               "ability": "math"}) + "\n")

    async def scripted(cfg, model_path, tokenizer, endpoint):
        from toolenv.syntax import build_syntax

        return _Scripted(build_syntax(cfg.tools, tokenizer))

    monkeypatch.setattr(ev, "_make_engine", scripted)
    cfg = load_config(SPINE, [f"model.path={tiny_model_dir}", f"tools.custom=[{CALC}]",
                              f"tools.syntax={syntax}", "model.max_model_len=1024"])
    summary = await ev.evaluate_async(cfg, data, k=2, out_dir=tmp_path / "out")
    assert (summary["pass@1"], summary["format_ok"], summary["tool_calls_per_sample"]) == (
        1.0, 1.0, 1.0)
    assert summary["tools"]["calculator.calls"] == 2 and summary["tools"]["errors"] == 0
    items = [json.loads(line) for line in (tmp_path / "out" / "items.jsonl").open()]
    assert all("14" in r for r in items[0]["responses"])
