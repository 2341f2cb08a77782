"""Each config key has one meaning (issue 30): the seven keys that had two were split or
folded, and the flat keys of a tool, the weight channel and the importance weight moved
into sections of their own (tagged unions where the keys depend on a mode). An old key
(or a value whose meaning is gone) is refused, from a YAML file and from an override
alike, in one line naming what to write instead; the defaults give the
same effective values as before (the eval temperature, the SFT chunk, the micro-batches,
a round's token limit, the prompt limit, the transport timeouts)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from arpo_async.core.config import (
    CONFIG_DIR,
    DEFAULT_CONFIG,
    RENAMED,
    SPINE_CONFIG,
    ConfigError,
    load_config,
    save_config,
)

# old override -> what the refusal must name
OLD = {
    "transport.timeout_s=5": ["transport.request_timeout_s", "transport.send_stall_s"],
    "sampling.max_new_tokens=64": ["sampling.round_max_tokens"],
    "sampling.round_limit=budget": ["sampling.round_max_tokens"],
    "learner.micro_batches=2": ["learner.min_micro_batches"],
    "sampling.max_prompt_tokens=0": ["null"],
    "sampling.on_overflow=skip": ["sampling.max_prompt_tokens"],
    "pipeline.eval_temperature=-1": ["null"],
    "run.quiet=true": ["--quiet"],
    # sections of their own and tagged unions (the third pass)
    **{f"tools.python_{old}=1": [f"tools.python.{new}"]
       for old, new in (("cpu_s", "cpu_s"), ("memory_mb", "memory_mb"),
                        ("max_procs", "max_procs"), ("max_output", "max_output"),
                        ("pool", "pool"), ("preload", "preload"), ("state", "state"),
                        ("max_sessions", "max_sessions"), ("session_idle_s", "session_idle_s"),
                        ("checkpoint_mb", "checkpoint_mb"))},
    "tools.allow_unsandboxed=true": ["tools.python.allow_unsandboxed"],
    "tools.retriever_url=http://h:1/retrieve": ["tools.search.retriever_url"],
    "tools.search_topk=3": ["tools.search.topk"],
    "tools.search_snippet_chars=100": ["tools.search.snippet_chars"],
    **{f"actors.{key}=1": [f"actors.engine.{key}"]
       for key in ("kv_cache_gib", "gpu_memory_utilization", "tensor_parallel",
                   "enable_prefix_caching", "cuda_graphs", "max_logprobs")},
    **{f"sim.{key}=1": [f"actors.engine.{key}"]
       for key in ("tokens_per_s", "engine_tokens_per_s", "request_latency_s", "chunk_tokens",
                   "round_tokens_min", "round_tokens_max", "tool_call_prob", "eos_prob",
                   "entropy", "entropy_after_tool", "entropy_noise", "update_s",
                   "actors_per_process")},
    "learner.nccl_buffer_mb=64": ["learner.weight_sync.buffer_mb"],
    "learner.nccl_timeout_s=60": ["learner.weight_sync.timeout_s"],
    "learner.loss.is_mode=mask": ["learner.loss.importance.mode"],
    "learner.loss.is_cap=2": ["learner.loss.importance.cap"],
    "learner.loss.is_mask_low=0.5": ["learner.loss.importance.low"],
    "learner.loss.is_mask_high=2": ["learner.loss.importance.high"],
}


def _old_key(override: str) -> str:
    return override if override in RENAMED else override.split("=", 1)[0]


def test_every_renamed_entry_is_covered():
    assert {_old_key(o) for o in OLD} == set(RENAMED)


@pytest.mark.parametrize("override", list(OLD))
def test_an_old_override_is_refused_naming_the_new_key(override):
    with pytest.raises(ConfigError) as err:
        load_config(SPINE_CONFIG, [override])
    msg = str(err.value)
    assert msg.startswith(_old_key(override) + ": ") and "\n" not in msg
    assert all(new in msg for new in OLD[override]), msg


@pytest.mark.parametrize("override", list(OLD))
def test_an_old_yaml_key_is_refused_naming_the_new_key(override, tmp_path):
    key, value = override.split("=", 1)
    tree: dict = {}
    node = tree
    *sections, name = key.split(".")
    for section in sections:
        node = node.setdefault(section, {})
    node[name] = yaml.safe_load(value)
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value).startswith(_old_key(override) + ": ")
    assert all(new in str(err.value) for new in OLD[override])


def test_an_old_file_is_named_even_under_an_override_of_the_new_shape(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("sim: {tokens_per_s: 50}\n")
    with pytest.raises(ConfigError, match=r"^sim.tokens_per_s: moved; use "
                                          r"actors.engine.tokens_per_s \(with type: simulated\)$"):
        load_config(path, ["actors.engine=simulated", "actors.engine.tokens_per_s=60"])


def test_a_run_folder_of_the_old_code_names_every_old_key(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("run: {quiet: false}\nsampling: {max_new_tokens: 64, max_prompt_tokens: 0}\n"
                    "pipeline: {eval_temperature: -1.0}\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    msg = str(err.value)
    assert msg.startswith("run.quiet: ") and "\n" not in msg
    assert msg.endswith("; also sampling.max_new_tokens, sampling.max_prompt_tokens=0, "
                        "pipeline.eval_temperature=-1")


@pytest.mark.parametrize("path", [DEFAULT_CONFIG, SPINE_CONFIG, CONFIG_DIR / "qwen3_tokenizer.yaml",
                                  CONFIG_DIR / "qwen35_xml.yaml",
                                  *sorted((CONFIG_DIR / "presets").glob("*.yaml"))])
def test_a_config_written_by_this_code_loads_back(path, tmp_path):
    cfg = load_config(path)
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_other_values_of_the_changed_keys_still_load():
    cfg = load_config(SPINE_CONFIG, ["pipeline.eval_temperature=0", "sampling.max_prompt_tokens=9",
                                     "sampling.on_overflow=cap", "sampling.round_max_tokens=null"])
    assert cfg.pipeline.eval_temperature == 0.0 and cfg.sampling.max_prompt_tokens == 9
    assert cfg.sampling.round_max_tokens is None
    with pytest.raises(ConfigError, match=r"^pipeline.eval_temperature: Input should be greater"):
        load_config(SPINE_CONFIG, ["pipeline.eval_temperature=-0.5"])


# ----------------------------------------------------------------------------- the defaults
def test_transport_timeouts_keep_the_old_30_s():
    t = load_config(DEFAULT_CONFIG).transport
    assert (t.request_timeout_s, t.send_stall_s) == (30.0, 30.0)


def test_round_limits_are_the_old_ones():
    """default.yaml: a tool round asks for the remaining budget (old round_limit=budget);
    spine.yaml: a sample without tools asks for min(48, 96) (old max_new_tokens=48); the
    old round_limit=max_new_tokens with max_new_tokens=24 is round_max_tokens=24."""
    s = load_config(DEFAULT_CONFIG).sampling
    assert [s.round_tokens(u) for u in (0, 100, 319)] == [320, 220, 1]
    assert load_config(SPINE_CONFIG).sampling.round_tokens(0) == 48
    capped = load_config(SPINE_CONFIG, ["sampling.round_max_tokens=24",
                                        "sampling.max_response_tokens=160"]).sampling
    assert [capped.round_tokens(u) for u in (0, 150)] == [24, 10]
    for preset in sorted((CONFIG_DIR / "presets").glob("*.yaml")):
        s = load_config(preset).sampling
        assert s.round_tokens(0) == s.max_response_tokens, preset.name


def test_the_prompt_limit_is_the_old_one():
    """The longest prompt a rollout takes: what max_model_len leaves room for one token
    in (old max_prompt_tokens=0 with on_overflow=refuse), or the presets' 1536."""
    from toolenv.tasks.prompts import PromptSource

    def limit(cfg) -> int:
        return PromptSource.max_tokens.fget(SimpleNamespace(cfg=cfg))

    assert limit(load_config(DEFAULT_CONFIG)) == 511
    assert limit(load_config(CONFIG_DIR / "presets" / "arpo_reasoning_qwen2.5_7b.yaml")) == 1536
    assert load_config(DEFAULT_CONFIG).sampling.on_overflow == "refuse"


