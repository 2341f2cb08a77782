"""How the trainer lays out a rank's leaves and runs the model on them: one strategy per
``learner.packing``, chosen once (``build_strategy``).

- ``PaddedStrategy`` (``padded``): ``learner.min_micro_batches`` padded batches of one row per
  leaf (learner/batching.py) and the model's full logits: the reference the packed path
  must equal (tests/unit/test_packing_exact.py).
- ``PackedStrategy`` (``tree``, ``flat``): each group one token tree, or each leaf one
  chain (learner/packing.py), several per micro-batch up to
  ``learner.max_tokens_per_microbatch``, in as many micro-batches as the busiest rank
  needs (at least ``min_micro_batches``; the ranks agree on the largest count), run with the
  packed attention (learner/tree_attention.py) and chunked log-probs (learner/logprobs.py).

A strategy owns the micro-batches of one mini-batch, the no-grad forward (proximal and
entropy passes, and the frozen reference's log-probs, on the same micro-batches), the loss
of one micro-batch, the copies each log-prob position stands for (the entropy
statistics), the preparation of a model before DeepSpeed wraps it, and its step metrics.
The trainer (learner/trainer.py) runs the steps the same way for both.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from arpo_async.core.logits import causal_lm_logprobs
from learner import tree_attention as TA
from learner.batching import Batch, LeafSample, balanced_split, collate
from learner.device import to_device
from learner.logprobs import packed_forward, packed_step_loss
from learner.losses import LossInputs, policy_loss
from learner.packing import (PackedBatch, bins_needed, build_units, collate_packed,
                             pad_targets, split_bins)

log = logging.getLogger("learner")

Loss = tuple[torch.Tensor, dict[str, float]]


def padded_forward(model, batch: Batch, temperature: float, entropy: bool, chunk: int = 0
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [B, L-1], entropies or None) of a padded batch, every position through
    the output layer ``chunk`` at a time (arpo_async/core/logits.py; 0: all at once), the
    model's own [B, L, V] logits never built."""
    stats = causal_lm_logprobs(model, batch.input_ids, attention_mask=batch.attention_mask,
                               temperature=temperature, chunk=chunk, entropy=entropy)
    return stats.logp, stats.entropy


def padded_step_loss(model, batch: Batch, settings, temperature: float, normaliser: float,
                     proximal: torch.Tensor | None = None, ref: torch.Tensor | None = None,
                     batch_entropy_stats: tuple[float, float] | None = None,
                     chunk: int = 0) -> Loss:
    """The loss of one padded micro-batch (the reference the packed paths must equal);
    ``ref``: reference log-probs (KL), ``batch_entropy_stats``: the whole batch's entropy
    (mean, std) for AEPO's entropy-aware advantage (None: this micro-batch's own)."""
    logp, entropy = padded_forward(model, batch, temperature, settings.needs.entropy, chunk)
    inputs = LossInputs(
        logprobs=logp, behaviour_logprobs=batch.behaviour, proximal_logprobs=proximal,
        advantages=batch.advantages, loss_mask=batch.weight, ref_logprobs=ref, entropy=entropy,
        seq_ids=batch.seq_ids)
    return policy_loss(inputs, settings, normaliser=normaliser,
                       entropy_stats=batch_entropy_stats)


