"""`krait serve` end to end: a real server in a subprocess over a tiny random Llama, driven with
the official openai client (and httpx for what the client cannot send)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from tests.utils import make_tiny_llama  # noqa: E402

API_KEY = "test-key"
MAX_MODEL_LEN = 4096  # long enough that an unaborted request would outlive the abort tests
ROOT = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_server(proc: subprocess.Popen) -> None:
    """Terminates a `krait serve` process, killing it if it does not exit within 10 s."""
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_healthy(proc: subprocess.Popen, base: str, log: Path, limit: float = 180) -> None:
    """Waits for a started server's /health; fails with its log if it exits or stays unhealthy
    (imports alone take ~10 s)."""
    deadline = time.monotonic() + limit
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"server not healthy within {limit:.0f} s:\n{log.read_text()}")
        try:
            if httpx.get(f"{base}/health", timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(base url, model dir) of a running server; its log is printed if it fails to start."""
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"),
                                max_position_embeddings=MAX_MODEL_LEN)
    port = _free_port()
    log = tmp_path_factory.mktemp("server_log") / "server.log"
    cmd = [sys.executable, "-m", "krait", "serve", model_dir, "--port", str(port),
           "--api-key", API_KEY, "--served-model-name", "tiny", "--max-num-seqs", "64"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log)
        yield base, model_dir
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def metric(base: str, name: str) -> float:
    """The sum of a Prometheus series `name` (with any labels) on /metrics."""
    text = httpx.get(f"{base}/metrics").text
    values = [float(m.group(1))
              for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    assert values, f"{name} missing from /metrics"
    return sum(values)


def post(base: str, path: str, body, timeout: float = 60.0) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    if isinstance(body, (bytes, str)):
        return httpx.post(base + path, content=body, headers=headers, timeout=timeout)
    return httpx.post(base + path, json=body, headers=headers, timeout=timeout)


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{server[0]}/health").status_code == 200


def test_greedy_completion_matches_llm_generate(server, client):
    from krait import LLM, SamplingParams

    prompts = ["Hello, my name is", [5, 17, 99, 3]]
    llm = LLM(server[1])
    expected = llm.generate(
        [p if isinstance(p, str) else {"prompt_token_ids": p} for p in prompts],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    for prompt, exp in zip(prompts, expected):
        resp = client.completions.create(model="tiny", prompt=prompt, max_tokens=12,
                                         temperature=0.0, extra_body={"ignore_eos": True})
        assert resp.object == "text_completion" and resp.id.startswith("cmpl-")
        assert resp.choices[0].text == exp.outputs[0].text
        assert resp.choices[0].finish_reason == "length"
        assert resp.usage.prompt_tokens == len(exp.prompt_token_ids)
        assert resp.usage.completion_tokens == 12
        assert resp.usage.total_tokens == 12 + len(exp.prompt_token_ids)

    stream = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=12,
                                       temperature=0.0, stream=True,
                                       stream_options={"include_usage": True},
                                       extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected[0].outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


def test_completion_batch_n_echo_logprobs(client):
    resp = client.completions.create(model="tiny", prompt=[[7, 8, 9], [10, 11]], n=2,
                                     max_tokens=4, temperature=1.0, seed=3, logprobs=2,
                                     echo=True, extra_body={"ignore_eos": True, "top_k": 20})
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert resp.usage.prompt_tokens == 5 and resp.usage.completion_tokens == 16
    for c in resp.choices:
        lp = c.logprobs
        n_prompt = 3 if c.index < 2 else 2
        assert len(lp.tokens) == n_prompt + 4
        # as OpenAI does: the echoed prompt's first token has none, the others have theirs
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(x is not None and x <= 0.0 for x in lp.token_logprobs[1:])
        assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[1:n_prompt])
        assert all(1 <= len(t) <= 3 for t in lp.top_logprobs[n_prompt:])
        assert c.text.startswith("".join(lp.tokens[:n_prompt]))


def test_chat_completion(server, client):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Say hi."}]
    resp = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                          max_completion_tokens=6, logprobs=True,
                                          top_logprobs=2, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    choice = resp.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    rendered = post(server[0], "/tokenize", {"messages": messages}).json()
    assert resp.usage.prompt_tokens == rendered["count"] and resp.usage.completion_tokens == 6

    stream = client.chat.completions.create(model="tiny", messages=messages, temperature=0.0,
                                            max_tokens=6, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage.total_tokens == resp.usage.total_tokens


def test_tokenize_detokenize(server):
    tok = post(server[0], "/tokenize", {"prompt": "Hello world"}).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] == MAX_MODEL_LEN
    detok = post(server[0], "/detokenize", {"tokens": tok["tokens"]}).json()
    assert detok["prompt"].endswith("Hello world")


def test_concurrent_streams_all_finish(server):
    async def one(aclient, i: int) -> tuple[int, str | None]:
        stream = await aclient.completions.create(
            model="tiny", prompt=[3 + i, 40 + i], max_tokens=8, temperature=0.8, seed=i,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        reason, usage = None, 0
        async for chunk in stream:
            if chunk.choices:
                reason = chunk.choices[0].finish_reason or reason
            if chunk.usage:
                usage = chunk.usage.completion_tokens
        return usage, reason

    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server[0]}/v1", api_key=API_KEY,
                                     max_retries=0, timeout=60)
        try:
            return await asyncio.gather(*(one(aclient, i) for i in range(32)))
        finally:
            await aclient.close()

    assert asyncio.run(main()) == [(8, "length")] * 32


