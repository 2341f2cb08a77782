"""The frozen reference policy of the KL term (``learner.loss.kl_coef > 0``).

The loss adds kl_coef * k3(pi_theta || pi_ref) per model token (learner/losses/base.py,
``kl_k3``); pi_ref is the policy the RL stage started from: the weights at
``model.path``, loaded once and never updated (a resumed learner loads the same files, so
its reference is the run's initial policy, not the checkpoint's).

How it is held: a second DeepSpeed engine without an optimizer, with the policy engine's
dtype settings, so that at step 1 (same weights) the reference's log-probs equal the
policy's bit for bit and the KL is exactly 0:

* ZeRO 0, 1, 2: engine at stage 0, a full copy of the weights on every rank. Memory: one
  more copy of the weights per rank in the forward dtype (bf16 on GPU: 2 bytes/param,
  about 15 GB for a 7B model; fp32 master weights on CPU: 4 bytes/param). No gradients,
  no optimizer state.
* ZeRO 3: engine at stage 3, parameters partitioned like the policy's: 1/world of a copy
  per rank, each layer gathered during its forward (collective: every rank calls the
  reference as often, which the trainer guarantees as it does for the policy).

Its log-probs are computed once per rollout batch, before the first optimizer step, on
the same micro-batches the loss uses and by the same forward (the trainer's strategy,
learner/strategies.py: padded rows, or packed trees with the tree mask), at the sampling
temperature; they are kept like the proximal log-probs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from transformers import AutoModelForCausalLM

from learner.device import model_load_kwargs

log = logging.getLogger("learner")


def reference_ds_config(cfg) -> dict:
    """DeepSpeed config of the frozen engine: ZeRO-3 when the policy is partitioned, else
    stage 0; the policy's bf16/fp16 switch; no optimizer, so no ZeRO-1/2 state to shard."""
    ds = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
          "zero_optimization": {"stage": 3 if cfg.learner.zero_stage == 3 else 0},
          "steps_per_print": 10**9, "wall_clock_breakdown": False}
    if cfg.model.dtype == "bfloat16":
        ds["bf16"] = {"enabled": True}
    elif cfg.model.dtype == "float16":
        ds["fp16"] = {"enabled": True}
    return ds


class ReferencePolicy:
    """The initial policy as a frozen DeepSpeed ``engine``; ``prepare`` readies the model
    for the trainer's micro-batches before DeepSpeed wraps it (the packed dispatcher)."""

    def __init__(self, cfg, model_path: str, prepare: Callable[[object], None]):
        import deepspeed  # deepspeed: after learner/dist.py has set DS_ACCELERATOR

        model = AutoModelForCausalLM.from_pretrained(model_path, **model_load_kwargs(cfg))
        model.config.use_cache = False
        model.requires_grad_(False)
        model.eval()
        prepare(model)
        self.engine, *_ = deepspeed.initialize(model=model, config=reference_ds_config(cfg))
        self.engine.eval()
        n = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
        log.info("reference policy for the KL term: %s (%.1fM parameters, ZeRO-%d, frozen)",
                 model_path, n / 1e6, reference_ds_config(cfg)["zero_optimization"]["stage"])
