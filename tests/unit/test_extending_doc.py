"""docs/extending.md stays true: every repository path it names exists; its loss
example, run as written, is a loss type the driver takes and is exact on trees; its weight
channel example carries a weight update over the real wire format; its rollout policy
example, run as written through the real rollout, builds the tree it
describes; its engine example is taken by the config checks and the launcher's plan as
its capabilities say, and generates a group through the real rollout."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Literal

import pytest
from hypothesis import Phase, given, settings
from pydantic import Field

from arpo_async.core.config import losses as config_losses
from learner import losses
from learner.batching import samples_from_groups
from learner.packing import build_units
from tests.unit.test_loss_types import TableLM, _z, assert_exact, packed, padded
from tests.unit.test_packing_exact import groups
from tests.unit.test_rollout_policy import scripted_run

EXAMPLES = settings(max_examples=10, deadline=None, derandomize=True,
                    phases=(Phase.explicit, Phase.reuse, Phase.generate))
REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "extending.md"
PATH = re.compile(r"`((?:arpo_async|actors|learner|toolenv|tests|examples|docs)/[\w/.<>-]+)`")


def _blocks() -> list[str]:
    parts = DOC.read_text().split("```")
    return [textwrap.dedent(parts[i].split("\n", 1)[1]) for i in range(1, len(parts), 2)]


def test_every_path_the_page_names_exists():
    named = {m.group(1) for m in PATH.finditer(DOC.read_text())}
    assert len(named) >= 20, named
    new = {"learner/losses/<name>.py", "learner/losses/reinforce.py",  # what you write
           "actors/rollout/<name>.py", "arpo_async/core/weights/<name>.py",
           "actors/engines/<name>.py", "actors/engines/script.py"}
    missing = sorted(p for p in named - new if not (REPO / p).exists())
    assert not missing, missing


@pytest.fixture
def reinforce(monkeypatch):
    """The page's example, registered as the page says."""
    objective, settings = (b for b in _blocks() if "_LossBase" in b or "LossType(" in b)
    module: dict = {}
    exec(compile(objective, "docs/extending.md (objective)", "exec"), module)
    cfg: dict = {"_LossBase": config_losses._LossBase, "Field": Field, "Literal": Literal}
    exec(compile("from __future__ import annotations\n" + settings,
                 "docs/extending.md (settings)", "exec"), cfg)
    cls = cfg["ReinforceLoss"]
    cls.model_rebuild(_types_namespace={"Literal": Literal})
    monkeypatch.setitem(losses.LOSSES, "reinforce", module["LOSS"])
    return cls


def test_the_loss_example_is_a_loss_type_exact_on_trees(reinforce):
    s = reinforce(proximal="recompute", importance={"mode": "truncate", "cap": 1.02})
    assert s.type == "reinforce" and s.model_fields["type"].description

    @EXAMPLES
    @given(gs=groups())
    def exact(gs):
        samples, _ = samples_from_groups(gs, "soft")
        z, table = _z(samples, "reinforce"), TableLM()
        assert_exact(padded(table, samples, s, True, z),
                     packed(table, build_units(samples, "tree"), s, True, z))

    exact()


def test_the_rollout_policy_example_builds_its_tree(tiny_model_dir):
    (block,) = (b for b in _blocks() if "GroupPolicy" in b)
    module: dict = {}
    exec(compile(block, "docs/extending.md (policy)", "exec"), module)
    group, _ = scripted_run(tiny_model_dir, module["EveryToolRound"], group_size=5, calls=3)
    leaves = group.leaves
    assert len(leaves) == 5
    # one root; every fork starts at the end of a tool result of its parent and shares
    # its parent's tokens up to there
    assert [leaf.parent for leaf in leaves].count(-1) == 1
    for leaf in leaves[1:]:
        parent = leaves[leaf.parent]
        n = leaf.branch_point
        assert n > 0 and list(leaf.tokens[:n]) == list(parent.tokens[:n])
        assert parent.loss_mask[n - 1] == 0  # the last shared token is the tool result's
    assert group.stats["rollout/context_full"] == 0


@pytest.fixture
def protocol_kinds():
    """The protocol's message kinds as they were: the example registers two more."""
    from arpo_async.core import protocol as P

    saved = dict(P.MESSAGES)
    yield
    P.MESSAGES.clear()
    P.MESSAGES.update(saved)


async def test_the_weight_channel_example_carries_an_update(tmp_path, monkeypatch,
                                                            protocol_kinds):
    import torch

    from arpo_async.core import protocol as P
    from arpo_async.core import weights

    (block,) = (b for b in _blocks() if "register_messages" in b)
    module: dict = {}
    # dont_inherit: not this file's "from __future__ import annotations" (the page's
    # dataclasses are written without it)
    exec(compile(block, "docs/extending.md (channel)", "exec", dont_inherit=True), module)
    monkeypatch.setitem(weights.CHANNELS, "folder", module["CHANNEL"])
    assert all(P.MESSAGES[c.KIND] is c for c in module["CHANNEL"].messages)  # registered
    cfg = SimpleNamespace(learner=SimpleNamespace(weight_sync=SimpleNamespace(channel="folder")),
                          run=SimpleNamespace(dir=tmp_path))
    senders = weights.build_weight_senders(cfg)
    assert [s.channel for s in senders] == ["zmq", "folder"]

    class Wire:
        """The learner's routing (learner/service.py): each request to the sender that
        lists it; both ways through the real wire format."""

        async def request(self, msg):
            msg = P.decode(P.encode(msg))
            (sender,) = (s for s in senders if isinstance(msg, s.requests))
            return P.decode(P.encode(sender.handle(msg)))

    class Engine:
        version, loaded = 0, []

        async def update_weights(self, tensors, version):
            self.loaded.append(tensors)
            self.version = version
            return 0.1

    receiver = await weights.build_weight_receiver(cfg, Wire(), Engine(), actor_id=0)
    engine = Engine()
    assert receiver.channel == "folder" and await receiver.sync(engine) is None
    sent = {"w": torch.randn(3, 4).to(torch.bfloat16), "b": torch.randn(4)}
    for s in senders:
        s.publish(1, sent)
    got = await receiver.sync(engine)
    assert (got.version, got.channel, engine.version) == (1, "folder", 1)
    (loaded,) = engine.loaded
    assert {n: t.dtype for n, t in loaded.items()} == {"w": torch.bfloat16, "b": torch.float32}
    assert all(torch.equal(loaded[n], sent[n]) for n in sent)
    assert await receiver.sync(engine) is None  # up to date


