"""The learner across hosts: a ZeRO-3 learner with one rank on each of two hosts, and an
actor on a third, each host a network namespace with its own address and hostname
(tests/integration/netns.py). Everything starts as the Slurm script starts it
(``launch --slurm --emit``: the resolved RUN_DIR/config.yaml and CurveZMQ keys on the
shared run folder; the learner bound to every interface of its host; one ``torchrun`` per
learner host, node rank 0 holding rank 0 and the sockets; ``launch actor --connect`` on
the actor host), gloo over the hosts' cables (``GLOO_SOCKET_IFNAME=eth0``: the hosts'
names resolve nowhere, as on a cluster whose DNS does not know them).

- ``test_two_learner_hosts_train_and_agree``: the run trains to its last step; the ranks
  say which host each is on; at step 1 every trained token's learner log-prob matches
  the actor's within 1e-3 (``loss/is_raw_weight`` with ``proximal=recompute``); the
  checkpoint written across the two hosts loads in transformers and holds the weights
  the learner published last.
- ``test_a_learner_host_cut_off_fails_the_step_and_resume_continues``: the second learner
  host's cable is pulled mid-run: rank 0 fails its step within
  ``learner.collective_timeout_s`` with a line naming both hosts (no hang); with the cable
  back, ``--resume`` on both hosts continues from the checkpoint to the last step.

The actor runs the ``transformers`` engine (real log-probs of the tiny model): the
agreement check needs them.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PY, REPO, SPINE, python_env
from tests.integration import netns

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HOSTS = ["l0", "l1", "a0"]
TRAJ_PORT, CTRL_PORT, RDZV_PORT = 29610, 29611, 29620  # nothing else lives on these hosts
DEADLINE_S = 20


@pytest.fixture(scope="module")
def hosts():
    yield from netns.hosts_or_skip(HOSTS)


class Job:
    """One run laid out as the Slurm script lays it out, on the namespace hosts."""

    def __init__(self, hosts: netns.Hosts, root: Path, model: Path, steps: int):
        self.hosts, self.root, self.procs = hosts, root, {}
        self.run_dir = root / "run"
        overrides = [
            f"run.dir={self.run_dir}", f"model.path={model}", "actors.num=1",
            "actors.engine=transformers", "actors.start_wait_s=120", "actors.max_restarts=0",
            f"transport.trajectory_port={TRAJ_PORT}",
            f"transport.control_port={CTRL_PORT}", "transport.connect_timeout_s=600",
            f"cluster.master_port={RDZV_PORT}", "sampling.round_max_tokens=16",
            "sampling.max_response_tokens=32", "learner.world_size=2", "learner.zero_stage=3",
            f"learner.max_steps={steps}", "learner.batch_groups=2", "learner.sync_every=1",
            "learner.max_staleness=1", "learner.checkpoint_every=2",
            "learner.wait_timeout_s=300", f"learner.collective_timeout_s={DEADLINE_S}",
            "learner.loss.proximal=recompute", "learner.lr=1e-3"]
        res = subprocess.run(
            [PY, "-m", "arpo_async.launch", "--slurm", "--nodes-learner", "2",
             "--nodes-actors", "1", "--emit", str(root / "job.sbatch"), "--config", SPINE,
             *overrides], cwd=REPO, env=python_env(), capture_output=True, text=True,
            timeout=300)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        self.script = (root / "job.sbatch").read_text()
        # the learner line of the script, as this test runs it on each host
        assert "--nnodes=2 --nproc-per-node=1" in self.script, self.script
        assert f"--master-port={RDZV_PORT}" in self.script, self.script

    def _start(self, host: str, argv: list[str], env: dict, log: str) -> subprocess.Popen:
        out = (self.root / log).open("a")
        proc = subprocess.Popen(self.hosts.command(host, argv), cwd=REPO, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.procs[log] = proc
        return proc

    def start_learner(self, resume: bool = False) -> None:
        env = python_env() | {"OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu",
                              "GLOO_SOCKET_IFNAME": "eth0"}
        for node, host in enumerate(("l0", "l1")):
            argv = [PY, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
                    f"--node-rank={node}", f"--master-addr={self.hosts.addr['l0']}",
                    f"--master-port={RDZV_PORT}", "-m", "learner.main", "--config",
                    str(self.run_dir / "config.yaml"), *(["--resume"] if resume else [])]
            self._start(host, argv, env, f"learner-{host}.log")

    def start_actor(self) -> None:
        argv = [PY, "-m", "arpo_async.launch", "actor", "--connect",
                f"tcp://{self.hosts.addr['l0']}:{CTRL_PORT}", "--actor-id", "0", "--keys",
                str(self.run_dir / "keys")]
        self._start("a0", argv, python_env() | {"OMP_NUM_THREADS": "1"}, "actor.log")

    def rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def wait_step(self, step: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if any(r["step"] >= step for r in self.rows()):
                return
            assert self.procs["learner-l0.log"].poll() is None, self.logs()
            time.sleep(0.5)
        raise AssertionError(f"no step {step} within {timeout_s:.0f} s: {self.logs()}")

    def wait_exit(self, log: str, timeout_s: float) -> int:
        try:
            return self.procs[log].wait(timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{log} still running after {timeout_s:.0f} s: "
                                 f"{self.logs()}") from None

    def log(self, name: str) -> str:
        path = self.root / name
        return path.read_text(errors="replace") if path.exists() else ""

    def logs(self) -> str:
        return "\n".join(f"--- {n}\n{self.log(n)[-2500:]}" for n in self.procs)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)


@pytest.fixture
def job(hosts, tiny_model_dir, tmp_path):
    made = []

    def make(steps: int) -> Job:
        made.append(Job(hosts, tmp_path, tiny_model_dir, steps))
        return made[-1]

    yield make
    for j in made:
        j.stop()
    hosts.link("l1", "up")


def test_two_learner_hosts_train_and_agree(job):
    j = job(4)
    j.start_learner()
    j.start_actor()
    assert j.wait_exit("learner-l0.log", 600) == 0, j.logs()
    assert j.wait_exit("learner-l1.log", 120) == 0, j.logs()
    rows = j.rows()
    assert [r["step"] for r in rows] == [1, 2, 3, 4], j.logs()
    assert "learner ranks: 0 on l0-host, 1 on l1-host" in j.log("learner-l0.log"), j.logs()
    first = rows[0]  # learner log-probs before the update against the actor's
    assert 1 - 1e-3 <= first["loss/is_raw_weight_min"] <= first["loss/is_raw_weight_max"] \
        <= 1 + 1e-3, first
    from transformers import AutoModelForCausalLM

    ckpts = sorted((j.run_dir / "checkpoints").glob("step-*"))
    assert ckpts, list(j.run_dir.iterdir())
    model = AutoModelForCausalLM.from_pretrained(ckpts[-1])  # gathered across both hosts
    assert sum(p.numel() for p in model.parameters()) > 0
    assert all(p.isfinite().all() for p in model.parameters())


def test_a_learner_host_cut_off_fails_the_step_and_resume_continues(job, hosts):
    j = job(12)
    j.start_learner()
    j.start_actor()
    j.wait_step(3, 600)  # the checkpoint of step 2 is written
    hosts.link("l1", "down")
    cut = time.monotonic()
    code = j.wait_exit("learner-l0.log", DEADLINE_S + 120)
    took = time.monotonic() - cut
    assert code != 0, j.logs()
    line = re.search(r"learner rank 0 on l0-host failed: .*", j.log("learner-l0.log"))
    assert line and "(ranks: 0 on l0-host, 1 on l1-host;" in line.group(0), j.logs()
    assert took <= DEADLINE_S + 90, (took, line.group(0))  # a deadline, not a hang
    j.procs["learner-l1.log"].kill()
    j.procs["learner-l1.log"].wait(30)
    hosts.link("l1", "up")
    last = max(r["step"] for r in j.rows())
    j.start_learner(resume=True)
    assert j.wait_exit("learner-l0.log", 600) == 0, j.logs()
    steps = [r["step"] for r in j.rows()]
    assert steps[-1] == 12 and last < 12, steps
    assert "resumed from" in j.log("learner-l0.log"), j.logs()
