"""Prompt sources for actors: the built-in arithmetic task, data files, and the
synthetic tool suite. A source yields ``Prompt``s (question, gold answers, chat-templated
token ids) from a seeded generator and scores a finished response.

The arithmetic task ("What is 3 + 4?") is the smallest verifiable task: the reward is
exact match of the final number (the ``\\boxed{}`` content when present, else the last
number in the text), never a constant.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from toolenv.syntax import build_syntax
from toolenv.tags import Markup, last_boxed
from toolenv.tasks.data import Example, load_examples
from toolenv.tasks.rewards import score_response
from toolenv.tasks.suite import SYSTEM_PROMPT, SuiteSpec, make_tasks

ARITH_SYSTEM = "Answer with the final number in \\boxed{}."
# The synthetic suite's prompt teaches ARPO's tags; under tools.syntax=hermes the tools
# are described by the chat template (syntax.prompt), so the prompt keeps the rest.
HERMES_SUITE_SYSTEM = ("Call the tools when they help: python runs code, search searches "
                       "documents. End with <answer>\\boxed{}</answer>.")

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass
class Prompt:
    id: str
    question: str
    answers: list[str]
    kind: str  # "math" | "qa" | "arith"
    tokens: list[int] = field(default_factory=list)
    system_prompt: str | None = None
    meta: dict = field(default_factory=dict)


def arith_score(response: str, answers: list[str]) -> float:
    """1.0 when the final number equals the gold answer, else 0.0."""
    boxed = last_boxed(response)
    found = _NUMBER.findall(boxed if boxed is not None else response)
    return 1.0 if found and found[-1] in answers else 0.0


class PromptSource:
    """Yields prompts forever (cycling through a shuffled order) and scores responses."""

    def __init__(self, cfg, tokenizer, stream: int = 0):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self._seed = [cfg.task.seed, cfg.run.seed, stream]
        self.rng = np.random.default_rng(self._seed)
        self.items = self._load()
        self.syntax = build_syntax(cfg.tools, tokenizer, cfg.model.chat_template_kwargs)
        self.order = self.rng.permutation(len(self.items))
        self.pos = 0
        self.epoch = 0  # permutations used up: position = epoch * len(items) + pos
        self._orders: dict[int, np.ndarray] = {}  # prompt_at's permutations, by epoch
        self.skipped_long = 0

    def _load(self) -> list[Prompt]:
        task = self.cfg.task
        if task.name == "arith":
            gen = np.random.default_rng(task.seed)
            a = gen.integers(0, 10, task.num_prompts)
            b = gen.integers(0, 10, task.num_prompts)
            return [Prompt(f"arith-{i}", f"What is {x} + {y}?", [str(x + y)], "arith",
                           system_prompt=ARITH_SYSTEM) for i, (x, y) in enumerate(zip(a, b))]
        if task.name == "file":
            return [Prompt(e.id, e.question, list(e.answers), e.kind,
                           system_prompt=e.system_prompt, meta={**e.meta, "row": e.row})
                    for e in load_examples(task.data, on_bad_row=task.on_bad_row)]
        if task.name == "synthetic_tools":
            # The same items as rl.jsonl of `python -m arpo_async.jobs.synthetic` with this seed.
            return synthetic_prompts(task.seed, task.num_prompts)
        raise ValueError(f"task.name: {task.name!r} is not available yet")

    def encode(self, prompt: Prompt) -> Prompt:
        prompt.tokens = encode_prompt(self.tokenizer, prompt.system_prompt, prompt.question,
                                      self.syntax)
        return prompt

    @property
    def markup(self) -> Markup:
        """The tool-call blocks responses are scored with (``tools.syntax``)."""
        return self.syntax.markup

    @property
    def max_tokens(self) -> int:
        """The longest prompt a rollout takes: ``sampling.max_prompt_tokens`` when set,
        else one token short of ``model.max_model_len`` (room for at least one new token)."""
        limit = self.cfg.sampling.max_prompt_tokens
        return self.cfg.model.max_model_len - 1 if limit is None else limit

    def too_long(self, prompt: Prompt) -> bool:
        """Encodes ``prompt`` when needed; True when it exceeds ``max_tokens``."""
        if not prompt.tokens:
            self.encode(prompt)
        return len(prompt.tokens) > self.max_tokens

    def next(self) -> Prompt:
        """The next prompt in this stream's order; prompts longer than ``max_tokens``
        (``sampling.max_prompt_tokens``, else what ``model.max_model_len`` leaves room
        for) are skipped and counted, never sent to the engine."""
        limit = self.max_tokens
        for _ in range(len(self.items)):
            if self.pos == len(self.order):
                self.order, self.pos = self.rng.permutation(len(self.items)), 0
                self.epoch += 1
            prompt = self.items[int(self.order[self.pos])]
            self.pos += 1
            if not self.too_long(prompt):
                return prompt
            self.skipped_long += 1
        raise ValueError(f"every prompt is longer than {limit} tokens (sampling.max_prompt_tokens"
                         f"={self.cfg.sampling.max_prompt_tokens}, model.max_model_len="
                         f"{self.cfg.model.max_model_len})")

    @property
    def position(self) -> int:
        """Prompts drawn from this stream so far (skipped ones included)."""
        return self.epoch * len(self.items) + self.pos

    def seek(self, position: int) -> None:
        """Continue as if ``position`` prompts had been drawn: the data position a
        restarted actor resumes from (``saved_position``)."""
        if position < 0:
            raise ValueError(f"seek: position must be >= 0, got {position}")
        self.rng = np.random.default_rng(self._seed)
        self.epoch, self.pos = divmod(position, len(self.items))
        for _ in range(self.epoch + 1):  # the permutations of every epoch so far, in order
            self.order = self.rng.permutation(len(self.items))

    def prompt_at(self, position: int) -> Prompt | None:
        """The prompt ``next`` drew (or will draw) at stream ``position``, without moving
        the stream; None where that prompt is longer than ``max_tokens`` (``next`` passes
        over it). For an actor drawing again a prompt the learner lost."""
        if position < 0:
            raise ValueError(f"prompt_at: position must be >= 0, got {position}")
        epoch, index = divmod(position, len(self.items))
        if epoch not in self._orders:
            rng = np.random.default_rng(self._seed)
            for _ in range(epoch + 1):  # the permutations in the order next() makes them
                order = rng.permutation(len(self.items))
            self._orders[epoch] = order
        prompt = self.items[int(self._orders[epoch][index])]
        return None if self.too_long(prompt) else prompt

    def score(self, response: str, prompt: Prompt) -> tuple[float, float]:
        """(reward, correctness) of one response."""
        if prompt.kind == "arith":
            s = arith_score(response, prompt.answers)
            return s, s
        ex = Example(prompt.id, prompt.question, prompt.answers, prompt.kind)
        result = score_response(response, ex, markup=self.markup)
        return result.reward, result.correct


def encode_prompt(tokenizer, system: str | None, question: str, syntax=None) -> list[int]:
    """The chat-templated prompt ids with the generation prompt. With a syntax, the tools
    reach the prompt its way (``ToolSyntax.prompt``: hermes through the template's
    ``tools=``, or Qwen's tools block in the system prompt for a template without one) and
    its chat-template arguments (``model.chat_template_kwargs``: Qwen3's
    ``enable_thinking``)."""
    tools, extra = None, {}
    if syntax is not None:
        extra = syntax.template_kwargs
        if syntax.templated and system == _suite_system():
            system = HERMES_SUITE_SYSTEM
        system, tools = syntax.prompt(system)
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": question})
    ids = tokenizer.apply_chat_template(messages, tools=tools, tokenize=True,
                                        add_generation_prompt=True, **extra)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return [int(t) for t in ids]


def _suite_system() -> str:
    return SYSTEM_PROMPT


def synthetic_prompts(seed: int, n: int) -> list[Prompt]:
    """The RL split as ``toolenv.tasks.prompts.Prompt``s (task.name=synthetic_tools); the same
    items as rl.jsonl written with this seed and --rl n (and the default entity count)."""
    tasks = make_tasks(SuiteSpec(seed=seed, rl=n), "rl")
    return [Prompt(t.id, t.question, [t.answer], "math", system_prompt=SYSTEM_PROMPT,
                   meta={"task": t.kind}) for t in tasks]
