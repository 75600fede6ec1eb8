"""Every environment variable krait reads, in one place: its default and what it is for.

They are diagnostics and deployment settings. Performance choices are not: each kernel path
the engine takes is the one measured fastest (docs/benchmarks.md), with no switch to take
another. Code reads a variable through `get`, which refuses a name not listed here
(tests/test_envs.py checks that krait/ names no other)."""

from __future__ import annotations

import os

# name: (default, what it is for)
VARIABLES: dict[str, tuple[str, str]] = {
    "KRAIT_TORCH_OPS": ("0", "1: every op runs its torch reference, on CUDA tensors too "
                        "(a kernel checked against its reference)"),
    "KRAIT_TRITON_CPU": ("0", "1 (with TRITON_INTERPRET=1): ops run their Triton kernels on CPU "
                         "tensors, interpreted (whole models through their kernels, no GPU)"),
    "KRAIT_PIECEWISE_GRAPHS": ("1", "0: eager steps (prefills, mixed batches) run without the "
                               "piecewise and prefill CUDA graphs (decode graphs stay)"),
    "KRAIT_TIMELINE": ("0", "1: kernels captured into a CUDA graph stamp the GPU timer per "
                       "program (krait/ops/timeline.py, scripts/timeline_decode.py)"),
    "KRAIT_LOG_LEVEL": ("INFO", "the CLI's log level (INFO shows the cache sizing)"),
    "KRAIT_CACHE_DIR": ("~/.cache/krait", "where the built-in demo model is built and kept"),
    "KRAIT_API_KEY": ("", "the bearer key `krait serve` requires (and `krait bench serve` "
                      "sends) when --api-key is not given"),
    "KRAIT_PP_LAYER_PARTITION": ("", "layers per pipeline stage, comma-separated (\"8,8,16\": "
                                 "3 stages); must sum to the model's layers. Empty: even "
                                 "stages, the remainder to the first"),
    "KRAIT_ALLOW_LONG_MAX_MODEL_LEN": ("0", "1: a max_model_len past the config's "
                                       "max_position_embeddings is allowed (as vLLM's override)"),
}

# CPython's store behind os.environ (bytes keys and values on POSIX), kept current by every
# os.environ write: reading it skips os.environ.get's encoding of the name and the value (an
# eager step reads KRAIT_TORCH_OPS for every op of every layer on the host's critical path)
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_BYTES = _ENV_DATA is not None and os.name == "posix"
_ENV_KEYS: dict[str, bytes] = {}


def environ_get(name: str, default: str | None = None) -> str | None:
    """os.environ.get(name, default), ~10x cheaper (0.1-0.3 against 1-3 us a call)."""
    if not _ENV_BYTES:
        return os.environ.get(name, default)
    key = _ENV_KEYS.get(name)
    if key is None:
        key = _ENV_KEYS[name] = os.fsencode(name)
    value = _ENV_DATA.get(key)
    return default if value is None else os.fsdecode(value)


def get(name: str) -> str:
    """The value of variable `name` (one of VARIABLES), its default when unset."""
    return environ_get(name, VARIABLES[name][0])