def test_the_eval_temperature_is_the_sampling_temperature_unless_set(monkeypatch, tmp_path):
    from arpo_async.jobs import pipeline
    from arpo_async.jobs.evaluate import eval_config

    seen = []
    monkeypatch.setattr(pipeline, "evaluate", lambda cfg, data, **kw: seen.append(
        eval_config(cfg, data, kw["k"], kw["temperature"]).sampling.temperature) or {})
    for overrides, want in (([], 1.0), (["sampling.temperature=0.7"], 0.7),
                            (["pipeline.eval_temperature=0"], 0.0),
                            (["pipeline.eval_temperature=0.6"], 0.6)):
        pipeline.run_eval(load_config(DEFAULT_CONFIG, overrides), "m", "", tmp_path)
        assert seen.pop() == want, overrides


def test_sft_has_its_own_chunk_of_the_old_size(monkeypatch, tmp_path):
    from arpo_async.jobs import pipeline

    seen = []
    monkeypatch.setattr(pipeline, "run_sft", lambda *a, **kw: seen.append(kw["chunk"]) or {})
    for overrides, want in (([], 512), (["learner.logprob_chunk_tokens=0"], 512),
                            (["pipeline.sft_logprob_chunk_tokens=64"], 64)):
        pipeline.cold_start_sft(load_config(DEFAULT_CONFIG, overrides), "m", tmp_path)
        assert seen.pop() == want, overrides
    assert load_config(DEFAULT_CONFIG).learner.logprob_chunk_tokens == 512


