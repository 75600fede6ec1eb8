"""StructuredOutputManager: compiles grammars off the engine loop and fills the step's masks.

- `submit(req)` starts (or finds in the cache) the compile of the request's (kind, spec) on a
  small thread pool; the request waits in the scheduler (`Request.waiting_for_grammar`) until
  `poll()` sees its compile done and gives it a `RequestGrammar`. A compile that fails, or takes
  longer than `compile_timeout_s`, is returned by `poll()` so the engine finishes that request
  with an error; other requests never wait for it.
- `fill_bitmask(reqs)` writes each structured row's allowed-token mask (int32, packed) for the
  step just scheduled; the runner applies it on the device (krait/ops/token_bitmask.py).

Nothing here runs for a batch without structured rows.
"""

from __future__ import annotations

import concurrent.futures as cf
import logging
import time
from collections import OrderedDict
from typing import Any

import torch

from krait.engine.request import Request
from krait.structured.grammar import (
    RequestGrammar,
    bitmask_words,
    build_grammar,
    load_xgrammar,
    tokenizer_info,
)

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 60.0  # a grammar not compiled by then fails its request
_CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped
_BATCH_FILL_ROWS = 16  # from this many structured rows a step, masks are filled in parallel


class StructuredOutputManager:
    """Grammar compilation and per-step masks for one engine (built on first use)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int],
                 max_workers: int = 2, compile_timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = list(stop_token_ids)
        self.compile_timeout_s = compile_timeout_s
        self.words = bitmask_words(vocab_size)
        self._max_workers = max_workers
        self._pool: cf.ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._cache: OrderedDict[tuple[str, str], cf.Future] = OrderedDict()
        self._pending: dict[str, tuple[Request, cf.Future, float]] = {}
        self._batch: Any = None  # xgrammar BatchGrammarMatcher, for steps of many rows

    # -- compilation ------------------------------------------------------------------
    def check_ready(self) -> None:
        """Raises ValueError (naming structured_outputs) when grammars cannot be built here:
        no xgrammar, or a model without a tokenizer."""
        self._ensure_compiler()

    def _ensure_compiler(self) -> None:
        if self._compiler is not None:
            return
        if self.tokenizer is None:
            raise ValueError("structured_outputs: this model has no tokenizer to build the "
                             "grammar's vocabulary from")
        xgr = load_xgrammar()
        info = tokenizer_info(self.tokenizer, self.vocab_size, self.stop_token_ids)
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self._pool = cf.ThreadPoolExecutor(self._max_workers, thread_name_prefix="krait-grammar")

    def compile(self, kind: str, spec: str) -> Any:
        """Compiles one constraint (runs on a pool thread); raises ValueError when invalid."""
        return self._compiler.compile_grammar(build_grammar(kind, spec))

    def submit(self, req: Request) -> None:
        """Starts compiling the request's grammar (a cached compile is shared)."""
        self._ensure_compiler()
        key = req.params.structured_outputs.key()
        fut = self._cache.get(key)
        if fut is None or (fut.done() and fut.exception() is not None):
            fut = self._pool.submit(self.compile, *key)
            self._cache[key] = fut
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        self._pending[req.request_id] = (req, fut, time.monotonic())

    def has_pending(self) -> bool:
        return bool(self._pending)

    def poll(self) -> list[tuple[Request, str]]:
        """Gives every request whose compile finished its matcher; returns the requests whose
        compile failed or timed out, with the reason (they stay waiting in the scheduler until
        the engine finishes them)."""
        failed: list[tuple[Request, str]] = []
        if not self._pending:
            return failed
        now = time.monotonic()
        for rid, (req, fut, since) in list(self._pending.items()):
            if not fut.done():
                if now - since > self.compile_timeout_s:
                    del self._pending[rid]
                    failed.append((req, "structured_outputs: the grammar did not compile within "
                                        f"{self.compile_timeout_s:.0f} s"))
                continue
            del self._pending[rid]
            exc = fut.exception()
            if exc is not None:
                why = str(exc) if isinstance(exc, ValueError) else (
                    f"structured_outputs: the grammar failed to compile ({type(exc).__name__}: "
                    f"{exc})")
                failed.append((req, why))
                continue
            req.grammar = RequestGrammar(fut.result())
        return failed

    def wait(self, timeout: float) -> None:
        """Blocks up to `timeout` s until some pending compile finishes (an engine with nothing
        else to do)."""
        futures = [f for _, f, _ in self._pending.values()]
        if futures:
            cf.wait(futures, timeout=timeout, return_when=cf.FIRST_COMPLETED)

    def discard(self, request_id: str) -> None:
        """Forget a request (aborted while its grammar compiles)."""
        self._pending.pop(request_id, None)

    # -- masks ------------------------------------------------------------------------
    def fill_bitmask(self, reqs: list[Request], drafts: list[list[int]] | None = None
                     ) -> torch.Tensor:
        """int32 [rows, words] (CPU): the tokens each request's grammar allows next; with
        `drafts` (the drafts each verifies, cut to what its grammar allows), 1 + len(drafts[s])
        consecutive rows for reqs[s], the mask after each run of its drafts."""
        if drafts is not None and any(drafts):
            bitmask = torch.empty(len(reqs) + sum(map(len, drafts)), self.words,
                                  dtype=torch.int32)
            row = 0
            for req, d in zip(reqs, drafts):
                req.grammar.fill_along(bitmask, row, d)
                row += 1 + len(d)
            return bitmask
        bitmask = torch.empty(len(reqs), self.words, dtype=torch.int32)
        if len(reqs) < _BATCH_FILL_ROWS:
            for s, req in enumerate(reqs):
                req.grammar.fill(bitmask, s)
            return bitmask
        if self._batch is None:  # xgrammar's threads fill many rows at once
            self._batch = load_xgrammar().BatchGrammarMatcher()
        self._batch.batch_fill_next_token_bitmask([r.grammar.matcher for r in reqs], bitmask)
        return bitmask

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
