"""Tool-call parsing and tool_choice grammars (krait/server/tool_calls.py), without a server:
hermes and granite texts, streamed text held back at a marker, forced calls read directly
(also from an array cut short), and the schemas tool_choice imposes."""

import json

import pytest

from krait.server.tool_calls import (
    ToolCallStream,
    forced_calls,
    get_tool_parser,
    parse_calls,
    tool_choice_constraint,
)

TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {
    "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}},
    {"type": "function", "function": {"name": "g"}}]


def test_hermes():
    p = get_tool_parser("hermes")
    text = ('Let me look.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
            '<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    content, calls = p.parse(text)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("f", {"x": 1}), ("g", {})]
    assert p.parse("no calls here") is None
    assert p.parse('<tool_call>{"name": broken</tool_call>') is None
    assert parse_calls("plain text", p, "auto", False) == ("plain text", [])


def test_granite():
    p = get_tool_parser("granite")
    content, calls = p.parse('<|tool_call|>[{"name": "f", "arguments": {"x": 2}}, '
                             '{"name": "g", "arguments": {}}]')
    assert content is None and [c.name for c in calls] == ["f", "g"]
    assert json.loads(calls[0].arguments) == {"x": 2}
    assert p.parse("<|tool_call|>[{") is None
    with pytest.raises(ValueError, match="--tool-call-parser"):
        get_tool_parser("nope")


def test_stream_holds_back_a_marker_and_sends_calls_as_they_close():
    s = ToolCallStream(get_tool_parser("hermes"))
    assert s.feed("Hi <tool") == ("Hi ", [])  # "<tool" may begin "<tool_call>"
    assert s.feed('Hi <tool_call>{"name"') == ("", [])
    first = 'Hi <tool_call>{"name": "f", "arguments": {"x": 3}}</tool_call>'
    text, calls = s.feed(first)
    assert text == "" and [(j, c.name) for j, c in calls] == [(0, "f")]
    rest, calls = s.finish(first + '\n<tool_call>{"name": "g", "arguments": {}}</tool_call>')
    assert rest == "" and [(j, c.name) for j, c in calls] == [(1, "g")]
    s = ToolCallStream(get_tool_parser("hermes"))
    assert s.feed("a <to") == ("a ", [])
    assert s.finish("a <to be") == ("<to be", [])  # no call after all: the held text is content


def test_forced_calls():
    assert [c.name for c in forced_calls('[{"name": "f", "parameters": {"x": 1}}]',
                                         "required")] == ["f"]
    cut = '[{"name": "f", "parameters": {"x": 1}}, {"name": "g", "param'
    assert [c.name for c in forced_calls(cut, "required")] == ["f"]
    named = {"type": "function", "function": {"name": "f"}}
    (call,) = forced_calls('{"x": 5}', named)
    assert call.name == "f" and json.loads(call.arguments) == {"x": 5}
    assert forced_calls('{"x": ', named) == []
    s = ToolCallStream(None, "required", forced=True)
    assert s.feed('[{"name": "g"') == ("", [])  # forced output is never content
    text, calls = s.feed('[{"name": "g", "parameters": {}}, {"na')
    assert [(j, c.name) for j, c in calls] == [(0, "g")]
    rest, calls = s.finish('[{"name": "g", "parameters": {}}, {"name": "f", "parameters": {}}]')
    assert rest == "" and [(j, c.name) for j, c in calls] == [(1, "f")]


def test_tool_choice_constraints():
    req = tool_choice_constraint(TOOLS, "required")
    schema = req.json
    assert schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    assert [o["properties"]["name"] for o in schema["items"]["anyOf"]] == [
        {"enum": ["f"]}, {"enum": ["g"]}]
    assert tool_choice_constraint(TOOLS, "required", parallel=False).json["maxItems"] == 1
    named = tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "f"}})
    assert named.json == TOOLS[0]["function"]["parameters"]
    assert tool_choice_constraint(TOOLS, "auto") is None
    assert tool_choice_constraint(TOOLS, "none") is None
    with pytest.raises(ValueError, match="tool_choice: no tool named"):
        tool_choice_constraint(TOOLS, {"type": "function", "function": {"name": "h"}})
    with pytest.raises(ValueError, match="tool_choice"):
        tool_choice_constraint(TOOLS, "sometimes")
    with pytest.raises(ValueError, match="tools"):
        tool_choice_constraint([{"type": "function"}], "auto")
