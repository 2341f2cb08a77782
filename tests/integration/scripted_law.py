"""A real network with a scripted next-token law, for tests that need a model to write
exactly what they check (a tool call, a merged tag) through the real engines.

A plain module, not a test file: ``from tests.integration.scripted_law import Law,
scripted_model``. The tiny Qwen3 network keeps its shape; its attention and MLP outputs
are zeroed, so the last hidden state is the current token's embedding, and the embedding
and output layer are set so that each scripted token has fixed successor logits (several
successors give a choice with those logits); any other token gets a uniform law. vLLM and
the learner then run the full network at full cost on these weights."""

from __future__ import annotations

from pathlib import Path

import torch

SURE = 25.0  # logit of a scripted successor: probability ~1 against the other tokens


class Law:
    """Successor logits of each scripted token: ``law.table[token] = {next: logit}``."""

    def __init__(self, tok):
        self.tok = tok
        self.table: dict[int, dict[int, float]] = {}

    def ids(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False)

    def chain(self, seq: list[int]) -> None:
        """Each token of ``seq`` is followed by the next one (one successor each)."""
        for a, b in zip(seq, seq[1:]):
            assert self.table.setdefault(a, {b: SURE}) == {b: SURE}, self.tok.decode([a])

    def choose(self, token: int, successors: dict[int, float]) -> None:
        """``token`` is followed by one of ``successors``, with these logits."""
        assert token not in self.table, self.tok.decode([token])
        self.table[token] = dict(successors)


def scripted_model(base: str | Path, out: str | Path, tok, law: Law):
    """``base``'s network with ``law`` written into its weights, saved to ``out`` with
    ``tok``; returns the model (eval mode)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    hidden = model.config.hidden_size
    assert len(law.table) < hidden, "more scripted tokens than hidden dimensions"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        emb, head = model.model.embed_tokens.weight, model.lm_head.weight
        emb.zero_()
        emb[:, 0] = 1.0  # unscripted tokens: slot 0, a uniform law
        head.zero_()
        model.model.norm.weight.fill_(1.0)
        for slot, (token, successors) in enumerate(law.table.items(), start=1):
            emb[token] = 0.0
            emb[token, slot] = 1.0
            for nxt, logit in successors.items():  # the final RMSNorm scales e_k to sqrt(H)
                head[nxt, slot] = logit / hidden ** 0.5
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return model.eval()
