"""The process plan (arpo_async/launcher/plan.py): which roles, where, on which devices, with
which commands; checked against the launchers that will parse those commands (torchrun,
DeepSpeed's runner, our own ``launch actor``)."""

from __future__ import annotations

import shlex

import pytest

from arpo_async.core.config import (
    SPINE_CONFIG,
    ConfigError,
    config_from_dict,
    load_config,
    total_actors,
)
from arpo_async.launcher.plan import (
    actor_gpu_slices,
    check_placement,
    format_plan,
    parse_hostfile,
    plan,
)

CFG_PATH = "runs/t/config.yaml"


def cfg_of(**sections):
    return config_from_dict(sections)


def gpu(**extra):
    tree = {"cluster": {"device": "cuda", "learner_gpus": [0], "actor_gpus": [1, 2]},
            "actors": {"num": 2}}
    for key, value in extra.items():
        tree.setdefault(key, {}).update(value)
    return config_from_dict(tree)


def test_default_cpu_plan_is_the_launchers_old_layout():
    cfg = load_config(SPINE_CONFIG, ["actors.num=2", "learner.threads=3", "actors.threads=2"])
    learner, *actors = plan(cfg, CFG_PATH, python="PY")
    assert learner.argv == ("PY", "-m", "learner.main", "--config", CFG_PATH)
    assert learner.env["OMP_NUM_THREADS"] == "3" and learner.env["DS_ACCELERATOR"] == "cpu"
    assert [a.argv for a in actors] == [
        ("PY", "-m", "actors.main", "--config", CFG_PATH, "--actor-id", str(i)) for i in (0, 1)]
    assert all(a.local and a.devices == "cpu" and a.env["OMP_NUM_THREADS"] == "2"
               and "CUDA_VISIBLE_DEVICES" not in a.env for a in actors)
    assert [r.log for r in (learner, *actors)] == ["learner.log", "actor0.log", "actor1.log"]


def test_several_local_learner_ranks_use_torchrun_with_a_parsable_command():
    from torch.distributed.run import get_args_parser

    cfg = cfg_of(learner={"world_size": 2}, actors={"num": 0})
    (learner,) = plan(cfg, CFG_PATH, master_port=29877, python="PY")
    args = get_args_parser().parse_args(list(learner.argv[3:]))
    assert (args.nproc_per_node, args.master_port, args.module) == ("2", 29877, True)
    assert args.training_script == "learner.main"
    assert args.training_script_args == ["--config", CFG_PATH]


def test_gpu_actors_take_tensor_parallel_slices_of_their_gpu_list():
    cfg = gpu(cluster={"actor_gpus": [4, 5, 6, 7]}, actors={"engine": {"tensor_parallel": 2}})
    learner, a0, a1 = plan(cfg, CFG_PATH)
    assert learner.env["CUDA_VISIBLE_DEVICES"] == "0" and learner.env["DS_ACCELERATOR"] == "cuda"
    assert (a0.env["CUDA_VISIBLE_DEVICES"], a1.env["CUDA_VISIBLE_DEVICES"]) == ("4,5", "6,7")
    assert (a0.devices, a1.devices) == ("cuda:4,5", "cuda:6,7")
    assert actor_gpu_slices([3, 1, 2], 3, 1, "x") == [[3], [1], [2]]


@pytest.mark.parametrize("extra, needle", [
    ({"cluster": {"actor_gpus": [1]}}, "cluster.actor_gpus: 2 actors x "
                                       "actors.engine.tensor_parallel=1 "
                                       "need 2 GPU ids, got 1"),
    ({"cluster": {"actor_gpus": [1, 1]}}, "cluster.actor_gpus: duplicate"),
    ({"learner": {"world_size": 2}}, "learner.world_size=2 but cluster.learner_gpus give 1"),
    ({"cluster": {"actor_gpus": [0, 1]}, "learner": {"weight_sync": {"channel": "nccl"}}},
     "NCCL cannot connect two ranks on one GPU"),
])
def test_bad_gpu_layouts_are_refused_naming_the_key(extra, needle):
    with pytest.raises(ConfigError) as info:
        plan(gpu(**extra), CFG_PATH)
    assert needle in str(info.value)


def test_cpu_device_refuses_gpu_ids_and_nccl():
    with pytest.raises(ConfigError, match="cluster.actor_gpus is set but cluster.device=cpu"):
        plan(cfg_of(cluster={"actor_gpus": [0]}), CFG_PATH)
    nccl = {"weight_sync": {"channel": "nccl"}}
    with pytest.raises(ConfigError,
                       match="learner.weight_sync.channel=nccl needs cluster.device=cuda"):
        cfg_of(learner=nccl)
    with pytest.raises(ConfigError, match="actors.engine=vllm"):
        plan(gpu(learner=nccl, actors={"engine": "transformers"}), CFG_PATH)


def test_a_gpu_shared_by_learner_and_actor_is_allowed_over_zeromq_with_a_note():
    cfg = gpu(cluster={"actor_gpus": [0, 1]})
    assert [r.devices for r in plan(cfg, CFG_PATH)] == ["cuda:0", "cuda:0", "cuda:1"]
    assert any("shared by the learner and local actors" in n for n in check_placement(cfg))


HOSTFILE = "# two nodes\nnode-a slots=8\n\nnode-b slots=8\n"


