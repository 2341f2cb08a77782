"""The launcher starts what ``--dry-run`` prints: ``supervisor.plan``, the function
``launch`` calls, builds its processes from arpo_async/launcher/plan.py's local roles
(commands, environment, logs), hands back the remote ones to print, and rewrites the
learner command for a restart with ``--resume``. No process is started here."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arpo_async.core.config import SPINE_CONFIG, config_from_dict, load_config
from arpo_async.launcher import supervisor
from arpo_async.launcher.plan import RoleSpec
from arpo_async.launcher.plan import plan as process_plan


def _port_of(cmd: list[str]) -> int | None:
    for c in cmd:
        if c.startswith("--master-port="):
            return int(c.split("=", 1)[1])
    return None


def _assert_same(cfg, roles: list[supervisor.Role], specs: list[RoleSpec]) -> None:
    """Every local spec became one Role with its argv, its env over ours, its log file."""
    local = [s for s in specs if s.local]
    assert [r.name for r in roles] == [s.name for s in local]
    for role, spec in zip(roles, local):
        assert role.cmd == list(spec.argv), role.name
        assert role.env == dict(os.environ, **spec.env), role.name
        assert role.log == Path(cfg.run.dir) / "logs" / spec.log
        assert role.proc is None


CONFIG = Path("runs/t/config.yaml")


def test_default_config_roles_are_the_plans(tmp_path):
    cfg = load_config(SPINE_CONFIG, [f"run.dir={tmp_path}", "learner.threads=3",
                                     "actors.threads=2"])
    roles, remote = supervisor.plan(cfg, CONFIG)
    assert remote == []
    _assert_same(cfg, roles, process_plan(cfg, CONFIG))
    learner, *actors = roles
    assert learner.env["OMP_NUM_THREADS"] == "3" and learner.env["PYTHONUNBUFFERED"] == "1"
    assert learner.env["TOKENIZERS_PARALLELISM"] == "false"
    assert [a.env["OMP_NUM_THREADS"] for a in actors] == ["2"] * cfg.actors.num
    assert [a.cmd[-1] for a in actors] == [str(i) for i in range(cfg.actors.num)]


def test_two_learner_ranks_get_a_free_rendezvous_port_unless_one_is_fixed(tmp_path):
    cfg = config_from_dict({"run": {"dir": str(tmp_path)}, "learner": {"world_size": 2}})
    roles, remote = supervisor.plan(cfg, CONFIG)
    assert remote == []
    port = _port_of(roles[0].cmd)
    assert port and roles[0].cmd[2] == "torch.distributed.run"
    _assert_same(cfg, roles, process_plan(cfg, CONFIG, master_port=port))

    cfg.cluster.master_port = 29123
    roles, remote = supervisor.plan(cfg, CONFIG)
    assert remote == []
    assert _port_of(roles[0].cmd) == 29123
    _assert_same(cfg, roles, process_plan(cfg, CONFIG, master_port=29123))


def test_simulated_actors_share_processes_as_the_plan_groups_them(tmp_path):
    cfg = load_config(SPINE_CONFIG, [f"run.dir={tmp_path}", "actors.engine=simulated",
                                     "actors.num=5", "actors.engine.actors_per_process=2"])
    roles, remote = supervisor.plan(cfg, CONFIG)
    assert remote == []
    _assert_same(cfg, roles, process_plan(cfg, CONFIG))
    assert [r.name for r in roles] == ["learner", "actors0-1", "actors2-3", "actors4-4"]


def _remote_cfg(tmp_path):
    return config_from_dict({
        "run": {"dir": str(tmp_path)}, "actors": {"num": 1},
        "transport": {"host": "0.0.0.0", "insecure": True, "trajectory_port": 29610,
                      "control_port": 29611},
        "cluster": {"learner_address": "node-a",
                    "remote_actors": [{"host": "node-b", "actors": 2}]}})


def test_remote_actors_are_printed_not_started(tmp_path, capsys):
    cfg = _remote_cfg(tmp_path)
    roles, remote = supervisor.plan(cfg, CONFIG)
    specs = process_plan(cfg, CONFIG)
    _assert_same(cfg, roles, specs)
    assert [r.name for r in roles] == ["learner", "actor0"]
    assert [s.name for s in remote] == [s.name for s in specs[2:]]
    supervisor._print_remote(remote)
    out = capsys.readouterr().out
    assert "start these 2 actor(s)" in out
    for spec in remote:
        assert not spec.local and spec.host == "node-b"
        assert f"{spec.name} on node-b (cpu): {spec.command()}" in out
        assert "--connect tcp://node-a:29611" in spec.command()
    supervisor._print_remote([])  # nothing remote: nothing printed
    assert capsys.readouterr().out == ""


def test_resume_plan_continues_the_learner_and_keeps_the_actors(tmp_path):
    cfg = config_from_dict({"run": {"dir": str(tmp_path)}, "learner": {"world_size": 2},
                            "cluster": {"master_port": 29123}})
    fresh, _ = supervisor.plan(cfg, CONFIG)
    resumed, _ = supervisor.plan(cfg, CONFIG, resume=True)
    assert resumed[0].cmd == fresh[0].cmd + ["--resume"]
    assert [r.cmd for r in resumed[1:]] == [r.cmd for r in fresh[1:]]


def test_launcher_refuses_what_the_plan_refuses(tmp_path):
    from arpo_async.core.config import ConfigError

    cfg = config_from_dict({"run": {"dir": str(tmp_path)}, "actors": {"num": 2},
                            "cluster": {"device": "cuda", "learner_gpus": [0],
                                        "actor_gpus": [1]}})
    with pytest.raises(ConfigError, match="cluster.actor_gpus: 2 actors"):
        supervisor.plan(cfg, CONFIG)


def test_resume_command_rewrites_either_port_spelling():
    torchrun = ["py", "-m", "torch.distributed.run", "--master-port=29500", "-m",
                "learner.main", "--config", "c.yaml"]
    fresh = supervisor._with_resume(torchrun)
    assert fresh[-1] == "--resume" and fresh[:3] == torchrun[:3] and fresh[4:-1] == torchrun[4:]
    assert _port_of(fresh) not in (None, 0)
    assert supervisor._with_resume(fresh).count("--resume") == 1
    assert _port_of(supervisor._with_resume(torchrun, fixed_port=29777)) == 29777

    runner = ["py", "-m", "deepspeed.launcher.runner", "--master_addr", "a", "--master_port",
              "29500", "--module", "learner.main", "--config", "c.yaml"]
    kept = supervisor._with_resume(runner, fixed_port=29500)
    assert kept == runner + ["--resume"]
    moved = supervisor._with_resume(runner)
    assert moved[6] != "29500" and int(moved[6]) > 0 and moved[5] == "--master_port"
    single = ["py", "-m", "learner.main", "--config", "c.yaml"]
    assert supervisor._with_resume(single) == single + ["--resume"]
