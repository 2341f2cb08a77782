"""The mechanics of one trajectory: its rounds and its tool calls, whatever the group
policy decides about it.

A round ends at the end of a tool call, ``</answer>``, end of sequence or the length limit.
After a tool call the result is appended as token ids (loss mask 0, never sampled, never
re-tokenising what came before): ``<result>...</result>`` or the chat template's tool
message, as ``tools.syntax`` says (toolenv/syntax.py).

A tag that is several tokens (a tokenizer like Qwen's, ``--tags-as-text``) stops the
round through a stop *string*. The engine stops at the first stop string in the round's
text but keeps the token that completed it whole, so the ids can run past the tag
(``</python>`` ending inside the token ``>\\n``). The boundary rule (docs/design.md "Tags
as text"): every sampled id stays in the trajectory, with its behaviour log-prob; the call
is parsed from the decoded text up to the end of the stop string, once; the characters
of the last token after it (the *overhang*) are model text; the tool result follows the
overhang, and when the overhang is a prefix of the text to insert (``\\n`` before
``\\n<result>``) that prefix is not inserted again (``after_overhang``). So the decoded
trajectory reads call, result exactly as with single-token tags when the overhang is such
a prefix, and call, overhang, result otherwise (the format rules judge that text).

A round's entropy is ``arpo_async.core.entropy.round_entropy`` over its first k tokens
with ``rollout.entropy_estimator`` (the authors' formula, the tail-corrected top-k
estimate, or the exact entropy the engine computes), ``rollout.entropy_reduce`` and
``rollout.short_round``. A round is bounded by the trajectory's remaining budget (as the
authors' rollout asks each round for the whole remaining budget), by
``sampling.round_max_tokens`` when set, and always by what ``model.max_model_len``
leaves: a context that fills it ends the trajectory as ``length``, counted
(``rollout/context_full``), never the actor.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.engines.base import ContextOverflow, GenerationEngine, GenRequest
from actors.rollout.base import Occupancy
from arpo_async.core.entropy import round_entropy
from toolenv.base import ToolResult
from toolenv.tags import ToolCall
from toolenv.tasks.prompts import Prompt


@dataclass
class LivePath:
    """A live trajectory: response tokens so far and where its forks would start."""

    tid: int
    tokens: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    tool_calls: int = 0
    branch_point: int = 0  # tokens shared with the parent
    decide: bool = False  # the next round follows a tool result this path ran itself
    snapshot: int = 0  # length at the end of the last tool result (where forks start)
    rounds: int = 0
    finish_reason: str = ""
    overhang: str = ""  # text of the last round's last token past its stop string
    context_full: bool = False  # ended because prompt + tokens filled model.max_model_len
    state: Any = None  # its sessions in stateful tools (ToolRunner.open_state), or None
    needs_h_init: bool = True  # its first round's entropy is read (GroupPolicy.first_round)
    pending: str = ""  # a round whose calls have not run yet: its text through the stop string

    def fork(self, tid: int, reads_first_round: bool = False) -> LivePath:
        """A fork shares everything up to and including the last tool result (so the call
        is not run again) and resamples the round after it."""
        n = self.snapshot
        return LivePath(tid, self.tokens[:n], self.mask[:n], self.logprobs[:n],
                        self.versions[:n], self.tool_calls, branch_point=n,
                        rounds=self.rounds - 1, needs_h_init=reads_first_round)


def split_at_stop(text: str, stop_reason: object) -> tuple[str, str]:
    """(the round's text through its stop string, the overhang after it). The engine
    stopped at the first occurrence of ``stop_reason``; a stop token id or EOS (not a
    string) leaves no overhang."""
    if isinstance(stop_reason, str) and stop_reason and (at := text.find(stop_reason)) >= 0:
        end = at + len(stop_reason)
        return text[:end], text[end:]
    return text, ""


def after_overhang(overhang: str, inserted: str) -> str:
    """The text to insert after a round whose last token ran ``overhang`` past its stop
    string: ``inserted`` without the prefix the model already wrote, if it wrote one."""
    return inserted[len(overhang):] if overhang and inserted.startswith(overhang) else inserted


@dataclass
class Round:
    """What a round gives the group: its text through the stop string, its window
    entropy (nan when not read), whether it was shorter than the window, and why it ended."""

    text: str
    entropy: float
    short: bool
    finish_reason: str


class PathStepper:
    """Runs rounds and tool calls of the paths of a rollout (all its groups)."""

    def __init__(self, cfg, engine: GenerationEngine, tokenizer, tools, syntax,
                 rng: np.random.Generator, occupancy: Occupancy):
        self.cfg, self.engine, self.tokenizer, self.tools = cfg, engine, tokenizer, tools
        self.syntax, self.rng, self.occupancy = syntax, rng, occupancy
        self.vocab = len(tokenizer)
        self.stop_ids, self.stop_strings = [], []
        for tag in syntax.stop_strings:
            ids = tokenizer.encode(tag, add_special_tokens=False)
            if len(ids) == 1:
                self.stop_ids.append(ids[0])
            else:
                self.stop_strings.append(tag)
        if tokenizer.eos_token_id is not None:
            self.stop_ids.append(tokenizer.eos_token_id)
        self.context_full = 0  # trajectories ended by model.max_model_len (all groups)

    async def round(self, prompt: Prompt, path: LivePath, read: bool) -> Round:
        """One round. ``read``: its window entropy is read, so the engine is asked for what
        the estimator needs (top-k log-probs, or the exact estimator's whole vectors), over
        the window only (``GenRequest.topk_window``) under ``sampling.topk_window_only``,
        else on every token of the round; whole vectors are always asked over the window
        only. Not read: the sampled tokens' own log-probs only, in one request."""
        s, r = self.cfg.sampling, self.cfg.rollout
        window = r.entropy_window
        exact = r.entropy_estimator == "exact"
        context = prompt.tokens + path.tokens
        limit = s.round_tokens(len(path.tokens))
        # What max_model_len leaves: a context that fills it ends the trajectory as
        # length, counted, instead of a request the engine must refuse.
        room = self.cfg.model.max_model_len - len(context)
        seed = int(self.rng.integers(2**31))
        if room < 1:
            return self._no_room(path)
        try:
            res = await self.engine.generate(GenRequest(
                prompt_tokens=context, max_tokens=min(limit, room),
                temperature=s.temperature, top_p=s.top_p, stop_token_ids=self.stop_ids,
                stop=self.stop_strings,
                logprobs_topk=s.logprobs_topk if read and not exact else 0,
                topk_window=window if read and (s.topk_window_only or exact) else 0,
                entropy=read and exact,
                seed=seed))
        except ContextOverflow:
            return self._no_room(path)
        if res.finish_reason == "length" and len(res.tokens) >= room:
            self._count_full(path)  # this round filled max_model_len: nothing can follow
        path.tokens += res.tokens
        path.mask += [1] * len(res.tokens)
        path.logprobs += list(res.logprobs)
        path.versions += list(res.versions)
        path.rounds += 1
        h = (round_entropy(res.top_logprobs, res.logprobs, res.entropies,
                           estimator=r.entropy_estimator, vocab_size=self.vocab, window=window,
                           reduce=r.entropy_reduce, short_round=r.short_round)
             if read else float("nan"))
        text = self.tokenizer.decode(res.tokens, skip_special_tokens=False)
        text, path.overhang = (split_at_stop(text, res.stop_reason) if res.finish_reason == "stop"
                               else (text, ""))
        return Round(text, h, len(res.tokens) < window, res.finish_reason)

    def _count_full(self, path: LivePath) -> None:
        self.context_full += 1
        path.context_full = True

    def _no_room(self, path: LivePath) -> Round:
        """No round fits: the trajectory ends as length, and no branch decision is made
        (there is no round to read an entropy from)."""
        self._count_full(path)
        path.decide = False
        return Round("", float("nan"), False, "length")

    async def run_calls(self, path: LivePath, calls: list[ToolCall]) -> list[ToolResult]:
        """Run the calls of one turn and append their results (one tool turn). Several
        calls run together through the runner (its cache, rate and concurrency limits);
        on a path with state (a Python session) one after another in the order written,
        since they share it. A call that cannot run (bad JSON, unknown tool, bad
        arguments) is answered with its error, as a serving stack's tool executor would,
        and counted."""
        with self.occupancy.waiting():  # not generating while the tools run
            if path.state is not None or len(calls) == 1:
                results = [await self._run(path, call) for call in calls]
            else:
                results = list(await asyncio.gather(*(self._run(path, c) for c in calls)))
        inserted = self.syntax.results_text([r.text for r in results])
        if not self.syntax.templated:  # a template's tool turn is inserted whole
            inserted = after_overhang(path.overhang, inserted)
        ids = self.tokenizer.encode(inserted, add_special_tokens=False)
        path.tokens += ids
        path.mask += [0] * len(ids)
        path.logprobs += [0.0] * len(ids)
        path.versions += [-1] * len(ids)
        path.tool_calls += len(calls)
        return results

    async def _run(self, path: LivePath, call: ToolCall) -> ToolResult:
        if call.error:
            return self.tools.reject(call.name, call.error)
        if path.state is not None:
            return await self.tools.call(call.name, call.args, state=path.state)
        return await self.tools.call(call.name, call.args)
