"""An engine is asked what it can do, never which engine it is (docs/extending.md, "A
generation engine"): every engine of ``ENGINES`` has a builder and the keys its
capabilities name; each capability answers as the name tests it replaced did (the same
configs refused with the same errors, the same plans and notes); and no module outside
the engines room and the config tables compares an engine's name with a string."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from actors.engines import ENGINE_BUILDERS
from actors.main import run_actors
from arpo_async.core.config import ConfigError, config_from_dict, load_config
from arpo_async.core.config.actors import ENGINES, _Engine, engines_that
from arpo_async.launcher.plan import check_placement, plan
from tests.unit.test_plan import CFG_PATH, gpu

REPO = Path(__file__).resolve().parents[2]
CAPABILITIES = ("keeps_kv_cache", "uses_gpu", "splits_over_gpus", "native_weight_transfer",
                "shares_process", "arpo_tags_only", "evaluates")
# what the name tests said: vLLM keeps its KV cache, computes on (and splits over) GPUs
# and takes NCCL weights; the simulated engine shares processes and writes ARPO tags only;
# evaluation took vllm or transformers
TODAY = {
    "vllm": {"keeps_kv_cache", "uses_gpu", "splits_over_gpus", "native_weight_transfer",
             "evaluates"},
    "transformers": {"evaluates"},
    "simulated": {"shares_process", "arpo_tags_only"},
}
# a capability that needs a number: the key of the member that carries it
KEYS = {"uses_gpu": "gpu_memory_utilization", "splits_over_gpus": "tensor_parallel",
        "shares_process": "actors_per_process"}
# where an engine's name may be compared: the engines room and the config's tables
ALLOWED = ("actors/engines/", "arpo_async/core/config/")


def test_every_engine_has_a_builder_and_the_keys_its_capabilities_name():
    assert set(ENGINES) == set(ENGINE_BUILDERS)
    assert set(CAPABILITIES) == set(_Engine.__class_vars__)
    for name, cls in ENGINES.items():
        assert issubclass(cls, _Engine) and cls.model_fields["type"].default == name
        for capability, key in KEYS.items():
            assert not getattr(cls, capability) or key in cls.model_fields, (name, capability)


def test_each_capability_answers_as_the_name_test_it_replaced():
    got = {name: {c for c in CAPABILITIES if getattr(cls, c)} for name, cls in ENGINES.items()}
    assert got == TODAY
    assert engines_that("evaluates") == ["vllm", "transformers"]  # evaluate --engine's order


def _name_tests(source: str, where: str) -> list[str]:
    """Comparisons of anything with an engine's name (``eng.type == "vllm"``, ``kind in
    ("vllm", ...)``) in one module's source."""
    found = []
    for node in ast.walk(ast.parse(source, where)):
        if isinstance(node, ast.Compare):
            consts = [c.value for side in [node.left, *node.comparators]
                      for c in ast.walk(side) if isinstance(c, ast.Constant)]
            if any(c in ENGINES for c in consts):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_outside_the_engines_and_the_config_tests_an_engines_name():
    probe = 'if cfg.actors.engine.type != "vllm":\n    pass\nok = kind in ("a", "simulated")\n'
    assert len(_name_tests(probe, "probe")) == 2  # the scan sees both forms
    files = [p for pkg in ("arpo_async", "actors", "learner", "toolenv")
             for p in sorted((REPO / pkg).rglob("*.py"))
             if not p.relative_to(REPO).as_posix().startswith(ALLOWED)]
    assert len(files) > 50
    found = [hit for p in files
             for hit in _name_tests(p.read_text(), p.relative_to(REPO).as_posix())]
    assert not found, "ask a capability (arpo_async/core/config/actors.py, _Engine):\n" + \
        "\n".join(found)


