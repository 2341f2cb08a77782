"""The decision strata (actors/rollout/arpo.py: the tool before the round and that call's
index) and ``rollout.mode=stratified`` (actors/rollout/stratified.py), the ablation that
places ARPO's forks at random with ARPO's rate per stratum; the step metrics add the
strata up (learner/rollout_metrics.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from actors.rollout import ARPOPolicy, StratifiedPolicy
from arpo_async.core.config import ConfigError, StratifiedRollout, config_from_dict
from learner.rollout_metrics import rollout_metrics
from toolenv.base import ToolResult
from toolenv.tags import ToolCall


def _rollout(**keys):
    return config_from_dict({"rollout": {"group_size": 4, "initial_samples": 1,
                                         "fill": "one_per_round", **keys}}).rollout


def _tool(policy, tid: int, name: str, h: float):
    policy.observe_tool(tid, 10, ToolCall(name, "x"), ToolResult("1", ok=True))
    return policy.tool_round(tid, 10, h, False)


def test_arpo_counts_each_decision_in_its_stratum_and_a_fork_inherits_the_calls():
    policy = ARPOPolicy(_rollout(mode="arpo", alpha=1.0, beta=0.0), np.random.default_rng(0))
    (root,) = policy.start()
    policy.first_round(root, 1.0, False)
    fork = _tool(policy, root, "search", 1.0).forks[0]  # P = 1: a fork of the first round
    assert not policy.reads_first_round(fork)  # fork_h_init=parent: it inherits H_init
    _tool(policy, root, "python", 1.0)
    _tool(policy, fork, "python", 1.0)  # the fork's second call: it made the search too
    stats = policy.stats()
    assert stats["stratum/search/1/n"] == 1 and stats["stratum/search/1/p_sum"] == 1.0
    assert stats["stratum/python/2/n"] == 2 and stats["stratum/python/2/p_sum"] == 2.0
    assert not any("/1/" in k and "python" in k for k in stats)


def test_stratified_draws_with_the_table_and_ignores_entropy():
    cfg = _rollout(mode="stratified", alpha=0.0, beta=0.2,
                   stratum_p={"search/1": 1.0, "python/1": 0.0})
    assert isinstance(cfg, StratifiedRollout)
    policy = StratifiedPolicy(cfg, np.random.default_rng(0))
    (root,) = policy.start()
    policy.first_round(root, 0.0, False)
    # an entropy rise of 50 would make ARPO's P 1; the table says 0 after a python result
    assert _tool(policy, root, "python", 50.0).forks == []
    # a fall would make it 0; the table says 1 after the first search ... which is the
    # second call here, so alpha (0) applies: no fork
    assert _tool(policy, root, "search", -50.0).forks == []
    other = StratifiedPolicy(cfg, np.random.default_rng(0))
    (r,) = other.start()
    other.first_round(r, 0.0, False)
    assert len(_tool(other, r, "search", -50.0).forks) == 1
    assert [d[3] for d in policy.decisions] == [0.0, 0.0]  # P recorded as drawn
    assert policy.decisions[0][2] == 50.0  # dH recorded, not read


@pytest.mark.parametrize("table, word", [({"search": 0.5}, "'search'"),
                                         ({"search/x": 0.5}, "'search/x'"),
                                         ({"search/1": 1.5}, "stratum_p.search/1")])
def test_a_bad_table_is_refused_by_name(table, word):
    with pytest.raises(ConfigError, match=word):
        config_from_dict({"rollout": {"mode": "stratified", "stratum_p": table}})


def test_the_step_metrics_add_the_strata_up():
    groups = [SimpleNamespace(stats={"branch/stratum/search/1/n": 2.0,
                                     "branch/stratum/search/1/p_sum": 1.1},
                              leaves=[None] * 4, tool_calls_executed=2),
              SimpleNamespace(stats={"branch/stratum/search/1/n": 1.0,
                                     "branch/stratum/search/1/p_sum": 0.6,
                                     "branch/stratum/python/2/n": 1.0,
                                     "branch/stratum/python/2/p_sum": 0.5},
                              leaves=[None] * 4, tool_calls_executed=1)]
    m = rollout_metrics(groups)
    assert m["branch/stratum/search/1/n"] == 3.0
    assert m["branch/stratum/search/1/p_sum"] == pytest.approx(1.7)
    assert m["branch/stratum/python/2/n"] == 1.0


def test_a_call_that_could_not_run_is_its_own_stratum_and_names_keep_their_shape():
    policy = ARPOPolicy(_rollout(mode="arpo", alpha=0.0, beta=0.0), np.random.default_rng(0))
    (root,) = policy.start()
    policy.first_round(root, 1.0, False)
    policy.observe_tool(root, 5, ToolCall("a/b", "x", error="unknown tool"),
                        ToolResult("", ok=False))
    policy.tool_round(root, 5, 1.0, False)
    policy.observe_tool(root, 9, ToolCall("mcp/fetch", "x"), ToolResult("1", ok=True))
    policy.tool_round(root, 9, 1.0, False)
    assert set(policy.stats()) >= {"stratum/invalid/1/n", "stratum/mcp_fetch/2/n"}
    StratifiedRollout(stratum_p={k.split("/", 1)[1].rsplit("/", 1)[0]: 0.5
                                 for k in policy.stats() if k.startswith("stratum/")})
