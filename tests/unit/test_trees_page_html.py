"""arpo_async/jobs/trees_page.py without a browser: hostile text cannot leave the data
element, the page needs nothing outside itself, and ``analyze trees`` reads a run's
trees/ folder (a bad file skipped, a missing folder a clear error).
tests/integration/test_trees_page.py loads the page in headless Chromium."""

from __future__ import annotations

import json
import re

from arpo_async.jobs.analyze import main as analyze_main
from arpo_async.jobs.trees_page import load_trees, page_html

HOSTILE = "</script><script>document.title='pwned'</script><!-- \u2028"


def record(text: str = "ok") -> dict:
    part = {"kind": "tool", "start": 0, "text": text}
    model = {"kind": "model", "start": 1, "text": text, "ids": [1], "pieces": [text],
             "score": [0.5], "versions": [2, 2]}
    return {"format": 1, "step": 1, "group_id": "a0-x", "prompt_id": text, "actor_id": 0,
            "mode": "arpo", "kind": text, "advantage_mode": "soft",
            "score": {"name": "-log p", "unit": "nats"}, "decisions_recorded": False,
            "prompt": {"text": text, "tokens": 1, "ends": []},
            "leaves": [{"index": 0, "parent": -1, "branch_point": 0, "length": 2,
                        "reward": 1.0, "score": 1.0, "advantage": 0.0, "tool_calls": 1,
                        "finish_reason": text}],
            "nodes": [{"id": "n0", "parent": None, "leaf": 0, "start": 0, "end": 2,
                       "leaves": [0], "ends": [0], "decisions": [],
                       "copies": [{"leaf": 0, "advantage": 0.0, "trained": True}],
                       "parts": [part, model]}]}


def test_hostile_text_stays_inside_the_data_element():
    page = page_html([record(HOSTILE)])
    assert "document.title='pwned'</script>" not in page
    assert page.count("</script>") == 2  # the data element's and the script's own
    data = re.search(r'<script id="trees-data" type="application/json">(.*?)</script>', page,
                     re.S).group(1)
    assert json.loads(data)["trees"][0]["nodes"][0]["parts"][0]["text"] == HOSTILE


def test_the_page_is_self_contained():
    page = page_html([record()])
    assert not re.search(r"https?://|\bsrc=|<link\b|@import|url\(", page)
    assert "innerHTML" not in page and "insertAdjacentHTML" not in page


def test_analyze_trees_reads_the_run(tmp_path, capsys):
    assert analyze_main(["trees", str(tmp_path)]) == 2  # no trees/ folder
    assert "learner.trees_every" in capsys.readouterr().out
    trees = tmp_path / "trees"
    trees.mkdir()
    (trees / "00000001-000001-a0-x.json").write_text(json.dumps(record()))
    (trees / "00000002-000002-a0-y.json").write_text("{not json")
    assert [r["group_id"] for r in load_trees(tmp_path)[0]] == ["a0-x"]
    out = tmp_path / "page.html"
    assert analyze_main(["trees", str(tmp_path), "--out", str(out)]) == 0
    assert "(1 groups)" in capsys.readouterr().out and out.stat().st_size > 1000
