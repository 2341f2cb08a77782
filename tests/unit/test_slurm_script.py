"""arpo_async/launcher/slurm.py without Slurm: the layout rules (errors name the key), the
config every node of the job reads, the script (valid bash, each part where it belongs),
and ``launch --slurm --emit``'s files. tests/integration/test_slurm.py submits it."""

from __future__ import annotations

import argparse
import shutil
import subprocess

import pytest
import yaml

from arpo_async.core.config import SPINE_CONFIG, ConfigError, load_config
from arpo_async.jobs.preflight import resolve_run
from arpo_async.launch import main as launch_main
from arpo_async.launcher.slurm import (
    check_ports,
    job_config,
    layout,
    run_slurm,
    sbatch_script,
    slurm_request,
)

PORTS = ["transport.trajectory_port=29610", "transport.control_port=29611"]


def _cfg(*overrides: str):
    return load_config(SPINE_CONFIG, [*PORTS, *overrides])


@pytest.mark.parametrize("overrides, nodes, needle", [
    (["learner.world_size=2"], (3, 1), "learner.world_size=2 does not divide"),
    (["actors.num=3"], (1, 2), "actors.num=3"),
    (["actors.num=1"], (1, 2), "actors.num=1"),
    (["cluster.remote_actors=[{host: b, actors: 1}]"], (1, 1), "cluster.remote_actors is set"),
    ([], (0, 1), "at least one node"),
])
def test_layout_refuses_what_does_not_divide(overrides, nodes, needle):
    with pytest.raises(ConfigError, match=needle.replace("[", r"\[")):
        layout(_cfg(*overrides), *nodes)


def test_ports_must_be_fixed_for_actors_on_other_nodes():
    with pytest.raises(ConfigError, match="transport.trajectory_port=0"):
        check_ports(load_config(SPINE_CONFIG, ["transport.control_port=29611"]))


def test_job_config_puts_every_actor_on_the_actor_nodes():
    cfg = _cfg("actors.num=4")
    job = job_config(cfg)
    assert job.actors.num == 0 and [(r.host, r.actors) for r in job.cluster.remote_actors] == [
        ("slurm-het-group-1", 4)]
    assert job.transport.host == "0.0.0.0" and cfg.transport.host == "127.0.0.1"  # a copy
    assert job_config(_cfg("transport.host=10.0.0.5")).transport.host == "10.0.0.5"


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_script_is_bash_and_places_each_part():
    cfg = _cfg("actors.num=4", "learner.world_size=4", "learner.threads=2", "cluster.device=cuda",
               "cluster.master_port=29555")
    text = sbatch_script(job_config(cfg), layout(cfg, 2, 2, "gpu", "02:00:00"), "/env/python",
                         "/shared/repo")
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    head, actors = text.split("#SBATCH hetjob\n")
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --cpus-per-task=4" in head
    assert "#SBATCH --gpus-per-node=2" in head and "#SBATCH --partition=gpu" in head
    assert actors.startswith("#SBATCH --partition=gpu\n#SBATCH --time=02:00:00\n"
                             "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=2")
    assert "--nnodes=2 --nproc-per-node=2" in text and "--master-port=29555" in text
    assert '--node-rank="$SLURM_NODEID"' in text
    assert "for _ in $(seq 2)" in text and "--gpus=1" in text
    assert "PY=/env/python" in text and "#SBATCH --chdir=/shared/repo" in text


def test_emit_writes_the_config_the_keys_and_the_script(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(config=str(SPINE_CONFIG), nodes_learner=1, nodes_actors=1,
                              emit=str(tmp_path / "job.sbatch"), partition="", time="",
                              overrides=[*PORTS, "run.dir=runs/x", "actors.num=2"])
    assert run_slurm(args, resolve_run(slurm_request(args))) == 0
    cfg = yaml.safe_load((tmp_path / "runs/x/config.yaml").read_text())
    assert cfg["actors"]["num"] == 0 and cfg["cluster"]["remote_actors"][0]["actors"] == 2
    assert cfg["transport"]["host"] == "0.0.0.0"
    keys = tmp_path / "runs/x/keys"
    assert {p.name for p in keys.iterdir()} == {"server.key", "server.key_secret",
                                                 "client.key", "client.key_secret"}
    assert (tmp_path / "runs/x/logs").is_dir()  # sbatch --output writes there
    assert f"#SBATCH --chdir={tmp_path}" in (tmp_path / "job.sbatch").read_text()
    assert not (tmp_path / "runs/x/slurm.sbatch").exists()  # --emit: not submitted


def test_emit_needs_slurm(capsys):
    assert launch_main(["--emit", "x.sbatch"]) == 2
    assert "--emit writes a Slurm script" in capsys.readouterr().err


def test_a_bad_layout_is_refused_before_keys_or_a_model_are_made(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = argparse.Namespace(config=str(SPINE_CONFIG), nodes_learner=1, nodes_actors=3,
                              emit=str(tmp_path / "job.sbatch"), partition="", time="",
                              overrides=[*PORTS, "run.dir=runs/x", "actors.num=2"])
    with pytest.raises(ConfigError):
        slurm_request(args)
    assert not (tmp_path / "runs/x").exists()
