"""Settings that pass each field's check but would learn nothing, or from biased ratios,
are refused in one line naming the key; YAML's bare `off` stays a word."""

from __future__ import annotations

import pytest

from arpo_async.core.config import SPINE_CONFIG, ConfigError, describe, load_config


@pytest.mark.parametrize(("overrides", "needle"), [
    (["rollout.group_size=1", "rollout.initial_samples=1"],
     "rollout.group_size=1: advantages are normalised"),
    (["sampling.top_p=0.9"], "sampling.top_p=0.9: the actor records log-probs renormalised"),
    (["sampling.top_p=0.9", "learner.loss.importance.mode=off",
      "learner.loss.proximal=recompute"],
     "sampling.top_p=0.9"),
    (["learner.loss.dual_clip=0.5"], "learner.loss.dual_clip: must be 0 (off) or > 1, got 0.5"),
])
def test_refused_in_one_line_naming_the_key(overrides, needle):
    with pytest.raises(ConfigError) as err:
        load_config(SPINE_CONFIG, overrides).check_trainable()
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_evaluation_may_use_one_sample_and_a_nucleus():
    cfg = load_config(SPINE_CONFIG, ["rollout.group_size=1", "rollout.initial_samples=1",
                                     "sampling.top_p=0.9"])  # loads; only a run refuses it
    with pytest.raises(ConfigError, match="rollout.group_size=1"):
        cfg.check_trainable()


def test_the_launcher_refuses_at_start(tmp_path, capsys):
    from arpo_async.launch import main

    code = main(["--config", str(SPINE_CONFIG), "--dry-run", "rollout.group_size=1",
                 "rollout.initial_samples=1", f"run.dir={tmp_path}"])
    assert code == 2 and "rollout.group_size=1" in capsys.readouterr().err


def test_what_is_allowed():
    cfg = load_config(SPINE_CONFIG, ["sampling.top_p=0.9", "learner.loss.importance.mode=off",
                                     "learner.loss.proximal=bypass", "rollout.group_size=2",
                                     "rollout.initial_samples=2"])
    cfg.check_trainable()
    assert cfg.learner.loss.importance.mode == "off" and cfg.rollout.group_size == 2


