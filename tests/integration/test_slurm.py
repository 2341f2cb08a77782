"""Slurm places the processes, for real, across hosts: a three-node Slurm cluster whose
nodes are network namespaces with their own addresses and hostnames
(tests/integration/netns.py): slurmctld on l0 (the head node), one slurmd on each of l0,
l1 and a0, munged on this machine (its socket is a file every namespace reaches), all
started by the test from a config it writes. The sbatch script of ``launch --slurm
--nodes-learner 2 --nodes-actors 1`` is submitted to it for a short spine run: a ZeRO-3
learner with one rank on each of l0 and l1 (het group 0: one torchrun per node,
rendezvous at l0's address, gloo over the hosts' cables), two actors as two srun steps on
a0 (het group 1) reaching rank 0 over CurveZMQ; the run folder and keys on the shared
disk. Skipped, with the reason in one line, where the packages, root or namespaces are
missing, or the daemons do not start."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import PY, SPINE, python_env
from tests.integration import netns

pytestmark = [pytest.mark.integration, pytest.mark.slow]

_DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol")
_NODES = ("l0", "l1", "a0")  # node names; each node's host is the namespace of that name
CTLD_PORT, SLURMD_PORT = 6817, 6818  # Slurm's defaults: nothing else lives on these hosts
TRAJ_PORT, CTRL_PORT, RDZV_PORT = 29610, 29611, 29620


def _slurm_conf(d: Path, hosts: netns.Hosts) -> str:
    nodes = "\n".join(f"NodeName={n} NodeHostname={hosts.hostname(n)} "
                      f"NodeAddr={hosts.addr[n]} Port={SLURMD_PORT} CPUs=4 State=UNKNOWN"
                      for n in _NODES)
    return f"""ClusterName=arpotest
