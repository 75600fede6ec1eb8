"""Tool calling for /v1/chat/completions: the grammar that `tool_choice` "required" or a named
function imposes, and the parsers that find tool calls in a model's text (`--tool-call-parser`).

- `tool_choice_constraint(tools, tool_choice, parallel)`: "required" constrains the output to a
  JSON array of calls `[{"name": ..., "parameters": {...}}]` (one of the tools each, their
  parameters' schemas), a named function to that function's parameters object; "auto" and
  "none" constrain nothing (the call's JSON comes compact: no free whitespace to wander in).
  With a constraint the output *is* the call(s): `forced_calls` reads
  them without a parser, so they hold even for a model that never learnt the tool format.
- Parsers (`TOOL_PARSERS`): hermes, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks; granite, `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`. `ToolCallStream`
  turns a growing text into content deltas and tool-call deltas for streaming, holding back
  any text that may be the start of a tool call.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from krait.sampling_params import StructuredOutputsParams


@dataclass
class ParsedCall:
    """One tool call: the function's name and its arguments as a JSON string."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")


# ---------------------------------------------------------------- tool_choice -> grammar


def _functions(tools: list[dict]) -> dict[str, dict]:
    """{name: parameters schema} of the request's tools (OpenAI's {"type": "function",
    "function": {...}} shape); ValueError naming `tools` otherwise."""
    out: dict[str, dict] = {}
    for t in tools:
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(
                fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError("tools: each tool must be {'type': 'function', 'function': "
                             "{'name': ..., 'parameters': {...}}}")
        params = fn.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise ValueError(f"tools: the parameters of {fn['name']!r} must be a JSON schema")
        out[fn["name"]] = params
    return out


def named_choice(tool_choice: Any) -> str | None:
    """The function a tool_choice names ({"type": "function", "function": {"name": X}})."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(
                fn.get("name"), str):
            raise ValueError("tool_choice: a named choice is {'type': 'function', 'function': "
                             "{'name': ...}}")
        return fn["name"]
    return None


def tool_choice_constraint(tools: list[dict], tool_choice: Any,
                           parallel: bool = True) -> StructuredOutputsParams | None:
    """The constraint `tool_choice` puts on the output (None for "auto" and "none")."""
    functions = _functions(tools)
    name = named_choice(tool_choice)
    if name is not None:
        if name not in functions:
            raise ValueError(f"tool_choice: no tool named {name!r} in tools")
        return StructuredOutputsParams(json=functions[name], disable_any_whitespace=True)
    if tool_choice == "required":
        one_of = [{"type": "object",
                   "properties": {"name": {"enum": [n]}, "parameters": p},
                   "required": ["name", "parameters"]} for n, p in functions.items()]
        items = one_of[0] if len(one_of) == 1 else {"anyOf": one_of}
        schema: dict = {"type": "array", "items": items, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema, disable_any_whitespace=True)
    if tool_choice in (None, "auto", "none"):
        return None
    raise ValueError(f"tool_choice: must be 'none', 'auto', 'required' or a named function, "
                     f"got {tool_choice!r}")


def _complete_items(text: str) -> list[Any]:
    """The complete items of a JSON array cut short (`[{...}, {...}, {"na`)."""
    dec, items, at = json.JSONDecoder(), [], text.find("[") + 1
    while at > 0:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        try:
            item, at = dec.raw_decode(text, at)
        except ValueError:
            break
        items.append(item)
    return items


def forced_calls(text: str, tool_choice: Any) -> list[ParsedCall]:
    """The calls of an output constrained by `tool_choice_constraint`: for "required", every
    complete call even of an array cut short by max_tokens; [] if nothing parses."""
    name = named_choice(tool_choice)
    try:
        value = json.loads(text)
    except ValueError:
        if name is not None:
            return []
        value = _complete_items(text)
    if name is not None:
        return [ParsedCall(name, json.dumps(value))]
    if not isinstance(value, list):
        return []
    return [ParsedCall(c["name"], json.dumps(c.get("parameters", {})))
            for c in value if isinstance(c, dict) and isinstance(c.get("name"), str)]


# ---------------------------------------------------------------- parsers


class ToolParser:
    """Finds tool calls in a finished text. `start` marks where tool calls begin."""

    name = ""
    start = ""

    def parse(self, text: str) -> tuple[str | None, list[ParsedCall]] | None:
        """(content before the calls, calls), or None when `text` holds no complete calls."""
        raise NotImplementedError

    @staticmethod
    def _call(obj: Any) -> ParsedCall | None:
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        return ParsedCall(obj["name"], args if isinstance(args, str) else json.dumps(args))


class HermesToolParser(ToolParser):
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks."""

    name = "hermes"
    start = "<tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def parse(self, text):
        if self.start not in text:
            return None
        calls = []
        for m in self._block.finditer(text):
            try:
                call = self._call(json.loads(m.group(1)))
            except ValueError:
                call = None
            if call is None:
                return None
            calls.append(call)
        if not calls:
            return None
        content = text[: text.index(self.start)].strip()
        return content or None, calls


class GraniteToolParser(ToolParser):
    """Granite 3: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`."""

    name = "granite"
    start = "<|tool_call|>"

    def parse(self, text):
        if self.start not in text:
            return None
        head, _, body = text.partition(self.start)
        try:
            value, _ = json.JSONDecoder().raw_decode(body.strip())
        except ValueError:
            return None
        items = value if isinstance(value, list) else [value]
        calls = [self._call(v) for v in items]
        if not calls or any(c is None for c in calls):
            return None
        return head.strip() or None, calls


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, GraniteToolParser)
}


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: unknown parser {name!r} "
                         f"(known: {', '.join(TOOL_PARSERS)})")
    return TOOL_PARSERS[name]()


