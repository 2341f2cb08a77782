"""bench/arpo_vs_grpo.py builds each arm's config from the default job's: the arm's
rollout mode picks the rollout section's class (a tagged union), so the arms differ in
what they name and nothing else."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import SimpleNamespace

import pytest

from arpo_async.core.config import (
    AepoRollout,
    ArpoRollout,
    GrpoRollout,
    StratifiedRollout,
    load_config,
)
from tests.conftest import REPO


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("arpo_vs_grpo",
                                                  REPO / "bench" / "arpo_vs_grpo.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("arm, cls", [("grpo", GrpoRollout), ("arpo", ArpoRollout),
                                      ("arpo_exact", ArpoRollout), ("random", ArpoRollout),
                                      ("random_strat", StratifiedRollout),
                                      ("arpo_max", ArpoRollout),
                                      ("aepo", AepoRollout), ("aepo_released", AepoRollout)])
def test_each_arm_gets_its_rollout_mode_and_the_rest_of_the_default_job(bench, arm, cls,
                                                                       tmp_path: Path):
    base = load_config()
    args = SimpleNamespace(tool_calls=2500, max_s=600, eval_limit=300, eval_k=4)
    cfg = bench.arm_config(base, arm, 3, args, tmp_path, random_alpha=0.41,
                           strata={"search/1": 0.6})
    assert type(cfg.rollout) is cls and cfg.rollout.group_size == base.rollout.group_size
    assert (cfg.run.seed, cfg.run.tool_call_budget, cfg.run.dir) == (
        3, 2500, str(tmp_path / f"{arm}-seed3"))
    assert cfg.model == base.model and cfg.learner.batch_groups == base.learner.batch_groups
    if cls is not GrpoRollout:  # the authors' rollout
        assert (cfg.rollout.fill, cfg.rollout.fork_h_init) == ("one_per_round", "own")
    assert cfg.rollout.beta == {"random": 0.0, "arpo_max": 1.5}.get(arm, 0.2)
    if arm == "random_strat":
        assert (cfg.rollout.stratum_p, cfg.rollout.alpha) == ({"search/1": 0.6}, 0.41)
    if cls is AepoRollout:
        assert cfg.rollout.aepo_rule == "authors"
        assert cfg.rollout.aepo_dynamic_budget == (arm == "aepo")


def test_the_arms_of_an_aepo_base_config_switch_mode_too(bench, tmp_path: Path):
    from arpo_async.core.config import CONFIG_DIR

    base = load_config(CONFIG_DIR / "presets" / "aepo_deepsearch_qwen3_8b.yaml")
    args = SimpleNamespace(tool_calls=100, max_s=60, eval_limit=10, eval_k=2)
    for arm, cls in (("grpo", GrpoRollout), ("random", ArpoRollout), ("aepo", AepoRollout)):
        cfg = bench.arm_config(base, arm, 1, args, tmp_path, random_alpha=0.4)
        assert type(cfg.rollout) is cls and cfg.rollout.group_size == base.rollout.group_size


def test_an_arm_stopped_by_its_wall_time_cap_is_flagged():
    from arpo_vs_grpo import capped_lines

    rows = [{"arm": "arpo", "seed": 0, "tool_calls": 2500, "budget_reached": True},
            {"arm": "grpo", "seed": 1, "tool_calls": 1800, "budget_reached": False},
            {"arm": "old", "seed": 0}]  # a row from before the flag: not judged
    assert capped_lines(rows) == ["WARNING grpo seed 1: stopped by --max-s at 1800 executed "
                                  "tool calls, before its budget: not at equal cost"]
