"""The policy under DeepSpeed: build the engine, run one importance-corrected update per
rollout batch, gather full weights for a broadcast, save and load checkpoints (HF files
for transformers/vLLM plus DeepSpeed's own state for an exact resume).

An update (``train_step``) is ``learner.minibatches`` x ``learner.ppo_epochs`` optimizer
steps, one per mini-batch of whole groups, as the papers' engine (verl) takes them.
Before the first step one no-grad pass over every micro-batch computes what all steps
share: proximal log-probs (recompute mode: kept, so the clips act from the second step),
the frozen reference's log-probs (``loss.kl_coef > 0``, learner/reference.py), the
trained-token count of each mini-batch and AEPO's entropy statistics over the whole
batch, all-reduced over the ranks in one call.

Every rank runs the same number of forward/backward calls per step (empty micro-batches
are padded with a one-token batch of zero weight) because ZeRO-3 gathers parameters
collectively. The loss of each micro-batch is normalised by the model-token count of its
mini-batch across all ranks, so micro-batching and world size do not change the
gradient (token-mean aggregation, docs/design.md "The importance-corrected loss").

``learner.packing`` picks, once, the strategy (learner/strategies.py) that lays out a
rank's leaves of a mini-batch in micro-batches (padded rows, or packed trees) and runs
the model, the loss and the frozen reference on them; the steps below are the same for
both. The optimizer steps once per mini-batch, at its last micro-batch (DeepSpeed's
accumulation boundary is set by hand: the packed count varies with the tokens).
"""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer

from arpo_async.core.config import Config
from arpo_async.core.logits import causal_lm_logprobs
from learner.batching import LeafSample, balanced_split
from learner.checkpoint import export_hf
from learner.device import model_load_kwargs, prepare_model, setup_device
from learner.losses import entropy_moments, loss_type, stats_from_moments
from learner.reference import ReferencePolicy
from learner.strategies import build_strategy

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


def split_minibatches(samples: list[LeafSample], n: int) -> list[list[LeafSample]]:
    """``n`` mini-batches of whole groups (a leaf without a group is its own unit),
    balanced by tokens, longest first; deterministic (the same samples in the same order
    give the same split). The loop applies it to the whole batch, before the ranks."""
    return balanced_split(samples, n, keep_groups=True) if n > 1 else [list(samples)]


def summarise_steps(steps: list[tuple[dict[str, float], float]]) -> dict[str, float]:
    """One metrics dict for a batch's optimizer steps: ``loss/*`` averaged over all steps
    by this rank's tokens, ``grad_norm`` the steps' mean; ``opt/*`` the step count and the
    clip fractions (high + low) of the first step and of the later ones: with one step
    and recompute mode the clip cannot act, from the second step on it can."""
    out: dict[str, float] = {"opt/steps": float(len(steps))}
    if not steps:
        return out | {"grad_norm": 0.0}
    total = sum(w for _, w in steps)
    keys = [k for k in steps[0][0] if k.startswith("loss/")]
    for k in keys:
        out[k] = (sum(m[k] * w for m, w in steps) / total if total > 0
                  else sum(m[k] for m, _ in steps) / len(steps))
    out["grad_norm"] = sum(m["grad_norm"] for m, _ in steps) / len(steps)

    def clip(m: dict[str, float]) -> float:
        return m.get("loss/clip_frac_high", 0.0) + m.get("loss/clip_frac_low", 0.0)

    out["opt/clip_frac_first"] = clip(steps[0][0])
    later = steps[1:]
    later_w = sum(w for _, w in later)
    out["opt/clip_frac_later"] = (sum(clip(m) * w for m, w in later) / later_w
                                  if later_w > 0 else 0.0)
    return out


@dataclass
class _BeforeUpdate:
    totals: list[float]  # Z of each mini-batch, all ranks: trained tokens (or sequences)
    proximal: list[list[torch.Tensor]] | None  # [mini-batch][micro-batch], recompute mode
    ref: list[list[torch.Tensor]] | None  # reference log-probs, kl_coef > 0
    entropy_stats: tuple[float, float] | None  # whole batch, aepo_entropy_adv_gamma != 0