def test_hostfile_grammar_matches_deepspeeds_own_parser(tmp_path):
    from deepspeed.launcher.runner import _parse_hostfile

    assert parse_hostfile(HOSTFILE, "h") == dict(_parse_hostfile(HOSTFILE.splitlines()))
    for bad, needle in [("node-a\n", "h:1: expected 'HOST slots=N'"),
                        ("a slots=1\na slots=2\n", "h:2: host a listed twice"),
                        ("# nothing\n", "h: no 'HOST slots=N' line")]:
        with pytest.raises(ConfigError, match=needle):
            parse_hostfile(bad, "h")


def multinode(tmp_path, **extra):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text(HOSTFILE)
    tree = {"cluster": {"device": "cuda", "hostfile": str(hostfile), "learner_gpus": [0, 1, 2, 3],
                        "actor_gpus": [4, 5], "master_addr": "node-a",
                        "remote_actors": [{"host": "node-b", "actors": 2, "gpus": [4, 5]}]},
            "learner": {"world_size": 8, "zero_stage": 3},
            "actors": {"num": 2}, "transport": {"host": "0.0.0.0", "trajectory_port": 29610,
                                                "control_port": 29611}}
    for key, value in extra.items():
        tree.setdefault(key, {}).update(value)
    return config_from_dict(tree)


def test_multinode_learner_command_is_what_deepspeeds_runner_accepts(tmp_path):
    from deepspeed.launcher.runner import parse_args, parse_resource_filter

    cfg = multinode(tmp_path)
    learner = plan(cfg, CFG_PATH, master_port=29500, python="PY")[0]
    assert learner.argv[:3] == ("PY", "-m", "deepspeed.launcher.runner")
    args = parse_args(list(learner.argv[3:]))
    assert (args.module, args.no_local_rank, args.master_addr, args.master_port) == (
        True, True, "node-a", 29500)
    assert (args.user_script, args.user_args) == ("learner.main", ["--config", CFG_PATH])
    pool = {h: list(range(n)) for h, n in parse_hostfile(HOSTFILE, "h").items()}
    active = parse_resource_filter(pool, include_str=args.include)
    assert sum(len(slots) for slots in active.values()) == cfg.learner.world_size
    assert active == {"node-a": [0, 1, 2, 3], "node-b": [0, 1, 2, 3]}


def test_multinode_world_size_must_match_the_hostfile(tmp_path):
    with pytest.raises(ConfigError, match="learner.world_size=4 but 2 hosts of .* give 8"):
        plan(multinode(tmp_path, learner={"world_size": 4}), CFG_PATH)
    with pytest.raises(ConfigError, match="cluster.learner_gpus: id 9 but"):
        plan(multinode(tmp_path, cluster={"learner_gpus": [9]}), CFG_PATH)


def test_remote_actors_follow_the_local_ids_and_get_launch_actor_commands(tmp_path):
    from arpo_async.launcher.remote import _parser

    cfg = multinode(tmp_path)
    roles = plan(cfg, CFG_PATH)
    remote = [r for r in roles if not r.local]
    assert total_actors(cfg) == 4 and [r.actor_id for r in remote] == [2, 3]
    assert all(r.host == "node-b" and r.weights == "zmq" for r in remote)
    assert [r.env for r in remote] == [{"CUDA_VISIBLE_DEVICES": "4"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    words = shlex.split(remote[0].command())
    assert words[0] == "CUDA_VISIBLE_DEVICES=4" and words[1:5] == [
        "python", "-m", "arpo_async.launch", "actor"]
    args = _parser().parse_args(words[5:])
    # a non-loopback learner needs keys: the command names the folder to copy them into
    assert (args.connect, args.actor_id, args.keys) == ("tcp://node-a:29611", 2,
                                                        f"{cfg.run.dir}/keys")
    text = format_plan(cfg, roles, check_placement(cfg))
    assert all(r.name in text for r in roles) and "start on node-b" in text


def test_remote_actors_need_fixed_ports_and_a_reachable_learner():
    remote = {"remote_actors": [{"host": "10.0.0.2", "actors": 1}]}
    with pytest.raises(ConfigError, match="transport.control_port and transport.trajectory_port"):
        cfg_of(cluster=remote)
    ports = {"trajectory_port": 5001, "control_port": 5002}
    with pytest.raises(ConfigError, match="transport.host=127.0.0.1 is a loopback address"):
        plan(cfg_of(cluster=remote, transport=ports), CFG_PATH)
    loopback = {"remote_actors": [{"host": "127.0.0.1", "actors": 2}]}
    roles = plan(cfg_of(cluster=loopback, transport=ports, actors={"num": 0}), CFG_PATH)
    assert [r.argv[4:8] for r in roles[1:]] == [
        ("--connect", "tcp://127.0.0.1:5002", "--actor-id", str(i)) for i in (0, 1)]
    assert all("--keys" not in r.argv for r in roles[1:])  # loopback without keys


def test_role_command_is_one_shell_line_that_splits_back():
    role = plan(gpu(), "runs/with space/config.yaml", python="PY")[1]
    words = shlex.split(role.command())
    env = dict(w.split("=", 1) for w in words if "=" in w and not w.startswith("-"))
    assert env == role.env
    assert words[len(env):] == list(role.argv)


def test_simulated_actors_share_processes_as_the_sim_engine_expects():
    cfg = cfg_of(actors={"num": 5, "engine": {"type": "simulated", "actors_per_process": 2}})
    roles = plan(cfg, CFG_PATH, python="PY")[1:]
    assert [r.name for r in roles] == ["actors0-1", "actors2-3", "actors4-4"]
    assert roles[1].argv == ("PY", "-m", "actors.main", "--config", CFG_PATH,
                             "--actor-ids", "2-3")
    assert [r.log for r in roles] == ["actors0-1.log", "actors2-3.log", "actors4-4.log"]
