"""A simulated engine core: a scheduler over a KV cache of ``num_blocks`` blocks.

No model runs. A request is admitted while fewer than ``max_num_seqs`` run and its tokens fit
in free KV blocks; "prefill" takes ``prefill_seconds_per_token × prompt tokens``, then one token
is produced every ``token_seconds``. When a running request needs a new block and none is free
it is preempted (recompute, as in vLLM V1) and goes back to waiting. Generated text is derived
deterministically from the prompt, so two identical requests give identical answers.

Statistics go to ``metrics.Metrics`` (prometheus_client), as vLLM's ``PrometheusStatLogger``.

While the server shuts down (``rejecting``), a new request is refused with
``RuntimeError("cannot schedule new futures after shutdown")``: vLLM 0.33's ``AsyncLLM.shutdown``
(``vllm/v1/engine/async_llm.py``) shuts the renderer's thread pool down before it drains, so the
next request's preprocessing fails in ``concurrent.futures.ThreadPoolExecutor.submit`` with that
message, which the API server answers as HTTP 500 (``server.py``). Requests already admitted
go on until done or until the drain's deadline aborts them.
"""

from __future__ import annotations

import hashlib
import math
import random
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.standin.metrics import Metrics

_WORD_TEXT = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more can out other "
    "fleet lab vllm token model serve engine cache block memory host rollout drain health metric"
)
WORDS = tuple(_WORD_TEXT.split())
_TOKEN_RE = re.compile(r"\w+|[^\w\s]")


def count_tokens(text: str) -> int:
    """A stable stand-in tokenizer: words and punctuation marks, plus a BOS token."""
    return len(_TOKEN_RE.findall(text)) + 1


class EngineDeadError(Exception):
    """The engine died (vLLM's ``EngineDeadError``)."""


#: ``concurrent.futures.ThreadPoolExecutor.submit`` after ``shutdown()`` (CPython ``thread.py``).
SHUTDOWN_MESSAGE = "cannot schedule new futures after shutdown"


class ShutdownRejected(RuntimeError):
    """A new request while the server shuts down (vLLM: the renderer's executor is shut down)."""


class RequestAborted(Exception):
    """The request was aborted (shutdown without drain, or drain timeout)."""


@dataclass
class Request:
    request_id: str
    prompt: str
    prompt_tokens: int
    max_tokens: int
    abort: threading.Event = field(default_factory=threading.Event)
    arrival: float = field(default_factory=time.monotonic)
    running_since: float | None = None
    blocks: int = 0
    generated: int = 0


