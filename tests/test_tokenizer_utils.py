"""The bundled demo tokenizer, local tokenizer loading and EOS id discovery."""

import importlib.util
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import AutoConfig, AutoTokenizer, LlamaConfig

from krait.tokenizer_utils import (
    DEMO_CHAT_TEMPLATE,
    DEMO_TOKENIZER_FILE,
    eos_token_ids,
    get_tokenizer,
    load_demo_tokenizer,
    save_demo_tokenizer,
)

TEXTS = [
    "The river town woke slowly in the autumn.",
    "  leading and trailing spaces, tabs\tand\nnewlines  ",
    "naïve café — 日本語のテキスト, emoji 🐍🚀 and combining e\u0301 marks",
    "symbols: {}[]<>|~^`@#$%&*_+=\\/ 0123456789 \x00\x7f",
]


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    assert all(0 <= i < 512 for i in ids)


def test_vocab_and_special_ids(tok):
    assert len(tok) == 512
    assert tok.convert_tokens_to_ids(["<|bos|>", "<|eos|>", "<|pad|>"]) == [0, 1, 2]
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 2)
    # Special tokens in text are recognised, and skipped on request.
    ids = tok.encode("<|bos|>hi<|eos|>")
    assert ids[0] == 0 and ids[-1] == 1
    assert tok.decode(ids, skip_special_tokens=True) == "hi"


def test_save_then_auto_tokenizer(tok, tmp_path):
    save_demo_tokenizer(tmp_path)
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), get_tokenizer(tmp_path)):
        for text in TEXTS:
            assert loaded.encode(text) == tok.encode(text)
        assert (loaded.bos_token_id, loaded.eos_token_id, loaded.pad_token_id) == (0, 1, 2)
        assert loaded.chat_template == DEMO_CHAT_TEMPLATE


def test_chat_template(tok):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "image"}]},
    ]
    body = "<|bos|><|system|>\nBe brief.<|eos|>\n<|user|>\nHi<|eos|>\n"
    assert tok.apply_chat_template(messages, tokenize=False) == body
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == body + "<|assistant|>\n"
    ids = tok.encode(prompt)
    assert ids[0] == 0 and ids.count(1) == 2 and tok.decode(ids) == prompt


def test_get_tokenizer_missing(tmp_path):
    assert get_tokenizer(tmp_path) is None
    with pytest.raises(FileNotFoundError):
        get_tokenizer(tmp_path / "absent")


def test_eos_token_ids_sources(tok, tmp_path):
    LlamaConfig(eos_token_id=[7, 1]).save_pretrained(tmp_path)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    config = AutoConfig.from_pretrained(tmp_path)  # name_or_path points at tmp_path
    assert eos_token_ids(tok, config) == [9, 7, 1]
    assert eos_token_ids(None, config) == [9, 7, 1]
    # Without a directory to read, the config and tokenizer alone.
    assert eos_token_ids(tok, {"eos_token_id": 5}) == [5, 1]
    assert eos_token_ids(tok, {"eos_token_id": 5}, model_dir=tmp_path) == [9, 7, 5, 1]
    assert eos_token_ids(tok, None) == [1]
    assert eos_token_ids(None, SimpleNamespace(eos_token_id=None)) == []
    nested = {"text_config": {"eos_token_id": [3, 3]}}
    assert eos_token_ids(None, nested) == [3]


def test_generation_config_null_eos(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": None}))
    assert eos_token_ids(None, {"eos_token_id": 4}, model_dir=tmp_path) == [4]


def test_committed_file_matches_script():
    script = Path(__file__).resolve().parent.parent / "scripts" / "make_demo_tokenizer.py"
    spec = importlib.util.spec_from_file_location("make_demo_tokenizer", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    fresh = json.loads(module.build_tokenizer().to_str())
    committed = json.loads(DEMO_TOKENIZER_FILE.read_text(encoding="utf-8"))
    # The trained content, not the serialisation details of one `tokenizers` version.
    for key in ("vocab", "merges"):
        assert committed["model"][key] == fresh["model"][key]
    assert committed["added_tokens"] == fresh["added_tokens"]
