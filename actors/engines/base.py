"""The generation-engine interface every actor talks to.

Engines are wired by config (``actors.engine``, the factory in actors/engines/__init__.py):
vLLM (default; the async engine, so many
rollouts share one batch), transformers (machines without vLLM), or a simulated engine
(throughput experiments). Token in, token out: a request is a list of token ids and the
result is the sampled ids with their behaviour log-probs, so nothing is re-tokenised.

Weight updates (``actors.update_mode``): ``drain`` holds new calls and waits for the calls
in flight to end before it loads; ``interrupt`` stops the calls in flight at a token
boundary, loads, and lets them continue under the new weights. An interrupted call keeps
every token it sampled, each with the version and log-prob it was sampled with
(``GenResult.versions``), and resumes from prompt + those tokens, recomputed under the new
weights: so its new-version tokens are exactly what the new policy samples from that
context (no stale KV cache), which is what the learner recomputes. ``keep`` (vLLM only)
freezes the calls in flight with their KV cache, loads, and lets them go on from where
they stopped: nothing is prefilled again, and the tokens sampled after the load carry the
new version and the log-probs the engine reported for them (under the new weights over
KV the old ones computed), which the learner uses as the behaviour policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
from safetensors import safe_open

if TYPE_CHECKING:
    pass


@dataclass
class GenRequest:
    prompt_tokens: list[int]  # full context so far: prompt + response tokens
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)  # e.g. id of "</python>"
    stop: list[str] = field(default_factory=list)  # stop strings for multi-token tags
    logprobs_topk: int = 20  # top-k log-probs per generated token, for entropy
    seed: int | None = None
    # top-k only for the first ``topk_window`` tokens (0: every token); later tokens carry
    # their own log-prob only (top_logprobs entry []): entropy is read over a window
    topk_window: int = 0
    ignore_eos: bool = False
    # also the exact entropy (nats) of each token's sampling distribution, over the same
    # tokens as the top-k (rollout.entropy_estimator=exact)
    entropy: bool = False


UPDATE_MODES = ("drain", "interrupt", "keep")


class ContextOverflow(ValueError):
    """A request whose context leaves no room under the engine's max_model_len: the
    rollout ends that trajectory as ``length`` (counted), never the actor."""


@dataclass
class GenResult:
    tokens: list[int]  # sampled ids, including the stop token/tag that ended the round
    logprobs: list[float]  # behaviour log-prob of each sampled token
    top_logprobs: list[list[float]]  # per token, the top-k log-probs, descending
    finish_reason: str  # "stop" (stop token/string or EOS), "length", or "abort"
    stop_reason: str | int | None = None  # the stop string or token id that matched
    version: int = -1  # policy version of the weights that generated the last token
    # per token, the policy version that sampled it (an update can interrupt a call, which
    # then resumes under the new weights); [] means every token has ``version``
    versions: list[int] = field(default_factory=list)
    interruptions: int = 0  # times a weight update stopped and resumed this call
    # per token, the exact entropy (nats) of its sampling distribution when the request
    # asked for it (nan past the window); [] when it did not or the engine cannot give it
    entropies: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.versions:
            self.versions = [self.version] * len(self.tokens)
        elif len(self.versions) != len(self.tokens):
            raise ValueError(f"{len(self.versions)} versions for {len(self.tokens)} tokens")


class GenerationEngine(Protocol):
    """What an actor needs from an inference engine."""

    version: int  # policy version of the weights now loaded
    tokenizer: Any  # the engine's own tokenizer, which the actor uses too (one per actor)

    async def generate(self, req: GenRequest) -> GenResult:
        """Sample one continuation. Weight updates never happen during one call."""

    async def update_weights(self, tensors: dict[str, Any], version: int) -> float:
        """Load full weights (torch tensors, or numpy arrays, by HF name; each is cast to
        the engine's dtype) in place (no engine restart) at a safe point: blocks new calls,
        and waits for the calls in flight (``drain``) or stops them at a token boundary to
        resume after the load (``interrupt``). Returns seconds generation paused."""

    async def sequence_logprobs(self, prompt_tokens: list[int], tokens: list[int]) -> list[float]:
        """Log-probs of ``tokens`` following ``prompt_tokens`` under the loaded weights
        (used to check that actor and learner agree after a broadcast)."""

    async def close(self) -> None: ...


class WeightGate:
    """The safe point for a weight update, shared by every engine.

    ``generate``/``sequence_logprobs`` run inside ``async with gate.call()``; an update
    runs inside ``async with gate.exclusive()``, which first holds new calls, then waits
    until the calls in flight have left. Calls issued while an update waits or runs
    start after it, so they see the new weights and version. Updates are serialised.

    Interrupt mode: a call that can stop early passes ``gate.call(stop=...)``, a callable
    (sync or async) that makes it return at its next token boundary with what it has;
    ``exclusive(interrupt=True)`` invokes every such callable before it waits, so the wait
    is one decode step, not the longest call. The caller resumes after the update.

    Keep mode: ``exclusive`` holds new calls and does not wait for the calls in flight;
    the engine freezes them itself (vLLM ``pause_generation(mode="keep")``).
    """

    def __init__(self, mode: str = "drain", modes: tuple[str, ...] = UPDATE_MODES) -> None:
        if mode not in modes:
            raise ValueError(f"actors.update_mode: {mode!r}, expected one of {modes}")
        self.mode = mode
        self._in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._open = asyncio.Event()
        self._open.set()
        self._update_lock = asyncio.Lock()
        self._stoppers: dict[int, Any] = {}
        self._ids = 0
        self.interrupted = 0  # calls stopped by updates, in all

    @property
    def in_flight(self) -> int:
        """Calls now running."""
        return self._in_flight

    @property
    def closed(self) -> bool:
        """True while an update holds new calls back."""
        return not self._open.is_set()

    @contextlib.asynccontextmanager
    async def call(self, stop=None):
        # Re-check after every wake-up: another update may have closed the gate again.
        while not self._open.is_set():
            await self._open.wait()
        self._in_flight += 1
        self._idle.clear()
        key = self._ids = self._ids + 1
        if stop is not None:  # used only if the update that comes interrupts
            self._stoppers[key] = stop
        try:
            yield
        finally:
            self._stoppers.pop(key, None)
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.set()

    @contextlib.asynccontextmanager
    async def exclusive(self, interrupt: bool | None = None):
        """Yields the seconds spent waiting for the calls in flight to leave: to end
        (drain), or, with ``interrupt`` (default: the gate's mode is ``interrupt``), to
        stop at their next token boundary."""
        interrupt = self.mode == "interrupt" if interrupt is None else interrupt
        async with self._update_lock:
            self._open.clear()
            try:
                t0 = time.perf_counter()
                if interrupt:
                    for stop in list(self._stoppers.values()):
                        self.interrupted += 1
                        out = stop()
                        if inspect.isawaitable(out):
                            await out
                if self.mode != "keep":
                    await self._idle.wait()
                yield time.perf_counter() - t0
            finally:
                self._open.set()


def check_weight_names(names: Iterable[str], expected: Mapping[str, tuple] | None,
                       optional: Iterable[str] = ()) -> None:
    """Full weights only: every expected name present with its shape, nothing unknown
    (checked before anything is loaded, so a bad update never half-applies)."""
    if expected is None:
        return
    names = dict(names) if isinstance(names, Mapping) else {n: None for n in names}
    unexpected = sorted(set(names) - set(expected))
    missing = sorted(set(expected) - set(names) - set(optional))
    if unexpected or missing:
        raise ValueError(f"weights do not match the model: unexpected {unexpected[:5]}, "
                         f"missing {missing[:5]}")
    for name, shape in names.items():
        if shape is not None and tuple(shape) != tuple(expected[name]):
            raise ValueError(f"weights[{name!r}]: shape {tuple(shape)}, model has "
                             f"{tuple(expected[name])}")


def torch_state_dict(tensors: Mapping[str, Any], dtype: Any) -> dict:
    """Weights as they arrive (torch tensors keyed by HF state_dict names, each of its own
    dtype, as the weight channels bring them; or numpy arrays) -> contiguous torch tensors
    of the engine's ``dtype``."""
    import torch  # torch: heavy, and every actor module (and --help) imports this one

    out = {}
    for name, arr in tensors.items():
        if isinstance(arr, torch.Tensor):
            t = arr.detach().cpu()
        elif isinstance(arr, np.ndarray):
            with warnings.catch_warnings():
                # Arrays decoded from ZeroMQ frames are read-only views; they are only
                # read (copied into the engine), never written through.
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                t = torch.from_numpy(np.ascontiguousarray(arr))
        else:
            raise TypeError(f"weights[{name!r}]: expected a numpy array or torch tensor, "
                            f"got {type(arr).__name__}")
        if not t.is_floating_point():
            raise ValueError(f"weights[{name!r}]: dtype {t.dtype} is not a floating-point weight")
        out[name] = t.to(dtype).contiguous()
    return out


def checkpoint_shapes(model_path: str) -> dict[str, tuple] | None:
    """Tensor names and shapes of a local safetensors checkpoint (None for a hub name or
    another format: updates are then not checked before they reach the engine)."""
    files = sorted(Path(model_path).glob("*.safetensors")) if Path(model_path).is_dir() else []
    if not files:
        return None
    shapes = {}
    for f in files:
        with safe_open(str(f), framework="np") as sf:
            for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                shapes[name] = tuple(sf.get_slice(name).get_shape())
    return shapes
