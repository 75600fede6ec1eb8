"""Device mirrors of RequestStates' token ids and block table, kept in step incrementally so
that input preparation runs on the device (krait/ops/prepare_inputs.py)."""

from __future__ import annotations

import numpy as np
import torch

from krait.ops.write_tokens import write_tokens
from krait.runner.input_batch import host_to_device


class DeviceTables:
    def __init__(self, max_reqs: int, max_model_len: int, max_blocks: int, device) -> None:
        self.device = device
        self.token_ids = torch.zeros(max_reqs, max_model_len, dtype=torch.int32, device=device)
        self.block_table = torch.zeros(max_reqs, max_blocks, dtype=torch.int32, device=device)
        self._rows: list[int] = []  # pending block-table writes (row, col, block id)
        self._cols: list[int] = []
        self._vals: list[int] = []

    def set_row(self, row: int, token_ids: list[int]) -> None:
        """A request takes `row`: its tokens so far (blocks arrive through add_blocks)."""
        if token_ids:
            self.token_ids[row, : len(token_ids)] = torch.tensor(
                token_ids, dtype=torch.int32
            ).to(self.device, non_blocking=True)

    def add_blocks(self, row: int, start: int, block_ids: list[int]) -> None:
        n = len(block_ids)
        self._rows += [row] * n
        self._cols += range(start, start + n)
        self._vals += block_ids

    def flush(self) -> None:
        """Applies the step's pending block-table writes in one scatter."""
        if not self._rows:
            return
        data = torch.tensor([self._rows, self._cols, self._vals], dtype=torch.int64)
        data = data.to(self.device, non_blocking=True)
        self.block_table[data[0], data[1]] = data[2].to(torch.int32)
        self._rows, self._cols, self._vals = [], [], []

    def write_sampled(self, rows: np.ndarray, positions: np.ndarray, tokens: torch.Tensor) -> None:
        """token_ids[rows[j], positions[j]] = tokens[j], from the sampler's device tensor."""
        if len(rows) == 0:
            return
        rp = host_to_device(np.stack([rows, positions]).astype(np.int64), self.device)
        write_tokens(self.token_ids, rp[0], rp[1], tokens)

    def write_known(self, rows: np.ndarray, positions: np.ndarray, tokens: np.ndarray) -> None:
        """token_ids[rows[j], positions[j]] = tokens[j] for tokens the host holds: rows,
        positions and tokens go in one host-to-device copy (`write_sampled` takes a device
        tensor of tokens: two)."""
        if len(rows) == 0:
            return
        rpt = host_to_device(np.stack([rows, positions, tokens]).astype(np.int64), self.device)
        write_tokens(self.token_ids, rpt[0], rpt[1], rpt[2])
