"""The default generation engine: vLLM's asynchronous engine (v1 ``AsyncLLM``).

Every rollout of an actor calls ``generate`` concurrently; vLLM batches them in one
engine-core process. Token in, token out: prompts are ``TokensPrompt`` ids and results
are the sampled ids, never re-tokenised text.

Which distribution the log-probs come from: the engine runs with
``logprobs_mode="processed_logprobs"``, so every returned log-prob (the sampled token's
behaviour log-prob and the top-k used for entropy) is log_softmax of the logits *after*
temperature and top-p, i.e. the distribution the token was actually drawn from. (vLLM's
default, ``raw_logprobs``, reports the temperature-1 distribution, which is the wrong
behaviour policy mu for an importance ratio when temperature != 1.) Two consequences:
tokens that top-p removed have log-prob -inf and are left out of ``top_logprobs``; a
greedy request (temperature 0) reports the temperature-1 distribution, as vLLM does.
Prompt log-probs (``sequence_logprobs``) skip the sampler and are always temperature-1
log_softmax, the quantity the learner computes.

Stop strings (tags that are several tokens): vLLM 0.32's detokenizer, with
``include_stop_str_in_output=True``, cuts the output *text* at the end of the first stop
string but keeps the token that completed it (only tokens after that one, when a step
adds several, are dropped). So the ids can run past the stop string (``</python>``
completing inside the token ``>\n``); they are returned as sampled, each with its
log-prob, and the text is not used. ``PathStepper`` handles the overhang
(docs/design.md "Tags as text").

Weights are replaced in place: the tensors go to a safetensors file in /dev/shm and a
function sent by ``collective_rpc`` makes each worker call ``reload_weights`` on it
(the model's own ``load_weights`` fails on CPU, whose linear layers are repacked).
"""

from __future__ import annotations

import asyncio
import gc
import itertools
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from actors.engines.base import (
    ContextOverflow,
    GenRequest,
    GenResult,
    WeightGate,
    check_weight_names,
    checkpoint_shapes,
    torch_state_dict,
)
from actors.engines.reaping import (
    SHUTDOWN_GRACE_S,
    Procs,
    adopting,
    mp_children,
    reap,
    reap_adopted,
)
from actors.engines.vllm_round import Round, sampling_params
from actors.weights.nccl import NcclTransferFailed, update_info_from

logger = logging.getLogger(__name__)

LOGPROBS_MODE = "processed_logprobs"


def cpu_bind_for(actor_id: int, threads: int, num_cpus: int | None = None) -> str:
    """vLLM CPU thread binding for actor ``actor_id``: ``threads`` consecutive cores,
    actors laid side by side and wrapping around, so engines on one machine do not all
    pile onto core 0 (what vLLM's "auto" does for every engine).

    Measured, 2 cores, 2 engines, 16x64 tokens each with logprobs=20, machine shared
    with other jobs: binds "0" and "1" 1.5-2.0k tok/s per engine, "auto" for both
    1.5-1.9k, "nobind" with 1 OpenMP thread each 0.4-1.1k.
    """
    n = num_cpus or len(os.sched_getaffinity(0))
    threads = max(1, min(threads, n))
    first = (actor_id * threads) % n
    cores = [(first + i) % n for i in range(threads)]
    return ",".join(str(c) for c in cores)


def _set_env(cpu_threads: int | None, cpu_bind: str | None, local: bool) -> None:
    """Environment the engine-core and worker processes read at start-up."""
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with a function
    os.environ["VLLM_NO_USAGE_STATS"] = "1"
    os.environ["VLLM_DO_NOT_TRACK"] = "1"
    os.environ["DO_NOT_TRACK"] = "1"
    if local:
        os.environ["HF_HUB_OFFLINE"] = "1"  # a local folder needs no hub look-ups
    # vLLM reads this legacy variable as whole GiB and it would override the exact
    # byte count passed in the engine args; only the args are used.
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpu_bind or "auto"
    if cpu_bind == "nobind" and cpu_threads:
        os.environ["OMP_NUM_THREADS"] = str(cpu_threads)


def _reload_from_file(worker: Any, path: str) -> int:
    """Runs inside each vLLM worker (sent by collective_rpc)."""
    import safetensors.torch  # safetensors.torch, torch: heavy, not for actors.main --help

    tensors = safetensors.torch.load_file(path)
    worker.reload_weights(weights_iterator=iter(tensors.items()), is_checkpoint_format=True)
    _retie_embeddings(worker)
    return len(tensors)


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


