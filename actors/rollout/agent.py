"""Tool-interleaved rollout of one prompt group: the group policy (GRPO, ARPO, AEPO, or
one of your own: ``policy.py``) says which trajectories start and where they fork; the
path stepper (``path.py``) runs each one's rounds and tool calls.

Every trajectory of the group runs as its own asyncio task, so one slow tool call never
stalls the others, and all rounds of all groups share the engine's batch. The round that
follows a tool result goes to the policy with its window entropy; a fork copies every
token up to and including the tool result (so the call is not run again) and resamples
the round from there. With ``tools.parallel_calls`` > 1 a round may end in several calls:
they run together (``PathStepper.run_calls``), their results go in as one tool turn, and the
policy sees each (``observe_tool``, in the order written) and then one round: one branch
decision per turn, after the last result.

Stateful tools (``tools.python.state=session``): each root trajectory opens its
``ToolState`` (``ToolRunner.open_state``) when it starts; a fork's child gets a copy of its
parent's state at the branch point (``ToolState.fork``, awaited before the parent runs its
next call, so the copy holds what the shared tool results produced and nothing later); a
trajectory's state is closed when it ends (``finished``) or is cancelled or fails
(``dropped``). With stateless tools ``open_state`` gives None and nothing of this runs.
"""

from __future__ import annotations

import asyncio
import pickle
from typing import TYPE_CHECKING, Any

import numpy as np

from actors.engines.base import GenerationEngine
from actors.rollout.base import Occupancy, new_group_id
from actors.rollout.path import LivePath, PathStepper
from actors.rollout.policy import GroupPolicy
from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from toolenv.syntax import build_syntax
from toolenv.tags import ToolCall
from toolenv.tasks.prompts import Prompt, PromptSource

if TYPE_CHECKING:
    from actors.journal import GroupJournal


