"""Token log-probs and entropies without a [B, L, V] tensor, and the packed forward.

``chunked_logprobs(lm_head, hidden, targets, ...)`` (arpo_async/core/logits.py, shared
with SFT and the engines): the hidden states of the positions that predict a target,
``[K, H]``, go through the output layer ``learner.logprob_chunk_tokens`` rows at a time,
each chunk's fp32 logits reduced at once to log p(target) and, when asked, the normalised
entropy, and recomputed in the backward pass: the memory of the log-prob stage is about
chunk x V floats whatever K is.

``packed_forward``: one packed micro-batch through the model (mask per
learner/tree_attention.py, position ids = depths, logits of no position), then the
chunked log-probs at the targets' parent positions. ``packed_loss_inputs`` gives the
loss (learner/losses/) every trained copy of a target, with its leaf's weight, advantage
and sequence id (learner/packing.py), as the padded path does; ``entropy_stats`` weights
the entropy statistics by the copies, as the padded path counts them.
"""

from __future__ import annotations

import torch

from arpo_async.core.logits import chunked_logprobs
from learner.losses import LossInputs, policy_loss


def packed_forward(model, lm_head, batch, mask, temperature: float, chunk: int,
                   entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(target log-probs [K], entropies [K] or None, a zero that ties the model's own
    outputs into the loss); ``model`` is the DeepSpeed engine or the HF model."""
    out = model(input_ids=batch.input_ids, attention_mask=mask,
                position_ids=batch.position_ids, output_hidden_states=True,
                logits_to_keep=torch.zeros(0, dtype=torch.long, device=batch.input_ids.device))
    hidden = out.hidden_states[-1][0]  # [T, H] after the final norm
    logp, ent = chunked_logprobs(lm_head, hidden.index_select(0, batch.ctx), batch.targets,
                                 temperature, chunk, entropy)
    # DeepSpeed starts its backward bookkeeping from the outputs' hooks, and ZeRO wants a
    # gradient (zeros here) for the output layer even when a micro-batch has no target.
    anchor = out.logits.float().sum() * 0.0
    return logp, ent, anchor


def packed_loss_inputs(batch, logp: torch.Tensor, entropy: torch.Tensor | None,
                       proximal: torch.Tensor | None, ref: torch.Tensor | None = None
                       ) -> LossInputs:
    """One entry per trained copy: its target's values, its own weight, advantage and
    sequence."""
    def copies(x):
        return None if x is None else x.index_select(0, batch.copy_target)

    return LossInputs(
        logprobs=copies(logp), behaviour_logprobs=copies(batch.behaviour),
        proximal_logprobs=copies(proximal), ref_logprobs=copies(ref),
        advantages=batch.copy_adv, loss_mask=batch.copy_m, entropy=copies(entropy),
        seq_ids=batch.copy_seq)


def entropy_stats(batch, entropy: torch.Tensor) -> tuple[float, float]:
    """(mean, sample std) of the entropy over every copy with m > 0, as the padded path
    computes them over its rows (learner/losses/base.py ``entropy_aware``)."""
    w = batch.count.double()
    h = entropy.detach().double()
    n = float(w.sum())
    if n <= 0:
        return 0.0, 0.0
    mean = float((w * h).sum() / n)
    var = float((w * (h - mean) ** 2).sum() / (n - 1)) if n > 1 else 0.0
    return mean, var ** 0.5


def packed_step_loss(model, lm_head, batch, mask, settings, temperature: float, chunk: int,
                     normaliser: float, proximal: torch.Tensor | None = None,
                     ref: torch.Tensor | None = None,
                     batch_entropy_stats: tuple[float, float] | None = None
                     ) -> tuple[torch.Tensor, dict[str, float]]:
    """The loss (a share of the step's token mean) of one packed micro-batch, and its
    metrics; what the trainer backpropagates. ``ref``: the reference policy's target
    log-probs (KL term); ``batch_entropy_stats``: the whole batch's entropy (mean, std) for
    AEPO's entropy-aware advantage (None: this micro-batch's own)."""
    needs = settings.needs
    logp, ent, anchor = packed_forward(model, lm_head, batch, mask, temperature, chunk,
                                       needs.entropy)
    stats = batch_entropy_stats
    if stats is None and needs.batch_entropy:
        stats = entropy_stats(batch, ent)
    loss, metrics = policy_loss(packed_loss_inputs(batch, logp, ent, proximal, ref), settings,
                                normaliser=normaliser, entropy_stats=stats)
    return loss + anchor, metrics