def test_off_is_a_word_and_on_is_still_a_boolean(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learner:\n  loss:\n    importance: {mode: off}\n")
    assert load_config(path).learner.loss.importance.mode == "off"
    off = load_config(SPINE_CONFIG, ["learner.loss.importance.mode=off"])
    assert off.learner.loss.importance.mode == "off"
    assert load_config(SPINE_CONFIG, ["run.probe_logprobs=on"]).run.probe_logprobs is True
    assert load_config(SPINE_CONFIG, ["run.probe_logprobs=false"]).run.probe_logprobs is False


def test_entropy_reduce_defaults_to_the_authors_sum():
    cfg = load_config(SPINE_CONFIG)
    assert cfg.rollout.entropy_reduce == "sum"
    aepo = load_config(SPINE_CONFIG, ["rollout.mode=aepo"]).rollout
    assert aepo.entropy_reduce == "sum" and aepo.aepo_budget_beta == 0.5
    with pytest.raises(ConfigError, match="rollout.entropy_reduce"):
        load_config(SPINE_CONFIG, ["rollout.entropy_reduce=median"])


@pytest.mark.parametrize("k", [5, 20])
def test_reference_estimator_reads_the_authors_top_10_only(k):
    """The authors' number is a sum over the log-probs vLLM returned at logprobs=10
    (vllm_rollout_with_tools.py:114); another k is another number, refused at load."""
    with pytest.raises(ConfigError) as err:
        load_config(SPINE_CONFIG, ["rollout.entropy_estimator=reference",
                                   f"sampling.logprobs_topk={k}"])
    msg = str(err.value)
    assert "rollout.entropy_estimator=reference" in msg and "sampling.logprobs_topk=10" in msg
    assert f"got {k}" in msg and "\n" not in msg
    cfg = load_config(SPINE_CONFIG, ["rollout.entropy_estimator=reference",
                                     "sampling.logprobs_topk=10"])
    assert cfg.sampling.logprobs_topk == 10
    assert load_config(SPINE_CONFIG, ["sampling.logprobs_topk=5"]).sampling.logprobs_topk == 5


def test_each_loss_type_has_its_settings_and_its_function():
    """A loss type's keys are declared once (its class in config/losses.py, each with a
    description) and its function is registered under the same name."""
    from arpo_async.core.config import LOSS_TYPES
    from learner.losses import LOSSES

    assert set(LOSS_TYPES) == set(LOSSES)
    for kind, cls in LOSS_TYPES.items():
        assert cls.model_fields["type"].default == kind
        for name, field in cls.model_fields.items():
            assert field.description, f"learner.loss.{name} ({kind}) has no description"


def test_the_loss_type_is_chosen_by_type_and_defaults_to_ppo():
    from arpo_async.core.config import LOSS_TYPES

    assert load_config(SPINE_CONFIG).learner.loss.type == "ppo"
    for kind in LOSS_TYPES:
        assert load_config(SPINE_CONFIG, [f"learner.loss.type={kind}"]).learner.loss.type == kind
    with pytest.raises(ConfigError, match=r"learner.loss.type: 'nope' is not a loss type"):
        load_config(SPINE_CONFIG, ["learner.loss.type=nope"])
    with pytest.raises(ConfigError, match=r"^learner.loss.eps_hgh: unknown key$"):
        load_config(SPINE_CONFIG, ["learner.loss.eps_hgh=0.3"])
    with pytest.raises(ConfigError, match=r"^learner.loss.importance.cap: Input should be "
                                          r"greater"):
        load_config(SPINE_CONFIG, ["learner.loss.importance.cap=0"])
    with pytest.raises(ConfigError, match=r"^learner.loss.importance.low: a key of importance "
                                          r"mode mask, not of truncate$"):
        load_config(SPINE_CONFIG, ["learner.loss.importance.low=0.1"])
    with pytest.raises(ConfigError, match=r"^learner.loss.is_mode: moved; use "
                                          r"learner.loss.importance.mode$"):
        load_config(SPINE_CONFIG, ["learner.loss.is_mode=mask"])
    with pytest.raises(ConfigError, match=r"learner.loss.importance.low 2.0 > high 1.0"):
        load_config(SPINE_CONFIG, ["learner.loss.importance.mode=mask",
                                   "learner.loss.importance.low=2",
                                   "learner.loss.importance.high=1"])
    lines = "\n".join(describe())
    assert "learner.loss.type = 'ppo'" in lines and "learner.loss.importance.mode" in lines


def test_the_python_tool_has_its_own_section_whose_keys_follow_its_state(tmp_path):
    from arpo_async.core.config import PythonSession, PythonStateless, save_config

    py = load_config(SPINE_CONFIG).tools.python
    assert isinstance(py, PythonStateless) and (py.cpu_s, py.pool) == (5, 2)
    cfg = load_config(SPINE_CONFIG, ["tools.python.state=session",
                                     "tools.python.max_sessions=4", "tools.python.cpu_s=3"])
    assert isinstance(cfg.tools.python, PythonSession)
    assert (cfg.tools.python.max_sessions, cfg.tools.python.cpu_s) == (4, 3)
    save_config(cfg, tmp_path / "c.yaml")  # the resolved file every process reads
    assert load_config(tmp_path / "c.yaml").tools.python == cfg.tools.python
    with pytest.raises(ConfigError, match=r"^tools.python.max_sessions: a key of python state "
                                          r"session, not of stateless$"):
        load_config(SPINE_CONFIG, ["tools.python.max_sessions=4"])
    with pytest.raises(ConfigError, match=r"^tools.python.state: 'sessions' is not a python "
                                          r"state \(session, stateless\)$"):
        load_config(SPINE_CONFIG, ["tools.python.state=sessions"])
    with pytest.raises(ConfigError, match=r"^tools.python.pool: Input should be greater"):
        load_config(SPINE_CONFIG, ["tools.python.pool=-1"])
    # the old flat keys name the new one
    with pytest.raises(ConfigError, match=r"^tools.python_state: moved; use "
                                          r"tools.python.state"):
        load_config(SPINE_CONFIG, ["tools.python_state=session"])
    with pytest.raises(ConfigError, match=r"^tools.python_checkpoint_mb: moved; use "
                                          r"tools.python.checkpoint_mb \(with state: session"):
        load_config(SPINE_CONFIG, ["tools.python_checkpoint_mb=8"])
    lines = "\n".join(describe())
    assert "tools.python.state = 'stateless'" in lines  # listed once: both states have it
    assert "tools.python.session_idle_s = 120.0" in lines and "[state=session]" in lines


def test_the_weight_channel_is_a_section_whose_keys_follow_its_channel():
    from arpo_async.core.config import NcclSync, ZmqSync

    assert isinstance(load_config(SPINE_CONFIG).learner.weight_sync, ZmqSync)
    cfg = load_config(SPINE_CONFIG, ["cluster.device=cuda", "learner.weight_sync.channel=nccl",
                                     "learner.weight_sync.timeout_s=60"])
    sync = cfg.learner.weight_sync
    assert isinstance(sync, NcclSync) and (sync.buffer_mb, sync.timeout_s) == (1024, 60)
    with pytest.raises(ConfigError, match=r"^learner.weight_sync.buffer_mb: a key of weight "
                                          r"channel nccl, not of zmq$"):
        load_config(SPINE_CONFIG, ["learner.weight_sync.buffer_mb=64"])
    bare = load_config(SPINE_CONFIG, ["cluster.device=cuda", "learner.weight_sync=nccl"])
    assert bare.learner.weight_sync == NcclSync()  # a bare channel: its section's defaults
    with pytest.raises(ConfigError, match=r"^learner.nccl_timeout_s: moved; use "
                                          r"learner.weight_sync.timeout_s"):
        load_config(SPINE_CONFIG, ["learner.nccl_timeout_s=60"])


def test_the_search_tool_has_its_own_section():
    cfg = load_config(SPINE_CONFIG, ["tools.search.retriever_url=http://h:1/retrieve",
                                     "tools.search.topk=5"])
    assert (cfg.tools.search.retriever_url, cfg.tools.search.topk) == ("http://h:1/retrieve", 5)
    assert load_config().tools.search.snippet_chars == 160  # configs/default.yaml
    with pytest.raises(ConfigError, match=r"^tools.retriever_url: moved; use "
                                          r"tools.search.retriever_url"):
        load_config(SPINE_CONFIG, ["tools.retriever_url=http://h:1/retrieve"])
    with pytest.raises(ConfigError, match=r"^tools.search.topk: Input should be greater"):
        load_config(SPINE_CONFIG, ["tools.search.topk=0"])


def test_each_wait_and_backoff_has_its_own_key():
    cfg = load_config(SPINE_CONFIG, ["actors.restart_backoff_s=1", "learner.restart_backoff_s=7",
                                     "transport.request_timeout_s=3", "actors.stop_wait_s=11",
                                     "learner.shutdown_wait_s=13", "transport.send_stall_s=17"])
    assert (cfg.actors.restart_backoff_s, cfg.learner.restart_backoff_s) == (1, 7)
    assert (cfg.transport.request_timeout_s, cfg.actors.stop_wait_s,
            cfg.learner.shutdown_wait_s, cfg.transport.send_stall_s) == (3, 11, 13, 17)


def test_run_log_level_reaches_the_project_loggers_only():
    import logging

    names = ("actor", "actors.actor", "learner.service", "toolenv.runner", "arpo_async.core")
    before = {n: logging.getLogger(n).level for n in ("actor", "actors", "learner", "toolenv",
                                                    "arpo_async", "vllm")}
    try:
        load_config(SPINE_CONFIG, ["run.log_level=DEBUG"]).run.apply_log_level()
        assert all(logging.getLogger(n).isEnabledFor(logging.DEBUG) for n in names)
        assert logging.getLogger("vllm").level == before["vllm"]
        with pytest.raises(ConfigError, match="run.log_level"):
            load_config(SPINE_CONFIG, ["run.log_level=LOUD"])
    finally:
        for name, level in before.items():
            logging.getLogger(name).setLevel(level)


def test_keep_mode_is_for_the_vllm_engine_only():
    """actors.update_mode=keep freezes requests on their KV cache, which only vLLM has."""
    assert load_config(SPINE_CONFIG, ["actors.engine=vllm",
                                      "actors.update_mode=keep"]).actors.update_mode == "keep"
    for engine in ("transformers", "simulated"):
        with pytest.raises(ConfigError) as err:
            load_config(SPINE_CONFIG, [f"actors.engine={engine}", "actors.update_mode=keep"])
        assert "actors.update_mode=keep" in str(err.value) and engine in str(err.value)


def test_the_engine_is_a_section_whose_keys_follow_its_type(tmp_path):
    """actors.engine by type: vLLM's keys and the simulated engine's (the old sim.*) each
    under their own engine; a bare name is that engine with its defaults; the tag an
    override repeats keeps the section's keys, another tag starts a fresh section."""
    from arpo_async.core.config import SimulatedEngine, TransformersEngine, VllmEngine

    spine = load_config(SPINE_CONFIG).actors.engine  # configs/spine.yaml: {type: vllm, ...}
    assert isinstance(spine, VllmEngine) and spine.kv_cache_gib == 1.0
    cfg = load_config(SPINE_CONFIG, ["actors.engine.kv_cache_gib=2", "actors.engine=vllm"])
    assert cfg.actors.engine.kv_cache_gib == 2.0
    sim = load_config(SPINE_CONFIG, ["actors.engine=simulated", "actors.engine.tokens_per_s=50"])
    assert sim.actors.engine == SimulatedEngine(tokens_per_s=50)
    hf = load_config(SPINE_CONFIG, ["actors.engine.kv_cache_gib=2", "actors.engine=transformers"])
    assert hf.actors.engine == TransformersEngine() and hf.actors.gpus_per_actor == 1
    tp = load_config(SPINE_CONFIG, ["actors.engine.tensor_parallel=2"])
    assert tp.actors.gpus_per_actor == 2
    with pytest.raises(ConfigError, match=r"^actors.engine.kv_cache_gib: a key of generation "
                                          r"engine vllm, not of simulated$"):
        load_config(SPINE_CONFIG, ["actors.engine=simulated", "actors.engine.kv_cache_gib=2"])
    with pytest.raises(ConfigError, match=r"^actors.engine.type: 'hf' is not a generation "
                                          r"engine \(simulated, transformers, vllm\)$"):
        load_config(SPINE_CONFIG, ["actors.engine=hf"])
    with pytest.raises(ConfigError, match=r"^actors.engine.round_tokens_min must be <= "):
        load_config(SPINE_CONFIG, ["actors.engine=simulated", "actors.engine.round_tokens_min=9",
                                   "actors.engine.round_tokens_max=8"])
    path = tmp_path / "c.yaml"  # a YAML file: the bare name and the section alike
    path.write_text("actors: {engine: simulated}\n")
    assert load_config(path).actors.engine == SimulatedEngine()
    path.write_text("actors: {engine: {type: simulated, chunk_tokens: 4}}\n")
    assert load_config(path).actors.engine.chunk_tokens == 4


def test_the_rollout_is_a_section_whose_keys_follow_its_mode():
    """rollout by mode: grpo, arpo and aepo share ARPO's keys (GRPO measures ARPO's would-be
    decisions with them); AEPO's own keys exist in aepo mode only. Evaluation turns an AEPO
    run's rollout into GRPO by retagging it (the keys GRPO lacks dropped)."""
    from arpo_async.core.config import ROLLOUT, AepoRollout, ArpoRollout, GrpoRollout

    assert isinstance(load_config(SPINE_CONFIG).rollout, GrpoRollout)  # configs/spine.yaml
    assert isinstance(load_config().rollout, ArpoRollout)  # configs/default.yaml
    aepo = load_config(SPINE_CONFIG, ["rollout.mode=aepo", "rollout.aepo_rule=authors"]).rollout
    assert isinstance(aepo, AepoRollout) and aepo.aepo_rule == "authors"
    with pytest.raises(ConfigError, match=r"^rollout.aepo_rule: a key of rollout mode aepo, "
                                          r"not of grpo$"):
        load_config(SPINE_CONFIG, ["rollout.aepo_rule=authors"])
    with pytest.raises(ConfigError, match=r"^rollout.mode: 'ppo' is not a rollout mode "
                                          r"\(aepo, arpo, grpo, stratified\)$"):
        load_config(SPINE_CONFIG, ["rollout.mode=ppo"])
    raw = aepo.model_dump(mode="json") | {"alpha": 0.3}
    grpo = GrpoRollout.model_validate(ROLLOUT.retag(raw, "grpo"))
    assert grpo.alpha == 0.3 and not hasattr(grpo, "aepo_rule")


def test_an_override_of_a_tag_keeps_the_keys_the_new_member_has():
    """rollout.mode=grpo on an AEPO preset drops AEPO's keys and keeps ARPO's;
    actors.engine.type=transformers on a vLLM section drops vLLM's; a bare YAML off under
    a nested override opens as that member."""
    from arpo_async.core.config import CONFIG_DIR, GrpoRollout, TransformersEngine

    preset = CONFIG_DIR / "presets" / "aepo_deepsearch_qwen3_8b.yaml"
    aepo = load_config(preset).rollout
    grpo = load_config(preset, ["rollout.mode=grpo"]).rollout
    assert isinstance(grpo, GrpoRollout) and not hasattr(grpo, "aepo_rule")
    assert (grpo.group_size, grpo.alpha, grpo.fork_h_init) == (
        aepo.group_size, aepo.alpha, aepo.fork_h_init)
    assert load_config(SPINE_CONFIG, ["actors.engine.type=transformers"]).actors.engine == \
        TransformersEngine()
    imp = load_config(SPINE_CONFIG, ["learner.loss.importance=off",
                                     "learner.loss.importance.mode=truncate"])
    assert imp.learner.loss.importance.mode == "truncate"


@pytest.mark.parametrize("bad", [["rollout.group_size=1", "rollout.initial_samples=1"],
                                 ["transport.host=0.0.0.0"]])
def test_the_pipeline_refuses_before_its_data_stage(tmp_path, capsys, bad):
    """The default job (pipeline.enabled) asks the launcher's checks before it builds the
    suite, the model or SFT: a run that cannot train, or cannot bind safely, stops in
    seconds with nothing made."""
    from arpo_async.launch import main

    run_dir, data_dir = tmp_path / "run", tmp_path / "data"
    code = main(["--quiet", f"run.dir={run_dir}", f"pipeline.data_dir={data_dir}",
                 f"task.data={data_dir}/rl.jsonl", f"model.path={tmp_path / 'model'}", *bad])
    err = capsys.readouterr().err
    assert code == 2 and bad[0].split("=")[0] in err, err
    assert not data_dir.exists() and not (tmp_path / "model").exists()  # no stage ran
