"""Per-request token statistics for the repetition / presence / frequency penalties, kept on the
device by req_state_idx so a step never rebuilds them from token lists."""

from __future__ import annotations

import numpy as np
import torch

from krait.runner.input_batch import host_to_device
from krait.sampling_params import SamplingParams


def uses_penalties(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0 or p.repetition_penalty != 1.0


class PenaltyState:
    """`output_counts` [max_reqs, V] float32 and `prompt_mask` [max_reqs, V] bool, allocated the
    first time a request with a penalty arrives; a row is rebuilt when a request takes it."""

    def __init__(self, max_reqs: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.active = np.zeros(max_reqs, dtype=bool)
        self.output_counts: torch.Tensor | None = None
        self.prompt_mask: torch.Tensor | None = None

    def add(self, row: int, params: SamplingParams | None, prompt: list[int], outputs: list[int]):
        self.active[row] = params is not None and uses_penalties(params)
        if not self.active[row]:
            return
        if self.output_counts is None:
            n, v = self.active.shape[0], self.vocab_size
            self.output_counts = torch.zeros(n, v, dtype=torch.float32, device=self.device)
            self.prompt_mask = torch.zeros(n, v, dtype=torch.bool, device=self.device)
        self.output_counts[row] = 0
        self.prompt_mask[row] = False
        if prompt:
            self.prompt_mask[row].index_fill_(0, host_to_device(prompt, self.device), True)
        if outputs:
            ids = host_to_device(outputs, self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones(len(outputs), device=self.device))

    def record(self, rows: np.ndarray, tokens: torch.Tensor) -> None:
        """Counts each row's newly sampled token (rows without penalties are left alone)."""
        keep = self.active[rows]
        if self.output_counts is None or not keep.any():
            return
        sel = host_to_device(np.nonzero(keep)[0], tokens.device)
        r = host_to_device(rows[keep].astype(np.int64), tokens.device)
        self.output_counts.index_put_(
            (r, tokens[sel]), torch.ones(len(sel), device=tokens.device), accumulate=True
        )

    def gather(self, rows: np.ndarray) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """([B, V] counts, [B, V] prompt mask) of these rows, or (None, None) if none uses them."""
        if self.output_counts is None or not self.active[rows].any():
            return None, None
        r = host_to_device(rows.astype(np.int64), self.device)
        return self.output_counts[r], self.prompt_mask[r]