def _memory_args(kv_cache_gib: float, max_model_len: int, gpu_memory_utilization: float,
                 weight_transfer: str | None) -> dict[str, Any]:
    """The engine arguments that size its memory (and the weight-transfer backend)."""
    from vllm.platforms import current_platform

    memory: dict[str, Any] = {"gpu_memory_utilization": gpu_memory_utilization}
    if current_platform.is_cpu():
        # A prefill split across steps makes vLLM 0.32's CPU sampler rewind a seeded
        # request's generator, which CPU generators cannot do ("CPU Generator does not use
        # offset") and the EngineCore dies; a large token budget keeps prefills whole.
        memory = {"kv_cache_memory_bytes": int(kv_cache_gib * 2**30),
                  "max_num_batched_tokens": max(65536, max_model_len)}
    if weight_transfer:
        memory["weight_transfer_config"] = {"backend": weight_transfer}
    return memory


class VLLMEngine:
    """``GenerationEngine`` over vLLM's ``AsyncLLM``; build it with ``await create(...)``."""

    def __init__(self, llm: Any, dtype: str, max_model_len: int, max_logprobs: int,
                 prefix_caching: bool, version: int, update_mode: str = "drain",
                 model_path: str = ""):
        self._llm = llm
        self._dtype = dtype
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self._prefix_caching = prefix_caching
        self.version = version
        self._gate = WeightGate(update_mode)
        self._ids = itertools.count()
        self._model_path = model_path
        self._tok = None  # the tokenizer, loaded when a stop string straddles segments
        self.prompt_tokens = 0  # prompt tokens of all requests, and those the cache served
        self.cached_tokens = 0
        self.interrupted_calls = 0
        self._shm = Path(tempfile.mkdtemp(prefix="arpo_weights_", dir=_shm_dir()))
        self.last_update: dict[str, float] = {}
        self.startup_s = 0.0
        self._expected: dict[str, tuple] | None = None  # checkpoint names -> shapes
        self.nccl_workers = 1  # vLLM worker processes (tensor parallel), for NCCL weights
        self._procs: Procs = []  # the engine-core process(es), reaped by close()

    @classmethod
    async def create(
        cls,
        model_path: str | Path,
        *,
        dtype: str = "float32",
        max_model_len: int = 512,
        kv_cache_gib: float = 1.0,
        seed: int = 0,
        max_logprobs: int = 20,
        enforce_eager: bool = True,
        cpu_threads: int | None = None,
        cpu_bind: str | None = None,
        gpu_memory_utilization: float = 0.85,
        tensor_parallel: int = 1,
        enable_prefix_caching: bool = False,
        version: int = 0,
        weight_transfer: str | None = None,
        update_mode: str = "drain",
    ) -> VLLMEngine:
        """Start the engine and run one warm-up request (the first request otherwise
        pays ~20 s of one-off set-up). ``cpu_bind``: vLLM's VLLM_CPU_OMP_THREADS_BIND
        ("auto" when None, "nobind", or cores such as "1" or "0-3": one OpenMP thread
        per listed core); ``cpu_threads`` sets OMP_NUM_THREADS, used only with "nobind".
        ``weight_transfer="nccl"`` enables vLLM's weight-transfer engine on the GPU workers
        (``init_weight_transfer`` / ``receive_weights_nccl``).
        The caller's main module must be import-safe (``if __name__ == "__main__"``):
        vLLM starts its engine process with spawn."""
        t0 = time.perf_counter()
        model_path = str(model_path)
        _set_env(cpu_threads, cpu_bind, local=Path(model_path).is_dir())
        # vllm: an optional extra (cpu, gpu), and its environment is set just above
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=model_path, dtype=dtype, max_model_len=max_model_len, seed=seed,
            max_logprobs=max_logprobs, logprobs_mode=LOGPROBS_MODE, enforce_eager=enforce_eager,
            enable_prefix_caching=enable_prefix_caching, tensor_parallel_size=tensor_parallel,
            disable_log_stats=True, **_memory_args(kv_cache_gib, max_model_len,
                                                   gpu_memory_utilization, weight_transfer),
        )
        before = mp_children()  # what the start adds is the engine's, for close() to reap
        # No local name for the AsyncLLM: the engine object must hold the only reference,
        # so that close() can release it (a finished frame here kept it alive).
        try:
            engine = cls(AsyncLLM.from_engine_args(args), dtype, max_model_len, max_logprobs,
                         enable_prefix_caching, version, update_mode, model_path)
        except BaseException:
            await reap(mp_children(before))  # a failed start leaves processes to reap too
            raise
        engine._procs = mp_children(before)
        engine._expected = checkpoint_shapes(model_path)
        engine.nccl_workers = tensor_parallel
        await engine._warm_up()
        engine.startup_s = time.perf_counter() - t0
        logger.info("vLLM engine ready in %.1f s (%s)", engine.startup_s, model_path)
        return engine

    async def _warm_up(self) -> None:
        """One request and one scoring pass (the first of each pays one-off set-up); an
        engine that fails them is closed."""
        try:
            await self.generate(GenRequest(prompt_tokens=[0, 1], max_tokens=2, logprobs_topk=1))
            await self.sequence_logprobs([0], [1])
        except BaseException:
            await self.close()
            raise

    def _check_prompt(self, tokens: list[int], extra: int) -> None:
        if not tokens:
            raise ValueError("prompt_tokens is empty")
        if len(tokens) + extra > self.max_model_len:
            raise ContextOverflow(f"prompt of {len(tokens)} tokens (+{extra}) exceeds "
                                  f"model.max_model_len={self.max_model_len}")

    async def _run(self, prompt: list[int], params: Any, request_id: str | None = None) -> Any:
        from vllm.inputs import TokensPrompt

        final = None
        request_id = request_id or self._request_id()
        async for out in self._llm.generate(TokensPrompt(prompt_token_ids=prompt), params,
                                            request_id):
            final = out
        return final

    def _request_id(self) -> str:
        return f"arpo-{id(self):x}-{next(self._ids)}"

    async def generate(self, req: GenRequest) -> GenResult:
        """One round, as one or more engine requests (segments): the first
        ``req.topk_window`` tokens with top-k log-probs, the rest with the sampled token's
        own log-prob only; and, in ``interrupt`` mode, a segment a weight update stopped
        resumes from prompt + the tokens so far under the new weights. A stop string
        split across two segments is still found (``_boundary_stops``)."""
        self._check_request(req)
        got = Round()
        finish, reason, interruptions = "length", None, 0
        window = req.topk_window if 0 < req.topk_window < req.max_tokens else 0
        while len(got.tokens) < req.max_tokens:
            if got.tokens and len(req.prompt_tokens) + len(got.tokens) >= self.max_model_len:
                finish, reason = "length", None  # no room left for another segment
                break
            in_window = window == 0 or len(got.tokens) < window
            k = max(0, req.logprobs_topk) if in_window else 0
            full = req.entropy and in_window  # the whole vector, for the exact entropy
            extra = (self._boundary_stops(req.stop, got.tokens)
                     if got.tokens and req.stop else {})
            limit = (window if window and in_window else req.max_tokens) - len(got.tokens)
            comp, version, stopped = await self._segment(
                req, got.tokens, sampling_params(req, limit, k, full, extra, len(got.tokens)))
            got.add(comp, k, full, req.entropy, version)
            finish, reason = comp.finish_reason or "abort", comp.stop_reason
            if finish == "abort" and stopped:
                interruptions += 1  # a weight update stopped it: resume under the new weights
                continue
            if finish == "stop" and reason in extra:
                if not comp.text.startswith(reason):
                    continue  # a stop string's tail matched inside new text: not a stop
                reason = extra[reason]  # the stop string that straddled the boundary
            if finish == "length" and window and len(got.tokens) == window < req.max_tokens:
                continue  # the window ended, not the round
            break
        if interruptions:
            self.interrupted_calls += 1
        return GenResult(tokens=got.tokens, logprobs=got.logprobs, top_logprobs=got.top,
                         finish_reason=finish, stop_reason=reason,
                         version=got.versions[-1] if got.versions else self.version,
                         versions=got.versions, interruptions=interruptions,
                         entropies=got.entropies)

    def _check_request(self, req: GenRequest) -> None:
        if self.max_logprobs != -1 and req.logprobs_topk > self.max_logprobs:
            raise ValueError(f"logprobs_topk={req.logprobs_topk} exceeds the engine's "
                             f"max_logprobs={self.max_logprobs}")
        if req.entropy and self.max_logprobs != -1:
            raise ValueError("an exact-entropy request needs the engine started with "
                             "max_logprobs=-1 (rollout.entropy_estimator=exact does that)")
        self._check_prompt(req.prompt_tokens, 1)

    async def _segment(self, req: GenRequest, tokens: list[int], params: Any
                       ) -> tuple[Any, int, list]:
        """One engine request continuing the round from prompt + ``tokens``, under the
        weight gate: (its completion, the version it ran under, non-empty if a weight
        update stopped it)."""
        request_id = self._request_id()
        stopped: list[bool] = []

        async def stop(rid=request_id, flag=stopped):
            flag.append(True)
            await self._llm.abort(rid)

        async with self._gate.call(stop=stop):
            version = self.version
            out = await self._run(list(req.prompt_tokens) + tokens, params, request_id)
        self.prompt_tokens += len(req.prompt_tokens) + len(tokens)
        self.cached_tokens += int(out.num_cached_tokens or 0)
        return out.outputs[0], version, stopped

    def _boundary_stops(self, stops: list[str], tokens: list[int]) -> dict[str, str]:
        """Stop strings the next segment must also stop at: for each stop string whose
        beginning the text so far ends with, its remaining tail (tail -> stop string). The
        engine matches stop strings in a request's own output only."""
        text = self._tokenizer().decode(tokens[-16:], skip_special_tokens=False)
        tails = {}
        for s in stops:
            for cut in range(len(s) - 1, 0, -1):
                if text.endswith(s[:cut]):
                    tails.setdefault(s[cut:], s)
                    break
        return tails

    def _tokenizer(self) -> Any:
        if self._tok is None:
            from transformers import AutoTokenizer  # transformers: heavy, not for --help

            self._tok = AutoTokenizer.from_pretrained(self._model_path)
        return self._tok

    def stats(self) -> dict[str, float]:
        """Prefix-cache hits (prompt tokens served from the cache) and interruptions."""
        return {"prefix_cache_hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
                "prompt_tokens": float(self.prompt_tokens),
                "cached_tokens": float(self.cached_tokens),
                "interrupted_calls": float(self.interrupted_calls)}

    async def sequence_logprobs(self, prompt_tokens: list[int], tokens: list[int]) -> list[float]:
        """One prefill with ``prompt_logprobs=0`` (each position's actual token only)."""
        from vllm import SamplingParams

        if not tokens:
            return []
        full = list(prompt_tokens) + list(tokens)
        self._check_prompt(list(prompt_tokens), len(tokens) + 1)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        async with self._gate.call():
            out = await self._run(full, params)
        entries = out.prompt_logprobs[len(prompt_tokens):]
        return [float(e[t].logprob) for t, e in zip(tokens, entries)]

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
        async with self._gate.exclusive() as drain_s:
            t1 = time.perf_counter()
            try:
                await self._llm.collective_rpc(_reload_from_file, args=(str(path),))
                if self._prefix_caching:
                    await self._llm.reset_prefix_cache()
            finally:
                path.unlink(missing_ok=True)
            self.version = version
            load_s = time.perf_counter() - t1
        paused = drain_s + load_s
        self.last_update = {"write_s": t_file, "drain_s": drain_s, "load_s": load_s,
                            "paused_s": paused, "tensors": float(len(state))}
        return paused

    # ------------------------------------------------------------------ NCCL weights
    async def init_weight_transfer(self, init_info: dict) -> None:
        """Join the learner's NCCL group (vLLM's ``NCCLWeightTransferInitInfo`` fields);
        returns once every worker and the learner have met."""
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))

    async def receive_weights_nccl(self, fetch_header, timeout_s: float):
        """At a safe point, ask for the newest weights (``await fetch_header()``: a
        ``NcclWeightsHeader``, or None when there is nothing newer) and receive them over
        NCCL into the workers. Returns (version, seconds paused) or None.

        The header is requested only after the calls in flight have drained, so the
        learner's broadcast never waits on this actor's generation. A transfer that does not
        finish in ``timeout_s`` raises ``NcclTransferFailed``: the workers are then stuck
        in NCCL and only a restart frees them."""
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        async with self._gate.exclusive() as drain_s:
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
                raise NcclTransferFailed(f"weights v{header.version}: the NCCL transfer did "
                                         f"not finish in {timeout_s:.0f} s") from None
            await self._llm.finish_weight_update()
            await self._llm.collective_rpc(_retie_embeddings)
            if self._prefix_caching:
                await self._llm.reset_prefix_cache()
            self.version = header.version
            load_s = time.perf_counter() - t1
        self.last_update = {"drain_s": drain_s, "load_s": load_s, "paused_s": drain_s + load_s,
                            "tensors": float(len(header.names)), "channel_nccl": 1.0}
        return header.version, drain_s + load_s

    async def close(self) -> None:
        """Shut the engine-core process down, reap it, and remove the weight scratch folder."""
        llm, self._llm = self._llm, None
        procs, self._procs = self._procs, []
        adopted: list[int] = []
        if llm is not None:
            with adopting(procs) as adopted:
                llm.shutdown(timeout=SHUTDOWN_GRACE_S)
            # Let the cancelled output-handler task finish and drop the last reference
            # now: AsyncLLM.__del__ at interpreter exit would shut down a second time.
            await asyncio.sleep(0)
            del llm
            gc.collect()
        await reap(procs)
        await reap_adopted(adopted)
        shutil.rmtree(self._shm, ignore_errors=True)


def _shm_dir() -> str | None:
    """/dev/shm keeps the weight file in memory; fall back to the default temp dir."""
    shm = "/dev/shm"
    return shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else None
