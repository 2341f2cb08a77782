"""Log-probs, entropies and greedy hits over a vocabulary of any size, without a
``[batch, length, vocab]`` float32 tensor: the one implementation SFT, the learner, the
transformers engine and evaluation scoring share.

A Qwen model has 151,936 logits per position: one sequence of 8,192 tokens is 5 GB of
float32 logits, a batch of 8 x 512 is 2.5 GB, and ``log_softmax`` makes a second copy.
Here the hidden states of the positions that predict a target, ``[K, H]``, go through the
output layer ``chunk`` rows at a time; each chunk's logits are upcast to fp32, divided by
the temperature and reduced at once to

- log p(target) = z_target - logsumexp(z),
- the normalised entropy H / ln V = (logsumexp(z) - sum_j p_j z_j) / ln V, with one
  softmax copy of the chunk and no ``p * log p`` temporary,
- optionally whether the target is the argmax (SFT's token accuracy).

Under autograd every chunk is checkpointed, so its logits are recomputed in the backward
pass instead of kept: the memory of this stage is a few copies of chunk x V floats,
whatever K is. ``chunk = 0`` is one pass over all K rows (K x V kept for backward).

``causal_lm_logprobs`` runs a Hugging Face causal LM with ``logits_to_keep`` = nothing, so
the model itself never builds its ``[B, L, V]`` logits, and reduces only the positions
whose target is selected (SFT: the model tokens; prompt and tool tokens cost no logits).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class TargetStats(NamedTuple):
    logp: torch.Tensor  # [K] fp32: log p(target)
    entropy: torch.Tensor | None  # [K] fp32 normalised entropy, when asked
    hit: torch.Tensor | None  # [K] bool: target == argmax, when asked (no gradient)


def entropy_of_logits(z: torch.Tensor, lse: torch.Tensor | None = None) -> torch.Tensor:
    """Entropy of softmax(z) over the last dim divided by ln V, from fp32 logits ``z``
    (temperature applied), with one V-sized temporary (the probabilities). Tokens with
    logit -inf contribute 0. Values in [0, 1]."""
    vocab = z.shape[-1]
    if vocab < 2:
        raise ValueError(f"entropy: vocabulary of {vocab} token(s); need >= 2")
    lse = torch.logsumexp(z, dim=-1) if lse is None else lse
    p = torch.exp(z - lse.unsqueeze(-1))
    # sum_j p_j z_j as a batched dot product: no [.., V] product tensor; -inf logits
    # (p = 0) would give 0 * -inf = nan, so they are zeroed in z's place only where masked.
    finite = torch.where(torch.isfinite(z), z, torch.zeros((), dtype=z.dtype, device=z.device))
    mean_z = torch.linalg.vecdot(p, finite)
    return ((lse - mean_z) / math.log(vocab)).clamp(0.0, 1.0)


def _chunk(lm_head, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
           entropy: bool, hit: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    z = lm_head(hidden).float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    logp = z.gather(-1, targets[:, None]).squeeze(-1) - lse
    ent = entropy_of_logits(z, lse) if entropy else logp.new_zeros(0)
    top = (z.detach().argmax(-1) == targets) if hit else targets.new_zeros(0, dtype=torch.bool)
    return logp, ent, top


class _ChunkedTargetLogp(torch.autograd.Function):
    """log p(target) through a bias-free output layer, a chunk of rows at a time, with a
    backward of its own: it keeps only each row's logsumexp and, per chunk, recomputes the
    logits once (one GEMM) and turns them in place into the logits' gradient,
    g (onehot - softmax) / T; then dh = dz W and dW = dz^T h. A checkpointed chunk would
    also recompute logsumexp and the gather, and hold a second chunk x V buffer."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, want_hit):
        k = hidden.shape[0]
        logp = hidden.new_empty(k, dtype=torch.float32)
        lse = hidden.new_empty(k, dtype=torch.float32)
        hit = torch.zeros(k, dtype=torch.bool, device=hidden.device)
        for a in range(0, k, chunk):
            z = F.linear(hidden[a:a + chunk], weight).float()
            if temperature != 1.0:
                z.div_(temperature)
            lse[a:a + chunk] = torch.logsumexp(z, dim=-1)
            t = targets[a:a + chunk]
            logp[a:a + chunk] = z.gather(-1, t[:, None]).squeeze(-1) - lse[a:a + chunk]
            if want_hit:
                hit[a:a + chunk] = z.argmax(-1) == t
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.mark_non_differentiable(hit)
        return logp, hit

    @staticmethod
    def backward(ctx, grad, _hit_grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        temperature, chunk = ctx.temperature, ctx.chunk
        dh = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        dw = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
              if ctx.needs_input_grad[1] else None)
        for a in range(0, hidden.shape[0], chunk):
            h, t, g = hidden[a:a + chunk], targets[a:a + chunk], grad[a:a + chunk].float()
            z = F.linear(h, weight).float()
            if temperature != 1.0:
                z.div_(temperature)
            dz = z.sub_(lse[a:a + chunk, None]).exp_().mul_(-g[:, None] / temperature)
            dz[torch.arange(len(t), device=t.device), t] += g / temperature
            dz = dz.to(weight.dtype)
            if dh is not None:
                dh[a:a + chunk] = dz @ weight
            if dw is not None:
                dw.addmm_(dz.t().float(), h.float())
        return dh, None if dw is None else dw.to(weight.dtype), None, None, None, None


