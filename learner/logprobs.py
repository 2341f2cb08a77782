"""Token log-probs and entropies without a [B, L, V] tensor, and the packed forward.

``chunked_logprobs(lm_head, hidden, targets, ...)``: the hidden states of the positions
that predict a target, ``[K, H]``, go through the output layer ``chunk`` rows at a time
(``learner.logprob_chunk_tokens``); each chunk's logits are upcast to fp32, divided by
the temperature, and reduced at once to log p(target) = z_target - logsumexp(z) and, when
asked, the normalised entropy (``arpo_async.core.entropy.entropy_from_logits``, the same
function the padded path uses). Under autograd every chunk is checkpointed: its logits are
recomputed in the backward pass instead of kept, so the memory of the log-prob stage is
about chunk x V floats (a few copies) whatever K is. ``chunk = 0`` is one unchecked pass
(K x V kept for backward, the padded path's cost without padding).

``packed_forward``: one packed micro-batch through the model (mask per
learner/tree_attention.py, position ids = depths, logits of no position), then the
chunked log-probs at the targets' parent positions. ``packed_loss_inputs`` lays the
targets out three times for learner/losses.py (weights mp, mn, mz; learner/packing.py
explains why this gives the padded loss exactly) and gives the entropy statistics weighted by the
copies, as the padded path counts them.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from arpo_async.core.entropy import entropy_from_logits
from learner.losses import LossInputs, policy_loss


def _chunk(lm_head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
           entropy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    logits = lm_head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.gather(-1, targets[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
    ent = entropy_from_logits(logits) if entropy else logp.new_zeros(0)
    return logp, ent


def chunked_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0, chunk: int = 0, entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each target [K] fp32, normalised entropy [K] or None) from ``hidden``
    [K, H] and an output layer ``lm_head`` (a module: ZeRO-3 gathers it per call)."""
    k = hidden.shape[0]
    step = chunk if chunk > 0 else max(k, 1)
    grad = torch.is_grad_enabled() and hidden.requires_grad and chunk > 0
    logps, ents = [], []
    for a in range(0, k, step):
        args = (lm_head, hidden[a:a + step], targets[a:a + step], temperature, entropy)
        lp, en = (checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
        logps.append(lp)
        ents.append(en)
    if not logps:
        empty = hidden.new_zeros(0, dtype=torch.float32) + hidden.float().sum() * 0.0
        return empty, (empty if entropy else None)
    return torch.cat(logps), (torch.cat(ents) if entropy else None)


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
    """Each target three times: weight mp and advantage P / mp, mn and N / mn, mz and 0."""
    def three(x):
        return None if x is None else torch.cat([x, x, x])

    return LossInputs(
        logprobs=three(logp), behaviour_logprobs=three(batch.behaviour),
        proximal_logprobs=three(proximal), ref_logprobs=three(ref),
        advantages=torch.cat([batch.ap, batch.an, torch.zeros_like(batch.ap)]),
        loss_mask=torch.cat([batch.mp, batch.mn, batch.mz]), entropy=three(entropy))


def entropy_stats(batch, entropy: torch.Tensor) -> tuple[float, float]:
    """(mean, sample std) of the entropy over every copy with m > 0, as the padded path
    computes them over its rows (learner/losses.py ``_entropy_aware``)."""
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
    want = bool(settings.entropy_coef or settings.aepo_entropy_adv_gamma)
    logp, ent, anchor = packed_forward(model, lm_head, batch, mask, temperature, chunk, want)
    stats = batch_entropy_stats
    if stats is None and settings.aepo_entropy_adv_gamma:
        stats = entropy_stats(batch, ent)
    loss, metrics = policy_loss(packed_loss_inputs(batch, logp, ent, proximal, ref), settings,
                                normaliser=normaliser, entropy_stats=stats)
    return loss + anchor, metrics
