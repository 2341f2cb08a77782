"""Two loss terms that need the whole learner, on real DeepSpeed ranks:

* KL to the frozen reference (``learner.loss.kl_coef=0.01``): five steps on one rank at
  ZeRO-0 (padded and tree paths) and on two gloo ranks at ZeRO-3 (tree); the KL is exactly
  0 at step 1 (the reference is the initial weights) and > 0 once the policy has moved.
* AEPO's entropy-aware advantage: with the same tokens split over three micro-batches on
  each of two ranks, z(H) uses the mean and std of the whole batch. The statistics, the
  loss and the gradient norm equal a one-rank, one-micro-batch step's, and the statistics
  equal a plain recomputation over every model token (one row per leaf)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import run_ranks

pytestmark = [pytest.mark.integration]

_SCRIPT = r"""
import json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from arpo_async.core.config import SPINE_CONFIG, load_config
from learner.batching import balanced_split, samples_from_groups
from learner.dist import init_distributed
from tests.integration.test_minibatches import make_groups

out_dir, model, zero = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
init_distributed()
from learner.trainer import PolicyTrainer
rank, world = dist.get_rank(), dist.get_world_size()
base = [f"model.path={model}", f"learner.zero_stage={zero}", f"learner.world_size={world}",
        "learner.batch_groups=4", "learner.max_tokens_per_microbatch=0"]
out = {}

def part(seed):
    samples, _ = samples_from_groups(make_groups(seed), "soft")
    return balanced_split(samples, world)[rank]

for packing in (("padded", "tree") if world == 1 else ("tree",)):
    cfg = load_config(SPINE_CONFIG, base + [f"learner.packing={packing}", "learner.lr=0.01",
                                            "learner.loss.kl_coef=0.01"])
    torch.manual_seed(0)
    trainer = PolicyTrainer(cfg, model)
    out[f"kl_{packing}"] = [trainer.train_step(part(seed))["loss/kl"] for seed in range(1, 6)]

cfg = load_config(SPINE_CONFIG, base + [f"learner.min_micro_batches={3 if world > 1 else 1}",
                                        "learner.loss.aepo_entropy_adv_gamma=0.2",
                                        "learner.loss.aepo_entropy_clip=true"])
torch.manual_seed(0)
trainer = PolicyTrainer(cfg, model)
m = trainer.train_step(part(7))
loss = torch.tensor([m["loss/loss"]], dtype=torch.float64)
dist.all_reduce(loss)  # each rank's share of the token-mean loss
out["aepo"] = {"loss": float(loss), "grad_norm": m["grad_norm"],
               "stats": list(trainer.last_entropy_stats),
               "microbatches": m["packing/microbatches"]}
if rank == 0:
    (out_dir / f"world{world}.json").write_text(json.dumps(out))
"""


def _plain_entropy_stats(model_dir: Path) -> tuple[float, float]:
    """Mean and sample std of the normalised entropy over every model token of the batch,
    one HF forward per leaf."""
    import torch
    from transformers import AutoModelForCausalLM

    from arpo_async.core.entropy import entropy_from_logits
    from learner.batching import samples_from_groups
    from tests.integration.test_minibatches import make_groups

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    samples, _ = samples_from_groups(make_groups(7), "soft")
    values = []
    with torch.no_grad():
        for s in samples:
            ids = torch.from_numpy(np.r_[s.prompt, s.response].astype(np.int64))[None]
            ent = entropy_from_logits(model(input_ids=ids).logits[0, :-1])
            ent = ent[len(s.prompt) - 1:]
            values += ent[torch.from_numpy(s.weight > 0)].double().tolist()
    return float(np.mean(values)), float(np.std(values, ddof=1))


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kl_aepo")
    out = {}
    for world, zero in ((1, 0), (2, 3)):
        res = run_ranks(_SCRIPT, [str(tmp), str(tiny_model_dir), str(zero)], world, 400)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-6000:]
        out[world] = json.loads((tmp / f"world{world}.json").read_text())
    return out


@pytest.mark.parametrize("world, packing", [(1, "padded"), (1, "tree"), (2, "tree")])
def test_kl_is_zero_at_the_start_and_grows(runs, world, packing):
    kl = runs[world][f"kl_{packing}"]
    assert len(kl) == 5 and kl[0] == 0.0, kl
    assert all(k > 0 for k in kl[1:]), kl
    assert kl[-1] > kl[1]  # the policy keeps moving away from the reference


def test_kl_paths_agree(runs):
    np.testing.assert_allclose(runs[1]["kl_tree"], runs[1]["kl_padded"], rtol=1e-3, atol=1e-9)


def test_entropy_aware_z_uses_the_whole_batch(runs, tiny_model_dir):
    one, two = runs[1]["aepo"], runs[2]["aepo"]
    assert two["microbatches"] == 3 and one["microbatches"] == 1
    mean, std = _plain_entropy_stats(tiny_model_dir)
    for got in (one, two):
        # a random model's entropies are all near 1 (std ~1e-4): the paths' fp32
        # entropies differ by ~1e-9, far below what one micro-batch's statistics change
        assert got["stats"][0] == pytest.approx(mean, rel=1e-6)
        assert got["stats"][1] == pytest.approx(std, rel=1e-4)
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-5, abs=1e-8)
    assert two["grad_norm"] == pytest.approx(one["grad_norm"], rel=1e-4)
