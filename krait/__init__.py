"""krait: a fast, compact inference engine for hybrid state-space/attention language models."""

from __future__ import annotations

from typing import TYPE_CHECKING

from krait.outputs import CompletionOutput, RequestOutput
from krait.sampling_params import SamplingParams, StructuredOutputsParams

if TYPE_CHECKING:  # what the lazy names below are, for type checkers and editors
    from krait.config import EngineConfig
    from krait.llm import LLM

__version__ = "0.1.0"

# Names imported on first use (PEP 562): they pull in torch (EngineConfig) and the model runner
# and transformers (LLM), which `import krait` (and so the CLI's --help) does not need.
_LAZY = {"LLM": "krait.llm", "EngineConfig": "krait.config"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput",
           "CompletionOutput"]
