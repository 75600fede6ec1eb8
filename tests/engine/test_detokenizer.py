"""IncrementalDetokenizer against full decodes of the demo tokenizer, and stop strings."""

import random

import pytest

from krait.engine.detokenizer import IncrementalDetokenizer, _TextBuffer
from krait.sampling_params import SamplingParams
from krait.tokenizer_utils import load_demo_tokenizer

UNICODE_TEXT = "naïve café — 日本語 🐍🚀 e\u0301 ok, the river town. Ünïcödé ∑ x² ≤ 10€"


@pytest.fixture(scope="module")
def tok():
    return load_demo_tokenizer()


def run(tok, ids, params, chunk_sizes=(1,), seed=0):
    """Feed `ids` in random-sized chunks; return (detokenizer, streamed deltas, stop)."""
    rng = random.Random(seed)
    detok = IncrementalDetokenizer(tok, [0, 5, 6], params)
    deltas, stop, i = [], None, 0
    while i < len(ids) and stop is None:
        n = rng.choice(chunk_sizes)
        stop = detok.update(ids[i : i + n])
        i += n
        deltas.append(detok.get_next_delta())
    if stop is None:
        stop = detok.finish()
    deltas.append(detok.get_next_delta())
    return detok, deltas, stop


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_match_full_decode(tok, skip_special_tokens):
    rng = random.Random(1234)
    params = SamplingParams(skip_special_tokens=skip_special_tokens)
    for trial in range(150):
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tok, [], params)
        deltas, i = [], 0
        while i < len(ids):
            n = rng.choice((1, 1, 2, 3))
            assert detok.update(ids[i : i + n]) is None
            i += n
            deltas.append(detok.get_next_delta())
            # What is emitted is final: always a prefix of the full decode so far.
            so_far = tok.decode(ids[:i], skip_special_tokens=skip_special_tokens)
            assert so_far.startswith(detok.output_text), (trial, ids[:i])
        detok.finish()
        deltas.append(detok.get_next_delta())
        full = tok.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.output_text == full, (trial, ids)
        assert "".join(deltas) == full


def test_unicode_split_mid_character(tok):
    ids = tok.encode(UNICODE_TEXT)
    # Several characters span more than one token, so the stream splits them.
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    detok = IncrementalDetokenizer(tok, [], SamplingParams())
    for k, token_id in enumerate(ids):
        detok.update([token_id])
        assert "\ufffd" not in detok.output_text
        assert UNICODE_TEXT.startswith(detok.output_text)
        if "\ufffd" not in tok.decode(ids[: k + 1]):
            assert detok.output_text == tok.decode(ids[: k + 1])
    assert detok.output_text == UNICODE_TEXT


def test_finish_releases_incomplete_character(tok):
    ids = tok.encode("ok 🐍")[:-1]  # the snake's last byte is missing
    detok, deltas, stop = run(tok, ids, SamplingParams())
    assert stop is None
    assert detok.output_text == tok.decode(ids) == "ok \ufffd"
    assert "".join(deltas) == detok.output_text


@pytest.mark.parametrize("skip", [True, False])
def test_skip_special_tokens(tok, skip):
    ids = [0] + tok.encode("hi there") + [1, 2, 1]
    detok, _, _ = run(tok, ids, SamplingParams(skip_special_tokens=skip), chunk_sizes=(1, 2))
    expected = "hi there" if skip else "<|bos|>hi there<|eos|><|pad|><|eos|>"
    assert detok.output_text == expected == tok.decode(ids, skip_special_tokens=skip)


def spanning_stop(tok, text):
    """ids of `text` and a stop string made of the end of one token and the start of the next."""
    ids = tok.encode(text)
    pieces = [tok.decode([i]) for i in ids]
    k = next(k for k in range(len(ids) - 2) if len(pieces[k]) >= 2 and len(pieces[k + 1]) >= 2)
    return ids, k, pieces[k][-2:] + pieces[k + 1][:2]


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_spanning_two_tokens(tok, include):
    text = "The river town woke slowly in the autumn fog."
    ids, k, stop = spanning_stop(tok, text)
    params = SamplingParams(stop=["zzz", stop], include_stop_str_in_output=include)
    detok = IncrementalDetokenizer(tok, [], params)
    for j in range(k + 1):
        assert detok.update([ids[j]]) is None
    assert detok.update([ids[k + 1]]) == stop
    assert detok.stop_reason == stop and detok.finished
    before = tok.decode(ids[: k + 1])[:-2]
    assert detok.output_text == (before + stop if include else before)
    assert detok.update(ids[k + 2 :]) is None  # ignored after the stop
    assert detok.output_text == (before + stop if include else before)


