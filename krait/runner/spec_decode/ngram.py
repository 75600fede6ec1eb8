"""Prompt-lookup (n-gram) drafting on the host, vectorised over the batch with numpy.

For each row the drafter takes the longest suffix of n tokens, prompt_lookup_max >= n >=
prompt_lookup_min, that occurs earlier in the row's tokens (prompt + output) and proposes the up
to k tokens that followed that occurrence. Among several earlier occurrences of that n-gram it
takes the MOST RECENT one (the nearest context predicts the continuation best; vLLM's v1
`NgramProposer` takes the earliest). When fewer than k tokens follow it before the row ends
(the row repeats with a period p < k), the drafts continue periodically: the p tokens after the
occurrence, again and again, so a short repeat still yields k drafts.

All rows are searched at once, over the [R, W] table (W: the longest row). A candidate is an
earlier position e where the row's last `level` tokens end, e followed by at least one token.
Level 1 compares every position with the row's last token; while candidates are dense (a
frequent last token: a space, a newline) further levels are ANDed in over the whole table
(past prompt_lookup_min one level at most, the one below kept for rows whose longer matches
all vanish), then the sparse candidates are extended backwards one token at a time with
gathers over the candidates alone. Per row, the longest match wins, then its most recent
occurrence.
"""

from __future__ import annotations

import numpy as np

# above this fraction of the table, candidates are cheaper filtered by one more whole-table
# comparison than extended one by one (a gather costs ~30x a compared element)
_DENSE = 1 / 32


class NgramProposer:
    """Proposes up to `num_speculative_tokens` drafts per row by prompt lookup."""

    def __init__(
        self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int
    ) -> None:
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                "need 1 <= prompt_lookup_min <= prompt_lookup_max, got "
                f"{prompt_lookup_min} and {prompt_lookup_max}"
            )
        self.k = num_speculative_tokens
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        # scratch for the whole-table comparisons: fresh [R, W] arrays would cost page faults
        self._buf = np.empty(0, dtype=bool)

    def propose(
        self, token_ids: np.ndarray, num_tokens: np.ndarray, max_drafts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """Drafts for every row.

        token_ids [R, L] int: row r's tokens in token_ids[r, :num_tokens[r]] (past that, any
        values). num_tokens [R] int. max_drafts [R] int: the most drafts row r may take (0: none).
        Returns (drafts [R, k] int32, -1 past each row's count; counts [R] int32).
        """
        num_rows = token_ids.shape[0]
        k = self.k
        drafts = np.full((num_rows, k), -1, dtype=np.int32)  # [R, k]
        counts = np.zeros(num_rows, dtype=np.int32)  # [R]
        n_tok = np.asarray(num_tokens, dtype=np.int64).reshape(num_rows)
        cap = np.minimum(np.asarray(max_drafts, dtype=np.int64).reshape(num_rows), k)
        if num_rows and int(n_tok.max()) > token_ids.shape[1]:
            raise ValueError(f"num_tokens exceed the table's width {token_ids.shape[1]}")
        # an occurrence needs a token after it, before the suffix's last token
        active = (cap > 0) & (n_tok >= self.min_n + 1)
        if k == 0 or not active.any():
            return drafts, counts
        width = int(n_tok[active].max()) - 1  # candidate ends e (last-token positions) < W
        # lasts[r, i]: the suffix's i-th token from the end (clipped where the row is shorter)
        lasts = np.take_along_axis(
            token_ids, np.maximum(n_tok[:, None] - 1 - np.arange(self.max_n), 0), axis=1
        )  # [R, max_n]
        limit = np.where(active, n_tok - 1, 0)  # [R] e < limit: followed by a token

        size = num_rows * width
        if self._buf.size < 3 * size:
            self._buf = np.empty(3 * size, dtype=bool)
        hit = self._buf[:size].reshape(num_rows, width)  # [R, W] e ends a match of `level`
        np.equal(token_ids[:, :width], lasts[:, :1], out=hit)
        for r in np.flatnonzero(limit < width).tolist():  # shorter rows' tails are not tokens
            hit[r, limit[r] :] = False
        level, fallback = 1, None
        num_hits = np.count_nonzero(hit)
        while level < self.max_n and num_hits > _DENSE * size:
            if level >= self.min_n:  # a valid answer already: keep it for rows that lose it
                if fallback is not None:
                    break  # (one fallback level at most)
                fallback = self._buf[size : 2 * size].reshape(num_rows, width)
                fallback[:] = hit
            same = self._buf[2 * size : 2 * size + num_rows * (width - level)]
            same = same.reshape(num_rows, width - level)  # [R, W - level]
            np.equal(token_ids[:, : width - level], lasts[:, level : level + 1], out=same)
            np.logical_and(hit[:, level:], same, out=hit[:, level:])
            hit[:, :level] = False
            level += 1
            num_hits = np.count_nonzero(hit)

        found = np.zeros(0, dtype=np.int64)
        start = np.zeros(0, dtype=np.int64)
        if num_hits:
            found, ends, n_best = self._extend(np.flatnonzero(hit), width, level, token_ids,
                                               lasts)
            ok = n_best >= self.min_n
            found, start = found[ok], ends[ok] + 1
        if fallback is not None:  # rows whose every longer match vanished: their best level
            lost = np.setdiff1d(np.flatnonzero(active), found)
            lost = lost[fallback[lost].any(axis=1)]
            if lost.size:
                recent = width - 1 - np.argmax(fallback[lost, ::-1], axis=1)
                found = np.concatenate([found, lost])
                start = np.concatenate([start, recent + 1])
        if found.size == 0:
            return drafts, counts
        # the tokens after the occurrence, continued periodically past the row's end (the
        # occurrence ends `period` tokens before the suffix does: what followed it once is
        # taken to follow again), so a short repeat still gives k drafts
        count = cap[found]
        period = n_tok[found] - start  # >= 1: start <= num_tokens - 1
        cols = np.arange(k)
        follow = start[:, None] + cols % period[:, None]  # [F, k]
        take = token_ids[found[:, None], follow]
        drafts[found] = np.where(cols < count[:, None], take, -1)
        counts[found] = count
        return drafts, counts

    def _extend(
        self, flat: np.ndarray, width: int, level: int, token_ids: np.ndarray, lasts: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Extends the candidates (flat indices into [R, W], each the end of a match of `level`
        tokens) backwards up to max_n tokens. Returns, for each row with a candidate: the row,
        the end of its longest match's most recent occurrence, and that match's length."""
        rows, ends = np.divmod(flat, width)  # sorted by row, then position
        length = np.full(flat.size, level, dtype=np.int64)
        live = np.arange(flat.size)  # candidates still matching: only they are extended
        tokens = token_ids.reshape(-1)  # flat gathers: twice as fast as [rows, cols] ones
        lasts_flat = lasts.reshape(-1)
        at_flat = rows * token_ids.shape[1] + ends  # [C] each candidate's end in `tokens`
        for i in range(level, self.max_n):
            ok = ends[live] >= i
            want = lasts_flat[rows[live] * self.max_n + i]
            ok &= tokens[np.where(ok, at_flat[live] - i, 0)] == want
            live = live[ok]
            if live.size == 0:
                break
            length[live] += 1
        key = length * width + ends  # the longest, then the most recent
        firsts = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]])
        best = np.maximum.reduceat(key, firsts)
        n_best, e_best = np.divmod(best, width)
        return rows[firsts], e_best, n_best
