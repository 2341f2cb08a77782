"""The multi-host form on one machine: a learner started by the launcher with no local
actors, and two actors started as on other machines, with exactly the commands
``launch --dry-run`` prints for ``cluster.remote_actors`` (all "hosts" on loopback),
CurveZMQ keys on every socket, the config fetched from the learner."""

from __future__ import annotations

import json
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from arpo_async.core.ports import free_ports
from tests.conftest import PY, REPO, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _free_ports(n: int) -> list[int]:
    return free_ports(n)


def _write_config(path: Path, run_dir: Path, model: Path) -> None:
    traj, ctrl = _free_ports(2)
    path.write_text(yaml.safe_dump({
        "run": {"dir": str(run_dir)},
        "model": {"path": str(model)},
        "actors": {"num": 0, "engine": "transformers", "start_wait_s": 120,
                   "max_restarts": 0},
        "cluster": {"remote_actors": [{"host": "127.0.0.1", "actors": 2}]},
        "transport": {"host": "127.0.0.1", "trajectory_port": traj, "control_port": ctrl},
        "rollout": {"mode": "grpo", "group_size": 4, "initial_samples": 4},
        "sampling": {"round_max_tokens": 16, "max_response_tokens": 32},
        "learner": {"max_steps": 3, "batch_groups": 2, "sync_every": 1, "max_staleness": 1,
                    "wait_timeout_s": 180},
    }))


def _remote_commands(plan_text: str) -> dict[int, str]:
    """actor id -> the shell line the plan says to run on that actor's machine."""
    lines = plan_text.splitlines()
    out = {}
    for i, line in enumerate(lines):
        if " (start on 127.0.0.1;" in line:
            out[int(line.split()[0].removeprefix("actor"))] = lines[i + 1].strip()
    return out


def _start(command: str, **kw) -> subprocess.Popen:
    words = shlex.split(command)
    env = python_env()
    while "=" in words[0]:
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[:4] == ["python", "-m", "arpo_async.launch", "actor"], words
    return subprocess.Popen([PY, *words[1:]], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **kw)


def test_learner_with_two_actors_started_as_on_other_machines(tiny_model_dir, tmp_path):
    from arpo_async.core.keys import generate

    run_dir = tmp_path / "run"
    generate(run_dir)  # keys present: CurveZMQ on every socket, as between machines
    config = tmp_path / "two_hosts.yaml"
    _write_config(config, run_dir, tiny_model_dir)
    dry = subprocess.run([PY, "-m", "arpo_async.launch", "--config", str(config), "--dry-run"],
                         cwd=REPO, env=python_env(), capture_output=True, text=True, timeout=60)
    assert dry.returncode == 0, dry.stderr
    commands = _remote_commands(dry.stdout)
    assert sorted(commands) == [0, 1] and all(f"--keys {run_dir}/keys" in c
                                              for c in commands.values())

    learner = subprocess.Popen([PY, "-m", "arpo_async.launch", "--config", str(config)],
                               cwd=REPO, env=python_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    actors = {}
    try:
        actors = {i: _start(c) for i, c in commands.items()}
        # an actor that may not change learning settings, and one without the keys
        ctrl = yaml.safe_load(config.read_text())["transport"]["control_port"]
        bad = _start(commands[0] + " sampling.temperature=0.5")
        keyless = _start(f"python -m arpo_async.launch actor --connect tcp://127.0.0.1:{ctrl} "
                         "--wait 3")
        out, _ = learner.communicate(timeout=400)
        assert learner.returncode == 0, out[-4000:]
        for i, proc in actors.items():
            log, _ = proc.communicate(timeout=60)
            assert proc.returncode == 0, (i, log[-3000:])
        bad_out, _ = bad.communicate(timeout=60)
        keyless_out, _ = keyless.communicate(timeout=60)
    finally:
        for proc in [learner, *actors.values()]:
            if proc.poll() is None:
                proc.kill()
    assert bad.returncode == 2 and "sampling.temperature: cannot be set on an actor" in bad_out
    assert keyless.returncode == 2 and "keys passed with --keys" in keyless_out

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3, summary
    ledger = summary["ledger"]
    assert set(ledger) == {"0", "1"}, ledger
    for led in ledger.values():  # both remote actors generated, and every group is accounted
        assert led["sent"] >= 1 and led["received"] == led["sent"], ledger
        assert led["trained"] + sum(led["dropped"].values()) == led["sent"], ledger
    assert sum(led["trained"] for led in ledger.values()) == 3 * 2
    for i in (0, 1):  # each actor ran from the config the learner sent, on this "machine"
        local = yaml.safe_load((run_dir / f"actor{i}" / "config.yaml").read_text())
        learner_cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        assert local["sampling"] == learner_cfg["sampling"]
        assert local["transport"]["host"] == "127.0.0.1"
        assert (run_dir / f"actor{i}" / "keys" / "client.key_secret").exists()
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["groups"] == 2
