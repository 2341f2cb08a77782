"""The vLLM engine's weight updates (``VLLMWeights``, mixed into
actors/engines/vllm_engine.py's ``VLLMEngine``), and the functions that run inside its
workers.

Weights are replaced in place: the tensors go to a safetensors file in /dev/shm and a
function sent by ``collective_rpc`` makes each worker call ``reload_weights`` on it
(the model's own ``load_weights`` fails on CPU, whose linear layers are repacked).

``actors.update_mode=keep``: the update holds new requests, waits until every request in
flight has reached the engine (its first output), pauses the scheduler with
``pause_generation(mode="keep", clear_cache=False)``, reads from the workers how many
tokens each request has sampled (``_sampled_counts``: exact, the scheduler is idle),
loads, and resumes: the frozen requests go on over their KV cache, and each token is
tagged with the version that sampled it from those counts. With prefix caching on, a
request's blocks are salted by its weights version (``cache_salt``), so that no new
request reuses KV computed under other weights; the cache is not reset.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from actors.engines.base import check_weight_names, torch_state_dict
from arpo_async.core.weights.base import WeightTransferFailed


def _reload_from_file(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker (sent by collective_rpc)."""
    import safetensors.torch  # safetensors.torch, torch: heavy, not for actors.main --help

    tensors = safetensors.torch.load_file(path)
    worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    _retie_embeddings(worker)
    return len(tensors)


def _sampled_counts(worker: Any) -> dict[str, int]:
    """Runs inside each vLLM worker (collective_rpc) while the scheduler is paused: the
    tokens each running request has sampled, by the id the caller gave it (vLLM adds
    ``-<8 chars>`` to make its own)."""
    requests = getattr(worker.model_runner, "requests", {})
    return {rid.rsplit("-", 1)[0]: len(state.output_token_ids)
            for rid, state in requests.items()}


class LiveRequest:
    """A request in flight: the version it started under, the versions that updates in
    keep mode switched it to (after how many of its tokens), and whether it reached the
    engine (its first output arrived)."""

    def __init__(self, version: int):
        self.version = version
        self.switches: list[tuple[int, int]] = []  # (tokens sampled before, new version)
        self.started = asyncio.Event()

    def versions(self, n: int) -> list[int]:
        out, v, done = [], self.version, 0
        for at, new in self.switches:
            at = min(max(at, done), n)
            out += [v] * (at - done)
            v, done = new, at
        return out + [v] * (n - done)


def _retie_embeddings(worker: Any) -> None:
    """Runs inside each vLLM worker after an in-place weight load (file or NCCL)."""
    model = worker.model_runner.get_model()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        # vLLM ties lm_head.weight to the embedding's Parameter; the in-place reload gives
        # the embedding a new Parameter and puts the old one back under lm_head (warning
        # "ParallelLMHead: Failed to load weights"), so logits used stale weights. Re-tie,
        # and rebuild the CPU GEMM handle that captured the old weight.
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None:
            raise RuntimeError(f"{type(model).__name__}: tied embeddings, but no "
                               "lm_head/model.embed_tokens to re-tie after a weight update")
        head.weight = embed.weight
        if getattr(head, "quant_method", None) is not None:
            head.quant_method.process_weights_after_loading(head)


