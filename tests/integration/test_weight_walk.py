"""One weight update, one way, with the dtype travelling with each tensor: a DeepSpeed
learner (one CPU rank, model.dtype=bfloat16) hands ``full_state`` to the ZeroMQ channel,
which encodes it once; the decoded update holds bfloat16 tensors equal bit for bit to the
trained parameters, and the engines' load conversion (``torch_state_dict``) turns them
into exactly those values in the engine's dtype."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_ranks

pytestmark = [pytest.mark.integration]

_SCRIPT = r"""
import json, sys
import numpy as np
import torch
from actors.engines.base import torch_state_dict
from arpo_async.core import protocol as P
from arpo_async.core.weights.zeromq import WeightsRequest
from arpo_async.core.config import SPINE_CONFIG as SPINE, load_config
from learner.batching import LeafSample
from learner.dist import init_distributed
from arpo_async.core.weights.zeromq import ZmqWeightSender

cfg = load_config(SPINE, [f"model.path={sys.argv[1]}", "model.dtype=bfloat16", "learner.lr=0.01"])
init_distributed()
from learner.trainer import PolicyTrainer
trainer = PolicyTrainer(cfg, sys.argv[1])
rng = np.random.default_rng(0)
samples = [LeafSample(rng.integers(1, 500, 5).astype(np.int32),
                      rng.integers(1, 500, 12).astype(np.int32), np.ones(12, np.float32),
                      np.full(12, -3.0, np.float32), rng.standard_normal(12).astype(np.float32),
                      np.zeros(12, np.int32)) for _ in range(2)]
trainer.train_step(samples)
params = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
state = trainer.full_state()
sender = ZmqWeightSender()
sender.publish(1, state)
update = P.decode([bytes(f) for f in sender.handle(WeightsRequest(0, -1)).frames])
loaded = torch_state_dict(update.tensors, torch.float32)
print(json.dumps({
    "params": len(params), "sent": len(update.tensors), "version": update.version,
    "state_dtypes": sorted({str(t.dtype) for t in state.values()}),
    "wire_dtypes": sorted({str(t.dtype) for t in update.tensors.values()}),
    "bits_equal": all(torch.equal(update.tensors[n].view(torch.int16),
                                  params[n].view(torch.int16)) for n in params),
    "loaded_equal": all(torch.equal(loaded[n], params[n].float()) for n in params),
    "param_dtypes": sorted({str(p.dtype) for p in params.values()}),
}))
"""


def test_a_bfloat16_update_reaches_the_engine_as_bfloat16_bit_for_bit(tiny_model_dir):
    res = run_ranks(_SCRIPT, [str(tiny_model_dir)], 1, 300)
    assert res.returncode == 0, res.stderr[-4000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["params"] == out["sent"] > 0 and out["version"] == 1
    assert out["state_dtypes"] == out["wire_dtypes"] == ["torch.bfloat16"]
    assert out["bits_equal"] and out["loaded_equal"]
    # DeepSpeed's bf16 mode holds the module in bfloat16 (float32 masters in the optimizer):
    # the update is those tensors, bit for bit, with their dtype
    assert out["param_dtypes"] == ["torch.bfloat16"]