class AgentRollout:
    def __init__(self, cfg, engine: GenerationEngine, source: PromptSource, tokenizer,
                 tools, rng: np.random.Generator, policy: type[GroupPolicy]):
        self.cfg, self.source, self.tokenizer, self.rng = cfg, source, tokenizer, rng
        self.policy = policy
        self.occupancy = Occupancy()
        # tools.syntax: where rounds stop, how calls are read and results inserted
        self.syntax = getattr(source, "syntax", None) or build_syntax(
            cfg.tools, tokenizer, cfg.model.chat_template_kwargs)
        self.stepper = PathStepper(cfg, engine, tokenizer, tools, self.syntax, rng,
                                   self.occupancy)

    @property
    def context_full(self) -> int:
        """Trajectories ended by model.max_model_len (all groups)."""
        return self.stepper.context_full

    async def run(self, prompt: Prompt, actor_id: int,
                  journal: GroupJournal | None = None) -> TrajectoryGroup:
        """One group; with ``journal``, every event is recorded there, and a group an
        earlier incarnation left in flight (``journal.resumed``) is finished from it."""
        if journal is not None and journal.resumed is not None:
            group = self._restore(prompt, journal)
        else:
            group = _Group(self.policy(self.cfg.rollout, self.rng), self.occupancy, journal)
            roots = [group.root(tid) for tid in group.policy.start()]
            group.record(*roots)
            for path in roots:
                self._start(prompt, group, path)
        await group.wait()
        leaves = [self._leaf(prompt, group.paths[tid], group.policy.parent_of(tid))
                  for tid in sorted(group.paths)]
        return TrajectoryGroup(
            group_id=new_group_id(actor_id), actor_id=actor_id, prompt_id=prompt.id,
            prompt_tokens=np.asarray(prompt.tokens, np.int32), leaves=leaves,
            mode=self.cfg.rollout.mode, tool_calls_executed=group.executed,
            kind=prompt.kind,
            decisions=group.policy.decisions,
            stats={**{f"branch/{k}": v for k, v in group.policy.stats().items()},
                   "rollout/context_full": float(sum(p.context_full
                                                     for p in group.paths.values())),
                   "rollout/resumed_tokens": float(group.resumed_tokens)})

    def _restore(self, prompt: Prompt, journal: GroupJournal) -> _Group:
        """The group as the journal left it: leaves kept, every other trajectory started
        again at its next round (or at the calls its last round made), its sessions
        rebuilt from their histories; a leaf the policy had not been told of is told now."""
        tree = journal.resumed
        group = _Group(pickle.loads(tree.policy), self.occupancy, journal)
        group.executed, group.resumed_tokens = tree.executed, tree.model_tokens()
        restore = getattr(self.stepper.tools, "restore_state", None)
        unacked = []
        for tid, rec in sorted(tree.paths.items()):
            path = rec.live(tid)
            if rec.phase == "done":
                group.paths[tid] = path
                if not rec.acked:
                    unacked.append(path)
                continue
            if restore is not None:
                path.state = restore(rec.sessions)
            self._start(prompt, group, path)
        for path in unacked:
            self._finished(prompt, group, path)
        return group

    def _start(self, prompt: Prompt, group: _Group, path: LivePath) -> None:
        group.spawn(self._drive(prompt, path, group), path.state)

    async def _drive(self, prompt: Prompt, path: LivePath, group: _Group) -> None:
        open_state = getattr(self.stepper.tools, "open_state", None)
        if path.state is None and open_state is not None:
            path.state = open_state()
        reason = "dropped"
        try:
            await self._steps(prompt, path, group)
            reason = "finished"
        finally:
            if path.state is not None:
                path.state.close(reason)
        group.paths[path.tid] = path
        self._finished(prompt, group, path)

    def _finished(self, prompt: Prompt, group: _Group, path: LivePath) -> None:
        """A leaf: the policy is told, and the global samples it asks for start."""
        roots = [group.root(tid) for tid in group.policy.finished(path.tid)]
        group.record(path, *roots, acked=True)
        for root in roots:
            self._start(prompt, group, root)

    async def _steps(self, prompt: Prompt, path: LivePath, group: _Group) -> None:
        """Rounds and tool calls until the path finishes (its finish_reason set)."""
        while path.pending or await self._round(prompt, path, group):
            calls, path.pending = self.syntax.find_calls(path.pending), ""
            limit = self.cfg.rollout.tool_call_limit
            results = await self.stepper.run_calls(path, over_limit(calls,
                                                                    limit - path.tool_calls))
            group.executed += len(calls)
            for call, result in zip(calls, results):
                group.policy.observe_tool(path.tid, len(path.tokens), call, result)
            if len(path.tokens) >= self.cfg.sampling.max_response_tokens:
                # The result used up the budget: another round would ask for <= 0 tokens.
                path.finish_reason = "length"
                break
            path.snapshot = len(path.tokens)
            path.decide = True
            group.record(path)

    async def _round(self, prompt: Prompt, path: LivePath, group: _Group) -> bool:
        """One round and what the policy makes of it. True: calls follow (the round's text
        in ``path.pending``); False: the path ended (``finish_reason`` set)."""
        policy = group.policy
        first = path.needs_h_init
        rnd = await self.stepper.round(prompt, path, read=path.decide or first)
        if first:
            path.needs_h_init = False
            policy.first_round(path.tid, rnd.entropy, rnd.short)
        forks: list[LivePath] = []
        roots: list[LivePath] = []
        if path.decide:
            path.decide = False
            spawn = policy.tool_round(path.tid, path.snapshot, rnd.entropy, rnd.short)
            forks = [path.fork(tid, policy.reads_first_round(tid)) for tid in spawn.forks]
            roots = [group.root(tid) for tid in spawn.roots]
        calls = self.syntax.find_calls(rnd.text) if rnd.finish_reason == "stop" else []
        room = self.cfg.sampling.max_response_tokens - len(path.tokens)
        if not calls or path.tool_calls >= self.cfg.rollout.tool_call_limit or room <= 0:
            path.finish_reason = "tool_limit" if calls else rnd.finish_reason
        else:
            path.pending = rnd.text
        # recorded before any await: a fork's sessions are its parent's as they are now
        group.record(path, *forks, *roots, parent=path)
        for child in forks:
            if path.state is not None:
                child.state = await path.state.fork()
            self._start(prompt, group, child)
        for root in roots:
            self._start(prompt, group, root)
        return not path.finish_reason

    def _leaf(self, prompt: Prompt, path: LivePath, parent: int) -> Trajectory:
        text = self.tokenizer.decode(path.tokens, skip_special_tokens=False)
        reward, score = self.source.score(text, prompt)
        return Trajectory(
            tokens=np.asarray(path.tokens, np.int32), loss_mask=np.asarray(path.mask, np.uint8),
            logprobs=np.asarray(path.logprobs, np.float32),
            versions=np.asarray(path.versions, np.int32), reward=reward, score=score,
            parent=parent, branch_point=path.branch_point, tool_calls=path.tool_calls,
            finish_reason=path.finish_reason)


def over_limit(calls: list[ToolCall], left: int) -> list[ToolCall]:
    """A turn's calls with those past the ``left`` the tool-call limit allows answered
    with an error instead of run (``tools.parallel_calls`` > 1 only: one call a round
    never passes it)."""
    error = "Error: the tool-call limit of this trajectory is reached"
    return calls[:left] + [ToolCall(c.name, c.args, c.error or error) for c in calls[left:]]


class _Group:
    """Tasks and finished paths of one group; all mutation happens on one event loop."""

    def __init__(self, policy: GroupPolicy, occupancy: Occupancy,
                 journal: GroupJournal | None = None):
        self.policy = policy
        self.occupancy = occupancy
        self.journal = journal
        self.resumed_tokens = 0  # model tokens carried over from an earlier incarnation
        self.paths: dict[int, LivePath] = {}
        self.tasks: set[asyncio.Task] = set()
        self.executed = 0

    def root(self, tid: int) -> LivePath:
        """A fresh global sample; its first round's entropy is read if the policy asks."""
        return LivePath(tid, needs_h_init=self.policy.reads_first_round(tid))

    def record(self, *paths: LivePath, parent: LivePath | None = None,
               acked: bool = False) -> None:
        """Journal an event (no journal: nothing): the policy now and ``paths``. Paths
        forked from ``parent`` start with its sessions' histories; a root with none."""
        if self.journal is None:
            return
        rows = []
        for path in paths:
            forked = parent is not None and path is not parent and path.branch_point > 0
            state = parent.state if forked else path.state
            rows.append((path, parent.tid if forked else -1,
                         state.histories() if state is not None else {}))
        self.journal.record(self.policy, self.executed, rows, acked=acked)

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