class VLLMWeights:
    """Weight updates of ``VLLMEngine`` (its ``_llm``, ``_gate``, ``_live``, ``_shm``,
    ``_dtype``, ``_expected``, ``_prefix_caching``, ``version`` and counters)."""

    async def update_weights(self, tensors: dict[str, Any], version: int) -> float:
        """Load full HF-named weights in place at a safe point; returns the seconds new
        calls were held (drain of the calls in flight + load). Details of the last update
        are in ``self.last_update``."""
        import safetensors.torch
        import torch

        t0 = time.perf_counter()
        state = torch_state_dict(tensors, getattr(torch, self._dtype))
        if self._expected is not None and "lm_head.weight" not in self._expected:
            # Tied embeddings: the checkpoint has no lm_head (vLLM skips it too), but a
            # learner's state_dict lists the shared tensor under both names.
            state.pop("lm_head.weight", None)
        # A bad name inside the worker would fail mid-load; refuse it here instead.
        check_weight_names({k: v.shape for k, v in state.items()}, self._expected)
        path = self._shm / f"v{version}.safetensors"
        try:
            safetensors.torch.save_file(state, str(path))
        except BaseException:  # a full /dev/shm: no partial file left behind
            path.unlink(missing_ok=True)
            raise
        t_file = time.perf_counter() - t0
        keep = self._gate.mode == "keep"
        async with self._gate.exclusive() as drain_s:
            t1 = time.perf_counter()
            counts = await self._freeze() if keep else {}
            freeze_s = time.perf_counter() - t1
            try:
                await self._llm.collective_rpc(_reload_from_file, args=(str(path),))
                await self._loaded(version, counts, keep)
            finally:
                path.unlink(missing_ok=True)
                if keep:
                    await self._llm.resume_generation()
            load_s = time.perf_counter() - t1
        paused = drain_s + load_s
        self.last_update = {"write_s": t_file, "drain_s": drain_s, "load_s": load_s,
                            "paused_s": paused, "tensors": float(len(state)),
                            "freeze_s": freeze_s}
        return paused

    async def _loaded(self, version: int, counts: dict[str, int], keep: bool) -> None:
        """New weights are in the workers: the version goes up, and each request frozen in
        flight (keep) switches to it after the tokens it had sampled (``counts``); without
        keep, the prefix cache (KV of the old weights) is reset."""
        if self._prefix_caching and not keep:
            await self._llm.reset_prefix_cache()
        for rid, live in self._live.items():
            live.switches.append((counts.get(rid, 0), version))
        self.version = version

    async def _freeze(self, reach_s: float = 1.0) -> dict[str, int]:
        """Keep mode: pause the engine with the requests in flight frozen on their KV
        cache; the tokens each has sampled. First waits (at most ``reach_s``) until every
        request in flight has reached the engine: one that has not yet is not in the
        workers' counts and counts 0 tokens sampled before the update, which is right only
        if it has sampled none."""
        waits = [asyncio.ensure_future(live.started.wait()) for live in self._live.values()]
        if waits:
            _, pending = await asyncio.wait(waits, timeout=reach_s)
            self.keep_unreached += len(pending)  # queued behind a full batch: counted
            for w in waits:
                w.cancel()
        await self._llm.pause_generation(mode="keep", clear_cache=False)
        counts: dict[str, int] = {}
        for worker in await self._llm.collective_rpc(_sampled_counts):
            for rid, n in worker.items():  # tensor-parallel workers agree; keep the most
                counts[rid] = max(n, counts.get(rid, 0))
        return counts

    # ------------------------------------------------------------------ NCCL weights
    async def init_weight_transfer(self, join) -> None:
        """Join the learner's NCCL group (``join``: the learner's ``NcclJoinReply``);
        returns once every worker and the learner have met."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._llm.init_weight_transfer_engine(
            WeightTransferInitRequest(init_info=init_info_from(join)))

    async def receive_weights_nccl(self, fetch_header, timeout_s: float):
        """At a safe point, ask for the newest weights (``await fetch_header()``: a
        ``NcclWeightsHeader``, or None when there is nothing newer) and receive them over
        NCCL into the workers. Returns (version, seconds paused) or None.

        The header is requested only after the calls in flight have drained, so the
        learner's broadcast never waits on this actor's generation. A transfer that does not
        finish in ``timeout_s`` raises ``WeightTransferFailed``: the workers are then stuck
        in NCCL and only a restart frees them."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        keep = self._gate.mode == "keep"
        async with self._gate.exclusive() as drain_s:
            counts = await self._freeze() if keep else {}
            stuck = False  # NCCL workers that did not finish cannot resume: not asked to
            try:
                header = await fetch_header()
                if header is None:
                    return None
                t1 = time.perf_counter()
                names = {n: tuple(s) for n, s in zip(header.names, header.shapes)}
                if self._expected is not None and "lm_head.weight" not in self._expected:
                    names.pop("lm_head.weight", None)  # tied: vLLM skips it when loading
                check_weight_names(names, self._expected)
                request = WeightTransferUpdateRequest(update_info=update_info_from(header))
                await self._llm.start_weight_update()
                try:
                    await asyncio.wait_for(self._llm.update_weights(request), timeout_s)
                except asyncio.TimeoutError:
                    stuck = True
                    raise WeightTransferFailed(f"weights v{header.version}: the NCCL transfer "
                                             f"did not finish in {timeout_s:.0f} s") from None
                await self._llm.finish_weight_update()
                await self._llm.collective_rpc(_retie_embeddings)
                await self._loaded(header.version, counts, keep)
                load_s = time.perf_counter() - t1
            finally:
                if keep and not stuck:
                    await self._llm.resume_generation()
        self.last_update = {"drain_s": drain_s, "load_s": load_s, "paused_s": drain_s + load_s,
                            "tensors": float(len(header.names)), "channel_nccl": 1.0}
        return header.version, drain_s + load_s


def init_info_from(join) -> dict:
    """vLLM ``NCCLWeightTransferInitInfo`` for this actor's workers from the learner's
    ``NcclJoinReply``: ranks 1..world-1 after the learner's rank 0, packed transfers with
    the learner's buffer geometry."""
    return {"master_address": join.master_address, "master_port": join.master_port,
            "rank_offset": 1, "world_size": join.world_size, "packed": True,
            "packed_buffer_size_bytes": join.buffer_bytes,
            "packed_num_buffers": join.num_buffers}


def update_info_from(header) -> dict:
    """vLLM ``NCCLWeightTransferUpdateInfo`` from an ``NcclWeightsHeader``: what the
    broadcast carries, in order."""
    if not (len(header.names) == len(header.dtype_names) == len(header.shapes)):
        raise ValueError(f"weights header v{header.version}: {len(header.names)} names, "
                         f"{len(header.dtype_names)} dtypes, {len(header.shapes)} shapes")
    return {"names": list(header.names), "dtype_names": list(header.dtype_names),
            "shapes": [list(s) for s in header.shapes]}


def shm_dir() -> str | None:
    """/dev/shm keeps the weight file in memory; fall back to the default temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