SlurmctldHost={hosts.hostname("l0")}({hosts.addr["l0"]})
SlurmctldPort={CTLD_PORT}
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
    """munged (here), slurmctld (on l0) and one slurmd per node (on its host), in ``d``;
    ``run`` runs a client command on the head node l0, where slurmctld listens."""

    def __init__(self, d: Path, hosts: netns.Hosts):
        self.d, self.hosts, self.procs = d, hosts, []
        for sub in ("state", "spool", "log"):
            (d / sub).mkdir(parents=True)
        os.chmod(d, 0o700)  # munged refuses a key or socket others could reach
        (d / "munge.key").write_bytes(os.urandom(1024))
        os.chmod(d / "munge.key", 0o600)
        (d / "slurm.conf").write_text(_slurm_conf(d, hosts))
        self.env = python_env() | {"SLURM_CONF": str(d / "slurm.conf")}

    def _start(self, host: str | None, *argv: str) -> None:
        log = (self.d / "log" / f"{argv[0]}-{len(self.procs)}.out").open("w")
        cmd = self.hosts.command(host, list(argv)) if host else list(argv)
        self.procs.append(subprocess.Popen(cmd, env=self.env, stdout=log,
                                           stderr=subprocess.STDOUT, start_new_session=True))

    def start(self) -> str:
        """"" once every node is idle, else the reason in one line."""
        d = self.d
        self._start(None, "munged", "-F", "-f", f"--socket={d}/munge.socket",
                    f"--key-file={d}/munge.key", f"--pid-file={d}/munged.pid",
                    f"--log-file={d}/log/munged.log", f"--seed-file={d}/munged.seed")
        self._start("l0", "slurmctld", "-D", "-i")
        for node in _NODES:
            self._start(node, "slurmd", "-D", "-N", node)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            dead = [p.args for p in self.procs if p.poll() is not None]
            if dead:
                name = next(a for a in dead[0] if a in _DAEMONS or a == "munged")
                return f"{name} exited at start: {self._last_log_line()}"
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

    def run(self, *argv: str, timeout: float = 30, env: dict | None = None,
            cwd: Path | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(self.hosts.command("l0", list(argv)), env=env or self.env,
                              cwd=cwd, capture_output=True, text=True, timeout=timeout)

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
    for hosts in netns.hosts_or_skip(list(_NODES)):  # root, namespaces; removed afterwards
        c = Cluster(tmp_path_factory.mktemp("slurm"), hosts)
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


def test_sbatch_script_places_two_learner_nodes_and_two_actor_steps(cluster, tiny_model_dir,
                                                                     tmp_path):
    """``launch --slurm`` as a user runs it on the head node (sbatch included); gloo is
    told the hosts' interface (``GLOO_SOCKET_IFNAME``, passed to every step by sbatch's
    default ``--export=ALL``): the hosts' names resolve nowhere, as on a cluster whose DNS
    does not know its nodes."""
    run_dir = tmp_path / "run"
    env = cluster.env | {"GLOO_SOCKET_IFNAME": "eth0"}
    sub = cluster.run(
        PY, "-m", "arpo_async.launch", "--slurm", "--nodes-learner", "2", "--nodes-actors",
        "1", "--config", SPINE, f"run.dir={run_dir}", f"model.path={tiny_model_dir}",
        "actors.engine=simulated", "actors.num=2", "learner.world_size=2",
        "learner.zero_stage=3", "learner.max_steps=3", f"transport.trajectory_port={TRAJ_PORT}",
        f"transport.control_port={CTRL_PORT}", f"cluster.master_port={RDZV_PORT}",
        "transport.request_timeout_s=10", "learner.collective_timeout_s=120",
        env=env, cwd=tmp_path, timeout=180)
    assert sub.returncode == 0, sub.stdout + sub.stderr
    job = sub.stdout.split("submitted job ")[1].split(";")[0].split()[0]
    script = (run_dir / "slurm.sbatch").read_text()
    assert "#SBATCH hetjob" in script and "--nnodes=2 --nproc-per-node=1" in script, script
    _wait_job(cluster, job, timeout_s=400)
    out = (run_dir / "logs" / f"slurm-{job}.out").read_text()
    logs = {p.name: p.read_text(errors="replace")[-1500:] for p in (run_dir / "logs").glob("*")}
    # Slurm chose the nodes: the learner's two (rank 0 on the first, at its NodeAddr) and
    # the actors' one, all three different; the ranks say they run on those hosts
    m = re.search(r"learner: nodes (\S+), rank 0 on (\S+) \((\S+)\)", out)
    assert m, (out, logs)
    learner_nodes = cluster.run("scontrol", "show", "hostnames", m.group(1)).stdout.split()
    first, addr = m.group(2), m.group(3)
    assert len(learner_nodes) == 2 and first == learner_nodes[0], out
    assert addr == cluster.hosts.addr[first], out
    (actor_node,) = set(_NODES) - set(learner_nodes)
    assert f"actor 0: node {actor_node}" in out and f"actor 1: node {actor_node}" in out, out
    learner = (run_dir / "logs" / "learner.log").read_text(errors="replace")
    hosts = [cluster.hosts.hostname(n) for n in learner_nodes]
    assert f"learner ranks: 0 on {hosts[0]}, 1 on {hosts[1]}" in learner, logs
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 3, (summary, out, logs)
    assert set(summary["ledger"]) == {"0", "1"} and not summary["actors_not_back"], summary
    for led in summary["ledger"].values():  # both srun-step actors trained, all accounted
        assert led["sent"] >= 1 and led["received"] + led["lost"] == led["sent"], summary
        assert led["trained"] + sum(led["dropped"].values()) == led["received"], summary
    assert summary["learner"]["rejected"] == {}, summary["learner"]["rejected"]
    # Slurm's own record: the learner's step has a task on each learner node, the
    # actors' two steps run on the third
    steps = {n: (cluster.d / "log" / f"slurmd-{n}.log").read_text().count("launch task ")
             for n in _NODES}
    assert steps == {learner_nodes[0]: 1, learner_nodes[1]: 1, actor_node: 2}, steps
    print(f"\nslurm: job {job}: {summary['wall_time_s']:.0f} s, ledger {summary['ledger']}")
