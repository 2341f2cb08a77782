"""The job's RESULT line: the standard error of pass@1 after RL minus after SFT, the
held-out prompts paired and each prompt's k samples one cluster (arpo_async/jobs/pipeline.py
``gain_se``), against a hand computation."""

from __future__ import annotations

import json
import math

from arpo_async.jobs.pipeline import gain_se


def _items(path, scores: dict[str, list[float]]):
    path.write_text("".join(json.dumps({"id": k, "scores": v}) + "\n"
                            for k, v in scores.items()))
    return path


def test_paired_by_prompt_and_clustered(tmp_path):
    before = _items(tmp_path / "a.jsonl", {"p1": [0, 0], "p2": [1, 0], "p3": [1, 1],
                                           "p4": [0, 1]})
    after = _items(tmp_path / "b.jsonl", {"p4": [1, 1], "p1": [1, 1], "p2": [1, 0],
                                          "p3": [1, 1], "extra": [1, 1]})
    se, n = gain_se(before, after)
    # per-prompt differences 1, 0, 0, 0.5: mean 0.375, sample var 0.2292 / 4 prompts
    diffs = [1.0, 0.0, 0.0, 0.5]
    mean = sum(diffs) / 4
    want = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 3 / 4)
    assert n == 4 and math.isclose(se, want) and math.isclose(se, 0.2394, abs_tol=1e-4)


def test_identical_evaluations_have_no_spread(tmp_path):
    a = _items(tmp_path / "a.jsonl", {"p1": [1, 0], "p2": [0, 0]})
    assert gain_se(a, a) == (0.0, 2)
    one = _items(tmp_path / "one.jsonl", {"p1": [1, 0]})
    se, n = gain_se(one, one)
    assert n == 1 and math.isnan(se)