def _samples(n_groups: int):
    from arpo_async.core.protocol import Trajectory, TrajectoryGroup
    from learner.batching import samples_from_groups

    def leaf(reward: float) -> Trajectory:
        n = 6
        return Trajectory(tokens=np.arange(1, n + 1, dtype=np.int32),
                          loss_mask=np.ones(n, np.uint8), logprobs=np.full(n, -1.0, np.float32),
                          versions=np.zeros(n, np.int32), reward=reward)

    groups = [TrajectoryGroup(group_id=f"g{g}", actor_id=0, prompt_id=str(g),
                              prompt_tokens=np.array([1, 2, 3], np.int32),
                              leaves=[leaf(0.0), leaf(1.0)]) for g in range(n_groups)]
    return samples_from_groups(groups, "soft")[0]


def _tiny_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    cfg = Qwen3Config(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=64)
    return Qwen3ForCausalLM._from_config(cfg, attn_implementation="sdpa", dtype=torch.float32)


@pytest.mark.parametrize(("overrides", "padded", "packed"), [
    ([], 1, 1),  # the default: one micro-batch (old micro_batches=1)
    (["learner.min_micro_batches=3"], 3, 3),
    # a token cap that fits one group per micro-batch: more than the minimum when packed
    (["learner.min_micro_batches=3", "learner.max_tokens_per_microbatch=20"], 3, 4),
])
def test_micro_batches_are_the_old_count_for_a_batch(overrides, padded, packed):
    import torch

    from learner.strategies import PackedStrategy, PaddedStrategy

    samples, cpu = _samples(4), torch.device("cpu")
    cfg = load_config(SPINE_CONFIG, overrides)
    assert len(PaddedStrategy(cfg, 0, cpu).micro_batches(samples)) == padded
    strategy = PackedStrategy(cfg, _tiny_model(), 0, cpu)
    assert len(strategy.micro_batches(samples)) == packed


def test_quiet_is_the_launcher_flag_only(capsys):
    from arpo_async.launcher.progress import Progress

    assert "quiet" not in load_config(SPINE_CONFIG).run.model_dump()
    progress = Progress(load_config(SPINE_CONFIG), quiet=True)
    assert progress.live is None
    progress.note("hello")
    assert "[launch] hello" in capsys.readouterr().out
