"""Authentication (issue 7): a non-loopback bind needs CurveZMQ keys (or an explicit,
loudly warned ``transport.insecure``); on such a run, peers without the run's client key
can neither deliver a trajectory nor receive weights, and an API key held in the
environment never reaches the run folder."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
import uuid

import numpy as np
import pytest
import yaml
import zmq

from tests.conftest import PY, REPO, SPINE, python_env

pytestmark = [pytest.mark.integration]


def _launch(*args: str, env: dict | None = None, timeout: float = 60):
    return subprocess.run([PY, "-m", "arpo_async.launch", "--config", SPINE, *args], cwd=REPO,
                          env=env or python_env(), capture_output=True, text=True,
                          timeout=timeout)


def _host_address() -> str:
    """This machine's address on its default route (not loopback), else 127.0.0.1."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # no packet is sent: only picks the route
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def test_a_non_loopback_bind_without_keys_is_refused_at_start(tmp_path):
    res = _launch(f"run.dir={tmp_path / 'run'}", f"model.path={tmp_path / 'model'}",
                  "transport.host=0.0.0.0")
    assert res.returncode == 2, res.stderr
    lines = [x for x in res.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "python -m arpo_async.core.keys" in lines[0], res.stderr
    assert not (tmp_path / "model").exists() and not (tmp_path / "run" / "processes.json").exists()


def test_insecure_true_is_allowed_with_a_warning(tmp_path, capsys):
    from arpo_async.launcher.supervisor import LaunchRequest, resolve

    args = LaunchRequest(quiet=True, dry_run=True, overrides=[
        f"run.dir={tmp_path / 'run'}", "transport.host=0.0.0.0", "transport.insecure=true"])
    cfg = resolve(args)
    assert cfg.transport.insecure and cfg.transport.trajectory_port > 0
    assert "WITHOUT encryption or authentication" in capsys.readouterr().err


def _group(actor_id: int):
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup, encode

    leaf = Trajectory(tokens=np.arange(5, 13, dtype=np.int32), loss_mask=np.ones(8, np.uint8),
                      logprobs=np.full(8, -1.0, np.float32), versions=np.zeros(8, np.int32),
                      reward=1.0)
    return encode(TrajectoryGroup("rogue", actor_id, "p", np.arange(1, 5, dtype=np.int32),
                                  [leaf, leaf]))


class Rogue:
    """Peers that try the learner's sockets: with an unknown CurveZMQ key, without any,
    and (the control case) with the run's own client key."""

    def __init__(self, host: str, ports: dict, client_keys):
        self.host, self.ports, self.client_keys = host, ports, client_keys
        self.ctx = zmq.Context()
        self.results: dict[str, object] = {}

    def _socket(self, kind: int, port: int, keys: str):
        import zmq.auth

        sock = self.ctx.socket(kind)
        sock.linger = 0
        if keys == "stranger":
            public, secret = zmq.curve_keypair()
            sock.curve_publickey, sock.curve_secretkey = public, secret
            sock.curve_serverkey = self.client_keys.server_public
        elif keys == "client":
            sock.curve_publickey = self.client_keys.public
            sock.curve_secretkey = self.client_keys.secret
            sock.curve_serverkey = self.client_keys.server_public
        sock.connect(f"tcp://{self.host}:{port}")
        return sock

    def push(self, keys: str) -> None:
        sock = self._socket(zmq.PUSH, self.ports["trajectory_port"], keys)
        sock.sndtimeo = 3000
        try:
            for _ in range(3):
                sock.send_multipart(_group(actor_id=9))
            self.results[f"push/{keys}"] = "queued"
        except zmq.Again:
            self.results[f"push/{keys}"] = "refused"
        time.sleep(1.0)  # give an accepted connection time to deliver
        sock.close()

    def weights(self, keys: str) -> None:
        from arpo_async.core.protocol import decode, encode
        from arpo_async.core.weights.zeromq import WeightsRequest

        sock = self._socket(zmq.DEALER, self.ports["control_port"], keys)
        sock.send_multipart([(1).to_bytes(8, "big"), *encode(WeightsRequest(9, -1))])
        if sock.poll(4000):
            reply = decode(sock.recv_multipart()[1:])
            self.results[f"weights/{keys}"] = type(reply).__name__
        else:
            self.results[f"weights/{keys}"] = "no reply"
        sock.close()

    def run(self) -> None:
        self.weights("client")  # first, while the run is surely still going
        for keys in ("stranger", "none"):
            self.push(keys)
            self.weights(keys)
        self.ctx.term()


def test_peers_without_the_run_key_get_nothing_in_and_nothing_out(tiny_model_dir, tmp_path):
    from arpo_async.core.keys import load_client_keys

    run_dir = tmp_path / "run"
    made = subprocess.run([PY, "-m", "arpo_async.core.keys", str(run_dir)], cwd=REPO,
                          env=python_env(), capture_output=True, text=True, timeout=30)
    assert made.returncode == 0, made.stderr
    secret = f"sk-{uuid.uuid4().hex}"
    env = python_env() | {"SERPER_API_KEY": secret, "ARPO_TEST_API_KEY": secret}
    host = _host_address()
    rogue_box: list[Rogue] = []

    def attack() -> None:
        deadline = time.time() + 300
        metrics = run_dir / "metrics.jsonl"  # its first line: the learner has published
        while time.time() < deadline and not (metrics.exists() and metrics.read_text()):
            time.sleep(0.3)
        ports = yaml.safe_load((run_dir / "config.yaml").read_text())["transport"]
        rogue = Rogue(host, ports, load_client_keys(run_dir / "keys"))
        rogue_box.append(rogue)
        rogue.run()

    thread = threading.Thread(target=attack, daemon=True)
    thread.start()
    res = _launch("--quiet", f"run.dir={run_dir}", f"model.path={tiny_model_dir}",
                  "transport.host=0.0.0.0", "actors.num=2", "actors.engine=transformers",
                  "learner.max_steps=20", "rollout.mode=grpo", "rollout.group_size=4",
                  env=env, timeout=400)
    thread.join(30)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    assert rogue_box, "the learner never came up"
    got = rogue_box[0].results
    # the control case: the run's own key reaches the learner on that address
    assert got["weights/client"] == "WeightsUpdate", got
    assert got["weights/stranger"] == "no reply" and got["weights/none"] == "no reply", got
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and set(summary["ledger"]) == {"0", "1"}
    rejected = summary["learner"]["rejected"]
    assert rejected.get("curve_denied", 0) >= 1 and rejected.get("control/curve_denied", 0) >= 1
    assert "9" not in summary["ledger"]
    # the API key in the environment is nowhere in the run folder (logs, config, state...)
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    assert secret not in res.stdout + res.stderr
    mode = os.stat(run_dir / "keys" / "server.key_secret").st_mode & 0o777
    assert mode == 0o600
    print(f"\nauth: host {host}: {got}; rejected {rejected}")
