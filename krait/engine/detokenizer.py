"""Incremental detokenization and stop-string detection for one request."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from krait.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"  # what a decoder yields for an incomplete UTF-8 byte sequence


class IncrementalDetokenizer:
    """Turns a request's generated ids into text one step at a time and finds stop strings.

    Decoding uses the prefix/read-offset scheme of vLLM and TGI: each new token is decoded in a
    short window that starts at `prefix_offset`, and the text it adds beyond the window's first
    `read_offset - prefix_offset` tokens is appended. Text ending in U+FFFD (an incomplete UTF-8
    character) is held back until a later token completes it, so per-step cost is O(new tokens).

    The text equals `tokenizer.decode(output_ids, skip_special_tokens=...)` of the ids passed to
    `update` (the prompt is not used as decoding context), once `finish()` has released any text
    still held back; a stop string cuts it short. Pass only the ids whose text belongs in the
    output (e.g. leave out an EOS id when special tokens are kept).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.enabled = tokenizer is not None and params.detokenize
        self.token_ids: list[int] = []  # output ids passed to update()
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.finished = False
        self._stops = list(params.stop_strings) if self.enabled else []
        max_stop_len = max((len(s) for s in self._stops), default=0)
        self._overlap = max(max_stop_len - 1, 0)  # chars before new text a stop may start in
        # Streamed text lags by this much, as a later stop match may cut it.
        self._stream_holdback = 0 if params.include_stop_str_in_output else self._overlap
        self._prefix_offset = 0
        self._read_offset = 0
        self._prefix_text = ""  # decode(token_ids[prefix_offset:read_offset])
        self._text = _TextBuffer()
        self._streamed = 0  # chars of text already returned by get_next_delta
        self._decode_fn = _fast_decoder(tokenizer, params.skip_special_tokens)

    @property
    def output_text(self) -> str:
        """All text so far (after stop truncation)."""
        return self._text.value()

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append tokens; return the stop string that matched (text then ends before it, or includes it
        when params.include_stop_str_in_output), else None.

        After a match or `finish()`, further ids are ignored.
        """
        if not self.enabled or self.finished:
            return None
        start = len(self._text)
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            self._text.append(self._decode_next())
        return self._check_stop(start)

    def finish(self) -> str | None:
        """Mark the request done: release text held back for an incomplete character (it stays
        U+FFFD, as in a full decode) and stop holding back streamed text. Returns a stop string
        if the released text completes one, else None. Calling it again does nothing."""
        if not self.enabled or self.finished:
            self.finished = True
            return None
        start = len(self._text)
        if self._read_offset < len(self.token_ids):
            new_text = self._decode(self.token_ids[self._prefix_offset :])
            self._text.append(new_text[len(self._prefix_text) :])
            self._read_offset = len(self.token_ids)
        stop = self._check_stop(start)
        self.finished = True
        return stop

    def get_next_delta(self) -> str:
        """Text appended since the last call (for streaming).

        Until the request finishes, the last (longest stop string - 1) characters are held back
        so that streamed text is never cut by a later stop match.
        """
        end = len(self._text) if self.finished else len(self._text) - self._stream_holdback
        if end <= self._streamed:
            return ""
        delta = self._text.slice(self._streamed, end)
        self._streamed = end
        return delta

    def _decode(self, ids: list[int]) -> str:
        return self._decode_fn(ids)

    def _decode_next(self) -> str:
        """Text the last token of `token_ids` makes stable ("" while it is held back)."""
        new_text = self._decode(self.token_ids[self._prefix_offset :])
        if new_text.endswith(REPLACEMENT_CHAR) or len(new_text) < len(self._prefix_text):
            return ""
        delta = new_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = self._decode(self.token_ids[self._prefix_offset : self._read_offset])
        return delta

    def _check_stop(self, new_start: int) -> str | None:
        """Find the earliest stop string ending in text from `new_start` on, and cut the text."""
        if not self._stops or len(self.token_ids) <= self.params.min_tokens:
            return None
        end = len(self._text)
        if end == new_start:
            return None
        window_start = max(new_start - self._overlap, 0)
        window = self._text.slice(window_start, end)
        best: tuple[int, str] | None = None
        for stop in self._stops:
            if not stop:
                continue
            # A match must end in the new text; earlier ones were searched before.
            pos = window.find(stop, max(new_start - len(stop) + 1 - window_start, 0))
            if pos >= 0 and (best is None or pos < best[0]):
                best = (pos, stop)
        if best is None:
            return None
        pos, stop = best
        cut = window_start + pos + (len(stop) if self.params.include_stop_str_in_output else 0)
        self._text.truncate(cut)
        self._streamed = min(self._streamed, cut)
        self.stop_reason = stop
        self.finished = True
        return stop


def _fast_decoder(tokenizer, skip_special_tokens: bool):
    """`tokenizer.decode` for this request; straight to the Rust tokenizer when that is
    equivalent (no clean-up pass), which skips the Python wrapper's per-call conversions."""
    if tokenizer is None:
        return lambda ids: ""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return lambda ids: backend.decode(ids, skip_special_tokens=skip_special_tokens)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class _TextBuffer:
    """Append-only text with cheap access to its end: appends, tail slices and truncation cost
    O(size of the change), not O(length); the whole string is joined only when asked for."""

    def __init__(self) -> None:
        self._chunks: list[str] = []
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def append(self, text: str) -> None:
        if text:
            self._chunks.append(text)
            self._len += len(text)

    def value(self) -> str:
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def slice(self, start: int, end: int) -> str:
        """text[start:end] for 0 <= start <= end <= len, walking chunks back from the end."""
        pos = self._len
        parts: list[str] = []
        for chunk in reversed(self._chunks):
            if pos <= start:
                break
            chunk_start = pos - len(chunk)
            if chunk_start < end:
                parts.append(chunk[max(start - chunk_start, 0) : min(end, pos) - chunk_start])
            pos = chunk_start
        return "".join(reversed(parts))

    def truncate(self, length: int) -> None:
        while self._len > length:
            chunk = self._chunks.pop()
            self._len -= len(chunk)
            if self._len < length:
                self._chunks.append(chunk[: length - self._len])
                self._len = length