class Engine:
    """Scheduler, KV accounting and statistics of one engine (``engine="0"``)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        token_seconds: float,
        prefill_seconds_per_token: float,
    ) -> None:
        self.num_blocks = max(1, num_blocks - 1)  # one block is the null block
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.token_seconds = token_seconds
        self.prefill_seconds_per_token = prefill_seconds_per_token
        self.cond = threading.Condition()
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.used_blocks = 0
        self.dead = False
        self.hung = False
        self.rejecting = False
        self.metrics: Metrics | None = None
        self._ids = 0

    # -- state changes from the server -------------------------------------------------
    def kill(self) -> None:
        """The engine dies: everything in flight fails with ``EngineDeadError``."""
        with self.cond:
            self.dead = True
            self.cond.notify_all()
        self.abort_all()

    def abort_all(self) -> int:
        with self.cond:
            requests = self.running + self.waiting
            for req in requests:
                req.abort.set()
            self.cond.notify_all()
        return len(requests)

    def in_flight(self) -> int:
        with self.cond:
            return len(self.running) + len(self.waiting)

    def kv_usage(self) -> float:
        with self.cond:
            return self.used_blocks / self.num_blocks

    # -- request path ------------------------------------------------------------------
    def new_request(self, prompt: str, max_tokens: int) -> Request:
        with self.cond:
            if self.dead:
                raise EngineDeadError("EngineCore encountered an issue. See stack trace above for the root cause.")
            self._ids += 1
            if self.rejecting:  # the renderer's executor is shut down (AsyncLLM.shutdown)
                raise ShutdownRejected(SHUTDOWN_MESSAGE)
            return Request(f"cmpl-{self._ids:08x}", prompt, count_tokens(prompt), max_tokens)

    def oldest_running_seconds(self) -> float:
        """How long the longest-running request has been scheduled (0 when none)."""
        now = time.monotonic()
        with self.cond:
            starts = [r.running_since for r in self.running if r.running_since is not None]
        return now - min(starts) if starts else 0.0

    def _blocks_for(self, tokens: int) -> int:
        return math.ceil(tokens / self.block_size)

    def _check(self, req: Request) -> None:
        if self.dead:
            raise EngineDeadError("EngineCore encountered an issue. See stack trace above for the root cause.")
        if req.abort.is_set():
            raise RequestAborted(req.request_id)

    def _admit(self, req: Request) -> None:
        with self.cond:
            self.waiting.append(req)
            try:
                while True:
                    self._check(req)
                    need = self._blocks_for(req.prompt_tokens + req.generated + 1)
                    if (
                        self.waiting[0] is req
                        and len(self.running) < self.max_num_seqs
                        and self.used_blocks + need <= self.num_blocks
                    ):
                        break
                    self.cond.wait(0.05)
            finally:
                self.waiting.remove(req)
            req.blocks = need
            self.used_blocks += need
            req.running_since = time.monotonic()
            self.running.append(req)
            self.cond.notify_all()

    def _release(self, req: Request) -> None:
        with self.cond:
            if req in self.running:
                self.running.remove(req)
                self.used_blocks -= req.blocks
                req.blocks = 0
                self.cond.notify_all()

    def _sleep(self, req: Request, seconds: float) -> None:
        if req.abort.wait(seconds):
            self._check(req)

    def generate(self, req: Request) -> Iterator[str]:
        """Yield the request's tokens; raises ``RequestAborted``/``EngineDeadError``."""
        arrival = req.arrival
        rng = random.Random(hashlib.sha256(req.prompt.encode()).digest())
        reason = "error"
        m = self.metrics
        try:
            self._check(req)
            self._admit(req)
            if m is not None:
                m.queue_time.observe(time.monotonic() - arrival)
                m.prompt_tokens.inc(req.prompt_tokens)
                m.prefix_cache_queries.inc(req.prompt_tokens)
            self._sleep(req, self.prefill_seconds_per_token * req.prompt_tokens)
            last: float | None = None
            while req.generated < req.max_tokens:
                while self.hung:  # the "alive but hung" engine: no token ever comes
                    self._sleep(req, 0.1)
                    self._check(req)
                self._sleep(req, self.token_seconds)
                self._check(req)
                with self.cond:
                    need = self._blocks_for(req.prompt_tokens + req.generated + 1)
                    if need > req.blocks:
                        if self.used_blocks + 1 > self.num_blocks:
                            preempted = True
                        else:
                            self.used_blocks += 1
                            req.blocks += 1
                            preempted = False
                    else:
                        preempted = False
                    if not preempted:
                        req.generated += 1
                if preempted:
                    if m is not None:
                        m.preemptions.inc()
                    self._release(req)
                    self._admit(req)
                    continue
                now = time.monotonic()
                if m is not None:
                    m.generation_tokens.inc()
                    if last is None:
                        m.ttft.observe(now - arrival)
                    else:
                        m.itl.observe(now - last)
                last = now
                yield " " + rng.choice(WORDS)
            reason = "length"
        except RequestAborted:
            reason = "abort"
            raise
        finally:
            self._release(req)
            if m is not None:
                m.success[reason].inc()
                m.e2e.observe(time.monotonic() - arrival)
                m.request_prompt_tokens.observe(req.prompt_tokens)
                m.request_generation_tokens.observe(req.generated)
                m.request_max_tokens.observe(req.max_tokens)
                m.request_max_num_generation_tokens.observe(req.max_tokens)
                m.request_params_n.observe(1)
                m.prefill_kv_computed.observe(req.prompt_tokens)
                m.prompt_tokens_computed.inc(req.prompt_tokens)
                if req.running_since is not None:
                    running = time.monotonic() - req.running_since
                    m.inference_time.observe(running)
                    if req.generated > 1:
                        m.tpot.observe(running / req.generated)
