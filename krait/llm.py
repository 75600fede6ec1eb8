"""Offline batch generation: LLM(model=...).generate(prompts, sampling_params)."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from tqdm import tqdm

from krait.config import EngineConfig
from krait.engine.engine import LLMEngine
from krait.outputs import RequestOutput
from krait.sampling_params import SamplingParams

PromptType = str | dict


class LLM:
    """Offline engine: every option of DESIGN.md's public API is a keyword here."""

    def __init__(self, model: str, **engine_options) -> None:
        self.llm_engine = LLMEngine.from_config(EngineConfig.from_kwargs(model=model, **engine_options))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict] | None = None,
    ) -> list[RequestOutput]:
        """Generates replies to one conversation (a list of {"role", "content"} messages) or to
        several, each rendered by the tokenizer's chat template (with `tools`, OpenAI-style
        function definitions, for templates that render them; constrain the reply with
        SamplingParams.structured_outputs to force a call)."""
        tok = self.get_tokenizer()
        if tok is None:
            raise ValueError("messages: this model has no tokenizer to render a chat template")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = []
        for conv in conversations:
            try:
                ids = tok.apply_chat_template(
                    conv, add_generation_prompt=add_generation_prompt, tokenize=True,
                    chat_template=chat_template, **({"tools": tools} if tools else {}),
                )
            except ValueError as e:  # e.g. no chat template
                raise ValueError(f"messages: {e}") from e
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Runs all prompts to completion; outputs come back in the prompts' order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        else:
            params_list = list(sampling_params)
            if len(params_list) != len(prompts):
                raise ValueError("sampling_params: need one per prompt, or a single one")
        params_list = [dataclasses.replace(p, output_kind="final_only") for p in params_list]
        engine = self.llm_engine
        ids = []
        try:
            for prompt, params in zip(prompts, params_list):
                rid = str(next(self._ids))
                engine.add_request(rid, prompt, params)
                ids.append(rid)
        except ValueError:
            engine.abort_request(ids)
            raise
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", disable=not use_tqdm)
        pending = set(ids)
        while pending:
            for out in engine.step():
                if out.finished and out.request_id in pending:
                    results[out.request_id] = out
                    pending.discard(out.request_id)
                    bar.update(1)
        bar.close()
        return [results[r] for r in ids]
