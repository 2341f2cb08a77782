"""Generation engines behind one interface (base.py): vLLM (vllm_engine.py), transformers
(hf_engine.py), a simulated engine for throughput experiments (sim_engine.py) and any
OpenAI-compatible server (endpoint_engine.py). ``ENGINE_BUILDERS`` maps each
``actors.engine.type`` to its builder, and ``build_engine`` calls the one the config
names; what an engine can do is declared on its settings class
(arpo_async/core/config/actors.py, ``ENGINES``), never asked of its name. A new engine is
a module here, its builder in the table and its settings class there (docs/extending.md).
The vLLM and simulated engines import vLLM, torch and transformers only once they start;
the transformers engine, which imports torch at its top, is imported only when chosen."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from actors.engines.sim_engine import SimulatedEngine
from actors.engines.vllm_engine import VLLMEngine, cpu_bind_for

if TYPE_CHECKING:
    from actors.engines.base import GenerationEngine
    from arpo_async.core.config import Config

# builder(cfg, model_path, *, actor_id, seed, version) -> the engine, started: its weights
# from model_path, its sampling seeded with seed, its version the given one
Builder = Callable[..., Awaitable["GenerationEngine"]]


async def _vllm(cfg: Config, model_path: str, *, actor_id: int, seed: int,
                version: int) -> VLLMEngine:
    eng = cfg.actors.engine
    return await VLLMEngine.create(
        model_path, dtype=cfg.model.dtype, max_model_len=cfg.model.max_model_len,
        kv_cache_gib=eng.kv_cache_gib, seed=seed,
        # the exact entropy reads every token's whole distribution: no cap (-1)
        max_logprobs=(-1 if cfg.rollout.entropy_estimator == "exact"
                      else max(eng.max_logprobs, cfg.sampling.logprobs_topk)),
        # CUDA graphs only on GPU: the CPU backend runs eager
        enforce_eager=cfg.cluster.device == "cpu" or not eng.cuda_graphs,
        cpu_threads=cfg.actors.threads,
        cpu_bind=cpu_bind_for(actor_id, cfg.actors.threads),
        gpu_memory_utilization=eng.gpu_memory_utilization,
        tensor_parallel=eng.tensor_parallel,
        enable_prefix_caching=prefix_caching(cfg), version=version,
        weight_transfer="nccl" if cfg.learner.weight_sync.channel == "nccl" else None,
        update_mode=cfg.actors.weight_update_mode(),
    )


async def _transformers(cfg: Config, model_path: str, *, actor_id: int, seed: int,
                        version: int) -> GenerationEngine:
    from actors.engines.hf_engine import HFEngine  # it imports torch: not for --help

    return await HFEngine.create(
        model_path, dtype=cfg.model.dtype, seed=seed, threads=cfg.actors.threads,
        version=version, max_model_len=cfg.model.max_model_len,
        update_mode=cfg.actors.weight_update_mode(),
    )


async def _simulated(cfg: Config, model_path: str, *, actor_id: int, seed: int,
                     version: int) -> SimulatedEngine:
    return await SimulatedEngine.create(cfg, model_path, seed=seed, version=version)


ENGINE_BUILDERS: dict[str, Builder] = {
    "vllm": _vllm,
    "transformers": _transformers,
    "simulated": _simulated,
}


async def build_engine(
    cfg: Config, model_path: str, actor_id: int = 0, version: int = 0
) -> GenerationEngine:
    """The engine ``cfg.actors.engine`` names, for actor ``actor_id``, loaded from
    ``model_path`` (already resolved by ``tiny_model.ensure_model``). Its sampling seed
    is ``run.seed + actor_id`` so actors draw different samples."""
    kind = cfg.actors.engine.type
    if kind not in ENGINE_BUILDERS:
        raise ValueError(f"actors.engine: unknown engine {kind!r} "
                         f"({', '.join(sorted(ENGINE_BUILDERS))})")
    return await ENGINE_BUILDERS[kind](cfg, model_path, actor_id=actor_id,
                                       seed=cfg.run.seed + actor_id, version=version)


def prefix_caching(cfg: Config) -> bool:
    """``actors.engine.enable_prefix_caching`` (vLLM), with null meaning: on GPUs, off on
    CPU."""
    on = cfg.actors.engine.enable_prefix_caching
    return cfg.cluster.device == "cuda" if on is None else bool(on)
