"""Attention over packed tree batches (learner/packing.py), for a transformers model.

The rule is one line: token q attends to token k iff ``k <= q < end[k]`` (k is an
ancestor of q, or q itself, in the pre-order layout). Backends (``learner.packed_attention``):

* ``dense``: that rule as a 4D mask ``[1, 1, T, T]`` handed to the model's own sdpa
  (boolean, True = attend) or eager (additive float) attention. Memory and compute grow
  with T x T, across groups too.
* ``tiles`` (CPU default): per chain segment of the layout (a prompt, a leaf's own
  tokens), one sdpa call whose keys are the segment's ancestors (gathered) and the
  segment itself, under a causal mask offset by the ancestors. The cost per token is its
  path length, as in a padded row, with no mask larger than a segment.
* ``flex`` (GPU default): a FlexAttention ``BlockMask`` built from ``end`` by a mask_mod,
  O(T) memory, fully masked blocks skipped.
* ``varlen`` (flat packing on GPU with flash-attention 2): no mask, the position ids
  restart at 0 for every leaf and transformers' flash path turns them into cu_seqlens.

How the mask reaches the attention, for every decoder transformers ships: the model is
called with ``attention_mask=<the mask>``, and each decoder turns it into its layers' mask
with ``masking_utils.create_causal_mask``. A 4D tensor or a ``BlockMask`` comes back from
it unchanged; a ``TileMask`` (4D ``shape`` and ``ndim``, no tensor) goes on to the mask
function registered for the attention implementation (``AttentionMaskInterface``), which
here returns it as it is. No model family's forward signature is relied on (Qwen3Model
also took a per-layer dict; LlamaModel does not).

``enable(model)`` registers one attention function (and its mask function) per base
implementation under ``arpo_packed_<base>`` and switches the model to it: a ``TileMask``
or ``BlockMask`` goes to the packed kernels, anything else (the padded path, the actor
agreement probe) to the base implementation, unchanged. A model with layers that are not
full attention (sliding windows, the linear attention of Qwen3.5 / Qwen3-Next) is refused:
a token's visible set there is not its tree path, or the layer is a recurrence over the
packed row, so only ``learner.packing=padded`` computes it right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface
from transformers.models.qwen3.modeling_qwen3 import eager_attention_forward

from arpo_async.core.architectures import packed_tree_refusal

PREFIX = "arpo_packed_"


@dataclass
class Tile:
    q0: int  # query rows [q0, q1)
    q1: int
    kv: torch.Tensor  # [n_kv] long: ancestors, then the rows themselves
    n_anc: int  # ancestors among kv (a causal mask offset by n_anc)


@dataclass
class TileMask:
    tiles: list[Tile]
    length: int

    @property
    def shape(self) -> tuple[int, ...]:  # for code that inspects masks
        return (1, 1, self.length, self.length)

    @property
    def ndim(self) -> int:  # masking_utils: a 4D mask is not a padding mask to expand
        return 4


def dense_mask(end: np.ndarray, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """[1, 1, T, T]: bool (True = attend) or, with a float ``dtype``, additive."""
    e = torch.as_tensor(end, device=device)
    idx = torch.arange(e.shape[0], device=device)
    allowed = (idx[None, :] <= idx[:, None]) & (idx[:, None] < e[None, :])
    if dtype is None or dtype == torch.bool:
        return allowed[None, None]
    zero = torch.zeros((), dtype=dtype, device=device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def tile_mask(pred: np.ndarray, device) -> TileMask:
    """One tile per chain segment: a segment starts where a token's parent is not the
    token right before it."""
    n = pred.shape[0]
    starts = np.flatnonzero((pred != np.arange(-1, n - 1)) | (pred < 0))
    bounds = np.append(starts, n)
    tiles = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        anc, p = [], int(pred[a])
        while p >= 0:
            anc.append(p)
            p = int(pred[p])
        kv = np.concatenate([np.asarray(anc[::-1], np.int64), np.arange(a, b)])
        tiles.append(Tile(int(a), int(b), torch.from_numpy(kv).to(device), len(anc)))
    return TileMask(tiles, n)


def flex_block_mask(end: np.ndarray, device):
    """FlexAttention BlockMask for the rule (T must suit flex: align to 128)."""
    # flex_attention: missing from old torch (see _dispatcher)
    from torch.nn.attention.flex_attention import create_block_mask

    e = torch.as_tensor(end, device=device)

    def mask_mod(b, h, q, k):
        return (k <= q) & (q < e[k])

    return create_block_mask(mask_mod, B=None, H=None, Q_LEN=e.shape[0], KV_LEN=e.shape[0],
                             device=device)


def _tile_attention(module, query, key, value, mask: TileMask, scaling, **_):
    """query [1, H, T, D], key/value [1, KVH, T, D] -> [1, T, H, D]. One gather of every
    tile's keys and one split (whose backward is one concatenation): per-tile slicing
    would make autograd add a full-size zero gradient per tile."""
    groups = query.shape[1] // key.shape[1]
    kv_all = torch.cat([t.kv for t in mask.tiles])
    sizes = [int(t.kv.shape[0]) for t in mask.tiles]
    keys = key.index_select(2, kv_all)
    values = value.index_select(2, kv_all)
    if groups > 1:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
    qs = torch.split(query, [t.q1 - t.q0 for t in mask.tiles], dim=2)
    outs = []
    for t, q, k, v in zip(mask.tiles, qs, torch.split(keys, sizes, dim=2),
                          torch.split(values, sizes, dim=2)):
        nq = t.q1 - t.q0
        if t.n_anc == 0:
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=nq > 1,
                                                                 scale=scaling)
        else:
            rows = torch.arange(nq, device=q.device)[:, None]
            cols = torch.arange(k.shape[2], device=q.device)[None, :]
            o = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=cols <= rows + t.n_anc, scale=scaling)
        outs.append(o)
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def _dispatcher(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        if isinstance(attention_mask, TileMask):
            return _tile_attention(module, query, key, value, attention_mask, **kwargs)
        try:
            from torch.nn.attention.flex_attention import BlockMask
        except ImportError:  # pragma: no cover - old torch
            BlockMask = ()  # noqa: N806
        if isinstance(attention_mask, BlockMask):
            fn = ALL_ATTENTION_FUNCTIONS["flex_attention"]
        elif base == "eager":
            fn = eager_attention_forward
        else:
            fn = ALL_ATTENTION_FUNCTIONS[base]
        return fn(module, query, key, value, attention_mask, **kwargs)

    return attention


def _mask_dispatcher(base: str):
    """The mask function of ``arpo_packed_<base>``: a packed mask as it is, anything
    else (a padding mask, none) as the base implementation builds it."""
    base_fn = ALL_MASK_ATTENTION_FUNCTIONS[base]

    def mask(*args, attention_mask=None, **kwargs):
        if isinstance(attention_mask, TileMask):
            return attention_mask
        return base_fn(*args, attention_mask=attention_mask, **kwargs)

    return mask


def enable(model) -> str:
    """Switch ``model`` to the packed dispatcher over its current implementation;
    returns the base implementation's name. Refuses a model whose layers a tree mask
    cannot serve, naming the packing that works."""
    base = model.config._attn_implementation
    if base.startswith(PREFIX):
        return base[len(PREFIX):]
    refusal = packed_tree_refusal(model.config)
    if refusal:
        raise ValueError(refusal)
    name = PREFIX + base
    AttentionInterface.register(name, _dispatcher(base))
    AttentionMaskInterface.register(name, _mask_dispatcher(base))
    model.set_attn_implementation(name)
    return base


def resolve(choice: str, packing: str, device_type: str, base: str) -> str:
    """The backend ``auto`` stands for, checked against the base implementation."""
    if choice == "auto":
        if device_type != "cuda":
            choice = "tiles"
        else:
            choice = "varlen" if packing == "flat" and base == "flash_attention_2" else "flex"
    if choice == "dense" and base not in ("sdpa", "eager"):
        raise ValueError(f"learner.packed_attention=dense needs sdpa or eager, not {base}")
    if choice == "varlen" and (packing != "flat" or base != "flash_attention_2"):
        raise ValueError("learner.packed_attention=varlen needs learner.packing=flat and "
                         "flash_attention_2 (a tree needs a mask: use flex, tiles or dense)")
    return choice


def attention_mask(batch, backend: str, device, dtype: torch.dtype, base: str):
    """The packed mask, passed as the model's ``attention_mask`` (module docstring)."""
    if backend == "dense":
        mask = dense_mask(batch.end, device, torch.bool if base == "sdpa" else dtype)
    elif backend == "tiles":
        mask = tile_mask(batch.pred, device)
    elif backend == "flex":
        mask = flex_block_mask(batch.end, device)
    elif backend == "varlen":
        mask = None
    else:
        raise ValueError(f"learner.packed_attention {backend!r}")
    return mask
