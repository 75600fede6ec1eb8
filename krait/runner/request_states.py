"""Persistent per-request tables, one row per live request (`req_state_idx`), kept for its life."""

from __future__ import annotations

import numpy as np

from krait.sampling_params import SamplingParams


class RequestStates:
    """Host-side tables indexed by req_state_idx. Rows come from a free list on arrival and
    go back on finish or preemption."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int, slots_per_req: int
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int32)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_prompt_tokens = np.zeros(max_num_reqs, dtype=np.int32)
        self.num_output_offset = np.zeros(max_num_reqs, dtype=np.int32)  # outputs before admission
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int32)
        self.state_slots = np.full((max_num_reqs, max(slots_per_req, 1)), -1, dtype=np.int32)
        self.params: list[SamplingParams | None] = [None] * max_num_reqs
        # rows the sampler can serve with a bare argmax (greedy, no penalties/bans/logprobs)
        self.plain_greedy = np.zeros(max_num_reqs, dtype=bool)
        self.wants_prompt_logprobs = np.zeros(max_num_reqs, dtype=bool)
        self.wants_logprobs = np.zeros(max_num_reqs, dtype=bool)
        self.eos_token_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.req_ids: list[str | None] = [None] * max_num_reqs
        self.index: dict[str, int] = {}
        self._free = list(range(max_num_reqs - 1, -1, -1))

    def add(
        self,
        req_id: str,
        token_ids: list[int],
        num_prompt_tokens: int,
        num_computed_tokens: int,
        num_output_offset: int,
        params: SamplingParams,
        block_ids: list[int],
        state_slots: list[int],
        eos_token_ids: list[int],
    ) -> int:
        if not self._free:
            raise RuntimeError("RequestStates is full: more live requests than max_num_seqs")
        i = self._free.pop()
        n = len(token_ids)
        self.token_ids[i, :n] = token_ids
        self.num_tokens[i] = n
        self.num_prompt_tokens[i] = num_prompt_tokens
        self.num_computed_tokens[i] = num_computed_tokens
        self.num_output_offset[i] = num_output_offset
        self.num_blocks[i] = 0
        self.append_blocks(i, block_ids)
        self.state_slots[i] = -1
        self.state_slots[i, : len(state_slots)] = state_slots
        self.params[i] = params
        self.plain_greedy[i] = params is not None and _plain_greedy(params)
        self.wants_prompt_logprobs[i] = params is not None and params.prompt_logprobs is not None
        self.wants_logprobs[i] = params is not None and params.logprobs is not None
        self.eos_token_ids[i] = eos_token_ids
        self.req_ids[i] = req_id
        self.index[req_id] = i
        return i

    def append_blocks(self, i: int, block_ids: list[int]) -> None:
        if block_ids:
            start = self.num_blocks[i]
            self.block_table[i, start : start + len(block_ids)] = block_ids
            self.num_blocks[i] = start + len(block_ids)

    def append_token(self, i: int, token_id: int) -> None:
        n = self.num_tokens[i]
        if n < self.token_ids.shape[1]:
            self.token_ids[i, n] = token_id
        self.num_tokens[i] = n + 1

    def remove(self, req_id: str) -> None:
        i = self.index.pop(req_id, None)
        if i is None:
            return
        self.params[i] = None
        self.req_ids[i] = None
        self._free.append(i)

    def output_token_ids(self, i: int) -> list[int]:
        start = self.num_prompt_tokens[i] - self.num_output_offset[i]
        return self.token_ids[i, start : self.num_tokens[i]].tolist()

    def prompt_token_ids(self, i: int) -> list[int]:
        return self.token_ids[i, : self.num_prompt_tokens[i] - self.num_output_offset[i]].tolist()


def _plain_greedy(p: SamplingParams) -> bool:
    return (
        p.is_greedy
        and p.logprobs is None
        and p.min_tokens == 0
        and p.presence_penalty == 0
        and p.frequency_penalty == 0
        and p.repetition_penalty == 1
        and not p.logit_bias
    )
