"""An LLMEngine stepped by a background thread, for the asyncio server.

One thread owns the stepping loop: it sleeps while there is no work, and otherwise adds the
requests that arrived, applies pending aborts, runs `engine.step()` and hands each RequestOutput to
its request's asyncio queue with `loop.call_soon_threadsafe`. Adds and aborts from the event loop
are queued for the thread rather than taken under the lock there: the event loop never blocks on
a running step, and a busy stepping thread cannot starve them. Every engine call is still made
under `self.lock`, so other threads that need the engine can serialise with it.

A step that raises fails the requests it involved (those named by the exception's `request_ids`
attribute when it has one, otherwise every request in the engine), aborts them and keeps the loop
running; only if the engine cannot even abort them is it marked dead (`dead_error`), after which
every request fails with `EngineDeadError`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from krait.outputs import RequestOutput
from krait.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop can no longer serve requests."""


class EngineStepError(RuntimeError):
    """A step of the engine raised while this request was in it."""


class EngineObserver(Protocol):
    """Receives timings and engine stats from the stepping thread (e.g. ServerMetrics)."""

    def on_engine_stats(self, stats: dict) -> None: ...
    def on_first_token(self, ttft: float, num_prompt_tokens: int) -> None: ...
    def on_tokens(self, num_new_tokens: int, inter_token_latency: float | None) -> None: ...
    def on_finished(self, e2e_latency: float, finish_reason: str | None) -> None: ...


@dataclass
class _Tracked:
    """Host-side bookkeeping of one live request."""

    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    arrival: float
    in_engine: bool = False
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0


@dataclass
class _PendingAdd:
    request_id: str
    prompt: str | dict
    params: SamplingParams
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    extra: dict[str, Any] = field(default_factory=dict)