@pytest.mark.parametrize("body, param, fragment", [
    ({"prompt": "hi", "temperature": -1.0}, "temperature", "temperature"),
    ({"prompt": "hi", "top_p": 1.5}, "top_p", "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens", "max_tokens"),
    ({"prompt": "hi", "n": "many"}, "n", "integer"),
    ({"prompt": [1, 2, 100000]}, "prompt_token_ids", "vocabulary"),
    ({"prompt": [5] * (MAX_MODEL_LEN + 10)}, "prompt", "max_model_len"),
    ({"prompt": []}, "prompt", "empty"),
    ({"max_tokens": 3}, "prompt", "required"),
    ({"prompt": "hi", "logprobs": 21}, "logprobs", "logprobs"),
])
def test_bad_requests_get_400(server, body, param, fragment):
    r = post(server[0], "/v1/completions", dict({"model": "tiny"}, **body))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "BadRequestError" and err["code"] == 400
    assert err["param"] == param and fragment in err["message"]


def test_error_cases_through_the_client(server, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="hi", temperature=-2.0)
    assert e.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt="hi")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    r = post(server[0], "/v1/chat/completions", b'{"model": "tiny", "messages": [')
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    assert httpx.get(f"{server[0]}/health").status_code == 200


def test_api_key(server):
    base = server[0]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.get(f"{base}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == 401
    bad = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert httpx.get(f"{base}/health").status_code == 200  # outside /v1: open


def _wait_for(fn, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if fn():
            return True
        time.sleep(0.05)
    return False


def test_client_disconnect_aborts(server):
    base = server[0]
    before = _abort_count(base)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": MAX_MODEL_LEN - 8,
            "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=headers,
                      timeout=60) as r:
        lines = r.iter_lines()  # held: dropping the iterator would close the connection
        assert next(lines).startswith("data: ")
        assert _wait_for(lambda: metric(base, "krait:num_requests_running") == 1)
        assert _abort_count(base) == before
    assert _wait_for(lambda: metric(base, "krait:num_requests_running") == 0)
    assert _wait_for(lambda: _abort_count(base) == before + 1)

    # a non-streaming request whose client gives up is aborted too
    with pytest.raises(httpx.ReadTimeout):
        post(base, "/v1/completions", dict(body, stream=False), timeout=1.0)
    assert _wait_for(lambda: _abort_count(base) == before + 2)
    assert _wait_for(lambda: metric(base, "krait:num_requests_running") == 0)


def _abort_count(base: str) -> float:
    text = httpx.get(f"{base}/metrics").text
    m = re.search(r'^krait:request_success_total{[^}]*finished_reason="abort"[^}]*} (\S+)$',
                  text, re.M)
    assert m, text
    return float(m.group(1))


def test_metrics_exposed(server, client):
    client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    text = httpx.get(f"{server[0]}/metrics").text
    for name in ("krait:num_requests_running", "krait:num_requests_waiting",
                 "krait:kv_cache_usage_perc", "krait:prompt_tokens_total",
                 "krait:generation_tokens_total", "krait:time_to_first_token_seconds_bucket",
                 "krait:inter_token_latency_seconds_bucket",
                 "krait:e2e_request_latency_seconds_count"):
        assert name in text, name
    assert metric(server[0], "krait:generation_tokens_total") >= 3
    assert metric(server[0], "krait:time_to_first_token_seconds_count") >= 1


def test_bench_serve(server, capsys):
    from krait.bench import serve

    args = Namespace(base_url=server[0], model=None, api_key=API_KEY, num_prompts=6,
                     request_rate=50.0, max_concurrency=4, input_len=16, output_len=4, seed=0)
    assert serve.main(args) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert result["completed"] == 6 and result["failed"] == 0
    assert result["total_output_tokens"] == 24 and result["total_input_tokens"] == 96
    assert result["output_throughput"] > 0 and result["mean_ttft_ms"] > 0
    assert "median_itl_ms" in result and "p99_tpot_ms" in result
    assert "krait serving benchmark" in captured.err


def test_logit_bias_and_unsupported_fields(server, client):
    import openai

    resp = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3,
                                     temperature=0.0, logit_bias={"77": 100},
                                     extra_body={"ignore_eos": True})
    want = post(server[0], "/detokenize", {"tokens": [77, 77, 77]}).json()["prompt"]
    assert resp.choices[0].text == want
    # structured outputs work (tests/server/test_structured_server.py); malformed ones and
    # tools on /v1/completions are refused
    for extra in ({"guided_regex": "(unclosed"}, {"response_format": {"type": "bogus"}},
                  {"tools": [{"type": "function", "function": {"name": "f"}}]}):
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body=extra)


def test_continuous_usage_stats(client):
    stream = client.completions.create(
        model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0.0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    chunks = list(stream)
    with_choices = [c for c in chunks if c.choices]
    assert with_choices and all(c.usage is not None for c in with_choices)
    assert with_choices[-1].usage.completion_tokens == 4 and chunks[-1].usage.total_tokens == 7
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=3, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
        extra_body={"ignore_eos": True})
    chat_chunks = list(chat)
    assert chat_chunks[-1].usage.completion_tokens == 3
    assert any(c.usage is not None for c in chat_chunks if c.choices)
