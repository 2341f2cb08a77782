"""Where the learner computes: the device, the process-group backend, the attention
kernel, and moving batches there. Small functions the trainer calls; CPU stays the
default and behaves exactly as before.

On GPU (``cluster.device=cuda``): each rank takes ``cuda:LOCAL_RANK`` (torchrun and the
DeepSpeed launcher set LOCAL_RANK and CUDA_VISIBLE_DEVICES), ranks talk over NCCL, the
model is loaded in the training dtype (flash-attn kernels need 16-bit weights) with
flash-attention 2 when the package is installed, and batches are built on the CPU and
copied to the device in one non-blocking transfer each.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import fields, replace
from typing import Any

import torch

_DTYPES = ("float32", "bfloat16", "float16")


def dist_backend(cfg) -> str:
    """torch.distributed backend for ``deepspeed.init_distributed``."""
    return "nccl" if cfg.cluster.device == "cuda" else "gloo"


def setup_device(cfg):
    """This rank's torch.device; on GPU also makes it current. Fails clearly without CUDA."""
    if cfg.cluster.device != "cuda":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("cluster.device=cuda but torch sees no GPU in the learner "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}, "
                           f"torch {torch.__version__} built for CUDA {torch.version.cuda})")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if local >= torch.cuda.device_count():
        raise RuntimeError(f"LOCAL_RANK={local} but only {torch.cuda.device_count()} GPUs are "
                           "visible: check cluster.learner_gpus")
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def attn_implementation(cfg, flash_available: bool | None = None) -> tuple[str, str]:
    """(transformers ``attn_implementation``, why). ``auto`` picks flash-attention 2 on
    GPU with 16-bit weights when flash-attn is installed, else PyTorch's sdpa."""
    choice = cfg.learner.attn_implementation
    if flash_available is None:
        flash_available = importlib.util.find_spec("flash_attn") is not None
    half = cfg.model.dtype in ("bfloat16", "float16")
    if choice == "flash_attention_2":
        problems = [msg for bad, msg in [
            (cfg.cluster.device != "cuda", "needs cluster.device=cuda"),
            (not half, f"needs model.dtype bfloat16 or float16 (got {cfg.model.dtype})"),
            (not flash_available, "needs the flash-attn package (pip install flash-attn)"),
        ] if bad]
        if problems:
            raise ValueError("learner.attn_implementation=flash_attention_2 "
                             + "; ".join(problems))
        return choice, "configured"
    if choice != "auto":
        return choice, "configured"
    if cfg.cluster.device == "cuda" and half and flash_available:
        return "flash_attention_2", "auto: GPU, 16-bit weights, flash-attn installed"
    reason = ("CPU" if cfg.cluster.device != "cuda" else
              f"dtype {cfg.model.dtype}" if not half else "flash-attn not installed")
    return "sdpa", f"auto: {reason}"


def model_load_kwargs(cfg) -> dict[str, Any]:
    """Keyword arguments for ``AutoModelForCausalLM.from_pretrained`` on this device.

    CPU keeps float32 master weights (DeepSpeed casts for bf16 itself). On GPU the model
    is loaded in the training dtype straight away: half the host memory for a 7B model,
    and flash-attention refuses float32 modules at load time."""
    if cfg.model.dtype not in _DTYPES:
        raise ValueError(f"model.dtype: {cfg.model.dtype!r}")
    dtype = getattr(torch, cfg.model.dtype) if cfg.cluster.device == "cuda" else torch.float32
    impl, _ = attn_implementation(cfg)
    return {"dtype": dtype, "attn_implementation": impl}


def prepare_model(model, cfg) -> None:
    """Switches set on the HF model before DeepSpeed wraps it."""
    model.config.use_cache = False  # training never reuses a KV cache
    if cfg.learner.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def to_device(batch, device):
    """A dataclass of tensors (learner.batching.Batch) with every tensor on ``device``;
    the same object on CPU."""
    if device.type == "cpu":
        return batch
    moved = {f.name: getattr(batch, f.name).to(device, non_blocking=True)
             for f in fields(batch) if isinstance(getattr(batch, f.name), torch.Tensor)}
    return replace(batch, **moved)
