"""The trees page in a real browser: a known group goes through the learner's sampler
(learner/trees.py) and ``analyze trees`` (arpo_async/jobs/trees_page.py), and headless
Chromium (Debian's ``chromium``; scripts/setup.sh installs it) loads the page: every
segment of the tree is in the DOM after the script ran, the browser logs no console line
at all (no error, no uncaught exception), and a tool result holding ``<script>`` and an
``onerror`` handler shows as text, run by nothing (the title stays the page's own).

``TREES_PNG=docs/trees.png pytest tests/integration/test_trees_page.py`` also keeps the
screenshot (docs/design.md shows it)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from html import unescape
from pathlib import Path

import numpy as np
import pytest

from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from arpo_async.jobs.analyze import main as analyze_main
from arpo_async.jobs.trees_page import TITLE
from learner.trees import TreeSampler

pytestmark = pytest.mark.integration

HOSTILE = "<script>document.title='pwned'</script><img src=x onerror=\"document.title='pwned'\">"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


class WordTokenizer:
    """A tokenizer of words, spaces and punctuation: ids grow as text is encoded."""

    def __init__(self):
        self.vocab: list[str] = []
        self.index: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        ids = []
        for piece in re.findall(r"\w+|\s|[^\w\s]", text):
            if piece not in self.index:
                self.index[piece] = len(self.vocab)
                self.vocab.append(piece)
            ids.append(self.index[piece])
        return ids

    def decode(self, ids, skip_special_tokens=False) -> str:
        return "".join(self.vocab[int(i)] for i in ids)

    def batch_decode(self, batch, skip_special_tokens=False) -> list[str]:
        return [self.decode(ids) for ids in batch]


def _leaf(tok, rng, runs, reward, parent=-1, branch_point=0, prefix=None) -> Trajectory:
    """A leaf from (is_model, text) runs, after ``prefix`` (the parent's shared tokens)."""
    ids, mask, lp = [], [], []
    if prefix is not None:
        ids, mask, lp = (list(prefix.tokens[:branch_point]), list(prefix.loss_mask[:branch_point]),
                         list(prefix.logprobs[:branch_point]))
    for model, text in runs:
        new = tok.encode(text)
        ids += new
        mask += [int(model)] * len(new)
        lp += list(-rng.exponential(1.0, len(new))) if model else [0.0] * len(new)
    mask_a = np.asarray(mask, np.uint8)
    calls = int(np.sum(np.diff(np.concatenate([[1], mask_a]).astype(int)) == -1))  # a result
    return Trajectory(tokens=np.asarray(ids, np.int32), loss_mask=mask_a,
                      logprobs=np.asarray(lp, np.float32),
                      versions=np.where(mask_a > 0, 3, -1).astype(np.int32), reward=reward,
                      score=reward, parent=parent, branch_point=branch_point,
                      tool_calls=calls, finish_reason="stop")


def known_group(tok: WordTokenizer) -> TrajectoryGroup:
    """Four leaves, two forks, one hostile tool result; decisions recorded with dH and P."""
    rng = np.random.default_rng(0)
    call = "I multiply with python. <python>print(17 * 23)</python>"
    a = _leaf(tok, rng, [(1, call), (0, "\n<result>391</result>\n"),
                         (1, "Check it: <search>17 times 23</search>"),
                         (0, "\n<result>no documents</result>\n"),
                         (1, "<answer>\\boxed{391}</answer>")], 1.0)
    cut_a = len(tok.encode(call + "\n<result>391</result>\n"))
    b = _leaf(tok, rng, [(1, "So <answer>\\boxed{381}</answer>")], 0.0, parent=0,
              branch_point=cut_a, prefix=a)
    look = "Let me look around. <python>import os; print(os.listdir())</python>"
    c = _leaf(tok, rng, [(1, look), (0, f"\n<result>{HOSTILE}</result>\n"),
                         (1, "<answer>\\boxed{0}</answer>")], 0.0)
    cut_c = len(tok.encode(look + f"\n<result>{HOSTILE}</result>\n"))
    d = _leaf(tok, rng, [(1, "That is not it; <answer>\\boxed{391}</answer>")], 1.0,
              parent=2, branch_point=cut_c, prefix=c)
    group = TrajectoryGroup(
        group_id="a0-known", actor_id=0, prompt_id="arith-17x23",
        prompt_tokens=np.asarray(tok.encode("What is 17 * 23? Use the tools."), np.int32),
        leaves=[a, b, c, d], mode="arpo", tool_calls_executed=3)
    second = len(tok.encode(call + "\n<result>391</result>\nCheck it: <search>17 times 23"
                            "</search>\n<result>no documents</result>\n"))
    group.decisions = [  # as a rollout that records its decisions would send them
        {"leaf": 0, "at": cut_a, "dh": 0.9, "p": 0.68, "forks": 1},
        {"leaf": 0, "at": second, "dh": -0.4, "p": 0.42, "forks": 0},
        {"leaf": 2, "at": cut_c, "dh": 1.3, "p": 0.76, "forks": 1}]
    return group


def build_page(run_dir: Path) -> tuple[Path, dict]:
    """The known group through the sampler and ``analyze trees``; (page, its record)."""
    import json

    tok = WordTokenizer()
    group = known_group(tok)
    sampler = TreeSampler(run_dir, every=1, advantage_mode="hard", tokenizer=tok)
    assert sampler.offer([group], step=7) == 1
    (record_file,) = (run_dir / "trees").glob("*.json")
    assert analyze_main(["trees", str(run_dir)]) == 0
    return run_dir / "analysis" / "trees.html", json.loads(record_file.read_text())


def chromium(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu",
                           "--no-first-run", "--disable-extensions", *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install "
                    "chromium; scripts/setup.sh does it, so CI has it)")
def test_trees_page_in_headless_chromium(tmp_path):
    page, record = build_page(tmp_path / "run")
    url = page.resolve().as_uri()
    profile = tmp_path / "profile"
    run = chromium(f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
                   "--virtual-time-budget=2000", "--dump-dom", url)
    assert run.returncode == 0, run.stderr[-2000:]
    dom = run.stdout
    # the script ran and drew every segment of the tree
    # two roots, each cut where its fork hangs: 0 | 0 1, and 2 | 2 3
    assert [(n["parent"], n["leaves"]) for n in record["nodes"]] == [
        (None, [0, 1]), ("n0", [0]), ("n0", [1]), (None, [2, 3]), ("n3", [2]), ("n3", [3])]
    for node in record["nodes"]:
        assert f'id="g0-{node["id"]}"' in dom, f"segment {node['id']} is not in the DOM"
    assert "showing 1 of 1" in dom
    # the hostile tool result is text, and nothing of it ran
    assert "&lt;script&gt;document.title='pwned'&lt;/script&gt;" in dom
    assert "<img" not in dom
    title = re.search(r"<title>(.*?)</title>", dom, re.S)
    assert title and unescape(title.group(1)) == TITLE
    assert "pwned" not in unescape(title.group(1))
    # decisions and rewards are on the page
    for text in ("dH +0.90, P 0.68, forked x1", "dH -0.40, P 0.42, no fork",
                 "dH +1.30, P 0.76, forked x1", "leaf 3 ends (stop): reward 1.00"):
        assert text in unescape(dom), text
    console = [line for line in run.stderr.splitlines() if "CONSOLE" in line or "Uncaught" in line]
    assert not console, "\n".join(console)

    shot = tmp_path / "trees.png"
    run = chromium(f"--user-data-dir={profile}", "--hide-scrollbars", "--window-size=1100,900",
                   f"--screenshot={shot}", url)
    assert run.returncode == 0 and shot.stat().st_size > 10_000, run.stderr[-2000:]
    if os.environ.get("TREES_PNG"):
        shutil.copyfile(shot, os.environ["TREES_PNG"])
