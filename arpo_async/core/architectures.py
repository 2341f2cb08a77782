"""What a model's architecture allows, read from its config alone (pure: no torch).

``packed_tree_problem(config)``: why the learner's packed trees (``learner.packing`` tree
or flat, learner/tree_attention.py) cannot compute a model right, or None. A packed tree
needs full attention in every layer: a sliding window sees positions by distance in the
packed row, not along a token's path, and linear attention (Qwen3.5's and Qwen3-Next's
Gated DeltaNet) is a recurrence along the row. Asked by the learner when it switches a
model to the packed attention, and by the run's preflight before anything is built.
"""

from __future__ import annotations

from typing import Any


def packed_tree_problem(config: Any) -> str | None:
    """None when every layer is full attention; else what is not, in words. ``config``: a
    transformers config (its text config is read for a multimodal one). A
    ``sliding_window`` without ``layer_types`` (Mistral, older Qwen2) counts when
    ``use_sliding_window`` is not false."""
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds = sorted(set(getattr(cfg, "layer_types", None) or ["full_attention"]))
    other = [k for k in kinds if k != "full_attention"]
    if other:
        return f"{type(cfg).__name__} has {', '.join(other)} layers"
    window = getattr(cfg, "sliding_window", None)
    if (window and getattr(cfg, "use_sliding_window", True)
            and getattr(cfg, "layer_types", None) is None):
        return f"{type(cfg).__name__} uses a sliding window of {window}"
    return None


def packed_tree_refusal(config: Any) -> str | None:
    """The one-line refusal of ``learner.packing`` tree/flat for ``config``, or None."""
    why = packed_tree_problem(config)
    return None if why is None else (f"learner.packing: {why}; packed trees need full "
                                     "attention in every layer (use learner.packing=padded)")