@pytest.mark.parametrize("engine", ["transformers", "simulated"])
def test_keep_mode_needs_an_engine_that_keeps_its_kv_cache(engine):
    with pytest.raises(ConfigError, match=re.escape(
            "actors.update_mode=keep freezes requests with their KV cache (vllm only); "
            f"actors.engine={engine} takes drain or interrupt")):
        load_config(None, [f"actors.engine={engine}", "actors.update_mode=keep"])
    assert load_config(None, [f"actors.engine={engine}"]).actors.weight_update_mode() == \
        "interrupt"
    assert load_config(None, ["actors.engine=vllm"]).actors.weight_update_mode() == "keep"


def test_other_tool_syntaxes_need_an_engine_that_writes_them():
    with pytest.raises(ConfigError, match=re.escape(
            "tools.syntax=hermes: the simulated engine writes ARPO tags only "
            "(actors.engine=simulated); use tools.syntax=arpo with it")):
        load_config(None, ["actors.engine=simulated", "tools.syntax=hermes"])
    load_config(None, ["actors.engine=transformers", "tools.syntax=hermes"])


@pytest.mark.parametrize("engine", ["transformers", "simulated"])
def test_nccl_needs_an_engine_that_receives_it(engine):
    with pytest.raises(ConfigError, match=re.escape(
            f"learner.weight_sync.channel=nccl needs actors.engine=vllm (got {engine})")):
        check_placement(gpu(actors={"engine": engine},
                            learner={"weight_sync": {"channel": "nccl"}}))


def test_the_gpu_notes_follow_uses_gpu():
    hf = check_placement(gpu(actors={"engine": "transformers"}, cluster={"actor_gpus": [0, 1]}))
    assert ("actors.engine=transformers does not use the GPU (only the vllm engine does); "
            "its actors compute on the CPU") in hf
    assert not any("shared by the learner" in n for n in hf)
    vllm = check_placement(gpu(cluster={"actor_gpus": [0, 1]}))
    assert any("the vllm engine takes actors.engine.gpu_memory_utilization=0.85" in n
               for n in vllm)
    assert not any("does not use the GPU" in n for n in vllm)


def test_gpus_per_actor_and_processes_follow_the_engines_keys():
    tp = gpu(actors={"engine": {"type": "vllm", "tensor_parallel": 2}},
             cluster={"actor_gpus": [1, 2, 3, 4]})
    assert tp.actors.gpus_per_actor == 2
    assert [r.devices for r in plan(tp, CFG_PATH)[1:]] == ["cuda:1,2", "cuda:3,4"]
    assert config_from_dict({"actors": {"engine": "transformers"}}).actors.gpus_per_actor == 1
    sim = config_from_dict({"actors": {"num": 3, "engine": {"type": "simulated",
                                                            "actors_per_process": 3}}})
    assert [r.name for r in plan(sim, CFG_PATH)[1:]] == ["actors0-2"]


async def test_only_an_engine_that_shares_processes_runs_several_actors_in_one():
    cfg = config_from_dict({"actors": {"engine": "transformers"}})
    with pytest.raises(ValueError, match=re.escape(
            "actors.engine is 'transformers': only simulated actors can share a process")):
        await run_actors(cfg, [0, 1])


@pytest.mark.parametrize("name, ok", [("", True), ("vllm", True), ("transformers", True),
                                      ("simulated", False), ("sglang", False)])
def test_eval_engine_is_an_engine_that_evaluates(name, ok):
    if ok:
        assert load_config(None, [f"pipeline.eval_engine={name}"]).pipeline.eval_engine == name
        return
    with pytest.raises(ConfigError, match=re.escape(
            f"pipeline.eval_engine: {name!r} is not a generation engine that evaluates "
            "('', transformers, vllm)")):
        load_config(None, [f"pipeline.eval_engine={name}"])


def test_evaluate_offers_the_engines_that_evaluate(capsys):
    from arpo_async.jobs.evaluate import main

    with pytest.raises(SystemExit):
        main(["--model", "m", "--data", "d", "--engine", "simulated"])
    assert "choose from 'vllm', 'transformers'" in capsys.readouterr().err
