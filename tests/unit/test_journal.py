"""The journal of trees in flight (actors/journal.py) through the real rollout: a group is
stopped at every point it can be (its k-th generation request never returns, and the
journal file is copied as a kill -9 would leave it), then finished by a new rollout from
the copy. Checked for each k: the group has its M leaves with valid parents; every token
the journal held is kept in its trajectory, with its version; no tool call whose result
was journaled runs again (the calls counted exactly); a stateful tool's session continues
from its history. Then the file format: a torn last record, a sent group, compaction."""

from __future__ import annotations

import asyncio
import copy as copy_
import zlib

import numpy as np
import pytest
from transformers import AutoTokenizer

from actors.engines.base import GenResult
from actors.journal import HEADER, PathRecord, TreeJournal, TreeRecord, why_regenerate
from actors.rollout import build_rollout
from arpo_async.core.config import config_from_dict
from toolenv.base import ToolResult
from toolenv.runner import ToolRunner
from toolenv.session import next_digest
from toolenv.tasks.prompts import PromptSource

CALL, ANSWER = "<python>n += 1</python>", "<answer>\\boxed{7}</answer>"
M = 4


class Engine:
    """Calls python until the context holds two tool results, then answers; its
    ``block_at``-th request never returns (the actor is killed while it waits)."""

    def __init__(self, tok, version: int, block_at: int | None = None, killed=None):
        self.tok, self.version, self.block_at, self.killed = tok, version, block_at, killed
        self.requests = 0
        self.blocked = asyncio.Event()

    async def generate(self, req) -> GenResult:
        self.requests += 1
        if self.requests == self.block_at:
            self.killed()  # the journal as a kill -9 leaves it, at this instant
            self.blocked.set()
            await asyncio.Event().wait()
        text = self.tok.decode(req.prompt_tokens, skip_special_tokens=False)
        reply = ANSWER if text.count("</result>") >= 2 else CALL
        ids = self.tok.encode(reply, add_special_tokens=False)
        return GenResult(ids, [-0.5] * len(ids), [[-0.5, -1.5] for _ in ids], "stop",
                         version=self.version)


class Session:
    def __init__(self, history=()):
        self.history = list(history)
        self.digest = ""
        for code in self.history:
            self.digest = next_digest(self.digest, code)

    def advance(self, code):
        self.history.append(code)
        self.digest = next_digest(self.digest, code)

    async def fork(self):
        await asyncio.sleep(0)  # a real fork waits on its sandbox: others run meanwhile
        return Session(self.history)

    def close(self, reason="finished"):
        pass


class Counter:
    """A stateful 'python': each call prints how many calls its session has run."""

    name, description, version = "python", "a counting interpreter", "1"
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}}
    stateful = True

    def __init__(self):
        self.executed = 0

    def open_session(self):
        return Session()

    def restore_session(self, history):
        return Session(history)

    async def call(self, args):
        raise AssertionError("a stateful call comes with its session")

    async def call_in(self, session, args):
        self.executed += 1
        session.advance(args)
        return ToolResult(str(len(session.history)), ok=True)


