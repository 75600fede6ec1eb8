"""Tokenizer loading (local directories only, never the hub) and the bundled demo tokenizer."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

DEMO_TOKENIZER_FILE = Path(__file__).resolve().parent / "data" / "demo_tokenizer.json"

# "<|bos|>", then one "<|role|>\n{content}<|eos|>\n" turn per message; content may be a string
# or a list of OpenAI-style parts, of which the text parts are kept.
DEMO_CHAT_TEMPLATE = (
    "<|bos|>"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}"
    "<|eos|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# Any one of these in a directory means it holds a tokenizer AutoTokenizer can load.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
)


def load_demo_tokenizer() -> PreTrainedTokenizerFast:
    """The bundled byte-level BPE tokenizer (512 tokens: <|bos|>=0, <|eos|>=1, <|pad|>=2)."""
    return PreTrainedTokenizerFast(
        tokenizer_file=str(DEMO_TOKENIZER_FILE),
        bos_token="<|bos|>",
        eos_token="<|eos|>",
        pad_token="<|pad|>",
        clean_up_tokenization_spaces=False,
        chat_template=DEMO_CHAT_TEMPLATE,
    )


def save_demo_tokenizer(directory: str | Path) -> None:
    """Write the demo tokenizer into a model directory, loadable offline by AutoTokenizer."""
    load_demo_tokenizer().save_pretrained(str(directory))


def get_tokenizer(
    path: str | Path, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase | None:
    """Load the tokenizer of a local model directory; None if it holds no tokenizer files.

    Raises FileNotFoundError if `path` is not a directory: krait never downloads.
    """
    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"model directory not found: {directory}")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return AutoTokenizer.from_pretrained(
        str(directory), trust_remote_code=trust_remote_code, local_files_only=True
    )


def eos_token_ids(
    tokenizer: PreTrainedTokenizerBase | None,
    hf_config: Any,
    model_dir: str | Path | None = None,
) -> list[int]:
    """All end-of-sequence ids of a model, deduplicated, in this order of sources:
    generation_config.json's `eos_token_id`, the config's (or its text_config's) `eos_token_id`,
    then `tokenizer.eos_token_id`. Each may be an int, a list of ints, or missing.

    `hf_config` is a transformers config, a dict, or None; `model_dir` (where to look for
    generation_config.json) defaults to the config's `name_or_path`.
    """
    ids: list[int] = []

    def add(value: Any) -> None:
        values: Iterable[Any] = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            if v is not None and int(v) not in ids:
                ids.append(int(v))

    if model_dir is None:
        model_dir = _get(hf_config, "name_or_path") or _get(hf_config, "_name_or_path")
    if model_dir:
        gen_file = Path(model_dir) / "generation_config.json"
        if gen_file.is_file():
            add(json.loads(gen_file.read_text(encoding="utf-8")).get("eos_token_id"))
    config_eos = _get(hf_config, "eos_token_id")
    if config_eos is None:
        config_eos = _get(_get(hf_config, "text_config"), "eos_token_id")
    add(config_eos)
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return ids


def _get(obj: Any, key: str) -> Any:
    """`key` of a config object or dict; None if absent."""
    if obj is None:
        return None
    if isinstance(obj, dict):
        return obj.get(key)
    return getattr(obj, key, None)
