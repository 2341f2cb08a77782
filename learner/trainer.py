"""The policy under DeepSpeed: build the engine, run one importance-corrected update,
gather full weights for a broadcast, save and load checkpoints (HF files for
transformers/vLLM plus DeepSpeed's own state for an exact resume).

Every rank runs the same number of forward/backward calls per step (empty micro-batches
are padded with a one-token batch of zero weight) because ZeRO-3 gathers parameters
collectively. The loss of each micro-batch is normalised by the model-token count of the
whole step across all ranks, so micro-batching and world size do not change the
gradient (token-mean aggregation, docs/design.md "The importance-corrected loss").

``learner.packing``: ``padded`` collates a rank's leaves into ``micro_batches`` padded
batches (learner/batching.py); ``tree`` and ``flat`` pack them (learner/packing.py) into
as many micro-batches as ``max_tokens_per_microbatch`` needs (at least ``micro_batches``;
the ranks agree on the largest count), run the model with the packed attention
(learner/tree_attention.py) and take chunked log-probs (learner/logprobs.py). The
optimizer steps once, at the last micro-batch (DeepSpeed's accumulation boundary is set
by hand because the count varies from step to step).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from arpo_async.core.config import Config
from learner import tree_attention as TA
from learner.batching import Batch, LeafSample, balanced_split, collate, token_logprobs
from learner.device import model_load_kwargs, prepare_model, setup_device, to_device
from learner.logprobs import packed_forward, packed_step_loss
from learner.losses import LossInputs, policy_loss
from learner.packing import (PackedBatch, bins_needed, build_units, collate_packed,
                             pad_targets, split_bins)

log = logging.getLogger("learner")

DEEPSPEED_TAG = "deepspeed"  # sub-folder of a checkpoint holding DeepSpeed's files
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def deepspeed_config(cfg: Config, micro_batches: int) -> dict:
    lcfg = cfg.learner
    ds = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": micro_batches,
        "gradient_clipping": lcfg.grad_clip,
        "zero_optimization": {"stage": lcfg.zero_stage},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if cfg.model.dtype == "bfloat16":
        ds["bf16"] = {"enabled": True}
    elif cfg.model.dtype == "float16":
        ds["fp16"] = {"enabled": True}
    if lcfg.deepspeed_config:
        # A DeepSpeed JSON (configs/deepspeed/*.json) adds ZeRO tuning; the batch
        # geometry and the stage stay those of the arpo_async config.
        extra = json.loads(Path(lcfg.deepspeed_config).read_text())
        zero = {**extra.pop("zero_optimization", {}), "stage": lcfg.zero_stage}
        ds = {**extra, **ds, "zero_optimization": zero}
    return ds


def padded_forward(model, batch: Batch, temperature: float, entropy: bool
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [B, L-1], entropies or None) of a padded batch: the full logits."""
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)
    logp = token_logprobs(out.logits, batch.input_ids, temperature)
    if not entropy:
        return logp, None
    from arpo_async.core.entropy import entropy_from_logits

    return logp, entropy_from_logits(out.logits[:, :-1].float() / temperature)


