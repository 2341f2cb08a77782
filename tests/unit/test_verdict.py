"""The verdict's statistics (bench/verdict.py), the recovery endpoint
(toolenv/tasks/suite.py ``recovery``) and the learner's checkpoints at tool-call
milestones (``learner.checkpoint_every_tool_calls``), on hand cases."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from arpo_async.core.config import config_from_dict
from learner.loop import LearnerLoop
from tests.conftest import REPO
from toolenv.tasks.suite import recovery, wrong_search_results


@pytest.fixture(scope="module")
def verdict():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("verdict", REPO / "bench" / "verdict.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_t_interval_by_hand(verdict):
    ci = verdict.mean_ci([0.01, 0.02, 0.03, 0.04, 0.05])
    se = math.sqrt(0.00025 / 5)  # sample variance 2.5e-4
    assert ci["mean"] == pytest.approx(0.03) and ci["se"] == pytest.approx(se)
    assert ci["hi"] - ci["mean"] == pytest.approx(2.776 * se)  # t(0.975, 4)
    assert verdict.t975(35) == 2.042 and math.isnan(verdict.mean_ci([0.1])["se"])
    assert verdict.mean_ci([None, float("nan")])["n"] == 0


def test_calls_to_reach_interpolates_and_censors(verdict):
    curve = [(0, 0.20), (500, 0.22), (1000, 0.28), (1500, 0.30)]
    assert verdict.calls_to_reach(curve, 0.25) == (pytest.approx(750.0), True)
    assert verdict.calls_to_reach(curve, 0.40) == (1500, False)  # censored at the last
    assert verdict.calls_to_reach(curve, 0.40, 2500) == (2500, False)  # ... or the budget
    assert verdict.calls_to_reach(curve, 0.15) == (0, True)
    bands = verdict.curve_bands([{"arm": "a", "curve": [{"calls": 510, "pass@1": 0.3}]},
                                 {"arm": "a", "curve": [{"calls": 520, "pass@1": 0.4}]}],
                                0.2, 500)
    assert [p["calls"] for p in bands["a"]] == [0, 500]
    assert bands["a"][1]["mean"] == pytest.approx((0.2 + 0.1 * 500 / 510
                                                   + 0.2 + 0.2 * 500 / 520) / 2)


def test_stratum_table_from_the_metrics(verdict, tmp_path: Path):
    rows = [{"step": 1, "branch/stratum/search/1/n": 30.0, "branch/stratum/search/1/p_sum": 18.0,
             "branch/stratum/python/3/n": 2.0, "branch/stratum/python/3/p_sum": 1.9},
            {"step": 2, "branch/stratum/search/1/n": 10.0, "branch/stratum/search/1/p_sum": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    # 22 / 40; python/3 has too few decisions and is left to alpha
    assert verdict.stratum_table(tmp_path) == {"search/1": 0.55}


def test_t_tables_agree_with_the_exact_p_value(verdict):
    # the closed form by hand: df 1, t 1: 1 - 2 atan(1) / pi; df 2: 1 - t / sqrt(2 + t^2)
    assert verdict.t_two_sided_p(1.0, 1) == pytest.approx(0.5)
    assert verdict.t_two_sided_p(math.sqrt(2), 2) == pytest.approx(1 - math.sqrt(0.5))
    assert verdict.t_two_sided_p(0.0, 7) == pytest.approx(1.0)
    assert math.isnan(verdict.t_two_sided_p(1.0, 0))
    for df in [*range(1, 31), 40, 60, 120]:  # every tabled quantile, to its 3 decimals
        assert verdict.t_two_sided_p(verdict.t975(df), df) == pytest.approx(0.05, abs=1e-4)
        assert verdict.t_two_sided_p(verdict.t80(df), df) == pytest.approx(0.40, abs=5e-4)
    assert verdict.t80(35) == 0.854 and verdict.t975(22) == 2.074


Q = "What is the population of Vel Bira plus the population of Kos Havi?"


def _resp(*titles: str) -> str:
    return "".join(f"<search>q</search>\n<result>\nDoc 1(Title: {t}) {t} is a city.\n</result>\n"
                   for t in titles) + "<answer>\\boxed{1}</answer>"


def test_a_search_without_a_document_is_a_wrong_result_and_results_do_not_merge():
    empty = "<search>q</search>\n<result>\nNo search results found.\n</result>\n"
    assert wrong_search_results(Q, empty + _resp("Vel Bira")) == (2, 1)
    noted = _resp("Vel Bira").replace(") Vel", ") No exact match. Vel")
    # with the suite's note, only a noted reply counts as wrong (a miscopied query's
    # reply names another entity but says nothing)
    assert wrong_search_results(Q, noted + _resp("Tano Kos"), "No exact match.") == (2, 1)
    assert wrong_search_results(Q, noted + _resp("Tano Kos")) == (2, 1)


def test_recovery_counts_samples_that_met_a_wrong_search_result():
    assert wrong_search_results(Q, _resp("Vel Bira", "Kos Havi")) == (2, 0)
    assert wrong_search_results(Q, _resp("Vel Bira", "Tano Kos", "Kos Havi")) == (3, 1)
    items = [{"question": Q, "responses": [_resp("Vel Bira", "Tano Kos", "Kos Havi"),
                                           _resp("Tano Kos"), _resp("Vel Bira", "Kos Havi"),
                                           "<answer>\\boxed{3}</answer>"],
              "scores": [1.0, 0.0, 1.0, 0.0]}]
    rec = recovery(items)
    assert (rec["rate"], rec["n"], rec["share"], rec["pass_clean"]) == (0.5, 2, 0.5, 0.5)


def test_a_checkpoint_at_each_tool_call_milestone():
    cfg = config_from_dict({"learner": {"checkpoint_every_tool_calls": 500}})
    loop = SimpleNamespace(cfg=cfg, tool_calls=510)
    assert LearnerLoop._calls_crossed(loop, 490)
    assert not LearnerLoop._calls_crossed(loop, 500)  # 500 was crossed by the step before
    loop.tool_calls = 1400
    assert LearnerLoop._calls_crossed(loop, 990) and not LearnerLoop._calls_crossed(loop, 1001)
    off = SimpleNamespace(cfg=config_from_dict({}), tool_calls=10**6)
    assert not LearnerLoop._calls_crossed(off, 0)