class PaddedStrategy:
    """``learner.packing=padded``: one row per leaf, padded to the longest of its batch."""

    def __init__(self, cfg, pad_id: int, device: torch.device):
        self.count, self.pad_id, self.device = cfg.learner.min_micro_batches, pad_id, device
        self.settings, self.temperature = cfg.learner.loss, cfg.sampling.temperature
        # Under ZeRO-3 on several ranks every call of the output layer is a collective, and
        # padded ranks hold different numbers of positions: one call per micro-batch.
        several = cfg.learner.zero_stage == 3 and cfg.learner.world_size > 1
        self.chunk = 0 if several else cfg.learner.logprob_chunk_tokens

    def prepare(self, model) -> None:
        """Nothing: the model's own attention takes the padding mask."""

    def micro_batches(self, samples: list[LeafSample]) -> list[Batch]:
        chunks = balanced_split(samples, self.count, keep_groups=False)
        return [to_device(collate(c, self.pad_id), self.device) for c in chunks]

    @torch.no_grad()
    def logprobs(self, model, batch: Batch, entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return padded_forward(model, batch, self.temperature, entropy, self.chunk)

    def loss(self, model, batch: Batch, normaliser: float, proximal, ref,
             entropy_stats) -> Loss:
        return padded_step_loss(model, batch, self.settings, self.temperature, normaliser,
                                proximal, ref, entropy_stats, self.chunk)

    def copies(self, batch: Batch) -> torch.Tensor:
        return (batch.weight > 0).to(torch.float64)

    def metrics(self, batches: list[Batch]) -> dict[str, float]:
        return {}


class PackedStrategy:
    """``learner.packing=tree|flat``: packed micro-batches with the packed attention."""

    def __init__(self, cfg, model, pad_id: int, device: torch.device):
        lc = cfg.learner
        self.packing, self.min_count = lc.packing, lc.min_micro_batches
        self.cap, self.chunk = lc.max_tokens_per_microbatch, lc.logprob_chunk_tokens
        self.zero3 = lc.zero_stage == 3
        self.pad_id, self.device = pad_id, device
        self.settings, self.temperature = lc.loss, cfg.sampling.temperature
        self.base_attention = TA.enable(model)
        self.attention = TA.resolve(lc.packed_attention, self.packing, device.type,
                                    self.base_attention)
        self.align = 128 if self.attention == "flex" else 1
        log.info("learner packing %s, attention %s over %s", self.packing, self.attention,
                 self.base_attention)

    def prepare(self, model) -> None:
        """The packed dispatcher on another model (the frozen reference)."""
        TA.enable(model)

    def micro_batches(self, samples: list[LeafSample]) -> list[PackedBatch]:
        """This rank's units in as many micro-batches as the busiest rank needs."""
        units = build_units(samples, self.packing)
        sizes = [u.num_tokens for u in units]
        n = torch.tensor([max(self.min_count, bins_needed(sizes, self.cap))],
                         device=self.device)
        if dist.is_initialized():
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
        bins = split_bins(sizes, int(n.item()), self.cap)
        batches = [collate_packed([units[i] for i in b], self.pad_id, self.align) for b in bins]
        if self.zero3 and dist.is_initialized():
            k = torch.tensor([b.ctx.shape[0] for b in batches], device=self.device)
            dist.all_reduce(k, op=dist.ReduceOp.MAX)
            batches = [pad_targets(b, int(x)) for b, x in zip(batches, k.tolist())]
        return [to_device(b, self.device) for b in batches]

    def _mask(self, model, batch: PackedBatch):
        return TA.attention_mask(batch, self.attention, self.device,
                                 next(model.module.parameters()).dtype, self.base_attention)

    @torch.no_grad()
    def logprobs(self, model, batch: PackedBatch, entropy: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logp, ent, _ = packed_forward(model, model.module.get_output_embeddings(), batch,
                                      self._mask(model, batch), self.temperature, self.chunk,
                                      entropy)
        return logp, ent

    def loss(self, model, batch: PackedBatch, normaliser: float, proximal, ref,
             entropy_stats) -> Loss:
        return packed_step_loss(model, model.module.get_output_embeddings(), batch,
                                self._mask(model, batch), self.settings, self.temperature,
                                self.chunk, normaliser, proximal, ref, entropy_stats)

    def copies(self, batch: PackedBatch) -> torch.Tensor:
        return batch.count

    def metrics(self, batches: list[PackedBatch]) -> dict[str, float]:
        return {"packing/microbatches": float(len(batches)),
                "packing/tokens": float(sum(b.tokens for b in batches)),
                "packing/leaf_tokens": float(sum(b.leaf_tokens for b in batches)),
                "packing/kept_apart": float(sum(b.kept_apart for b in batches))}


def build_strategy(cfg, model, pad_id: int, device: torch.device
                   ) -> PaddedStrategy | PackedStrategy:
    """The strategy of ``learner.packing`` for the policy ``model`` (not yet wrapped by
    DeepSpeed: the packed one installs its attention dispatcher on it)."""
    if cfg.learner.packing == "padded":
        return PaddedStrategy(cfg, pad_id, device)
    return PackedStrategy(cfg, model, pad_id, device)