def _fusable(lm_head) -> bool:
    """A plain bias-free linear layer whose weight is whole here (not a ZeRO-3 partition,
    which only a call of the module gathers)."""
    w = getattr(lm_head, "weight", None)
    return (isinstance(lm_head, torch.nn.Linear) and lm_head.bias is None and w is not None
            and w.dim() == 2 and not hasattr(w, "ds_id"))


def target_stats(lm_head, hidden: torch.Tensor, targets: torch.Tensor,
                 temperature: float = 1.0, chunk: int = 0, entropy: bool = False,
                 hit: bool = False) -> TargetStats:
    """Stats of each target [K] from ``hidden`` [K, H] and an output layer ``lm_head`` (a
    module: ZeRO-3 gathers it per call), ``chunk`` rows at a time (0: all at once).

    Under autograd with chunks, the log-probs of a plain output layer go through
    ``_ChunkedTargetLogp``; with entropies, or a partitioned layer, each chunk is
    checkpointed instead (its logits recomputed in backward by calling the module)."""
    k = hidden.shape[0]
    step = chunk if chunk > 0 else max(k, 1)
    grad = torch.is_grad_enabled() and hidden.requires_grad and chunk > 0
    if grad and k and not entropy and _fusable(lm_head):
        logp, top = _ChunkedTargetLogp.apply(hidden, lm_head.weight, targets, temperature,
                                             step, hit)
        return TargetStats(logp, None, top if hit else None)
    parts = []
    for a in range(0, k, step):
        args = (lm_head, hidden[a:a + step], targets[a:a + step], temperature, entropy, hit)
        parts.append(checkpoint(_chunk, *args, use_reentrant=False) if grad else _chunk(*args))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32) + hidden.float().sum() * 0.0
        return TargetStats(empty, empty if entropy else None,
                           targets.new_zeros(0, dtype=torch.bool) if hit else None)
    logp, ent, top = (torch.cat(x) for x in zip(*parts))
    return TargetStats(logp, ent if entropy else None, top if hit else None)


def chunked_logprobs(lm_head, hidden: torch.Tensor, targets: torch.Tensor,
                     temperature: float = 1.0, chunk: int = 0, entropy: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log p of each target [K] fp32, normalised entropy [K] or None): ``target_stats``
    without the greedy hits."""
    stats = target_stats(lm_head, hidden, targets, temperature, chunk, entropy)
    return stats.logp, stats.entropy


def causal_lm_logprobs(model, input_ids: torch.Tensor, select: torch.Tensor | None = None,
                       attention_mask: torch.Tensor | None = None, temperature: float = 1.0,
                       chunk: int = 512, entropy: bool = False, hit: bool = False
                       ) -> TargetStats:
    """Stats of the next-token targets ``input_ids[:, 1:]`` of a Hugging Face causal LM.

    ``select`` [B, L-1] bool picks the targets (None: all of them, returned as [B, L-1]);
    with it the stats are flat [K] in row-major order of the selected positions. The
    model computes no logits of its own (``logits_to_keep`` is empty); its output layer
    is applied here, ``chunk`` targets at a time."""
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True,
                logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device))
    hidden = out.hidden_states[-1][:, :-1]  # [B, L-1, H], after the final norm
    targets = input_ids[:, 1:]
    head = getattr(model, "module", model).get_output_embeddings()  # a DeepSpeed engine too
    if select is None:
        b, n = targets.shape
        stats = target_stats(head, hidden.reshape(b * n, -1), targets.reshape(-1),
                             temperature, chunk, entropy, hit)
        stats = TargetStats(*(None if x is None else x.view(b, n) for x in stats))
    else:
        stats = target_stats(head, hidden[select], targets[select], temperature, chunk,
                             entropy, hit)
    # DeepSpeed starts its backward bookkeeping from the model's outputs (the empty logits)
    return stats._replace(logp=stats.logp + out.logits.float().sum() * 0.0)
