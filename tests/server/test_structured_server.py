"""Structured outputs and tool calling through `krait serve` and the official openai client,
over a tiny random model (its unconstrained text is noise): response_format and vLLM's guided
fields on both endpoints, streamed and not; `chat.completions.parse` with a pydantic model;
tool_choice "required" and named functions always yield parseable calls; bad constraints
are 400s."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from typing import Literal

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("xgrammar")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
jsonschema = pytest.importorskip("jsonschema")
from pydantic import BaseModel, Field  # noqa: E402

from tests.server.test_api_server import (  # noqa: E402
    ROOT,
    _free_port,
    post,
    stop_server,
    wait_healthy,
)
from tests.utils import make_tiny_llama  # noqa: E402

# the demo template, with the tools rendered in a system turn when a request has them
TOOLS_TEMPLATE = (
    "<|bos|>{% if tools %}<|system|>\nTools: {{ tools | tojson }}<|eos|>\n{% endif %}"
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|eos|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "unit": {"enum": ["C", "F"]}}, "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 9},
        "b": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["a", "b"]}}}
TOOLS = [WEATHER, ADD]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# label: ASCII by pattern. With maxLength alone, xgrammar lets a random model sample byte
# tokens that form an overlong 4-byte UTF-8 sequence (F0 84 AA B2: one "character" to the
# grammar, four replacement characters once decoded), which then fails maxLength 4
SCHEMA = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 99},
    "label": {"type": "string", "pattern": "^[a-z ]{0,4}$"}, "ok": {"type": "boolean"}},
    "required": ["id", "label", "ok"]}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from transformers import AutoTokenizer

    model_dir = make_tiny_llama(tmp_path_factory.mktemp("tiny_tools"), max_position_embeddings=2048)
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.chat_template = TOOLS_TEMPLATE
    tok.save_pretrained(model_dir)
    port = _free_port()
    log = tmp_path_factory.mktemp("server_log") / "server.log"
    cmd = [sys.executable, "-m", "krait", "serve", model_dir, "--port", str(port),
           "--served-model-name", "tiny", "--max-num-seqs", "64", "--max-model-len", "2048",
           "--enable-auto-tool-choice", "--tool-call-parser", "hermes"]
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                                env=dict(os.environ))
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, base, log)
        yield base
    finally:
        stop_server(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0, timeout=120)


def _json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def test_response_format_on_both_endpoints(server):
    """24 concurrent requests: json_schema on chat and completions, temperature 1 and 0."""
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="x", max_retries=0,
                                     timeout=120)
        try:
            chats = [aclient.chat.completions.create(
                model="tiny", messages=MESSAGES, max_tokens=80, seed=i, temperature=i % 2,
                response_format=_json_schema_format(SCHEMA)) for i in range(12)]
            comps = [aclient.completions.create(
                model="tiny", prompt=f"record {i}:", max_tokens=80, seed=i, temperature=i % 2,
                extra_body={"response_format": _json_schema_format(SCHEMA)}) for i in range(12)]
            return await asyncio.gather(*chats, *comps)
        finally:
            await aclient.close()

    results = asyncio.run(main())
    texts = [r.choices[0].message.content for r in results[:12]]
    texts += [r.choices[0].text for r in results[12:]]
    for r, text in zip(results, texts):
        assert r.choices[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)


def test_guided_fields_streamed_and_not(client):
    cases = [
        ({"guided_regex": r"[a-c]{2,4}-\d\d"}, lambda t: re.fullmatch(r"[a-c]{2,4}-\d\d", t)),
        ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
        ({"guided_grammar": 'root ::= "<" [0-9] ">"'}, lambda t: re.fullmatch(r"<\d>", t)),
        ({"guided_json": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
        ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
        ({"response_format": {"type": "json_object"}, "structured_outputs": None},
         lambda t: t.startswith("{")),
    ]
    for extra, check in cases:
        full = client.completions.create(model="tiny", prompt="go", max_tokens=80,
                                         temperature=0.0, extra_body=extra)
        assert check(full.choices[0].text), (extra, full.choices[0].text)
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES,
                                                max_tokens=80, temperature=0.0, stream=True,
                                                extra_body=extra)
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert check(text), (extra, text)
        if "json_object" not in str(extra):
            assert chunks[-1].choices[0].finish_reason == "stop"
        streamed = client.completions.create(model="tiny", prompt="go", max_tokens=80,
                                             temperature=0.0, stream=True, extra_body=extra)
        assert "".join(c.choices[0].text for c in streamed if c.choices) == full.choices[0].text


class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    celsius: int = Field(ge=-9, le=40)
    sunny: bool


def test_parse_with_a_pydantic_model(client):
    for seed in range(3):
        resp = client.chat.completions.parse(model="tiny", messages=MESSAGES, max_tokens=80,
                                             seed=seed, response_format=Weather)
        parsed = resp.choices[0].message.parsed
        assert isinstance(parsed, Weather), resp.choices[0].message.content


@pytest.mark.parametrize("body, param, fragment", [
    ({"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format", "objectx"),
    ({"guided_regex": "a(b"}, "guided_regex", "parenthesis"),
    ({"guided_grammar": "root ::= nothing"}, "guided_grammar", "nothing"),
    ({"guided_choice": []}, "guided_choice", "choice"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_json", "at most one"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
])
def test_bad_constraints_are_400(server, body, param, fragment):
    for path, base in (("/v1/completions", {"prompt": "hi"}),
                       ("/v1/chat/completions", {"messages": MESSAGES})):
        r = post(server, path, {"model": "tiny", "max_tokens": 4, **base, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and fragment in err["message"], err


def _check_calls(calls, names=PARAMS):
    assert calls
    for call in calls:
        assert call.type == "function" and call.function.name in names and call.id
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_tool_choice_required(client):
    for seed in range(4):
        # one call; or parallel calls, which a random model may go on adding until max_tokens
        # cuts the array short: its complete calls still come back
        kw = dict(parallel_tool_calls=False) if seed % 2 else {}
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                              tool_choice="required", temperature=1.0,
                                              seed=seed, max_tokens=80, **kw)
        choice = resp.choices[0]
        assert choice.finish_reason in ("tool_calls", "length"), choice.message
        _check_calls(choice.message.tool_calls)
        assert choice.message.content is None
        if seed % 2:
            assert choice.finish_reason == "tool_calls"
            assert len(choice.message.tool_calls) == 1
        stream = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                                tool_choice="required", temperature=1.0,
                                                seed=seed, stream=True, max_tokens=80,
                                                **kw)
        calls: dict[int, dict] = {}
        finish = None
        for chunk in stream:
            for tc in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            finish = chunk.choices[0].finish_reason or finish
        assert finish == choice.finish_reason
        got = [(c["name"], c["arguments"]) for _, c in sorted(calls.items())]
        assert got == [(c.function.name, c.function.arguments) for c in
                       choice.message.tool_calls]  # same seed: the same calls, streamed


def test_named_tool_choice(client):
    resp = client.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=TOOLS, max_tokens=80, temperature=1.0, seed=3,
        tool_choice={"type": "function", "function": {"name": "add"}})
    choice = resp.choices[0]
    assert choice.finish_reason == "stop"
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    _check_calls(choice.message.tool_calls, names={"add"})


def test_tools_rendered_auto_and_none(server, client):
    plain = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4,
                                           temperature=0.0)
    for choice in ("auto", "none"):
        resp = client.chat.completions.create(model="tiny", messages=MESSAGES, tools=TOOLS,
                                              tool_choice=choice, max_tokens=4,
                                              temperature=0.0)
        assert resp.usage.prompt_tokens > plain.usage.prompt_tokens + 20  # the tools rendered
        assert resp.choices[0].message.content is not None
    r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": MESSAGES,
                                              "tools": TOOLS, "tool_choice": {
                                                  "type": "function",
                                                  "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def test_auto_tool_choice_parses_hermes_calls(client):
    """tool_choice "auto" with the hermes parser: a regex makes the random model write a hermes
    block after some text; it comes back as content + tool_calls, streamed and not."""
    regex = (r'[a-z]{1,3} <tool_call>\{"name": "add", "arguments": \{"a": [0-9], '
             r'"b": [0-9]\}\}</tool_call>')
    kw = dict(model="tiny", messages=MESSAGES, tools=TOOLS, tool_choice="auto", max_tokens=80,
              temperature=1.0, seed=1, extra_body={"guided_regex": regex})
    choice = client.chat.completions.create(**kw).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert re.fullmatch("[a-z]{1,3}", choice.message.content)
    _check_calls(choice.message.tool_calls, names={"add"})
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**kw, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            calls[tc.index] = (tc.function.name, tc.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and content == choice.message.content + " "
    assert list(calls.values()) == [(c.function.name, c.function.arguments)
                                    for c in choice.message.tool_calls]
