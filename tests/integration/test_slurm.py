"""Slurm places the processes, for real: a two-node Slurm cluster on this machine (munged,
slurmctld and two slurmd started by the test from a config it writes; Debian's
slurm-wlm 22.05 runs several slurmd on one host, each its own node), and the sbatch
script of ``launch --slurm`` submitted to it for a short spine run: one learner rank on
node n1 (het group 0, torchrun), two actors as two srun steps on node n2 (het group 1),
CurveZMQ keys and the run folder on the (shared) local disk. Skipped, with the reason in
one line, where the packages are missing or the daemons do not start."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from arpo_async.core.ports import free_ports
from tests.conftest import PY, SPINE, python_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
_NODES = ("n1", "n2")


def _free_ports(n: int) -> list[int]:
    """Below the kernel's ephemeral range (arpo_async/core/ports.py): the sockets srun and
    slurmstepd open take ephemeral ports, and one once took the learner's."""
    return free_ports(n)


def _slurm_conf(d: Path, ports: list[int]) -> str:
    ctld, *node_ports = ports
    nodes = "\n".join(f"NodeName={n} NodeHostname={socket.gethostname()} NodeAddr=127.0.0.1 "
                      f"Port={p} CPUs=4 State=UNKNOWN" for n, p in zip(_NODES, node_ports))
    return f"""ClusterName=arpotest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={d}/munge.socket
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
ReturnToService=2
SlurmdParameters=config_overrides
{nodes}
PartitionName=debug Nodes={",".join(_NODES)} Default=YES MaxTime=INFINITE State=UP
"""


class Cluster:
    """munged, slurmctld and one slurmd per node, in ``d``; ``env`` reaches them."""

    def __init__(self, d: Path):
        self.d, self.procs = d, []
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True)
        os.chmod(d, 0o700)  # munged refuses a key or socket others could reach
        (d / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(d / "munge.key", 0o600)
        (d / "slurm.conf").write_text(_slurm_conf(d, _free_ports(1 + len(_NODES))))
        self.env = python_env() | {"SLURM_CONF": str(d / "slurm.conf")}

    def _start(self, *argv: str) -> None:
        log = (self.d / "log" / f"{argv[0]}-{len(self.procs)}.out").open("w")
        self.procs.append(subprocess.Popen(argv, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def start(self) -> str:
        """"" once every node is idle, else the reason in one line."""
        d = self.d
        self._start("munged", "-F", "-f", f"--socket={d}/munge.socket",
                    f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed")
        self._start("slurmctld", "-D", "-i")
        for node in _NODES:
            self._start("slurmd", "-D", "-N", node)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                return f"{dead[0]} exited at start: {self._last_log_line()}"
            res = self.run("sinfo", "-h", "-N", "-o", "%N %T")
            states = dict(line.split() for line in res.stdout.splitlines() if line.strip())
            if all(states.get(n) == "idle" for n in _NODES):
                return ""
            time.sleep(0.5)
        return f"the nodes did not become idle within 60 s: {self._last_log_line()}"

    def _last_log_line(self) -> str:
        lines = [x for f in sorted((self.d / "log").glob("*")) for x in
                 f.read_text(errors="replace").splitlines() if "error" in x.lower()]
        return lines[-1].strip() if lines else "(no error in the daemons' logs)"

    def run(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True,
                              timeout=timeout)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = [d for d in _DAEMONS if shutil.which(d) is None]
    if missing:
        pytest.skip(f"Slurm not installed ({missing[0]} missing): apt-get install slurm-wlm munge")
    if os.geteuid() != 0:
        pytest.skip("the one-machine Slurm cluster runs its daemons as root")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        why = c.start()
        if why:
            pytest.skip(f"Slurm daemons did not start: {why}")
        yield c
    finally:
        c.stop()


def _wait_job(c: Cluster, job: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not c.run("squeue", "-h", "-j", job).stdout.strip():
            return
        time.sleep(1)
    c.run("scancel", job)
    raise AssertionError(f"job {job} still queued or running after {timeout_s:.0f} s")


def test_sbatch_script_places_learner_and_two_actor_steps(cluster, tiny_model_dir, tmp_path):
    traj, ctrl, rdzv = _free_ports(3)
    run_dir = tmp_path / "run"
    sub = subprocess.run(
        [PY, "-m", "arpo_async.launch", "--slurm", "--nodes-learner", "1", "--nodes-actors",
         "1", "--config", SPINE, f"run.dir={run_dir}", f"model.path={tiny_model_dir}",
         "actors.engine=simulated", "actors.num=2", "learner.max_steps=3",
         f"transport.trajectory_port={traj}", f"transport.control_port={ctrl}",
         f"cluster.master_port={rdzv}", "transport.request_timeout_s=10"],
        cwd=tmp_path, env=cluster.env, capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.split("submitted job ")[1].split(";")[0].split()[0]
    script = (run_dir / "slurm.sbatch").read_text()
    assert "#SBATCH hetjob" in script and "--het-group=1" in script, script
    _wait_job(cluster, job, timeout_s=300)
    out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    logs = {p.name: p.read_text(errors="replace")[-1500:] for p in (run_dir / "logs").glob("*")}
    assert "learner: nodes n1, rank 0 on n1 (127.0.0.1)" in out, (out, logs)
    assert "actor 0: node n2" in out and "actor 1: node n2" in out, out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3, (summary, out, logs)
    assert set(summary["ledger"]) == {"0", "1"} and not summary["actors_not_back"], summary
    for led in summary["ledger"].values():  # both srun-step actors trained, all accounted
        assert led["sent"] >= 1 and led["received"] + led["lost"] == led["sent"], summary
        assert led["trained"] + sum(led["dropped"].values()) == led["received"], summary
    assert summary["learner"]["rejected"] == {}, summary["learner"]["rejected"]
    # Slurm's own record: one step (the learner's torchrun) on n1, two (the actors) on n2
    steps = {n: (cluster.d / "log" / f"slurmd-{n}.log").read_text().count("launch task ")
             for n in _NODES}
    assert steps == {"n1": 1, "n2": 2}, steps
    print(f"\nslurm: job {job}: {summary['wall_time_s']:.0f} s, ledger {summary['ledger']}")