class PolicyTrainer:
    def __init__(self, cfg: Config, model_path: str):
        import deepspeed  # deepspeed: after learner/dist.py has set DS_ACCELERATOR

        self.cfg = cfg
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        self.micro_batches = cfg.learner.min_micro_batches
        self.device = setup_device(cfg)  # CPU, or this rank's GPU (learner/device.py)
        # the learner's one tokenizer: the pad id here, decoded tree files (learner/trees.py)
        self.tokenizer = tok = AutoTokenizer.from_pretrained(model_path)
        self.pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
        # CPU: float32 master weights, sdpa; GPU: the training dtype, flash-attn if present
        model = AutoModelForCausalLM.from_pretrained(model_path, **model_load_kwargs(cfg))
        prepare_model(model, cfg)
        self.strategy = build_strategy(cfg, model, self.pad_id, self.device)
        optim = torch.optim.AdamW(model.parameters(), lr=cfg.learner.lr,
                                  weight_decay=cfg.learner.weight_decay)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optim, config=deepspeed_config(cfg, self.micro_batches))
        self.loss_settings = cfg.learner.loss
        self.loss_unit = loss_type(self.loss_settings).unit  # what the loss's Z counts
        self.zero3 = cfg.learner.zero_stage == 3
        self.minibatches, self.ppo_epochs = cfg.learner.minibatches, cfg.learner.ppo_epochs
        self.last_steps: list[dict[str, float]] = []  # the last batch's per-step metrics
        self.last_entropy_stats: tuple[float, float] | None = None  # and its z(H) statistics
        self.reference = None
        if self.loss_settings.needs.reference:  # a frozen copy of the initial weights
            self.reference = ReferencePolicy(cfg, model_path, self.strategy.prepare)

    # ------------------------------------------------------------------ training
    def train_step(self, samples: list[LeafSample] | list[list[LeafSample]]
                   ) -> dict[str, float]:
        """One update on a rollout batch: ``minibatches * ppo_epochs`` optimizer steps on
        this rank's part; collective over all ranks. ``samples`` is this rank's part of
        each mini-batch (the loop splits the batch into mini-batches before the ranks, so
        that every mini-batch has groups), or a flat list that is split here."""
        t0 = time.perf_counter()
        parts = (samples if samples and isinstance(samples[0], list)
                 else split_minibatches(samples, self.minibatches))
        batches = [self.strategy.micro_batches(p) for p in parts]
        pre = self._before_update(batches)
        steps: list[tuple[dict[str, float], float]] = []
        for _ in range(self.ppo_epochs):
            for j, mbs in enumerate(batches):
                if pre.totals[j] <= 0:  # no trained token on any rank: no step
                    continue
                steps.append(self._accumulate(
                    mbs, lambda i, b, total, j=j: self._loss(b, total, pre, j, i),
                    total=pre.totals[j]))
        out = summarise_steps(steps) | self.strategy.metrics([b for m in batches for b in m])
        out["train_time_s"] = time.perf_counter() - t0
        self.last_steps = [m for m, _ in steps]
        self.last_entropy_stats = pre.entropy_stats
        return out

    def _before_update(self, batches: list[list]) -> "_BeforeUpdate":
        """What every optimizer step of this batch needs from before the first one (one
        pass over every micro-batch, no gradient): the proximal log-probs (recompute
        mode: kept for all mini-batch steps, so the clips act from the second on), the
        reference log-probs (KL), the trained-token count of each mini-batch over all
        ranks (or its sequences, for a sequence-level loss), and the entropy mean and std
        over the whole batch, every micro-batch and rank (AEPO's entropy-aware
        advantage)."""
        s = self.loss_settings
        recompute = self.cfg.learner.loss.proximal == "recompute"
        want_ent = s.needs.batch_entropy
        proximal: list[list] | None = [] if recompute else None
        ref: list[list] | None = [] if self.reference is not None else None
        moments = torch.zeros(3, dtype=torch.float64)
        for mbs in batches:
            if recompute or want_ent:
                out = [self.strategy.logprobs(self.engine, b, want_ent) for b in mbs]
                if recompute:
                    proximal.append([lp.detach() for lp, _ in out])
                if want_ent:
                    for b, (_, ent) in zip(mbs, out):
                        moments += entropy_moments(ent, self.strategy.copies(b)).cpu()
            if ref is not None:  # the frozen reference, on the same micro-batches
                ref.append([self.strategy.logprobs(self.reference.engine, b, False)[0]
                            for b in mbs])
        # one all-reduce: per mini-batch trained tokens or sequences (the loss's unit),
        # then the entropy moments (on the device: NCCL reduces only GPU tensors)
        size = (lambda b: b.num_weighted) if self.loss_unit == "token" \
            else (lambda b: b.num_sequences)
        vec = torch.tensor([sum(size(b) for b in mbs) for mbs in batches]
                           + moments.tolist(), dtype=torch.float64, device=self.device)
        if dist.is_initialized():
            dist.all_reduce(vec)
        vec = vec.cpu()
        n = len(batches)
        return _BeforeUpdate(
            totals=vec[:n].tolist(), proximal=proximal, ref=ref,
            entropy_stats=stats_from_moments(vec[n:]) if want_ent else None)

    def _loss(self, batch, total: float, pre: "_BeforeUpdate", j: int, i: int):
        """Loss and metrics of micro-batch ``i`` of mini-batch ``j``."""
        prox = pre.proximal[j][i] if pre.proximal is not None else None
        ref = pre.ref[j][i] if pre.ref is not None else None
        return self.strategy.loss(self.engine, batch, total, prox, ref, pre.entropy_stats)

    def _accumulate(self, batches: list, loss_of, total: float
                    ) -> tuple[dict[str, float], float]:
        """Backward each micro-batch's share of the mini-batch's mean loss
        (``loss_of(i, batch, total)``, ``total`` the loss's Z over all ranks),
        then one optimizer step; (the loss metrics averaged over this rank's weighted
        tokens, those tokens). ``loss`` and ``pg_loss`` are summed instead: this rank's
        share of the mini-batch's token-mean loss (with one rank, that loss)."""
        shares = {"loss": 0.0, "pg_loss": 0.0}
        own_norm = None
        sums: dict[str, float] = {}
        for i, batch in enumerate(batches):
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            loss, metrics = loss_of(i, batch, max(total, 1.0))
            # DeepSpeed averages gradients over ranks; the loss is already a share of
            # the global token mean, so undo that average.
            self.engine.backward(loss * self.world, scale_wrt_gas=False)
            if i == len(batches) - 1 and not self.engine.zero_optimization():
                own_norm = self._grad_norm()  # DeepSpeed reports none at ZeRO-0 in fp32
            self.engine.step()
            for k, v in metrics.items():
                if k in shares:
                    shares[k] += float(v)
                else:
                    sums[k] = sums.get(k, 0.0) + float(v) * batch.num_weighted
        local_w = sum(b.num_weighted for b in batches)
        out = {f"loss/{k}": v / max(local_w, 1e-9) for k, v in sums.items()}
        out |= {f"loss/{k}": v for k, v in shares.items()}
        norm = self.engine.get_global_grad_norm()
        out["grad_norm"] = float(norm if norm is not None and (norm or own_norm is None)
                                 else own_norm)
        return out, local_w

    def _grad_norm(self) -> float:
        """L2 norm of the accumulated gradients before clipping (ZeRO-0: full on each
        rank, already averaged over ranks by DeepSpeed's all-reduce at the boundary)."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack(
            [torch.linalg.vector_norm(g.float()) for g in grads])))

    # ------------------------------------------------------------------ weights
    def full_state(self) -> dict[str, torch.Tensor]:
        """Full weights (HF names) as fresh host tensors of ``model.dtype``, gathered under
        ZeRO-3, on rank 0 (others: {}); collective. Each tensor carries its dtype from
        here to the engine that loads it (arpo_async/core/protocol/wire.py)."""
        params = dict(self.engine.module.named_parameters())
        if self.zero3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(params.values()), modifier_rank=None):
                return self._to_host(params) if self.rank == 0 else {}
        return self._to_host(params) if self.rank == 0 else {}

    def _to_host(self, params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dtype = _DTYPES[self.cfg.model.dtype]
        # cast on the device, then copy: never a view of the trained parameter
        return {name: p.detach().to(dtype).to("cpu", copy=True).contiguous()
                for name, p in params.items()}

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, folder: Path, model_path: str | Path) -> None:
        """Write this engine's state into ``folder`` (prepared by learner/checkpoint.py):
        the HF model files (rank 0, weights gathered under ZeRO-3) and DeepSpeed's own
        checkpoint (every rank its shard: fp32 weights and optimizer state); collective."""
        state = self.full_state()
        if self.rank == 0:
            export_hf(folder, state, model_path)
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
        select = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool, device=self.device)
        select[0, len(prompt) - 1:] = True  # the positions that predict ``tokens``
        return causal_lm_logprobs(self.engine, ids, select, torch.ones_like(ids),
                                  chunk=self.cfg.learner.logprob_chunk_tokens).logp.tolist()
