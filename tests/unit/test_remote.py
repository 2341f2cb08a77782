"""Actors on other machines (arpo_async/launcher/remote.py): the config they get from the learner,
what they may change locally, how ids are handed out, keys, and the restart loop."""

from __future__ import annotations

import stat
import sys
import time

import pytest
import yaml

from arpo_async.core import protocol as P
from arpo_async.core.config import ConfigError, config_from_dict, save_config
from arpo_async.launcher.remote import (
    check_local_paths,
    install_keys,
    local_config,
    parse_endpoint,
    run_child,
)
from learner.config_server import ConfigServer


def learner_cfg(**extra):
    tree = {"run": {"dir": "/runs/exp"}, "actors": {"num": 2},
            "transport": {"host": "0.0.0.0", "trajectory_port": 7001, "control_port": 7002}}
    for key, value in extra.items():
        tree.setdefault(key, {}).update(value)
    return config_from_dict(tree)


def learner_yaml(cfg) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


@pytest.mark.parametrize("endpoint, expected", [
    ("tcp://node-a:29611", ("node-a", 29611)), ("tcp://10.0.0.5:1", ("10.0.0.5", 1)),
    ("tcp://[::1]:5000", ("::1", 5000))])
def test_parse_endpoint(endpoint, expected):
    assert parse_endpoint(endpoint) == expected


@pytest.mark.parametrize("bad", ["node-a:29611", "tcp://node-a", "tcp://:5", "tcp://h:0",
                                 "tcp://h:99999", "ipc:///tmp/x"])
def test_parse_endpoint_rejects(bad):
    with pytest.raises(ValueError, match="expected tcp://HOST:PORT"):
        parse_endpoint(bad)


def test_local_config_is_the_learners_with_this_machines_paths():
    text = learner_yaml(learner_cfg(sampling={"temperature": 0.7}))
    cfg = local_config(text, ["model.path=/local/qwen", "actors.threads=6"], "node-a", 7002,
                       None, actor_id=3)
    assert (cfg.model.path, cfg.actors.threads) == ("/local/qwen", 6)
    assert cfg.sampling.temperature == 0.7  # learning settings come from the learner
    assert (cfg.run.dir, cfg.tools.cache_dir) == ("/runs/exp/actor3", "/runs/exp/tool_cache")
    assert (cfg.transport.host, cfg.transport.control_port, cfg.transport.trajectory_port) == (
        "node-a", 7002, 7001)
    assert not cfg.model.build_if_missing
    # the learner's DeepSpeed JSON need not exist on an actor machine
    ds = learner_yaml(learner_cfg()).replace("deepspeed_config: ''",
                                             "deepspeed_config: /learner/only/zero3.json")
    assert "/learner/only" in ds
    assert local_config(ds, [], "h", 7002, None, 0).learner.deepspeed_config == ""
    assert local_config(text, [], "h", 7002, "/tmp/mine", 0).run.dir == "/tmp/mine"


@pytest.mark.parametrize("override, needle", [
    ("sampling.temperature=0.5", "sampling.temperature: cannot be set on an actor machine"),
    ("learner.lr=1", "learner.lr: cannot be set"), ("model.path", "expected key=value"),
    ("actors.threads=many", "actors.threads")])
def test_local_config_refuses_learning_settings(override, needle):
    with pytest.raises(ConfigError, match=needle):
        local_config(learner_yaml(learner_cfg()), [override], "h", 7002, None, 0)


def test_local_paths_must_exist_here(tmp_path):
    cfg = learner_cfg(model={"path": str(tmp_path / "missing")})
    with pytest.raises(ConfigError, match="does not exist on this machine"):
        check_local_paths(cfg)
    hub = learner_cfg(model={"path": "Qwen/Qwen3-8B"})
    assert "Hugging Face cache" in check_local_paths(hub)[0]
    (tmp_path / "m").mkdir()
    assert check_local_paths(learner_cfg(model={"path": str(tmp_path / "m")})) == []
    with pytest.raises(ConfigError, match="task.data=/no.parquet does not exist"):
        check_local_paths(learner_cfg(model={"path": str(tmp_path / "m")},
                                      task={"name": "file", "data": "/no.parquet"}))


def test_config_server_assigns_free_ids_above_the_local_actors():
    srv = ConfigServer(learner_cfg(), silent_s=10)
    ask = lambda i=-1, host="b": srv.handle(P.ConfigRequest(i, host, 1), seen, now=100.0)  # noqa
    seen = {0: 99.0, 1: 99.0, 2: 50.0}
    first, second = ask(), ask()
    assert (first.actor_id, second.actor_id) == (3, 4)  # 2 is in the ledger already
    assert yaml.safe_load(first.config_yaml)["transport"]["control_port"] == 7002
    assert ask(0, "b").ok is False and "in use by the launcher" in ask(0, "b").reason
    seen[3] = 99.5
    assert ask(3, "b").actor_id == 3  # the same machine again: a restart
    refused = ask(3, "c")
    assert not refused.ok and "actor id 3 is in use by b" in refused.reason
    seen[3] = 10.0  # silent for long: the id is free again
    assert ask(3, "c").actor_id == 3


def test_install_keys_copies_the_client_pair_privately(tmp_path):
    from arpo_async.core.keys import generate, load_client_keys

    learner_keys = generate(tmp_path / "learner")
    dst = install_keys(learner_keys, tmp_path / "actor")
    assert stat.S_IMODE((dst / "client.key_secret").stat().st_mode) == 0o600
    assert load_client_keys(dst).server_public == load_client_keys(learner_keys).server_public
    with pytest.raises(FileNotFoundError, match="client.key_secret, server.key missing"):
        install_keys(tmp_path / "nothing", tmp_path / "x")


def test_run_child_restarts_a_crashing_actor_then_gives_up(tmp_path):
    marker = tmp_path / "runs"
    code = f"import sys; open({str(marker)!r}, 'a').write('x'); sys.exit(3)"
    t0 = time.monotonic()
    assert run_child([sys.executable, "-c", code], {}, max_restarts=2, backoff_s=0.01) == 1
    assert marker.read_text() == "xxx" and time.monotonic() - t0 < 20
    assert run_child([sys.executable, "-c", "pass"], {}, max_restarts=0) == 0


def test_run_child_does_not_restart_an_actor_whose_learner_is_gone(tmp_path):
    marker = tmp_path / "runs"
    code = f"import sys; open({str(marker)!r}, 'a').write('x'); sys.exit(69)"
    assert run_child([sys.executable, "-c", code], {}, max_restarts=3, backoff_s=0.01) == 69
    assert marker.read_text() == "x"  # once: a restart would wait for the learner again


def test_saved_local_config_loads_back(tmp_path):
    from arpo_async.core.config import load_config

    cfg = local_config(learner_yaml(learner_cfg()), [], "node-a", 7002, str(tmp_path), 5)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg
