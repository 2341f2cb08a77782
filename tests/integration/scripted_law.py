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

    def unique_ids(self, text: str, avoid: set[int] = frozenset()) -> list[int]:
        """``text`` as tokens a first-order law can write: each token, where it repeats (in
        ``text`` or among the tokens scripted already), has the same successor; the last
        one needs none. Not the canonical tokenisation where that breaks the rule (an XML
        call's ``<``, ``=`` and newlines), but ids that decode to the same text, as an
        engine may emit them. Longest pieces first, backtracking; ``avoid``: never used."""
        pieces = self._pieces()
        longest = max(map(len, pieces))
        fixed = {t: next(iter(s)) for t, s in self.table.items() if len(s) == 1}
        choice = {t for t, s in self.table.items() if len(s) > 1} | set(avoid)
        budget = [200_000]

        def walk(i: int, seq: list[int], succ: dict[int, int]) -> list[int] | None:
            if i == len(text):
                return seq
            for j in range(min(len(text), i + longest), i, -1):
                tid = pieces.get(text[i:j])
                budget[0] -= 1
                if tid is None or tid in choice or budget[0] < 0:
                    continue
                if seq and succ.get(seq[-1], tid) != tid:
                    continue
                found = walk(j, seq + [tid], {**succ, **({seq[-1]: tid} if seq else {})})
                if found is not None:
                    return found
            return None

        found = walk(0, [], fixed)
        assert found is not None and self.tok.decode(found) == text, text
        return found

    def _pieces(self) -> dict[str, int]:
        """Each token's text -> its id (the first id, for texts several ids decode to;
        byte fragments of a character left out)."""
        if not hasattr(self, "_piece_map"):
            texts = self.tok.batch_decode([[i] for i in range(len(self.tok))])
            self._piece_map = {}
            for i, t in enumerate(texts):
                if t and "\ufffd" not in t:
                    self._piece_map.setdefault(t, i)
        return self._piece_map

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