def _setup(tiny_model_dir, mode: str = "arpo", initial: int = 2):
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    # alpha 1, beta 0: every round after a tool result forks while the budget lasts
    cfg = config_from_dict({
        "rollout": {"mode": mode, "group_size": M, "initial_samples": initial, "alpha": 1.0,
                    "beta": 0.0},
        "sampling": {"round_max_tokens": 32, "max_response_tokens": 200},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    return tok, cfg, PromptSource(cfg, tok)


def _rollout(cfg, engine, source, tok, tool):
    runner = ToolRunner({"python": tool}, None, rate_per_s=0, concurrency=4, timeout_s=5,
                        retries=0)
    return build_rollout(cfg, engine, source, tok, runner, np.random.default_rng(0))


async def _crash(tiny_model_dir, tmp_path, block_at: int, mode: str = "arpo",
                 initial: int = 2):
    """Run a group until its ``block_at``-th request; the journal as a kill leaves it, or
    None when the group finished first."""
    tok, cfg, source = _setup(tiny_model_dir, mode, initial)
    journal = TreeJournal(tmp_path / f"live{block_at}.bin")
    copy = tmp_path / f"killed{block_at}.bin"
    engine = Engine(tok, 1, block_at, lambda: copy.write_bytes(journal.path.read_bytes()))
    tool = Counter()
    prompt = source.next()
    run = asyncio.ensure_future(_rollout(cfg, engine, source, tok, tool).run(
        prompt, 0, journal.group(0, 1, source.position)))
    blocked = asyncio.ensure_future(engine.blocked.wait())
    await asyncio.wait([run, blocked], return_when=asyncio.FIRST_COMPLETED)
    if run.done():
        blocked.cancel()
        return None
    run.cancel()
    await asyncio.gather(run, return_exceptions=True)
    return copy, tool.executed


async def _resume(tiny_model_dir, copy, mode: str = "arpo", initial: int = 2):
    tok, cfg, source = _setup(tiny_model_dir, mode, initial)
    journal = TreeJournal(copy)
    trees = journal.load()
    held = copy_.deepcopy(trees[0])  # the journal goes on recording into its own
    engine, tool = Engine(tok, 2), Counter()
    group = await asyncio.wait_for(_rollout(cfg, engine, source, tok, tool).run(
        source.prompt_at(0), 0, journal.group(0, trees[0].end, journal.next)), 60)
    return held, group, tool.executed, tok


# one initial sample: its forks are made on rounds that end it (a leaf the policy is told
# of only after the forks' sessions are copied: the journal's unacknowledged leaf)
@pytest.mark.parametrize(("mode", "initial"), [("arpo", 1), ("arpo", 2), ("grpo", 2),
                                               ("aepo", 2)])
async def test_a_group_killed_anywhere_is_finished_from_its_journal(tiny_model_dir, tmp_path,
                                                                    mode, initial):
    kills = 0
    for block_at in range(1, 40):
        crashed = await _crash(tiny_model_dir, tmp_path, block_at, mode, initial)
        if crashed is None:
            break
        kills += 1
        tree, group, executed, tok = await _resume(tiny_model_dir, crashed[0], mode, initial)
        leaves = group.leaves
        assert len(leaves) == M and all(-1 <= leaf.parent < i for i, leaf in enumerate(leaves))
        if mode != "grpo":  # the policy was told of every leaf, once
            assert group.stats["branch/leaves"] == M, (block_at, group.stats)
        again = 0
        for tid, leaf in enumerate(leaves):
            kept = tree.paths.get(tid)
            n = len(kept.tokens) if kept is not None else 0
            if kept is not None:  # every journaled token kept, with its version
                assert leaf.tokens[:n].tolist() == kept.tokens
                assert leaf.versions[:n].tolist() == kept.versions
            own = max(n, leaf.branch_point)
            text = tok.decode(leaf.tokens, skip_special_tokens=False)
            again += tok.decode(leaf.tokens[own:], skip_special_tokens=False).count("<result>")
            # the session went on from its history: results count 1, 2 along every lineage
            results = [r.split("</result>")[0].strip() for r in text.split("<result>")[1:]]
            assert results == ["1", "2"]
        assert executed == again, (block_at, executed, again)  # nothing journaled ran again
        assert sum(leaf.tool_calls for leaf in leaves) == 2 * M
    assert kills >= 5  # the loop met the group at many points


async def test_resumed_tokens_are_all_the_journal_held(tiny_model_dir, tmp_path):
    copy, _ = await _crash(tiny_model_dir, tmp_path, 6)
    tree, group, _, _ = await _resume(tiny_model_dir, copy)
    assert tree.model_tokens() > 0
    old = sum(int(((leaf.versions == 1) & (leaf.loss_mask == 1))[leaf.branch_point:].sum())
              for leaf in group.leaves)
    # version-1 model tokens in the leaves = those journaled = what the group reports
    assert old == tree.model_tokens() == group.stats["rollout/resumed_tokens"]


async def test_a_torn_last_record_is_dropped_and_counted(tiny_model_dir, tmp_path):
    copy, _ = await _crash(tiny_model_dir, tmp_path, 8)
    whole = TreeJournal(copy)
    before = whole.load()[0]
    data = copy.read_bytes()
    for cut in (1, HEADER.size + 3):  # mid-header and mid-body of a last record
        body = b"\x92\x01\x02" * 10
        torn = data + (HEADER.pack(len(body), zlib.crc32(body)) + body)[:cut]
        copy.write_bytes(torn)
        journal = TreeJournal(copy)
        trees = journal.load()
        assert journal.counts["torn"] == 1 and trees[0].model_tokens() == before.model_tokens()
        assert copy.read_bytes() != torn  # rewritten without it
    flipped = bytearray(data)
    flipped[-1] ^= 0xFF  # a last record whose crc fails
    copy.write_bytes(bytes(flipped))
    journal = TreeJournal(copy)
    journal.load()
    assert journal.counts["torn"] == 1


def test_a_sent_group_is_retired_and_compaction_keeps_the_rest(tmp_path):
    journal = TreeJournal(tmp_path / "j.bin", max_mb=0.001)
    journal.load()

    class Path_:
        def __init__(self, tid):
            self.tid, self.tokens, self.mask = tid, [1, 2, 3], [1, 1, 1]
            self.logprobs, self.versions = [-0.1] * 3, [4] * 3
            self.tool_calls = self.branch_point = self.snapshot = self.rounds = 0
            self.decide = self.context_full = self.needs_h_init = False
            self.finish_reason = self.overhang = self.pending = ""

    for pos in range(3):
        journal.group(pos, pos + 1, pos + 1).record({"policy": pos}, 0, [(Path_(0), -1, {})])
    journal.sent(1)
    for _ in range(30):  # past max_mb: compacted while running
        journal.group(2, 3, 3).record({"policy": 2}, 0, [])
    assert journal.counts["compactions"] >= 1
    journal.close()
    again = TreeJournal(tmp_path / "j.bin")
    trees = again.load()
    assert sorted(trees) == [0, 2] and again.next == 3
    assert trees[0].paths[0].tokens == [1, 2, 3] and trees[0].paths[0].versions == [4] * 3


FULL_DISK = r"""
import json, resource, sys
sys.path.insert(0, sys.argv[1])
from actors.journal import TreeJournal

class P:
    def __init__(self, tid, n):
        self.tid, self.tokens, self.mask = tid, list(range(n)), [1] * n
        self.logprobs, self.versions = [-0.5] * n, [3] * n
        self.tool_calls = self.branch_point = self.snapshot = self.rounds = 0
        self.decide = self.context_full = self.needs_h_init = False
        self.finish_reason = self.overhang = self.pending = ""

path = sys.argv[2]
journal = TreeJournal(path)
journal.load()
soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, hard))  # the disk is full past 20 kB
paths = {}
for pos in range(12):  # each record ~2.5 kB: the later ones fail (EFBIG, never raised)
    paths[pos] = P(0, 200 + pos)
    journal.group(pos, pos + 1, pos + 1).record({"p": pos}, pos, [(paths[pos], -1, {})])
errors = journal.counts["write_errors"]
resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))  # room again
journal.sent(3)  # the next record rewrites the file from memory
again = TreeJournal(path)
trees = again.load()
print(json.dumps({"errors": errors, "stale_after": journal._stale,
                  "positions": sorted(trees), "tokens": {p: len(t.paths[0].tokens)
                                                         for p, t in trees.items()}}))
"""


def test_a_full_disk_never_reaches_the_rollout_and_the_file_catches_up(tmp_path):
    """RLIMIT_FSIZE in a child process: writes past it fail with EFBIG as on a full disk
    (Python ignores SIGXFSZ). Nothing is raised; once there is room, the file is rewritten
    from the trees in memory and holds every tree not sent."""
    import json as json_
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    res = subprocess.run([sys.executable, "-c", FULL_DISK, str(root), str(tmp_path / "j.bin")],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json_.loads(res.stdout.strip().splitlines()[-1])
    assert out["errors"] >= 1 and out["stale_after"] is False
    assert out["positions"] == [p for p in range(12) if p != 3]
    assert out["tokens"] == {str(p): 200 + p for p in range(12) if p != 3}


def test_a_resumed_tree_the_learner_could_not_train_is_generated_again():
    """Finished only if its tokens can still be trained: none newer than the learner's
    weights (a rolled-back version), none older than the staleness bound allows."""
    tree = TreeRecord(pos=3, end=4, paths={
        0: PathRecord(tokens=[1, 2, 3, 4], mask=[0, 1, 1, 0], versions=[-1, 5, 6, -1]),
        1: PathRecord(tokens=[1, 2, 9], mask=[0, 1, 1], versions=[-1, 5, 7],
                      fields={"branch_point": 2})})
    assert tree.versions() == (5, 7)
    assert why_regenerate(tree, 7, 2) == "" and why_regenerate(tree, 7, 0) == "stale"
    assert why_regenerate(tree, 8, 3) == "" and why_regenerate(tree, 8, 2) == "stale"
    assert why_regenerate(tree, 6, 2) == "rolled_back"  # v7's weights are gone
    assert why_regenerate(tree, -1, 0) == ""  # the learner not heard from: finish it
    roots = TreeRecord(pos=0, end=1, paths={0: PathRecord(tokens=[1], mask=[0],
                                                          versions=[-1])})
    assert roots.versions() == (-1, -1) and why_regenerate(roots, 50, 1) == ""
