"""Pydantic shapes of the OpenAI-compatible API (requests, responses, stream chunks, errors).

Request fields follow OpenAI's names plus vLLM's sampling extensions (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, ...). Unknown fields are ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_serializer

from krait.sampling_params import MAX_LOGPROBS, SamplingParams, StructuredOutputsParams


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ---------------------------------------------------------------- errors


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


# ---------------------------------------------------------------- models


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "krait"
    root: str | None = None
    max_model_len: int | None = None
    vocab_size: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- requests


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(OpenAIModel):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and its
    # structured_outputs object (one of them at most); tools: chat completions only
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None

    _structured_field: str = PrivateAttr(default="structured_outputs")

    def _refuse_unsupported(self) -> None:
        if self.functions:
            raise ValueError("functions: the legacy functions field is not supported; use tools")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The constraint the body asks for, from whichever one field gives it; ValueError
        naming the field when it is malformed or several are given."""
        given: dict[str, StructuredOutputsParams] = {}
        rf = self.response_format
        if rf is not None:
            kind = rf.get("type", "text") if isinstance(rf, dict) else None
            if kind == "json_object":
                given["response_format"] = StructuredOutputsParams(json_object=True)
            elif kind == "json_schema":
                js = rf.get("json_schema")
                schema = js.get("schema") if isinstance(js, dict) else None
                if not isinstance(schema, (dict, str)):
                    raise ValueError("response_format: json_schema must hold a 'schema' object")
                given["response_format"] = StructuredOutputsParams(json=schema)
            elif kind != "text":
                raise ValueError("response_format: type must be 'text', 'json_object' or "
                                 f"'json_schema', got {kind!r}")
        for name, key in (("guided_json", "json"), ("guided_regex", "regex"),
                          ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                given[name] = StructuredOutputsParams(**{key: value})
        if self.structured_outputs is not None:
            try:
                given["structured_outputs"] = StructuredOutputsParams(**self.structured_outputs)
            except TypeError as e:
                raise ValueError(f"structured_outputs: {e}") from e
        if len(given) > 1:
            raise ValueError(f"{', '.join(given)}: give at most one structured-output field")
        if not given:
            return None
        (name, so), = given.items()
        self._structured_field = name
        try:
            so.validate()
        except ValueError as e:  # name the field the client sent
            raise ValueError(f"{name}: {e}") from e
        return so

    @property
    def structured_field(self) -> str:
        """The body field the request's constraint came from (for error messages)."""
        return self._structured_field

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._refuse_unsupported()
        top_k = self.top_k
        try:
            bias = {int(t): float(b) for t, b in (self.logit_bias or {}).items()} or None
        except ValueError as e:
            raise ValueError(f"logit_bias: keys must be token ids ({e})") from e
        return SamplingParams(
            structured_outputs=self.structured_outputs_params(),
            logit_bias=bias,
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=-1 if top_k is None or top_k == 0 else top_k,
            min_p=self.min_p or 0.0,
            seed=self.seed,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage so far on every streamed chunk (vLLM's stream_options extension)."""
        return self.include_usage and self.stream_options.continuous_usage_stats


PromptInput = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    """POST /v1/completions."""

    prompt: PromptInput
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | dict[str, list[int]]]:
        """The batch of engine prompts: strings, or {"prompt_token_ids": [...]}."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise ValueError("prompt must not be empty")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": list(x)} for x in p]
        raise ValueError("prompt must be a string, a list of strings, token ids, or lists of them")

    def to_sampling_params(self) -> SamplingParams:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of is not supported (must equal n={self.n}), got {self.best_of}")
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools: tool calling is served by /v1/chat/completions only")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        params = self._sampling_params(self.max_tokens, self.logprobs)
        if self.echo and self.logprobs is not None:
            params.prompt_logprobs = self.logprobs  # echoed prompt tokens get theirs too
        return params


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    def for_template(self) -> dict[str, Any]:
        """The message as a chat template expects it: text parts joined into one string."""
        msg = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text":
                    raise ValueError(f"messages: content part type {part.get('type')!r} unsupported")
                texts.append(str(part.get("text", "")))
            msg["content"] = "\n".join(texts)
        elif self.content is None:
            msg["content"] = ""
        calls = msg.get("tool_calls")
        if isinstance(calls, list):  # templates expect the arguments as a mapping
            msg["tool_calls"] = [_call_for_template(c) for c in calls]
        return msg


def _call_for_template(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    fn = dict(call["function"])
    if isinstance(fn.get("arguments"), str):
        try:
            fn["arguments"] = json.loads(fn["arguments"])
        except ValueError:
            pass
    return {**call, "function": fn}


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= MAX_LOGPROBS:
            raise ValueError(
                f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {self.top_logprobs}")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        max_tokens = self.max_completion_tokens
        if max_tokens is None:
            max_tokens = self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


class TokenizeRequest(OpenAIModel):
    """POST /tokenize: a prompt, or chat messages (vLLM's two shapes)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


# ---------------------------------------------------------------- responses


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogProbs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogProbs(OpenAIModel):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str  # a JSON object, as a string


class ToolCall(OpenAIModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(OpenAIModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OpenAIModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(OpenAIModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_nones(self, handler: Any) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatStreamChoice(OpenAIModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class CompletionChunk(OpenAIModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
