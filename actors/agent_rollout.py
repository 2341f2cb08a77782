"""Tool-interleaved rollout of one prompt group: GRPO, ARPO and AEPO sampling.

Every trajectory of the group runs as its own asyncio task, so one slow tool call never
stalls the others, and all rounds of all groups share the engine's batch. A round ends at
the end of a tool call, ``</answer>``, end of sequence or the length limit. After a tool
call the result is appended as token ids (loss mask 0, never sampled, never
re-tokenising what came before): ``<result>...</result>`` or the chat template's tool
message, as ``tools.syntax`` says (toolenv/syntax.py). The next round's window entropy
goes to the group's ``BranchPlanner``; a fork copies every token up to and including the
tool result (so the call is not run again) and resamples the round from there.

A tag that is several tokens (a tokenizer like Qwen's, ``--tags-as-text``) stops the
round through a stop *string*. The engine stops at the first stop string in the round's
text but keeps the token that completed it whole, so the ids can run past the tag
(``</python>`` ending inside the token ``>\n``). The boundary rule (docs/design.md "Tags
as text"): every sampled id stays in the trajectory, with its behaviour log-prob; the call
is parsed from the decoded text up to the end of the stop string, once; the characters
of the last token after it (the *overhang*) are model text; the tool result follows the
overhang, and when the overhang is a prefix of the text to insert (``\n`` before
``\n<result>``) that prefix is not inserted again (``after_overhang``). So the decoded
trajectory reads call, result exactly as with single-token tags when the overhang is such
a prefix, and call, overhang, result otherwise (the format rules judge that text).

A round's entropy is ``arpo_async.core.entropy.round_entropy`` over its first k tokens
with ``rollout.entropy_estimator`` (the authors' formula, the tail-corrected top-k
estimate, or the exact entropy the engine computes), ``rollout.entropy_reduce`` and
``rollout.short_round``. A round is bounded by the trajectory's remaining budget alone
(``sampling.round_limit=budget``, as the authors' rollout asks each round for the whole
remaining budget) or by ``sampling.max_new_tokens``, and always by what
``model.max_model_len`` leaves: a context that fills it ends the trajectory as ``length``,
counted (``rollout/context_full``), never the actor.

Stateful tools (``tools.python_state=session``): each root trajectory opens its
``ToolState`` (``ToolRunner.open_state``) when it starts; a fork's child gets a copy of its
parent's state at the branch point (``ToolState.fork``, awaited before the parent runs its
next call, so the copy holds what the shared tool results produced and nothing later); a
trajectory's state is closed when it ends (``finished``) or is cancelled or fails
(``dropped``). With stateless tools ``open_state`` gives None and nothing of this runs.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from actors.branching import BranchPlanner, BranchSettings, aepo_global_samples
from actors.engines.base import ContextOverflow, GenerationEngine, GenRequest
from actors.rollout import Occupancy, new_group_id
from arpo_async.core.entropy import round_entropy
from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from toolenv.syntax import build_syntax
from toolenv.tags import ToolCall
from toolenv.tasks.prompts import Prompt, PromptSource


@dataclass
class _Path:
    """A live trajectory: response tokens so far and what the planner needs."""

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
    needs_h_init: bool = True  # its next round's entropy is its H_init (BranchPlanner)

    def fork(self, tid: int, own_h_init: bool = False) -> _Path:
        """A fork shares everything up to and including the last tool result; with
        ``own_h_init`` its first round gives its H_init (rollout.fork_h_init=own)."""
        n = self.snapshot
        return _Path(tid, self.tokens[:n], self.mask[:n], self.logprobs[:n], self.versions[:n],
                     self.tool_calls, branch_point=n, rounds=self.rounds - 1,
                     needs_h_init=own_h_init)


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


class AgentRollout:
    def __init__(self, cfg, engine: GenerationEngine, source: PromptSource, tokenizer,
                 tools, rng: np.random.Generator):
        self.cfg, self.engine, self.source, self.tokenizer = cfg, engine, source, tokenizer
        self.tools, self.rng = tools, rng
        self.occupancy = Occupancy()
        self.settings = BranchSettings.from_config(cfg.rollout)
        self.vocab = len(tokenizer)
        # tools.syntax: where rounds stop, how calls are read and results inserted
        self.syntax = getattr(source, "syntax", None) or build_syntax(
            cfg.tools, tokenizer, cfg.model.chat_template_kwargs)
        self.stop_ids, self.stop_strings = [], []
        for tag in self.syntax.stop_strings:
            ids = tokenizer.encode(tag, add_special_tokens=False)
            if len(ids) == 1:
                self.stop_ids.append(ids[0])
            else:
                self.stop_strings.append(tag)
        if tokenizer.eos_token_id is not None:
            self.stop_ids.append(tokenizer.eos_token_id)
        self.context_full = 0  # trajectories ended by model.max_model_len (all groups)

    # ------------------------------------------------------------------ one round
    async def _round(self, prompt: Prompt, path: _Path, read: bool
                     ) -> tuple[str, float, bool, str]:
        """One round: (text, entropy, shorter than the window, finish reason). ``read``:
        its window entropy is read (a round that gives an H_init, a round after the path's
        own tool result), so what the estimator needs is asked for over the window only
        (``GenRequest.topk_window``), else not at all."""
        s = self.cfg.sampling
        budget = s.max_response_tokens - len(path.tokens)
        window = self.settings.entropy_window
        exact = self.cfg.rollout.entropy_estimator == "exact"
        context = prompt.tokens + path.tokens
        limit = budget if s.round_limit == "budget" else min(s.max_new_tokens, budget)
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
                topk_window=window if s.topk_window_only else 0, entropy=read and exact,
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
        r = self.cfg.rollout
        h = (round_entropy(res.top_logprobs, res.logprobs, res.entropies,
                           estimator=r.entropy_estimator, vocab_size=self.vocab, window=window,
                           reduce=r.entropy_reduce, short_round=r.short_round)
             if read else float("nan"))
        text = self.tokenizer.decode(res.tokens, skip_special_tokens=False)
        text, path.overhang = (split_at_stop(text, res.stop_reason) if res.finish_reason == "stop"
                               else (text, ""))
        return text, h, len(res.tokens) < window, res.finish_reason

    def _count_full(self, path: _Path) -> None:
        self.context_full += 1
        path.context_full = True

    def _no_room(self, path: _Path) -> tuple[str, float, bool, str]:
        """No round fits: the trajectory ends as length, and no branch decision is made
        (there is no round to read an entropy from)."""
        self._count_full(path)
        path.decide = False
        return "", float("nan"), False, "length"

    async def _tool(self, path: _Path, call: ToolCall) -> None:
        # A call that cannot run (hermes: bad JSON, unknown tool, bad arguments) is
        # answered with its error, as a serving stack's tool executor would, and counted.
        with self.occupancy.waiting():  # not generating while the tool runs
            if call.error:
                result = self.tools.reject(call.name, call.error)
            elif path.state is not None:
                result = await self.tools.call(call.name, call.args, state=path.state)
            else:
                result = await self.tools.call(call.name, call.args)
        inserted = self.syntax.result_text(result.text)
        if self.syntax.name == "arpo":  # the template's tool turn (hermes) is inserted whole
            inserted = after_overhang(path.overhang, inserted)
        ids = self.tokenizer.encode(inserted, add_special_tokens=False)
        path.tokens += ids
        path.mask += [0] * len(ids)
        path.logprobs += [0.0] * len(ids)
        path.versions += [-1] * len(ids)
        path.tool_calls += 1

    # ------------------------------------------------------------------ one path
    async def _drive(self, prompt: Prompt, path: _Path, group: _GroupState) -> None:
        open_state = getattr(self.tools, "open_state", None)
        if path.state is None and open_state is not None:
            path.state = open_state()
        reason = "dropped"
        try:
            await self._steps(prompt, path, group)
            reason = "finished"
        finally:
            if path.state is not None:
                path.state.close(reason)
        group.planner.finish(path.tid)
        group.paths[path.tid] = path
        self._maybe_grow(prompt, group)

    async def _steps(self, prompt: Prompt, path: _Path, group: _GroupState) -> None:
        """Rounds and tool calls until the path finishes (its finish_reason set)."""
        planner = group.planner
        while True:
            first = path.needs_h_init
            text, h, short, finish = await self._round(prompt, path, read=path.decide or first)
            if first:
                path.needs_h_init = False
                planner.record_initial_entropy(path.tid, h, short)
                if planner.parent_of(path.tid) == -1:
                    group.h_root.append(h)
            if path.decide:
                path.decide = False
                if group.measuring(path.tid):  # AEPO's probe before m is known: measure only
                    group.h_tool.append(h)
                    self._split_budget(prompt, group)
                else:
                    forks, info = planner.after_tool_round(path.tid, h, short)
                    group.decisions.append([float(path.tid), float(path.snapshot),
                                            info["dh"], info["p"], info["forks"]])
                    own = self.settings.fork_h_init == "own"
                    for tid in forks:
                        child = path.fork(tid, own)
                        if path.state is not None:
                            child.state = await path.state.fork()
                        group.spawn(self._drive(prompt, child, group), child.state)
            call = self.syntax.find_call(text) if finish == "stop" else None
            room = self.cfg.sampling.max_response_tokens - len(path.tokens)
            if call is None or path.tool_calls >= self.cfg.rollout.tool_call_limit or room <= 0:
                path.finish_reason = ("tool_limit" if call is not None else finish)
                break
            await self._tool(path, call)
            group.executed += 1
            if len(path.tokens) >= self.cfg.sampling.max_response_tokens:
                # The result used up the budget: another round would ask for <= 0 tokens.
                path.finish_reason = "length"
                break
            path.snapshot = len(path.tokens)
            path.decide = True

    def _split_budget(self, prompt: Prompt, group: _GroupState) -> None:
        """AEPO's entropy pre-monitoring (arXiv 2510.14545 Sec. 3): the probe's root
        entropy and its first post-tool entropy give m = M * sigmoid(beta * (H_root -
        H_tool)); the probe and m - 1 fresh global samples make exactly m, and M - m are
        left to branching (refilled with global samples only if branching leaves them).
        A probe that ends without a tool call measures no gap: m = M / 2."""
        group.probe_pending = False
        h_root = group.h_root[0] if group.h_root else float("nan")
        group.m = aepo_global_samples(h_root, group.h_tool, self.settings.group_size,
                                      self.settings.budget_beta)
        for _ in range(group.m - 1):  # nothing branched yet: the budget holds them all
            group.spawn(self._drive(prompt, _Path(group.planner.new_root()), group))

    def _maybe_grow(self, prompt: Prompt, group: _GroupState) -> None:
        """AEPO's budget split when its probe ended before any tool call, then the fill
        rule (docs/design.md "ARPO branching"): with nothing of the group live, every
        missing global sample (``rollout.fill=all``) or one (``one_per_round``, the
        authors'; the next comes when it and its forks have ended)."""
        if group.probe_pending:
            self._split_budget(prompt, group)
        for tid in group.planner.fill():
            group.spawn(self._drive(prompt, _Path(tid), group))

    # ------------------------------------------------------------------ the group
    async def run(self, prompt: Prompt, actor_id: int) -> TrajectoryGroup:
        initial = 1 if self.settings.dynamic_budget else None
        group = _GroupState(BranchPlanner(self.settings, self.rng, initial=initial),
                            self.occupancy, probe=self.settings.dynamic_budget)
        for tid in group.planner.start():
            group.spawn(self._drive(prompt, _Path(tid), group))
        await group.wait()
        leaves = [self._leaf(prompt, group.paths[tid], group.planner.parent_of(tid))
                  for tid in sorted(group.paths)]
        return TrajectoryGroup(
            group_id=new_group_id(actor_id), actor_id=actor_id, prompt_id=prompt.id,
            prompt_tokens=np.asarray(prompt.tokens, np.int32), leaves=leaves,
            mode=self.cfg.rollout.mode, tool_calls_executed=group.executed,
            decisions=group.decisions,
            stats={**{f"branch/{k}": v for k, v in group.stats().items()},
                   "rollout/context_full": float(sum(p.context_full
                                                     for p in group.paths.values()))})

    def _leaf(self, prompt: Prompt, path: _Path, parent: int) -> Trajectory:
        text = self.tokenizer.decode(path.tokens, skip_special_tokens=False)
        reward, score = self.source.score(text, prompt)
        return Trajectory(
            tokens=np.asarray(path.tokens, np.int32), loss_mask=np.asarray(path.mask, np.uint8),
            logprobs=np.asarray(path.logprobs, np.float32),
            versions=np.asarray(path.versions, np.int32), reward=reward, score=score,
            parent=parent, branch_point=path.branch_point, tool_calls=path.tool_calls,
            finish_reason=path.finish_reason)


class _GroupState:
    """Tasks and finished paths of one group; all mutation happens on one event loop."""

    def __init__(self, planner: BranchPlanner, occupancy: Occupancy, probe: bool = False):
        self.planner = planner
        self.occupancy = occupancy
        self.paths: dict[int, _Path] = {}
        self.tasks: set[asyncio.Task] = set()
        self.executed = 0
        self.h_root: list[float] = []  # first-round entropies of the global samples
        self.h_tool: list[float] = []  # the AEPO probe's post-tool entropy
        self.probe_pending = probe  # AEPO: trajectory 0 measures; m is not known yet
        self.m = 0  # AEPO: global samples the probe's measurement asked for
        self.decisions: list[list[float]] = []  # TrajectoryGroup.decisions

    def measuring(self, tid: int) -> bool:
        return self.probe_pending and tid == 0

    def stats(self) -> dict[str, float]:
        return self.planner.stats() | ({"aepo_m": float(self.m)} if self.m else {})

    def spawn(self, coro, state: Any = None) -> None:
        """Start a path; it counts as generating from now (``Occupancy``). A fork's
        ``state`` is closed here if its task is cancelled before it ever ran."""
        task = asyncio.ensure_future(coro)
        if state is not None:
            task.add_done_callback(lambda t: state.close("dropped") if t.cancelled() else None)
        self.tasks.add(self.occupancy.track(task))

    async def wait(self) -> None:
        try:
            while self.tasks:
                done, _ = await asyncio.wait(self.tasks, return_when=asyncio.FIRST_COMPLETED)
                self.tasks -= done
                for task in done:
                    task.result()  # re-raise a failed path
        finally:  # a failed or cancelled group leaves no orphan paths behind
            for task in self.tasks:
                task.cancel()
