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

Weight updates (in place, from a file or over NCCL; keep mode): actors/engines/
vllm_weights.py.
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
    checkpoint_shapes,
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
from actors.engines.vllm_weights import VLLMWeights, LiveRequest, shm_dir

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


def _request_amx(worker: Any) -> bool:
    """Runs inside each vLLM worker (collective_rpc): asks Linux for the AMX tile state
    (``arch_prctl(ARCH_REQ_XCOMP_PERM)``, via torch). vLLM 0.32's CPU attention takes its
    AMX kernel for bfloat16 whenever the CPU lists AMX, without asking for it; where nothing
    in the worker asked first, the first bfloat16 step dies of SIGILL (worker exit code -4,
    seen on this project's CPU machines). True when AMX is there and granted."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


class VLLMEngine(VLLMWeights):
    """``GenerationEngine`` over vLLM's ``AsyncLLM``; build it with ``await create(...)``."""

    def __init__(self, llm: Any, dtype: str, max_model_len: int, max_logprobs: int,
                 prefix_caching: bool, version: int, update_mode: str = "drain"):
        self._llm = llm
        self._dtype = dtype
        self.max_model_len = max_model_len
        self.max_logprobs = max_logprobs
        self._prefix_caching = prefix_caching
        self.version = version
        self._gate = WeightGate(update_mode)
        self._ids = itertools.count()
        self.prompt_tokens = 0  # prompt tokens of all requests, and those the cache served
        self.cached_tokens = 0
        self.interrupted_calls = 0
        self.kept_calls = 0  # requests frozen across an update (keep) and resumed on their KV
        self.recomputed_tokens = 0  # context prefilled again after an interruption
        self.sampled_tokens = 0  # tokens generated (as they stream, not at the end)
        self.rounds = 0  # generate() calls, and the engine requests they made (segments)
        self.requests = 0
        self._live: dict[str, LiveRequest] = {}  # requests in flight, by id
        self.keep_unreached = 0  # requests without output yet at a keep update (see _freeze)
        self._shm = Path(tempfile.mkdtemp(prefix="arpo_weights_", dir=shm_dir()))
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
                         enable_prefix_caching, version, update_mode)
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
        """AMX asked for on a CPU (``_request_amx``), then one request and one scoring pass
        (the first of each pays one-off set-up); an engine that fails them is closed."""
        from vllm.platforms import current_platform

        try:
            if current_platform.is_cpu():
                await self._llm.collective_rpc(_request_amx)
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

    async def _run(self, prompt: list[int], params: Any, request_id: str | None = None,
                   live: LiveRequest | None = None) -> Any:
        from vllm.inputs import TokensPrompt

        final = None
        request_id = request_id or self._request_id()
        tokens = TokensPrompt(prompt_token_ids=prompt)
        if self._prefix_caching and self._gate.mode == "keep":
            tokens["cache_salt"] = f"v{self.version}"  # no KV shared across weights
        seen = 0
        async for out in self._llm.generate(tokens, params, request_id):
            final = out
            if live is not None:
                live.started.set()
                n = len(out.outputs[0].token_ids) if out.outputs else seen
                self.sampled_tokens += n - seen
                seen = n
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
        self.rounds += 1
        got = Round()
        finish, reason, interruptions = "length", None, 0
        asked = req.logprobs_topk > 0 or req.entropy  # a window with nothing asked: no split
        window = req.topk_window if asked and 0 < req.topk_window < req.max_tokens else 0
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
            comp, versions, stopped = await self._segment(
                req, got.tokens, sampling_params(req, limit, k, full, extra, len(got.tokens)))
            got.add(comp, k, full, req.entropy, versions)
            finish, reason = comp.finish_reason or "abort", comp.stop_reason
            if finish == "abort" and stopped:
                interruptions += 1  # a weight update stopped it: resume under the new weights
                self.recomputed_tokens += len(req.prompt_tokens) + len(got.tokens)
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
                         ) -> tuple[Any, list[int], list]:
        """One engine request continuing the round from prompt + ``tokens``, under the
        weight gate: (its completion, the version that sampled each of its tokens,
        non-empty if a weight update stopped it)."""
        request_id = self._request_id()
        self.requests += 1
        stopped: list[bool] = []

        async def stop(rid=request_id, flag=stopped):
            flag.append(True)
            await self._llm.abort(rid)

        async with self._gate.call(stop=stop):
            live = self._live[request_id] = LiveRequest(self.version)
            try:
                out = await self._run(list(req.prompt_tokens) + tokens, params, request_id,
                                      live)
            finally:
                self._live.pop(request_id, None)
        self.prompt_tokens += len(req.prompt_tokens) + len(tokens)
        self.cached_tokens += int(out.num_cached_tokens or 0)
        self.kept_calls += bool(live.switches)
        comp = out.outputs[0]
        return comp, live.versions(len(comp.token_ids)), stopped

    def _boundary_stops(self, stops: list[str], tokens: list[int]) -> dict[str, str]:
        """Stop strings the next segment must also stop at: for each stop string whose
        beginning the text so far ends with, its remaining tail (tail -> stop string). The
        engine matches stop strings in a request's own output only."""
        text = self.tokenizer.decode(tokens[-16:], skip_special_tokens=False)
        tails = {}
        for s in stops:
            for cut in range(len(s) - 1, 0, -1):
                if text.endswith(s[:cut]):
                    tails.setdefault(s[cut:], s)
                    break
        return tails

    @property
    def tokenizer(self) -> Any:
        """vLLM's own tokenizer (its detokenizer's): the actor's too, never a second copy."""
        return self._llm.get_tokenizer()

    def stats(self) -> dict[str, float]:
        """Prefix-cache hits (prompt tokens served from the cache) and interruptions."""
        return {"prefix_cache_hit_rate": self.cached_tokens / max(1, self.prompt_tokens),
                "prompt_tokens": float(self.prompt_tokens),
                "cached_tokens": float(self.cached_tokens),
                "interrupted_calls": float(self.interrupted_calls),
                "kept_calls": float(self.kept_calls),
                "keep_unreached": float(self.keep_unreached),
                "recomputed_tokens": float(self.recomputed_tokens),
                "sampled_tokens": float(self.sampled_tokens),
                "rounds": float(self.rounds), "requests": float(self.requests)}

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
