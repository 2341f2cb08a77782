"""The local tiny model factory: deterministic files, a tokenizer that keeps the ARPO
format compact, a Qwen3 config vLLM's CPU backend accepts, and ensure_model's rules."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from arpo_async.core.config import ModelConfig
from arpo_async.jobs.tiny_model import (
    ARPO_TAGS,
    SPECIAL_TOKENS,
    build_tiny_model,
    ensure_model,
    generate_corpus,
)

REPO = Path(__file__).resolve().parents[2]
SMALL = {"hidden": 64, "layers": 1, "heads": 2, "vocab": 600}  # head_dim 32, builds in ~1 s


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("m") / "tiny")


@pytest.fixture(scope="module")
def tok(built):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(built)


@pytest.mark.parametrize("tags_as_text", [False, True])
def test_same_seed_same_bytes_other_seed_other_weights(tmp_path, tags_as_text):
    a = build_tiny_model(tmp_path / "a", **SMALL, seed=3, tags_as_text=tags_as_text)
    b = build_tiny_model(tmp_path / "b", **SMALL, seed=3, tags_as_text=tags_as_text)
    c = build_tiny_model(tmp_path / "c", **SMALL, seed=4)
    names = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()


def test_corpus_is_seeded():
    assert list(generate_corpus(1, 50)) == list(generate_corpus(1, 50))
    assert list(generate_corpus(1, 50)) != list(generate_corpus(2, 50))


def test_building_leaves_the_global_rng_alone(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    build_tiny_model(tmp_path / "m", **SMALL)
    assert torch.equal(torch.rand(3), expected)


def test_tokenizer_specials_tags_and_digits(tok):
    assert len(tok) == 2048
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    for t in SPECIAL_TOKENS + ARPO_TAGS:
        ids = tok(t, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1, t
    text = "<think>ok</think><python>print(12*34)</python><result>408</result>"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    # Tags are not special: decoding with skip_special_tokens keeps them.
    assert tok.decode(ids, skip_special_tokens=True) == text
    pieces = [tok.decode([i]) for i in ids]
    assert pieces[pieces.index("(") + 1 : pieces.index("(") + 6] == ["1", "2", "*", "3", "4"]
    assert pieces[pieces.index("<result>") + 1 : pieces.index("</result>")] == ["4", "0", "8"]


def test_chat_template_is_chatml(tok):
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "Q?"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nQ?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
    plain = tok.apply_chat_template(msgs, add_generation_prompt=False, tokenize=False)
    assert not plain.endswith("assistant\n")


def test_arpo_format_tokenises_compactly(tok):
    traj = ("<think>I need to compute the product first</think>\n<python>print(12*34)</python>"
            "\n<result>408</result>\n<answer>The answer is \\boxed{408}</answer>")
    n = len(tok(traj, add_special_tokens=False)["input_ids"])
    assert n <= 42  # byte-level with no merges would take ~130


def test_model_config_and_forward(built, tok):
    from transformers import AutoModelForCausalLM, GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(built)
    cfg = model.config
    assert cfg.model_type == "qwen3" and cfg.vocab_size == len(tok)
    assert cfg.head_dim == 32 and cfg.num_key_value_heads == 2
    assert cfg.tie_word_embeddings is False
    assert model.get_input_embeddings().weight.data_ptr() != model.lm_head.weight.data_ptr()
    gen = GenerationConfig.from_pretrained(built)
    assert gen.eos_token_id == tok.eos_token_id and gen.pad_token_id == tok.pad_token_id
    logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, len(tok)) and torch.isfinite(logits).all()


def test_bad_shapes_and_existing_folder_are_refused(tmp_path):
    with pytest.raises(ValueError, match="head_dim"):
        build_tiny_model(tmp_path / "x", hidden=64, heads=4)
    with pytest.raises(ValueError, match="divide"):
        build_tiny_model(tmp_path / "x", hidden=128, heads=4, kv_heads=3)
    (tmp_path / "exists").mkdir()
    with pytest.raises(FileExistsError, match="exists"):
        build_tiny_model(tmp_path / "exists", **SMALL)


def test_ensure_model_rules(tmp_path, built, monkeypatch):
    cfg = ModelConfig(build_if_missing=False)
    assert ensure_model(built, cfg) == built  # an existing folder is used as is
    missing = tmp_path / "no" / "model"
    with pytest.raises(FileNotFoundError) as err:
        ensure_model(missing, cfg)
    assert str(err.value) == (f"model.path: {missing} does not exist "
                              "(set model.build_if_missing=true to build a tiny local model)")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        ensure_model(tmp_path / "empty", cfg)
    monkeypatch.chdir(tmp_path)
    assert str(ensure_model("Qwen/Qwen3-0.6B", cfg)) == "Qwen/Qwen3-0.6B"  # hub name passes
    small = ModelConfig(build_if_missing=True, tiny_hidden=64, tiny_layers=1, tiny_heads=2,
                        tiny_vocab=600, tiny_tags_as_text=True)
    out = ensure_model(tmp_path / "built", small)
    from transformers import AutoConfig, AutoTokenizer

    conf = AutoConfig.from_pretrained(out)
    assert (conf.hidden_size, conf.num_hidden_layers, conf.vocab_size) == (64, 1, 600)
    # model.tiny_tags_as_text reaches the builder: the tags are text
    assert len(AutoTokenizer.from_pretrained(out).encode("</python>")) > 1


def test_cli_builds_a_loadable_folder(tmp_path):
    out = tmp_path / "cli"
    cmd = [sys.executable, "-m", "arpo_async.jobs.tiny_model", str(out), "--hidden", "64",
           "--layers", "1", "--heads", "2", "--kv-heads", "1", "--vocab", "600", "--seed", "2",
           "--tags-as-text"]
    proc = subprocess.run(cmd, check=False, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().endswith(str(out))
    from transformers import AutoConfig, AutoTokenizer

    assert AutoConfig.from_pretrained(out).num_key_value_heads == 1
    tok = AutoTokenizer.from_pretrained(out)
    assert all(len(tok.encode(t, add_special_tokens=False)) > 1 for t in ARPO_TAGS)