@pytest.fixture
def script_engine(monkeypatch):
    """The page's engine example, registered as the page says: its settings in
    ``ENGINES``, its builder in ``ENGINE_BUILDERS``. Pydantic builds the schema of the
    ``actors.engine`` union once, at import, from ``ENGINES``; it is rebuilt here with the
    new member, and back without it afterwards."""
    from actors import engines
    from arpo_async.core import config
    from arpo_async.core.config import actors as config_actors
    from arpo_async.core.config.base import Tagged

    module_block, settings_block = (b for b in _blocks() if "class Script" in b)
    module: dict = {}
    exec(compile(module_block, "docs/extending.md (engine)", "exec"), module)
    cfg = dict(vars(config_actors))
    exec(compile("from __future__ import annotations\n" + settings_block,
                 "docs/extending.md (engine settings)", "exec"), cfg)
    settings = cfg["ScriptSettings"]
    settings.model_rebuild(_types_namespace={"Literal": Literal})
    monkeypatch.setitem(config_actors.ENGINES, "script", settings)
    monkeypatch.setitem(engines.ENGINE_BUILDERS, "script", module["ScriptEngine"].create)
    field = config.ActorsConfig.model_fields["engine"]
    old = field.annotation

    def rebuild(annotation):
        field.annotation = annotation
        config.ActorsConfig.model_rebuild(force=True)
        config.Config.model_rebuild(force=True)

    rebuild(Tagged("actors.engine", "type", config_actors.ENGINES, "vllm",
                   "generation engine").annotation)
    try:
        yield settings
    finally:
        rebuild(old)


def test_the_engine_example_is_an_engine_the_config_and_plan_take(script_engine):
    from arpo_async.core.config import ConfigError, load_config
    from arpo_async.launcher.plan import check_placement, plan
    from tests.unit.test_plan import gpu

    overrides = ["actors.engine.type=script", "actors.num=3", "actors.engine.actors_per_process=2"]
    cfg = load_config(None, overrides)  # the default config's vLLM section, retagged
    assert isinstance(cfg.actors.engine, script_engine) and cfg.actors.engine.replies
    assert cfg.actors.weight_update_mode() == "interrupt" and cfg.actors.gpus_per_actor == 1
    roles = plan(cfg, "runs/t/config.yaml", python="PY")[1:]  # shares_process
    assert [r.name for r in roles] == ["actors0-1", "actors2-2"]
    for extra, needle in [("actors.update_mode=keep", "actors.engine=script takes drain"),
                          ("tools.syntax=hermes", "the script engine writes ARPO tags only"),
                          ("pipeline.eval_engine=script", "pipeline.eval_engine: 'script'")]:
        with pytest.raises(ConfigError, match=re.escape(needle)):
            load_config(None, [*overrides, extra])
    on_gpu = gpu(actors={"engine": "script"})
    assert any("actors.engine=script does not use the GPU" in n for n in check_placement(on_gpu))
    with pytest.raises(ConfigError, match=r"channel=nccl needs actors.engine=vllm \(got script"):
        check_placement(gpu(actors={"engine": "script"},
                            learner={"weight_sync": {"channel": "nccl"}}))


async def test_the_engine_example_generates_a_group_through_the_rollout(script_engine,
                                                                       tiny_model_dir):
    import numpy as np

    from actors.engines import build_engine
    from actors.rollout import build_rollout
    from arpo_async.core.config import config_from_dict
    from tests.unit.test_rollout_policy import ANSWER, CALL, FakeTools
    from toolenv.tasks.prompts import PromptSource

    cfg = config_from_dict({
        "actors": {"engine": {"type": "script", "replies": [CALL, CALL, ANSWER]}},
        "rollout": {"mode": "arpo", "group_size": 2, "initial_samples": 2},
        "sampling": {"round_max_tokens": 32, "max_response_tokens": 200},
        "tools": {"enabled": ["python"]}, "task": {"name": "arith"}})
    engine = await build_engine(cfg, str(tiny_model_dir), actor_id=1, version=3)
    tok = engine.tokenizer
    source = PromptSource(cfg, tok)
    rollout = build_rollout(cfg, engine, source, tok, FakeTools(), np.random.default_rng(0))
    group = await rollout.run(source.next(), actor_id=1)
    assert len(group.leaves) == 2
    for leaf in group.leaves:
        text = tok.decode(leaf.tokens, skip_special_tokens=False)
        assert text.count(CALL) == 2 and text.endswith(ANSWER) and leaf.tool_calls == 2
        assert set(leaf.versions[leaf.loss_mask > 0]) == {3}
    assert await engine.update_weights({}, 4) >= 0 and engine.version == 4
    await engine.close()
