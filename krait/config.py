"""Engine configuration: one frozen dataclass per concern, composed into EngineConfig."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from krait import envs

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def _json_floats(obj: Any) -> Any:
    """Undo transformers' `{"__float__": "Infinity"}` encoding (and plain "Infinity" strings)."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: _json_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_floats(v) for v in obj]
    if isinstance(obj, str) and obj in ("Infinity", "-Infinity", "NaN"):
        return float(obj)
    return obj


def read_hf_config(model_dir: str | Path) -> Any:
    """Reads config.json into a transformers PretrainedConfig, tolerant of the float encodings
    that differ between transformers versions."""
    from transformers import AutoConfig, PretrainedConfig

    path = Path(model_dir) / "config.json"
    if not path.exists():
        raise ValueError(f"model: no config.json in {model_dir}")
    raw = _json_floats(json.loads(path.read_text()))
    model_type = raw.get("model_type")
    try:
        cls = AutoConfig.for_model(model_type).__class__ if model_type else PretrainedConfig
    except ValueError:
        cls = PretrainedConfig
    return cls.from_dict(raw)


def resolve_dtype(dtype: str | torch.dtype, hf_config: Any, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32
        cfg_dtype = getattr(hf_config, "dtype", None) or getattr(hf_config, "torch_dtype", None)
        if isinstance(cfg_dtype, str):
            cfg_dtype = _DTYPES.get(cfg_dtype)
        if cfg_dtype in (torch.bfloat16, torch.float16):
            return cfg_dtype
        return torch.bfloat16
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclass(frozen=True)
class ModelConfig:
    model: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    vocab_size: int
    load_format: str = "auto"
    seed: int = 0
    tokenizer: str | None = None


# "auto": the model dtype; "fp8" (= "fp8_e4m3"): keys and values stored as float8 e4m3 without
# scales (vLLM's default scale 1.0), saturating at +-448: half the KV bytes of bf16
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def resolve_kv_cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the paged KV cache for CacheConfig.kv_cache_dtype."""
    return model_dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    num_kv_blocks: int | None = None  # overrides the memory-based pool size
    kv_cache_dtype: str = "auto"
    mamba_ssm_cache_dtype: str = "float32"
    enable_prefix_caching: bool = False
    cpu_kv_cache_gib: float = 2.0  # memory budget for the cache on CPU
    # prefix caching with recurrent layers: tokens between state snapshots (a multiple of
    # block_size; None: the Mamba chunk size rounded up to it) and how many snapshots the cache
    # holds (None: what a tenth of the cache's memory holds, up to 4 per max_num_seqs)
    mamba_block_size: int | None = None
    num_state_snapshots: int | None = None


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    # schedule and prepare step N+1 while the device runs step N (outputs come one call later)
    async_scheduling: bool = True


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "uni": the runner in this process (one rank); "mp": one worker process a rank (the
    # default for several); "ray": workers as Ray actors in a placement group
    distributed_executor_backend: str = "uni"

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


SPEC_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp", "qwen3_next_mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` keys. `method` defaults to "draft_model" when `model` is
    given, else "ngram"."""

    method: str | None = None
    num_speculative_tokens: int = 0
    model: str | None = None
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    draft_tensor_parallel_size: int | None = None

    @classmethod
    def from_dict(cls, d: dict) -> SpeculativeConfig:
        """Validates the keys and values; a ValueError names the offending one."""
        known = {f for f in cls.__dataclass_fields__}
        for key in d:
            if key not in known:
                raise ValueError(
                    f"speculative_config: unknown key {key!r} (known: {', '.join(sorted(known))})")
        return cls(**d).validated()

    def validated(self) -> SpeculativeConfig:
        method = self.method or ("draft_model" if self.model else "ngram")
        if method not in SPEC_METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(SPEC_METHODS)};"
                             f" got {method!r}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or isinstance(k, bool) or k < 1:
            raise ValueError(
                f"speculative_config.num_speculative_tokens must be an integer >= 1; got {k!r}")
        if k > 16:
            raise ValueError(f"speculative_config.num_speculative_tokens is at most 16; got {k}")
        if method in ("draft_model", "eagle", "eagle3"):
            if not self.model:
                what = "a draft checkpoint" if method == "draft_model" else "an EAGLE head's"
                raise ValueError(f"speculative_config.model: the {method} method needs {what} "
                                 "checkpoint directory")
        elif self.model and method not in ("mtp", "qwen3_next_mtp"):
            # mtp: the target's own checkpoint unless `model` names another copy of it
            raise ValueError("speculative_config.model is only for draft_model, eagle, eagle3 "
                             f"and mtp, not {method!r}")
        dtp = self.draft_tensor_parallel_size
        if dtp is not None and (not isinstance(dtp, int) or isinstance(dtp, bool) or dtp < 1):
            raise ValueError("speculative_config.draft_tensor_parallel_size must be an integer "
                             f">= 1; got {dtp!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if method != "ngram" and (lo is not None or hi is not None):
            raise ValueError("speculative_config.prompt_lookup_min/max are only for ngram")
        if method == "ngram":
            # vLLM's rule: one of them given sets both
            lo = lo if lo is not None else (hi if hi is not None else 1)
            hi = hi if hi is not None else max(lo, 4)
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                    raise ValueError(f"speculative_config.{name} must be an integer >= 1; got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) is larger than "
                                 f"prompt_lookup_max ({hi})")
        return SpeculativeConfig(method, k, self.model, hi, lo, self.draft_tensor_parallel_size)


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: torch.device
    enforce_eager: bool = False
    speculative: SpeculativeConfig | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_kwargs(
        cls,
        model: str,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 8192,
        block_size: int = 16,
        gpu_memory_utilization: float = 0.9,
        num_kv_blocks: int | None = None,
        load_format: str = "auto",
        seed: int = 0,
        enforce_eager: bool = False,
        speculative_config: dict | SpeculativeConfig | None = None,
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_prefix_caching: bool = False,
        kv_cache_dtype: str = "auto",
        mamba_ssm_cache_dtype: str = "float32",
        tokenizer: str | None = None,
        cpu_kv_cache_gib: float = 2.0,
        async_scheduling: bool = True,
        mamba_block_size: int | None = None,
        num_state_snapshots: int | None = None,
        distributed_executor_backend: str | None = None,
    ) -> EngineConfig:
        """Builds and validates the whole configuration from LLM(...)-style keyword options."""
        if load_format not in ("auto", "safetensors", "dummy"):
            raise ValueError(f"load_format must be auto, safetensors or dummy; got {load_format!r}")
        dev = resolve_device(device)
        hf_config = read_hf_config(model)
        limit = _positional_limit(hf_config)
        if max_model_len is None:
            max_model_len = limit or 4096  # pure state-space models have no positional limit
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {max_model_len}")
        if limit and max_model_len > limit and envs.get(
                "KRAIT_ALLOW_LONG_MAX_MODEL_LEN") != "1":
            raise ValueError(
                f"max_model_len {max_model_len} is longer than the model's positional limit "
                f"({limit}, max_position_embeddings in its config.json): positions past it are "
                "untrained. Set KRAIT_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it anyway")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be at least 1, got {max_num_seqs}")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be at least 1, got {max_num_batched_tokens}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        if mamba_block_size is not None and (mamba_block_size < 1 or mamba_block_size % block_size):
            raise ValueError(f"mamba_block_size must be a positive multiple of block_size="
                             f"{block_size}, got {mamba_block_size}")
        if num_state_snapshots is not None and num_state_snapshots < 1:
            raise ValueError(f"num_state_snapshots must be at least 1, got {num_state_snapshots}")
        if num_kv_blocks is not None and num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be at least 1, got {num_kv_blocks}")
        if not 0.0 < gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
        from krait.distributed.layout import validate_layout

        backend = validate_layout(hf_config, tensor_parallel_size, pipeline_parallel_size,
                                  distributed_executor_backend, dev)
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}"
            )
        if kv_cache_dtype != "auto" and dev.type == "cuda" and torch.cuda.get_device_capability(dev) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype={kv_cache_dtype!r} needs a GPU with fp8 conversions (compute "
                f"capability 8.9 or newer); this one is {torch.cuda.get_device_capability(dev)}"
            )
        if mamba_ssm_cache_dtype not in ("float32", "bfloat16", "float16", "auto"):
            raise ValueError(
                "mamba_ssm_cache_dtype must be float32, bfloat16, float16 or auto; "
                f"got {mamba_ssm_cache_dtype!r}"
            )
        if isinstance(speculative_config, dict):
            speculative_config = SpeculativeConfig.from_dict(speculative_config)
        elif isinstance(speculative_config, SpeculativeConfig):
            speculative_config = speculative_config.validated()
        elif speculative_config is not None:
            raise ValueError("speculative_config must be a dict or a SpeculativeConfig")
        if speculative_config is not None and pipeline_parallel_size > 1:
            raise ValueError("speculative decoding with pipeline_parallel_size > 1 is not "
                             "supported yet (tensor parallelism is)")
        method = speculative_config.method if speculative_config is not None else None
        dtp = speculative_config.draft_tensor_parallel_size if method else None
        if dtp is not None and dtp != tensor_parallel_size:
            # a drafter runs on every tensor-parallel rank, sharded like the target
            raise ValueError(f"speculative_config.draft_tensor_parallel_size={dtp}: the draft "
                             f"runs sharded over the target's {tensor_parallel_size} "
                             f"tensor-parallel rank(s); leave it out or set "
                             f"{tensor_parallel_size}")
        if method in ("eagle", "eagle3", "mtp", "qwen3_next_mtp") and enable_prefix_caching:
            # the head's KV at a prefix hit would need the target hidden states of the cached
            # positions, which no step computed
            raise ValueError(f"speculative_config.method={method!r} with enable_prefix_caching"
                             " is not supported yet")
        vocab_size = getattr(hf_config, "vocab_size", None)
        if vocab_size is None:
            raise ValueError("model: config.json has no vocab_size")
        return cls(
            model=ModelConfig(
                model=str(model),
                hf_config=hf_config,
                dtype=resolve_dtype(dtype, hf_config, dev),
                max_model_len=int(max_model_len),
                vocab_size=int(vocab_size),
                load_format=load_format,
                seed=seed,
                tokenizer=tokenizer,
            ),
            cache=CacheConfig(
                block_size=block_size,
                gpu_memory_utilization=gpu_memory_utilization,
                num_kv_blocks=num_kv_blocks,
                kv_cache_dtype=kv_cache_dtype,
                mamba_ssm_cache_dtype=mamba_ssm_cache_dtype,
                enable_prefix_caching=enable_prefix_caching,
                cpu_kv_cache_gib=cpu_kv_cache_gib,
                mamba_block_size=mamba_block_size,
                num_state_snapshots=num_state_snapshots,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                # (speculative steps run asynchronously only where the runner drafts on the
                # device: LLMEngine.async_scheduling)
                async_scheduling=bool(async_scheduling),
            ),
            parallel=ParallelConfig(tensor_parallel_size, pipeline_parallel_size, backend),
            device=dev,
            enforce_eager=enforce_eager,
            speculative=speculative_config,
        )


def engine_option_names() -> list[str]:
    """Keyword options EngineConfig.from_kwargs accepts (used by the CLI and LLM)."""
    import inspect

    return [p for p in inspect.signature(EngineConfig.from_kwargs).parameters if p != "cls"]


def _positional_limit(hf_config: Any) -> int | None:
    """The longest sequence the config declares (None: no positional limit, e.g. Mamba2). Rope
    scaling that stretches positions (linear, dynamic: by its factor; yarn: its original length
    by the factor) raises it, as vLLM derives it; llama3 configs already state the long length."""
    limit = None
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        v = getattr(hf_config, key, None)
        if isinstance(v, int) and v > 0:
            limit = v
            break
    rope = getattr(hf_config, "rope_scaling", None) or getattr(hf_config, "rope_parameters", None)
    if limit is None or not isinstance(rope, dict):
        return limit
    kind, factor = rope.get("rope_type", rope.get("type")), rope.get("factor")
    if not isinstance(factor, (int, float)) or factor <= 1:
        return limit
    if kind in ("linear", "dynamic"):
        return int(limit * factor)
    if kind == "yarn":
        return int(rope.get("original_max_position_embeddings", limit) * factor)
    return limit
