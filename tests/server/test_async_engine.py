"""AsyncLLMEngine and the app's failure handling, against a small fake LLMEngine (no model):
errors from add_request, a step that raises, aborts, and the server surviving all of them."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest

from krait.engine.async_engine import AsyncLLMEngine, EngineStepError
from krait.outputs import CompletionOutput, RequestOutput
from krait.sampling_params import SamplingParams


class StepFailure(RuntimeError):
    def __init__(self, msg: str, request_ids: list[str] | None = None) -> None:
        super().__init__(msg)
        if request_ids is not None:
            self.request_ids = request_ids


@dataclass
class _Req:
    prompt: list[int]
    params: SamplingParams
    out: list[int] = field(default_factory=list)


class FakeEngine:
    """LLMEngine's interface; request r's k-th token is (last prompt token + k) % vocab."""

    def __init__(self, vocab: int = 100, step_delay: float = 0.0) -> None:
        self.config = SimpleNamespace(model=SimpleNamespace(model="fake", max_model_len=64,
                                                            vocab_size=vocab))
        self.tokenizer = None
        self.vocab = vocab
        self.step_delay = step_delay
        self.reqs: dict[str, _Req] = {}
        self.aborted: list[str] = []
        self.fail_next: Exception | None = None
        self.add_error: Exception | None = None

    def add_request(self, request_id, prompt, params, arrival_time=None) -> None:
        if self.add_error is not None:
            raise self.add_error
        params.validate(self.vocab)
        if not isinstance(prompt, dict):
            raise ValueError("prompt: this model has no tokenizer; pass prompt_token_ids")
        ids = prompt["prompt_token_ids"]
        if not ids:
            raise ValueError("prompt must not be empty")
        if any(not 0 <= t < self.vocab for t in ids):
            raise ValueError("prompt_token_ids holds a token outside the vocabulary")
        self.reqs[request_id] = _Req(list(ids), params)

    def step(self) -> list[RequestOutput]:
        time.sleep(self.step_delay)
        if self.fail_next is not None:
            exc, self.fail_next = self.fail_next, None
            raise exc
        outs = []
        for rid, r in list(self.reqs.items()):
            r.out.append((r.prompt[-1] + len(r.out) + 1) % self.vocab)
            done = len(r.out) >= r.params.max_tokens
            comp = CompletionOutput(0, " ".join(map(str, r.out)), list(r.out),
                                    finish_reason="length" if done else None)
            outs.append(RequestOutput(rid, None, r.prompt, [comp], finished=done))
            if done:
                del self.reqs[rid]
        return outs

    def abort_request(self, request_id) -> None:
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            if self.reqs.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.reqs)

    def get_stats(self) -> dict:
        return {"num_running": len(self.reqs), "num_waiting": 0, "kv_cache_usage": 0.0}


class Recorder:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.tokens = 0
        self.finished: list[str | None] = []
        self.stats: list[dict] = []

    def on_engine_stats(self, stats):
        self.stats.append(stats)

    def on_first_token(self, ttft, num_prompt_tokens):
        self.ttft.append(ttft)

    def on_tokens(self, n, itl):
        self.tokens += n

    def on_finished(self, e2e, reason):
        self.finished.append(reason)


def ids(*t: int) -> dict:
    return {"prompt_token_ids": list(t)}


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n)


@pytest.fixture
def engine():
    fake = FakeEngine(step_delay=0.002)
    eng = AsyncLLMEngine(fake, observer=Recorder())
    yield eng
    eng.shutdown()


async def collect(eng: AsyncLLMEngine, rid: str, prompt, params) -> list[RequestOutput]:
    return [out async for out in eng.generate(rid, prompt, params)]


def test_generate_streams_cumulative_outputs(engine):
    async def main():
        return await asyncio.gather(collect(engine, "a", ids(5), greedy(4)),
                                    collect(engine, "b", ids(10, 20), greedy(2)))

    a, b = asyncio.run(main())
    assert [o.outputs[0].token_ids for o in a] == [[6], [6, 7], [6, 7, 8], [6, 7, 8, 9]]
    assert [o.finished for o in a] == [False, False, False, True]
    assert b[-1].outputs[0].token_ids == [21, 22] and b[-1].finished
    rec = engine.observer
    assert rec.tokens == 6 and len(rec.ttft) == 2 and sorted(rec.finished) == ["length"] * 2
    assert rec.stats[-1]["num_running"] == 0


def test_add_request_errors_propagate_as_value_error(engine):
    async def main():
        with pytest.raises(ValueError, match="temperature"):
            await engine.add_request("x", ids(1), SamplingParams(temperature=-1.0))
        with pytest.raises(ValueError, match="vocabulary"):
            await engine.add_request("y", ids(1, 500), greedy(2))
        return await collect(engine, "x", ids(1), greedy(2))  # the id is free again

    assert asyncio.run(main())[-1].outputs[0].token_ids == [2, 3]


def test_leaving_a_stream_aborts_the_request(engine):
    async def main():
        gen = engine.generate("long", ids(1), greedy(50))
        first = await gen.__anext__()
        await gen.aclose()
        for _ in range(200):
            if "long" in engine.engine.aborted:
                break
            await asyncio.sleep(0.005)
        return first

    assert asyncio.run(main()).outputs[0].token_ids == [2]
    assert engine.engine.aborted == ["long"]
    assert not engine.engine.has_unfinished_requests()
    assert "abort" in engine.observer.finished


def test_step_failure_fails_only_named_requests(engine):
    async def main():
        sa = await engine.add_request("a", ids(1), greedy(30))
        sb = await engine.add_request("b", ids(2), greedy(30))
        await sa.__anext__()
        engine.engine.fail_next = StepFailure("boom", request_ids=["a"])
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in sa:
                pass
        outs = [o async for o in sb]
        return outs[-1]

    last_b = asyncio.run(main())
    assert last_b.finished and len(last_b.outputs[0].token_ids) == 30
    assert engine.engine.aborted == ["a"]
    assert engine.is_running


def test_unnamed_step_failure_fails_all_and_loop_survives(engine):
    async def main():
        sa = await engine.add_request("a", ids(1), greedy(30))
        sb = await engine.add_request("b", ids(2), greedy(30))
        engine.engine.fail_next = RuntimeError("kernel exploded")
        for s in (sa, sb):
            with pytest.raises(EngineStepError, match="kernel exploded"):
                async for _ in s:
                    pass
        return await collect(engine, "c", ids(3), greedy(3))

    assert asyncio.run(main())[-1].outputs[0].token_ids == [4, 5, 6]
    assert sorted(engine.engine.aborted) == ["a", "b"]
    assert engine.is_running and "error" in engine.observer.finished


def test_server_survives_a_failing_step():
    """Over HTTP: the failed request gets a 500 (or an SSE error event), the next one succeeds."""
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from krait.server.api_server import build_app

    fake = FakeEngine(step_delay=0.001)
    eng = AsyncLLMEngine(fake)
    try:
        client = TestClient(build_app(eng, ["fake"]), raise_server_exceptions=False)
        body = {"model": "fake", "prompt": [3, 4], "max_tokens": 3, "temperature": 0}
        fake.fail_next = RuntimeError("device lost")
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500
        assert r.json()["error"]["type"] == "InternalServerError"
        assert "device lost" in r.json()["error"]["message"]

        fake.fail_next = RuntimeError("device lost again")
        r = client.post("/v1/completions", json=dict(body, stream=True))
        events = [line for line in r.text.split("\n\n") if line]
        assert '"error"' in events[-2] and events[-1] == "data: [DONE]"

        fake.add_error = KeyError("a bug")  # not a ValueError: 500, in the same JSON shape
        r = client.post("/v1/completions", json=body)
        assert r.status_code == 500 and "a bug" in r.json()["error"]["message"]
        fake.add_error = None

        r = client.post("/v1/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == "5 6 7"
        assert client.get("/health").status_code == 200
        r = client.post("/v1/completions", json=dict(body, prompt="text"))
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    finally:
        eng.shutdown()
