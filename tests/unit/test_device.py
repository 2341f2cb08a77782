"""Learner device helpers (learner/device.py): the CPU path stays as it was, and the GPU
choices (backend, attention kernel, load dtype) follow the config."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from arpo_async.core.config import config_from_dict
from learner.device import (
    attn_implementation,
    dist_backend,
    model_load_kwargs,
    prepare_model,
    setup_device,
    to_device,
)


def cfg(device="cpu", dtype="float32", attn="auto", ckpt=False):
    return config_from_dict({"cluster": {"device": device}, "model": {"dtype": dtype},
                             "learner": {"attn_implementation": attn,
                                         "gradient_checkpointing": ckpt}})


def test_backend_and_device_follow_cluster_device():
    assert (dist_backend(cfg()), dist_backend(cfg("cuda"))) == ("gloo", "nccl")
    assert setup_device(cfg()) == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="cluster.device=cuda but torch sees no GPU"):
            setup_device(cfg("cuda"))


@pytest.mark.parametrize("device, dtype, flash, expected", [
    ("cpu", "bfloat16", True, "sdpa"),
    ("cuda", "bfloat16", True, "flash_attention_2"),
    ("cuda", "float16", True, "flash_attention_2"),
    ("cuda", "float32", True, "sdpa"),
    ("cuda", "bfloat16", False, "sdpa"),
])
def test_auto_attention_picks_flash_only_where_it_runs(device, dtype, flash, expected):
    impl, why = attn_implementation(cfg(device, dtype), flash_available=flash)
    assert impl == expected and why.startswith("auto")


def test_forced_flash_attention_lists_every_missing_condition():
    with pytest.raises(ValueError) as info:
        attn_implementation(cfg("cpu", "float32", "flash_attention_2"), flash_available=False)
    msg = str(info.value)
    assert all(s in msg for s in ("cluster.device=cuda", "model.dtype", "flash-attn"))
    assert attn_implementation(cfg(attn="eager")) == ("eager", "configured")


def test_cpu_load_kwargs_load_the_model_as_before(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    kwargs = model_load_kwargs(cfg(dtype="bfloat16"))
    assert kwargs == {"dtype": torch.float32, "attn_implementation": "sdpa"}
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, **kwargs)
    assert model.config._attn_implementation == "sdpa"
    prepare_model(model, cfg(ckpt=True))
    assert model.is_gradient_checkpointing and model.config.use_cache is False
    model.train()
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()  # checkpointed backward runs and reaches the embeddings
    assert model.get_input_embeddings().weight.grad.abs().sum() > 0


def test_to_device_is_a_no_op_on_cpu_and_moves_every_tensor_otherwise():
    from learner.batching import LeafSample, collate

    s = LeafSample(np.array([1, 2], np.int32), np.array([3, 4], np.int32),
                   np.ones(2, np.float32), np.zeros(2, np.float32), np.ones(2, np.float32),
                   np.zeros(2, np.int32))
    batch = collate([s], pad_id=0)
    assert to_device(batch, torch.device("cpu")) is batch
    if torch.cuda.is_available():
        moved = to_device(batch, torch.device("cuda", 0))
        assert moved.input_ids.is_cuda and moved.weight.is_cuda