class RequestStream:
    """The RequestOutputs of one request, as an async iterator.

    Iteration ends after the output with `finished=True`; an engine failure raises
    `EngineStepError` / `EngineDeadError`. `close()` aborts the request if it is still running.
    """

    def __init__(self, engine: AsyncLLMEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def close(self) -> None:
        """Abort the request unless it already finished."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


def _resolve(fut: asyncio.Future, exc: BaseException | None) -> None:
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
    else:
        fut.set_exception(exc)


class AsyncLLMEngine:
    """Runs `engine` in a daemon thread; call `shutdown()` to stop it."""

    def __init__(self, engine: Any, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.observer = observer
        self.lock = threading.Lock()  # held for every call into `engine`
        self._cv = threading.Condition()  # guards the fields below
        self._requests: dict[str, _Tracked] = {}
        self._pending_adds: list[_PendingAdd] = []
        self._pending_aborts: list[str] = []
        self._has_work = False
        self._stop = False
        self.dead_error: BaseException | None = None
        self.stats: dict = {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}
        self._thread = threading.Thread(target=self._run, name="krait-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: Any, observer: EngineObserver | None = None) -> AsyncLLMEngine:
        from krait.engine.engine import LLMEngine

        return cls(LLMEngine.from_config(config), observer)

    @property
    def config(self) -> Any:
        return self.engine.config

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead_error is None and not self._stop

    # ------------------------------------------------------------ event-loop side

    async def add_request(self, request_id: str, prompt: str | dict,
                          params: SamplingParams) -> RequestStream:
        """Add a request and return its output stream.

        Raises the engine's ValueError for invalid input, EngineDeadError if the loop is dead.
        """
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        tracked = _Tracked(queue=asyncio.Queue(), loop=loop, arrival=time.perf_counter())
        with self._cv:
            if self.dead_error is not None or self._stop:
                raise EngineDeadError(f"the engine is not running: {self.dead_error}")
            if request_id in self._requests:
                raise ValueError(f"request_id {request_id!r} is already in use")
            self._requests[request_id] = tracked
            self._pending_adds.append(_PendingAdd(request_id, prompt, params, fut, loop))
            self._cv.notify()
        try:
            await fut
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, tracked.queue)

    async def generate(self, request_id: str, prompt: str | dict,
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its RequestOutputs; leaving early aborts it."""
        stream = await self.add_request(request_id, prompt, params)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        """Stop delivering the request's outputs and abort it in the engine before its next step.

        Safe from any thread; never blocks on a running step.
        """
        with self._cv:
            tracked = self._requests.pop(request_id, None)
            self._pending_aborts.append(request_id)
            self._cv.notify()
        if tracked is not None and self.observer is not None:
            self.observer.on_finished(time.perf_counter() - tracked.arrival, "abort")

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the thread; requests still running fail with EngineDeadError."""
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout)
        self._fail(list(self._requests), EngineDeadError("the engine was shut down"))

    # ------------------------------------------------------------ engine thread

    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._stop or self._pending_adds or self._pending_aborts
                           or self._has_work):
                    self._cv.wait()
                if self._stop:
                    return
                adds, self._pending_adds = self._pending_adds, []
                aborts, self._pending_aborts = self._pending_aborts, []
            try:
                self._iteration(adds, aborts)
            except Exception as exc:  # a failure outside step(): the engine state is unknown
                logger.exception("engine loop failed; the engine is dead")
                self._die(exc)
                return

    def _iteration(self, adds: list[_PendingAdd], aborts: list[str]) -> None:
        outputs: list[RequestOutput] = []
        step_error: Exception | None = None
        with self.lock:
            for add in adds:
                self._add(add)
            if aborts:
                self._abort_in_engine(aborts)
            if self.engine.has_unfinished_requests():
                try:
                    outputs = self.engine.step()
                except Exception as exc:
                    step_error = exc
            if step_error is None:
                self._has_work = self.engine.has_unfinished_requests()
                self.stats = dict(self.engine.get_stats())
        if self.observer is not None:  # before the outputs go out: a client that has its
            self.observer.on_engine_stats(self.stats)  # last token sees metrics that count it
        if step_error is not None:
            self._handle_step_error(step_error)
        else:
            self._dispatch(outputs, time.perf_counter())

    def _add(self, add: _PendingAdd) -> None:
        try:
            self.engine.add_request(add.request_id, add.prompt, add.params)
        except Exception as exc:
            with self._cv:
                self._requests.pop(add.request_id, None)
            add.loop.call_soon_threadsafe(_resolve, add.future, exc)
            return
        with self._cv:
            tracked = self._requests.get(add.request_id)
            if tracked is not None:
                tracked.in_engine = True
        add.loop.call_soon_threadsafe(_resolve, add.future, None)

    def _abort_in_engine(self, request_ids: list[str]) -> None:
        try:
            self.engine.abort_request(request_ids)
            return
        except Exception:
            logger.warning("abort of %d requests failed; retrying one by one", len(request_ids))
        for rid in request_ids:
            try:
                self.engine.abort_request(rid)
            except Exception:
                logger.exception("abort of request %s failed", rid)

    def _dispatch(self, outputs: list[RequestOutput], now: float) -> None:
        for out in outputs:
            with self._cv:
                tracked = self._requests.get(out.request_id)
                if tracked is not None and out.finished:
                    del self._requests[out.request_id]
            if tracked is None:
                continue  # aborted by its client
            if self.observer is not None:
                self._observe(tracked, out, now)
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, out)

    def _observe(self, t: _Tracked, out: RequestOutput, now: float) -> None:
        obs = self.observer
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        new = num_tokens - t.num_tokens
        if new > 0:
            if t.first_token is None:
                t.first_token = now
                obs.on_first_token(now - t.arrival, len(out.prompt_token_ids or []))
                obs.on_tokens(new, None)
            else:
                obs.on_tokens(new, now - t.last_token)
            t.last_token = now
            t.num_tokens = num_tokens
        if out.finished:
            reasons = [c.finish_reason for c in out.outputs if c.finish_reason]
            reason = "length" if "length" in reasons else (reasons[0] if reasons else None)
            obs.on_finished(now - t.arrival, reason)

    def _handle_step_error(self, exc: Exception) -> None:
        named = set(getattr(exc, "request_ids", None) or ())
        with self._cv:
            in_engine = [rid for rid, t in self._requests.items() if t.in_engine]
            pending_aborts, self._pending_aborts = self._pending_aborts, []
        victims = [rid for rid in in_engine if rid in named] if named else in_engine
        # without named requests every request in the engine is failed; if the engine still
        # reports work after aborting them all, it cannot recover
        logger.error("engine step failed; failing %d request(s)", len(victims), exc_info=exc)
        error = EngineStepError(f"the engine step failed: {type(exc).__name__}: {exc}")
        try:
            with self.lock:
                if victims or pending_aborts:
                    self.engine.abort_request(victims + pending_aborts)
                self._has_work = self.engine.has_unfinished_requests()
                self.stats = dict(self.engine.get_stats())
            if self._has_work and not named:
                raise RuntimeError("requests remain in the engine after aborting them all")
        except Exception:
            logger.exception("could not abort the failed requests; the engine is dead")
            self._die(exc)
            return
        self._fail(victims, error)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        now = time.perf_counter()
        for rid in request_ids:
            with self._cv:
                tracked = self._requests.pop(rid, None)
            if tracked is None:
                continue
            if self.observer is not None:
                self.observer.on_finished(now - tracked.arrival, "error")
            tracked.loop.call_soon_threadsafe(tracked.queue.put_nowait, error)

    def _die(self, exc: BaseException) -> None:
        error = EngineDeadError(f"the engine died: {type(exc).__name__}: {exc}")
        with self._cv:
            self.dead_error = exc
            adds, self._pending_adds = self._pending_adds, []
            self._stop = True
        for add in adds:
            add.loop.call_soon_threadsafe(_resolve, add.future, error)
        self._fail(list(self._requests), error)
