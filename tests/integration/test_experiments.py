"""Throughput experiments: the sweep over a 1x2 grid with simulated actors (real learner,
real ZeroMQ, real launcher), 64 simulated actors in one process losing nothing, and the
per-run summary computed by hand from a small metrics file."""

from __future__ import annotations

import csv
import json
import math
import subprocess

import pytest

from arpo_async.jobs.experiments import COLUMNS, summarize_run
from tests.conftest import PY, REPO, SPINE, python_env

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _metrics_row(step, wall, leaves, groups, tokens, step_time, wait, lag_mean, lag_max, reward):
    return {"step": step, "wall_time": wall, "leaves": leaves, "groups": groups,
            "model_tokens": tokens, "step_time_s": step_time, "wait_s": wait,
            "staleness_mean": lag_mean, "staleness_max": lag_max, "reward_mean": reward,
            "score_mean": reward / 2}


def test_summarize_run_by_hand(tmp_path):
    rows = [_metrics_row(1, 10.0, 8, 2, 100, 9.0, 8.0, 0.0, 0, 0.0),
            _metrics_row(2, 12.0, 8, 2, 120, 2.0, 0.5, 0.5, 1, 0.2),
            _metrics_row(3, 14.0, 6, 2, 80, 2.0, 1.0, 1.0, 1, 0.4)]
    service = {"actor0/idle_s": 3.0, "actor0/elapsed_s": 10.0, "actor0/send_blocked_s": 1.0,
               "actor1/idle_s": 1.0, "actor1/elapsed_s": 10.0,
               "dropped": {"stale": 1, "shutdown": 2, "actor_restart": 1},
               "staleness": {"lag_hist": {"0": 3, "1": 3, "2": 1}}}
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "learner_summary.json").write_text(json.dumps({"service": service}))
    ledger = {"0": {"sent": 5, "received": 5, "trained": 3, "dropped": {"stale": 1, "shutdown": 1}}}
    (tmp_path / "summary.json").write_text(json.dumps({"wall_time_s": 20.0, "ledger": ledger}))
    row, series = summarize_run(tmp_path, slots=4)
    assert row["window_s"] == 4.0  # end of step 1 to end of step 3
    assert row["trajectories_per_s"] == 14 / 4 and row["groups_per_s"] == 1.0
    assert row["model_tokens_per_s"] == 200 / 4
    assert row["learner_busy_frac"] == (1.5 + 1.0) / 4 and row["learner_wait_frac"] == 1.5 / 4
    assert row["actor_idle_frac"] == 4.0 / 80 and row["actor_blocked_frac"] == 1.0 / 80
    assert row["staleness_mean"] == 0.5 and row["staleness_max"] == 1
    assert (row["dropped_stale"], row["dropped_other"], row["dropped_at_stop"]) == (1, 1, 2)
    assert math.isclose(row["reward_last"], 0.2) and math.isclose(row["accuracy_last"], 0.1)
    assert row["ledger_ok"] and row["steps"] == 3 and row["wall_time_s"] == 20.0
    assert series["lag_hist"] == {0: 3, 1: 3, 2: 1} and series["reward"] == [0.0, 0.2, 0.4]
    ledger["0"]["received"] = 4  # a lost message must show
    (tmp_path / "summary.json").write_text(json.dumps({"wall_time_s": 20.0, "ledger": ledger}))
    assert not summarize_run(tmp_path, slots=4)[0]["ledger_ok"]


@pytest.mark.integration
def test_sweep_simulated(tiny_model_dir, tmp_path):
    out = tmp_path / "sweep"
    # one actor count (the sweep's loop over it is the same loop): two runs, not four
    cmd = [PY, "-m", "arpo_async.jobs.experiments", "sweep", "--actors", "2", "--max-staleness",
           "0,1", "--simulate", "--steps", "4", "--time-limit", "120", "--out", str(out),
           f"model.path={tiny_model_dir}", "rollout.mode=arpo", "rollout.group_size=4",
           "rollout.initial_samples=2", "actors.engine.tokens_per_s=300"]
    res = subprocess.run(cmd, cwd=REPO, env=python_env(), capture_output=True, text=True,
                         timeout=400)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    with (out / "sweep.csv").open() as f:
        rows = list(csv.DictReader(f))
    assert [r["name"] for r in rows] == ["a2_s0", "a2_s1"]
    assert list(rows[0]) == COLUMNS
    for r in rows:
        eta = int(r["max_staleness"])
        assert r["status"] == "ok" and r["ledger_ok"] == "True" and int(r["steps"]) == 4, r
        assert r["engine"] == "simulated" and int(r["actors"]) == 2
        assert float(r["trajectories_per_s"]) > 0 and float(r["model_tokens_per_s"]) > 0
        assert 0 < float(r["learner_busy_frac"]) <= 1.05
        assert 0 <= float(r["actor_idle_frac"]) <= 1
        # groups finishing out of order can go stale; they are dropped and counted
        # (ledger_ok above), and nothing trained is ever older than the bound
        assert int(r["staleness_max"]) <= eta
        assert (r["mode"] == "sync (lockstep)") == (eta == 0)
    assert all(float(r["staleness_mean"]) == 0 for r in rows if r["max_staleness"] == "0")
    sweep = json.loads((out / "sweep.json").read_text())
    assert all(len(s["reward"]) == 4 for s in sweep["series"].values())
    for name in ("throughput_vs_actors", "learner_util_vs_actors", "staleness_hist",
                 "reward_vs_wallclock"):
        data = (out / "plots" / f"{name}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, name


@pytest.mark.integration
def test_64_simulated_actors_in_one_process_lose_nothing(tiny_model_dir, tmp_path):
    run_dir = tmp_path / "run"
    cmd = [PY, "-m", "arpo_async.launch", "--quiet", "--config", SPINE, f"run.dir={run_dir}",
           f"model.path={tiny_model_dir}", "actors.engine=simulated", "actors.num=64",
           "actors.engine.actors_per_process=64", "learner.max_steps=4", "learner.batch_groups=8",
           "rollout.mode=arpo", "rollout.group_size=4", "rollout.initial_samples=2",
           "actors.max_restarts=0"]
    res = subprocess.run(cmd, cwd=REPO, env=python_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert list(summary["restarts"]) == ["learner", "actors0-63"]
    ledger = summary["ledger"]
    assert sorted(map(int, ledger)) == list(range(64))  # every actor connected and said bye
    for actor, led in ledger.items():
        assert led["received"] == led["sent"], (actor, led)
        assert led["trained"] + sum(led["dropped"].values()) == led["sent"], (actor, led)
    assert sum(led["trained"] for led in ledger.values()) == 4 * 8
    assert (run_dir / "logs" / "actors0-63.log").exists()
