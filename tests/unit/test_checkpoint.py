"""learner/checkpoint.py (atomic writes, layout, retention, choosing what to load), the
group checks and ledger bookkeeping of learner/service.py, and the prompt stream's data
position (toolenv/tasks/prompts.py) that restarts resume from."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from arpo_async.core import files as F
from arpo_async.core import rundir as R
from arpo_async.core.config import SPINE_CONFIG, load_config
from arpo_async.core.protocol import Trajectory, TrajectoryGroup
from arpo_async.core.rundir import saved_position
from learner import checkpoint as C
from learner.ledger import ActorLedger, peer_count
from learner.service import check_group
from toolenv.tasks.prompts import PromptSource


def _write(run_dir: Path, step: int, keep: int = 3, payload: bytes = b"w") -> Path:
    def write(folder: Path) -> None:
        (folder / "model.safetensors").write_bytes(payload * 100)

    return C.write_checkpoint(run_dir, step, write, {"step": step, "policy_version": step}, keep)


# ----------------------------------------------------------------------------- durable files


def test_atomic_write_replaces_whole_files_and_leaves_no_temporaries(tmp_path):
    path = tmp_path / "state.json"
    F.atomic_write_json(path, {"step": 1})
    F.atomic_write_json(path, {"step": 2, "x": [1, 2]})
    assert json.loads(path.read_text()) == {"step": 2, "x": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_crash_before_the_rename_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "state.json"
    F.atomic_write_json(path, {"step": 1})

    def crash(*_):
        raise OSError("killed here")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed here"):
        F.atomic_write_json(path, {"step": 2})
    assert json.loads(path.read_text()) == {"step": 1}


def test_read_json_tolerates_missing_and_torn_files(tmp_path):
    assert F.read_json(tmp_path / "none.json") is None
    (tmp_path / "torn.json").write_text('{"step": 3, "led')
    assert F.read_json(tmp_path / "torn.json") is None
    (tmp_path / "list.json").write_text("[1]")
    assert F.read_json(tmp_path / "list.json") is None


# ----------------------------------------------------------------------------- checkpoints


def test_checkpoints_keep_the_newest_and_the_pointer_names_it(tmp_path):
    for step in (2, 4, 6, 8):
        _write(tmp_path, step, keep=2)
    names = [p.name for p in R.complete_checkpoints(tmp_path)]
    assert names == ["step-00000006", "step-00000008"]
    assert (R.checkpoints_dir(tmp_path) / R.LATEST).read_text().strip() == "step-00000008"
    assert R.latest_checkpoint(tmp_path).name == "step-00000008"
    assert C.read_meta(R.latest_checkpoint(tmp_path))["step"] == 8


def test_unfinished_and_broken_checkpoints_are_never_loaded(tmp_path):
    _write(tmp_path, 2)
    root = R.checkpoints_dir(tmp_path)
    # a crash before the rename leaves a partial folder; after it, one without metadata
    partial = C.prepare(tmp_path, 4)
    (partial / "model.safetensors").write_bytes(b"half")
    (root / "step-00000006").mkdir()
    (root / "step-00000008").mkdir()
    (root / "step-00000008" / R.META).write_text('{"step": 8, "torn')
    assert R.latest_checkpoint(tmp_path).name == "step-00000002"
    # the next write removes the leftover partial folder
    _write(tmp_path, 10)
    assert not partial.exists() and R.latest_checkpoint(tmp_path).name == "step-00000010"


def test_a_pointer_left_behind_by_a_crash_does_not_hide_the_newest(tmp_path, caplog):
    _write(tmp_path, 2)
    _write(tmp_path, 4)
    (R.checkpoints_dir(tmp_path) / R.LATEST).write_text("step-00000002\n")
    assert R.latest_checkpoint(tmp_path).name == "step-00000004"
    assert "pointer" in caplog.text


def test_no_checkpoint_and_bad_arguments(tmp_path):
    assert R.latest_checkpoint(tmp_path) is None
    with pytest.raises(ValueError, match="keep"):
        C.prune(tmp_path, 0)
    with pytest.raises(ValueError, match="step"):
        R.checkpoint_name(-1)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        C.read_meta(tmp_path)


def test_exported_folder_loads_in_transformers_with_the_same_weights(tiny_model_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with torch.no_grad():  # weights that differ from the source folder's
        for p in model.parameters():
            p.add_(0.01)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}

    def write(folder: Path) -> None:
        C.export_hf(folder, state, tiny_model_dir)

    ckpt = C.write_checkpoint(tmp_path, 1, write, {"step": 1}, keep=1)
    assert sorted(p.name for p in ckpt.glob("*.safetensors")) == ["model.safetensors"]
    loaded = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(ckpt).vocab_size == AutoTokenizer.from_pretrained(
        tiny_model_dir).vocab_size
    ids = torch.arange(1, 17)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, rtol=0, atol=0)


# ----------------------------------------------------------------------------- service pieces


def _group(**leaf_overrides) -> TrajectoryGroup:
    n = 6
    leaf = dict(tokens=np.arange(10, 10 + n, dtype=np.int32), loss_mask=np.ones(n, np.uint8),
                logprobs=np.full(n, -0.5, np.float32), versions=np.zeros(n, np.int32))
    leaves = [Trajectory(**leaf), Trajectory(**(leaf | {"reward": 1.0} | leaf_overrides))]
    return TrajectoryGroup("g", 0, "p", np.arange(1, 5, dtype=np.int32), leaves)


@pytest.mark.parametrize("override, reason", [
    ({}, ""),
    ({"tokens": np.array([1, 2, 3, 4, 5, 4096], np.int32)}, "token_id"),
    ({"tokens": np.array([1, 2, 3, -4, 5, 6], np.int32)}, "token_id"),
    ({"logprobs": np.array([-1, np.nan, -1, -1, -1, -1], np.float32)}, "logprobs"),
    ({"logprobs": np.full(6, 3.0, np.float32)}, "logprobs"),
    # a NaN on a tool token (mask 0) would still turn the loss sums into NaN
    ({"logprobs": np.array([-1, np.nan, -1, -1, -1, -1], np.float32),
      "loss_mask": np.array([1, 0, 1, 1, 1, 1], np.uint8)}, "logprobs"),
    ({"loss_mask": np.full(6, 2, np.uint8)}, "loss_mask"),
    ({"versions": np.full(6, -1, np.int32)}, "versions"),
    ({"reward": float("inf")}, "reward"),
    ({"parent": 1}, "tree"),  # its own parent: a cycle
    ({"parent": -1, "branch_point": 3}, "tree"),
])
def test_check_group_names_what_would_break_training(override, reason):
    assert check_group(_group(**override), vocab_size=2048, max_tokens=64) == reason


def test_check_group_bounds_size_and_ids():
    assert check_group(_group(), 2048, max_tokens=8) == "too_long"
    bad = _group()
    bad.actor_id = -3
    assert check_group(bad, 2048, 64) == "actor_id"
    bad = _group()
    bad.leaves = []
    assert check_group(bad, 2048, 64) == "leaves"
    assert check_group(_group(), 2048, 64, max_leaves=1) == "leaves"


def test_ledger_survives_a_json_round_trip_and_counts_lost_groups():
    led = ActorLedger(pid=11, received_total=5, trained=3)
    led.dropped["stale"] = 2
    led.sent_by_pid = {10: 4, 11: 3}  # a dead incarnation said 4, the live one 3
    led.received_by_pid = {10: 3, 11: 2}
    led.stats["data_pos"] = 17.0
    back = ActorLedger.from_state(json.loads(json.dumps(led.to_state())))
    assert back.to_state() == led.to_state()
    assert back.sent() == 7 and back.lost() == 2
    led.received_by_pid[10] = 6  # more arrived than a last heartbeat said: count them
    assert led.sent() == 9


def test_numbers_from_peers_never_raise():
    assert peer_count(12.0, 0) == 12 and peer_count(3, 0) == 3
    for bad in (float("nan"), float("inf"), -1.0, 1e30, True, "7", None):
        assert peer_count(bad, 5) == 5, bad


# ----------------------------------------------------------------------------- data position


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_seek_continues_the_stream_exactly(tokenizer):
    cfg = load_config(SPINE_CONFIG, ["task.num_prompts=7"])
    whole = PromptSource(cfg, tokenizer, stream=3)
    ids = [whole.next().id for _ in range(30)]
    assert whole.position == 30
    for start in (0, 1, 6, 7, 8, 14, 29):
        src = PromptSource(cfg, tokenizer, stream=3)
        src.seek(start)
        assert src.position == start
        assert [src.next().id for _ in range(30 - start)] == ids[start:], start
    with pytest.raises(ValueError, match="position"):
        whole.seek(-1)


def test_prompt_at_is_the_prompt_the_stream_draws_there(tokenizer):
    """An actor draws again a prompt the learner lost (actors/actor.py ``_plan_redo``):
    ``prompt_at(p)`` is the prompt ``next`` drew at position p, over several epochs, in
    any order, without moving the stream."""
    cfg = load_config(SPINE_CONFIG, ["task.num_prompts=7"])
    whole = PromptSource(cfg, tokenizer, stream=3)
    ids = [whole.next().id for _ in range(30)]
    src = PromptSource(cfg, tokenizer, stream=3)
    for p in (29, 0, 13, 7, 6, 21, 14, 28, 1):
        assert src.prompt_at(p).id == ids[p], p
    assert src.position == 0 and src.next().id == ids[0]
    with pytest.raises(ValueError, match="position"):
        src.prompt_at(-1)


def test_saved_position_reads_the_run_state(tmp_path):
    assert saved_position(tmp_path, 0) == 0
    F.atomic_write_json(tmp_path / R.RUN_STATE, {"data_position": {"0": 12, "1": 3}})
    assert saved_position(tmp_path, 0) == 12 and saved_position(tmp_path, 1) == 3
    assert saved_position(tmp_path, 2) == 0
    (tmp_path / R.RUN_STATE).write_text("{torn")
    assert saved_position(tmp_path, 0) == 0
