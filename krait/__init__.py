"""krait: a fast, compact inference engine for hybrid state-space/attention language models."""

from krait.config import EngineConfig
from krait.outputs import CompletionOutput, RequestOutput
from krait.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in the model runner (torch, transformers); import it on first use.
    if name == "LLM":
        from krait.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "EngineConfig", "RequestOutput",
           "CompletionOutput"]