# ---------------------------------------------------------------- streaming


class ToolCallStream:
    """One streamed choice: `feed(text so far)` -> (the content to send now, the calls completed
    since the last feed, each with its index); `finish(text)` the same for the finished text.
    Content that may begin a tool call is held back; each call goes out whole in one delta as
    soon as it is complete (a hermes block closed, an item of a "required" array closed; a
    granite list or a named call when the choice finishes)."""

    def __init__(self, parser: ToolParser | None, tool_choice: Any = None,
                 forced: bool = False) -> None:
        self.parser, self.tool_choice, self.forced = parser, tool_choice, forced
        self.sent = 0  # characters of the text sent as content
        self.num_calls = 0  # calls sent

    def _safe_end(self, text: str) -> int:
        """How much of `text` is surely content."""
        if self.forced:
            return 0
        if self.parser is None:
            return len(text)
        marker = self.parser.start
        at = text.find(marker)
        if at >= 0:
            return at
        for k in range(min(len(marker) - 1, len(text)), 0, -1):  # a marker's partial start
            if text.endswith(marker[:k]):
                return len(text) - k
        return len(text)

    def _new_calls(self, text: str) -> list[tuple[int, ParsedCall]]:
        if self.forced or (self.parser is not None and self.parser.start in text):
            calls = parse_calls(text, self.parser, self.tool_choice, self.forced)[1]
        else:
            calls = []
        new = list(enumerate(calls))[self.num_calls:]
        self.num_calls = max(self.num_calls, len(calls))
        return new

    def feed(self, text: str) -> tuple[str, list[tuple[int, ParsedCall]]]:
        end = max(self._safe_end(text), self.sent)
        delta, self.sent = text[self.sent:end], end
        return delta, self._new_calls(text)

    def finish(self, text: str) -> tuple[str, list[tuple[int, ParsedCall]]]:
        new = self._new_calls(text)
        if self.num_calls:
            rest = "" if self.forced else text[self.sent:max(self._safe_end(text), self.sent)]
        else:
            rest = text[self.sent:]  # no call after all: everything held back is content
        self.sent = len(text)
        return rest, new


def parse_calls(text: str, parser: ToolParser | None, tool_choice: Any,
                forced: bool) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished output: forced calls read directly, otherwise through the
    parser (no parser, or nothing found: all content)."""
    if forced:
        calls = forced_calls(text, tool_choice)
        return (None if calls else text), calls
    if parser is not None:
        found = parser.parse(text)
        if found is not None:
            return found
    return text, []
