"""``python -m arpo_async.jobs.analyze entropy`` end to end: the real rollout (transformers
engine, the sandboxed Python tool) on the benchmarks' tool-calling model, the exact
entropy from a learner-side forward, the null test of every estimator (windows resampled
at each decision's prefix by the same engine, scored by the same forward), both output
files. Its calibration on a known law is tests/unit/test_null_calibration.py."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PY, REPO, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_entropy_analysis_writes_its_files(tmp_path):
    from bench.common import build_tool_caller

    model = build_tool_caller(tmp_path / "tool_caller", {
        "<python>": 0.2, "</python>": 0.1, "<|im_end|>": 0.002, "</answer>": 0.002,
        "<answer>": 0.002})
    data = tmp_path / "q.jsonl"
    data.write_text("".join(json.dumps({"id": i, "question": f"What is {i} + 2?",
                                        "answer": str(i + 2), "ability": "math"}) + "\n"
                            for i in range(4)))
    out = tmp_path / "analysis"
    res = subprocess.run(
        [PY, "-m", "arpo_async.jobs.analyze", "entropy", "--model", str(model), "--data", str(data),
         "--out", str(out), "--limit", "4", "--k", "2", "--resample", "3",
         "--config", "configs/spine.yaml",
         "actors.engine=transformers", "sampling.round_max_tokens=null",
         "sampling.max_response_tokens=160", "rollout.tool_call_limit=3",
         "tools.enabled=[python]"],
        cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=400)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    result = json.loads((out / "entropy.json").read_text())
    for key in ("before_tool", "after_tool", "first_round", "n_tool_calls", "by_round",
                "by_tool", "estimate", "null_test", "finding"):
        assert key in result, key
    assert result["n_tool_calls"] > 0 and set(result["by_tool"]) == {"python"}
    assert len(result["after_tool"]["by_position"]) == 20
    assert 0.0 <= result["after_tool"]["mean"] <= 1.0
    est = result["estimate"]
    assert est["sum"]["decisions"] > 0 and est["sum"]["dh_mae"] >= 0
    null = result["null_test"]
    assert result["resampled_windows"] == 3
    assert {"reference", "tail_corrected", "exact", "exact+scale", "reference+skip"} <= set(null)
    for row in null.values():
        # every real decision has its resampled windows (unusable: fewer than 2 of them)
        assert row["decisions"] + row["decisions_unusable"] == row["real"]["n"]
        assert 0.0 <= row["real"].get("outside_band", 0.0) <= 1.0
    ref = null["reference"]
    assert ref["real"]["n"] == est["sum"]["decisions"] > 0
    assert ref["decisions"] >= 2 and ref["post_var_mean"] > 0
    assert ref["signal_to_noise_post_only"] == pytest.approx(
        ref["dh_var"] / ref["post_var_mean"])
    if ref["init_var"] is not None:  # two trajectories of a prompt made decisions
        assert ref["signal_to_noise"] == pytest.approx(
            ref["dh_var"] / (ref["post_var_mean"] + ref["init_var"]))
        assert ref["signal_to_noise"] <= ref["signal_to_noise_post_only"]
    assert null["exact"]["real"]["n"] == ref["real"]["n"]
    assert "null test (3 windows resampled at each decision's prefix" in res.stdout
    assert (out / "entropy_by_position.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["finding"] in res.stdout