@pytest.mark.parametrize("include", [False, True])
def test_stop_in_one_multi_token_update(tok, include):
    text = "The river town woke slowly in the autumn fog."
    params = SamplingParams(stop="slow", include_stop_str_in_output=include)
    detok, deltas, stop = run(tok, tok.encode(text), params, chunk_sizes=(50,))
    assert stop == "slow"
    assert detok.output_text == ("The river town woke slow" if include else "The river town woke ")
    assert "".join(deltas) == detok.output_text


def test_earliest_stop_wins(tok):
    params = SamplingParams(stop=["town", "river", "e r"])
    detok, _, stop = run(tok, tok.encode("The river town"), params, chunk_sizes=(20,))
    assert stop == "e r" and detok.output_text == "Th"


def test_min_tokens_delays_stop(tok):
    ids = tok.encode("a cat, a cat, a cat.")
    params = SamplingParams(stop="cat", min_tokens=4)
    detok, _, stop = run(tok, ids, params)
    assert stop == "cat"
    # The first "cat" ends within the first 4 tokens, so the second one stops the text.
    assert tok.decode(ids[:4]).count("cat") == 1
    assert detok.output_text == "a cat, a "


@pytest.mark.parametrize("include", [False, True])
def test_deltas_concatenate_and_never_get_cut(tok, include):
    text = "Numbers and names appear everywhere in such a place: the year 1887 carved above"
    for stop_str in ["the year", "carved", "nowhere", "e"]:
        params = SamplingParams(stop=[stop_str, "appear every"], include_stop_str_in_output=include)
        for seed in range(5):
            detok, deltas, _ = run(tok, tok.encode(text), params, chunk_sizes=(1, 2, 3), seed=seed)
            assert "".join(deltas) == detok.output_text
            # Each delta was a prefix of the final text when streamed: nothing streamed was cut.
            assert text.startswith(detok.output_text)


def test_stream_holds_back_possible_stop_prefix(tok):
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop="town!"))
    detok.update(tok.encode("The river town"))
    streamed = detok.get_next_delta()
    assert streamed == "The river town"[: -len("town")]
    assert detok.finish() is None
    assert streamed + detok.get_next_delta() == "The river town"


@pytest.mark.parametrize(
    "tokenizer_given, detokenize", [(False, True), (True, False)], ids=["no-tokenizer", "off"]
)
def test_disabled(tok, tokenizer_given, detokenize):
    params = SamplingParams(stop="river", detokenize=detokenize)
    detok = IncrementalDetokenizer(tok if tokenizer_given else None, [], params)
    assert detok.update(tok.encode("The river town")) is None
    assert detok.finish() is None
    assert detok.output_text == "" and detok.get_next_delta() == ""


class CountingTokenizer:
    """Wraps a tokenizer and records how many ids each decode call receives."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, **kwargs):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, **kwargs)


def test_decode_window_stays_small(tok):
    ids = tok.encode((UNICODE_TEXT + " ") * 40)
    counting = CountingTokenizer(tok)
    detok, _, _ = run(counting, ids, SamplingParams(stop=["never"]), chunk_sizes=(1, 2, 4))
    assert len(ids) > 1000
    assert detok.output_text == tok.decode(ids)
    assert max(counting.sizes) <= 12
    assert len(counting.sizes) <= 2 * len(ids) + 1


def test_text_buffer_against_str():
    rng = random.Random(7)
    buf, ref = _TextBuffer(), ""
    for _ in range(500):
        op = rng.random()
        if op < 0.6:
            piece = "".join(rng.choice("ab€🐍") for _ in range(rng.randrange(4)))
            buf.append(piece)
            ref += piece
        elif op < 0.7:
            n = rng.randrange(len(ref) + 1)
            buf.truncate(n)
            ref = ref[:n]
        elif op < 0.8:
            assert buf.value() == ref
        start = rng.randrange(len(ref) + 1)
        end = rng.randrange(start, len(ref) + 1)
        assert buf.slice(start, end) == ref[start:end]
        assert len(buf) == len(ref)
