"""From trajectory groups to padded training tensors.

A group becomes one ``LeafSample`` per leaf: prompt and response tokens, and per response
token the loss weight (model token, and in hard attribution the owner of a shared
segment), the behaviour log-prob and the advantage; each sample also keeps its place in
the group's tree (group, leaf index, parent, branch point) so that learner/packing.py can
rebuild the tree. Samples are split across learner ranks balanced by token count, a
group's leaves staying on one rank; ``learner.packing = padded`` then splits a rank's
leaves into micro-batches and collates them into right-padded tensors (``collate``).
No deepspeed or zmq here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from arpo_async.core.protocol import TrajectoryGroup
from learner.advantages import token_advantages


@dataclass
class LeafSample:
    prompt: np.ndarray  # int32 prompt ids
    response: np.ndarray  # int32 response ids (model and tool tokens)
    weight: np.ndarray  # float32 loss weight per response token (0 for tool tokens)
    behaviour: np.ndarray  # float32 behaviour log-probs
    advantages: np.ndarray  # float32 per response token
    versions: np.ndarray  # int32 policy version per response token
    group: int = -1  # index of its group in the step's batch (-1: a leaf on its own)
    index: int = 0  # leaf index within the group
    parent: int = -1  # leaf index of the parent (-1: a global sample)
    branch_point: int = 0  # response tokens shared with the parent

    @property
    def num_tokens(self) -> int:
        return int(self.prompt.shape[0] + self.response.shape[0])


def samples_from_groups(groups: list[TrajectoryGroup], mode: str) -> tuple[list[LeafSample], dict]:
    """Attribute advantages within each group (soft or hard) and flatten to leaves."""
    samples: list[LeafSample] = []
    for g, group in enumerate(groups):
        rewards = np.array([leaf.reward for leaf in group.leaves])
        advs, owners, _ = token_advantages(group.leaves, rewards, mode)
        for i, (leaf, adv, owner) in enumerate(zip(group.leaves, advs, owners)):
            samples.append(LeafSample(
                prompt=np.asarray(group.prompt_tokens, dtype=np.int32),
                response=np.asarray(leaf.tokens, dtype=np.int32),
                weight=(leaf.loss_mask.astype(np.float32) * owner.astype(np.float32)),
                behaviour=np.asarray(leaf.logprobs, dtype=np.float32),
                advantages=np.asarray(adv, dtype=np.float32),
                versions=np.asarray(leaf.versions, dtype=np.int32),
                group=g, index=i, parent=int(leaf.parent), branch_point=int(leaf.branch_point),
            ))
    leaves = [leaf for g in groups for leaf in g.leaves]
    rewards = np.array([leaf.reward for leaf in leaves], dtype=np.float64)
    metrics = {
        "reward_mean": float(rewards.mean()) if leaves else 0.0,
        "reward_std": float(rewards.std()) if leaves else 0.0,
        "score_mean": float(np.mean([leaf.score for leaf in leaves])) if leaves else 0.0,
        "leaves": len(samples),
        "model_tokens": float(sum(s.weight.sum() for s in samples)),
    }
    return samples, metrics


def balanced_split(samples: list[LeafSample], parts: int, keep_groups: bool = True
                   ) -> list[list[LeafSample]]:
    """Longest-first greedy split into ``parts`` lists of similar token counts. With
    ``keep_groups`` the leaves of one group go to the same part (a packed tree needs all
    of them); the loss is normalised by the step's global token count, so the split
    changes no gradient."""
    units: dict[tuple[int, int], list[LeafSample]] = {}
    for k, s in enumerate(samples):
        key = (s.group, -1) if keep_groups and s.group >= 0 else (-1, k)
        units.setdefault(key, []).append(s)
    bins: list[list[LeafSample]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for unit in sorted(units.values(), key=lambda u: -sum(s.num_tokens for s in u)):
        i = loads.index(min(loads))
        bins[i].extend(unit)
        loads[i] += sum(s.num_tokens for s in unit)
    return bins


@dataclass
class Batch:
    input_ids: torch.Tensor  # [B, L] long, right padded
    attention_mask: torch.Tensor  # [B, L]
    # Per predicted position (L-1 columns): token t+1 predicted from position t.
    weight: torch.Tensor  # [B, L-1] float loss weight (0 on prompt, padding, tool tokens)
    behaviour: torch.Tensor  # [B, L-1]
    advantages: torch.Tensor  # [B, L-1]

    @property
    def num_weighted(self) -> float:
        return float(self.weight.sum())

    @property
    def num_sequences(self) -> float:
        """Rows with a trained token (what a sequence-level loss counts)."""
        return float((self.weight.sum(dim=1) > 0).sum())

    @property
    def seq_ids(self) -> torch.Tensor:
        """[B, L-1] the row of each position: the sequence structure the loss reads."""
        rows = torch.arange(self.weight.shape[0], device=self.weight.device)
        return rows[:, None].expand_as(self.weight)


def collate(samples: list[LeafSample], pad_id: int) -> Batch:
    """Right-pad samples into one batch aligned to next-token positions."""
    if not samples:  # keeps ranks in step: a one-token batch that contributes nothing
        samples = [LeafSample(np.array([pad_id, pad_id], np.int32), np.zeros(0, np.int32),
                              np.zeros(0, np.float32), np.zeros(0, np.float32),
                              np.zeros(0, np.float32), np.zeros(0, np.int32))]
    length = max(s.num_tokens for s in samples)
    n = len(samples)
    ids = torch.full((n, length), pad_id, dtype=torch.long)
    attn = torch.zeros((n, length), dtype=torch.long)
    weight = torch.zeros((n, length - 1))
    behaviour = torch.zeros((n, length - 1))
    adv = torch.zeros((n, length - 1))
    for i, s in enumerate(samples):
        p, r = s.prompt.shape[0], s.response.shape[0]
        ids[i, :p] = torch.from_numpy(s.prompt.astype(np.int64))
        ids[i, p:p + r] = torch.from_numpy(s.response.astype(np.int64))
        attn[i, :p + r] = 1
        # response token j sits at position p + j and is predicted from position p + j - 1
        weight[i, p - 1:p - 1 + r] = torch.from_numpy(s.weight)
        behaviour[i, p - 1:p - 1 + r] = torch.from_numpy(s.behaviour)
        adv[i, p - 1:p - 1 + r] = torch.from_numpy(s.advantages)
    return Batch(ids, attn, weight, behaviour, adv)