def padded_step_loss(model, batch: Batch, settings, temperature: float, normaliser: float,
                     proximal: torch.Tensor | None = None
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of one padded micro-batch (the reference the packed paths must equal)."""
    logp, entropy = padded_forward(model, batch, temperature,
                                   bool(settings.entropy_coef or settings.aepo_entropy_adv_gamma))
    inputs = LossInputs(
        logprobs=logp, behaviour_logprobs=batch.behaviour, proximal_logprobs=proximal,
        advantages=batch.advantages, loss_mask=batch.weight, entropy=entropy)
    return policy_loss(inputs, settings, normaliser=normaliser)


class PolicyTrainer:
    def __init__(self, cfg: Config, model_path: str):
        import deepspeed
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.micro_batches = cfg.learner.micro_batches
        self.device = setup_device(cfg)  # CPU, or this rank's GPU (learner/device.py)
        tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        # CPU: float32 master weights, sdpa; GPU: the training dtype, flash-attn if present
        model = AutoModelForCausalLM.from_pretrained(model_path, **model_load_kwargs(cfg))
        prepare_model(model, cfg)
        self.packing = cfg.learner.packing
        if self.packing != "padded":
            self.base_attention = TA.enable(model)
            self.attention = TA.resolve(cfg.learner.packed_attention, self.packing,
                                        self.device.type, self.base_attention)
            self.align = 128 if self.attention == "flex" else 1
            log.info("learner packing %s, attention %s over %s", self.packing, self.attention,
                     self.base_attention)
        optim = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr,
                                  weight_decay=cfg.learner.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optim, config=deepspeed_config(cfg, self.micro_batches))
        self.loss_settings = cfg.learner.loss.settings()
        self.temperature = cfg.sampling.temperature
        self.zero3 = cfg.learner.zero_stage == 3

    # ------------------------------------------------------------------ training
    def _forward_logprobs(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor | None]:
        s = self.loss_settings
        return padded_forward(self.engine, batch, self.temperature,
                              bool(s.entropy_coef or s.aepo_entropy_adv_gamma))

    def train_step(self, samples: list[LeafSample]) -> dict[str, float]:
        """One optimizer step on this rank's samples; collective over all ranks."""
        if self.packing != "padded":
            return self._train_packed(samples)
        t0 = time.perf_counter()
        chunks = balanced_split(samples, self.micro_batches, keep_groups=False)
        batches = [to_device(collate(c, self.pad_id), self.device) for c in chunks]
        proximal = None
        if self.cfg.learner.loss.proximal == "recompute":
            with torch.no_grad():
                proximal = [self._forward_logprobs(b)[0].detach() for b in batches]

        def loss_of(i: int, batch: Batch, total: float):
            return padded_step_loss(self.engine, batch, self.loss_settings, self.temperature,
                                    total, proximal[i] if proximal is not None else None)

        out = self._accumulate(batches, loss_of, set_boundary=False)
        out["train_time_s"] = time.perf_counter() - t0
        return out

    def _accumulate(self, batches: list, loss_of, set_boundary: bool) -> dict[str, float]:
        """Backward each micro-batch's share of the step's token-mean loss (``loss_of(i,
        batch, total)``, ``total`` the loss-weighted tokens over all ranks), then the
        optimizer step; the loss metrics averaged over this rank's weighted tokens."""
        # on the device: NCCL reduces only GPU tensors
        local = torch.tensor([sum(b.num_weighted for b in batches)], dtype=torch.float64,
                             device=self.device)
        if dist.is_initialized():
            dist.all_reduce(local)
        total = max(float(local.item()), 1.0)
        sums: dict[str, float] = {}
        for i, batch in enumerate(batches):
            if set_boundary:
                self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            loss, metrics = loss_of(i, batch, total)
            # DeepSpeed averages gradients over ranks; the loss is already a share of
            # the global token mean, so undo that average.
            self.engine.backward(loss * self.world, scale_wrt_gas=False)
            self.engine.step()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + float(v) * batch.num_weighted
        local_w = max(sum(b.num_weighted for b in batches), 1e-9)
        out = {f"loss/{k}": v / local_w for k, v in sums.items()}
        out["grad_norm"] = float(self.engine.get_global_grad_norm() or 0.0)
        return out

    # ------------------------------------------------------------------ packed batches
    def _packed_batches(self, samples: list[LeafSample]) -> list[PackedBatch]:
        """This rank's units in as many micro-batches as the busiest rank needs."""
        units = build_units(samples, self.packing)
        sizes = [u.num_tokens for u in units]
        cap = self.cfg.learner.max_tokens_per_microbatch
        n = torch.tensor([max(self.micro_batches, bins_needed(sizes, cap))], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(n, op=dist.ReduceOp.MAX)
        bins = split_bins(sizes, int(n.item()), cap)
        batches = [collate_packed([units[i] for i in b], self.pad_id, self.align) for b in bins]
        if self.zero3 and dist.is_initialized():
            k = torch.tensor([b.ctx.shape[0] for b in batches], device=self.device)
            dist.all_reduce(k, op=dist.ReduceOp.MAX)
            batches = [pad_targets(b, int(x)) for b, x in zip(batches, k.tolist())]
        return [to_device(b, self.device) for b in batches]

    def _mask(self, batch: PackedBatch):
        return TA.attention_mask(batch, self.attention, self.device,
                                 next(self.engine.module.parameters()).dtype,
                                 self.base_attention)

    def _proximal(self, batch: PackedBatch) -> torch.Tensor:
        with torch.no_grad():
            return packed_forward(self.engine, self.engine.module.get_output_embeddings(),
                                  batch, self._mask(batch), self.temperature,
                                  self.cfg.learner.logprob_chunk_tokens, False)[0].detach()

    def _train_packed(self, samples: list[LeafSample]) -> dict[str, float]:
        t0 = time.perf_counter()
        batches = self._packed_batches(samples)
        proximal = None
        if self.cfg.learner.loss.proximal == "recompute":
            proximal = [self._proximal(b) for b in batches]

        def loss_of(i: int, batch: PackedBatch, total: float):
            return packed_step_loss(
                self.engine, self.engine.module.get_output_embeddings(), batch,
                self._mask(batch), self.loss_settings, self.temperature,
                self.cfg.learner.logprob_chunk_tokens, total,
                proximal[i] if proximal is not None else None)

        out = self._accumulate(batches, loss_of, set_boundary=True)
        out |= {"train_time_s": time.perf_counter() - t0,
                "packing/microbatches": float(len(batches)),
                "packing/tokens": float(sum(b.tokens for b in batches)),
                "packing/leaf_tokens": float(sum(b.leaf_tokens for b in batches)),
                "packing/kept_apart": float(sum(b.kept_apart for b in batches))}
        return out

    # ------------------------------------------------------------------ weights
    def full_state(self) -> dict[str, np.ndarray]:
        """Full weights as numpy (HF names), gathered under ZeRO-3; collective."""
        params = dict(self.engine.module.named_parameters())
        if self.zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                return self._to_numpy(params) if self.rank == 0 else {}
        return self._to_numpy(params) if self.rank == 0 else {}

    def _to_numpy(self, params: dict[str, torch.Tensor]) -> dict[str, np.ndarray]:
        dtype = _DTYPES[self.cfg.model.dtype]
        out = {}
        for name, p in params.items():
            t = p.detach().to(dtype).cpu().contiguous()  # cast on the device, then copy
            out[name] = (t.view(torch.uint16).numpy().copy() if dtype == torch.bfloat16
                         else t.numpy().copy())
        return out

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, folder: Path, model_path: str | Path) -> None:
        """Write this engine's state into ``folder`` (prepared by learner/checkpoint.py):
        the HF model files (rank 0, weights gathered under ZeRO-3) and DeepSpeed's own
        checkpoint (every rank its shard: fp32 weights and optimizer state); collective."""
        from learner.checkpoint import export_hf, tensors_from_numpy

        state = self.full_state()
        if self.rank == 0:
            export_hf(folder, tensors_from_numpy(state, self.cfg.model.dtype == "bfloat16"),
                      model_path)
        self.engine.save_checkpoint(str(folder), tag=DEEPSPEED_TAG, save_latest=False)
        if dist.is_initialized():
            dist.barrier()

    def load_checkpoint(self, folder: Path) -> None:
        """Restore weights and optimizer state saved by ``save_checkpoint``; collective."""
        path, _ = self.engine.load_checkpoint(str(folder), tag=DEEPSPEED_TAG,
                                              load_optimizer_states=True,
                                              load_lr_scheduler_states=True)
        if path is None:
            raise FileNotFoundError(f"{folder}/{DEEPSPEED_TAG}: DeepSpeed found no checkpoint "
                                    "for this rank (same world size and ZeRO stage needed)")

    @torch.no_grad()
    def sequence_logprobs(self, prompt: list[int], tokens: list[int]) -> list[float]:
        """Log-probs of ``tokens`` after ``prompt`` at temperature 1 (actor agreement check)."""
        ids = torch.tensor([prompt + tokens], dtype=torch.long, device=self.device)
        out = self.engine(input_ids=ids, attention_mask=torch.ones_like(ids))
        logp = token_logprobs(out.logits, ids)[0]
        return logp[len(prompt) - 1:].tolist()
