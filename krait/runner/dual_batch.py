"""Two half-batches of a decode graph, run on two streams.

A large decode batch's step alternates kernels bound by different resources: the projections
(cuBLAS tiles that fill half of the SMs at batch 256) and the recurrent state update (memory
bound). Every op of a decode forward treats its rows independently, so the batch's rows can run
as two half-batches whose forwards are independent branches of the captured graph: the GPU
runs kernels of both at once, and one half's GEMMs fill the SMs the other's leave idle.

Only decode graphs take this path (every row one token: each half's query_start_loc is the
leading run of the whole's, `arange`), without speculative decoding (one state slot per row)
and on one GPU; the halves write disjoint KV slots and state slots (padded rows: -1 in both).
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from krait.ops._dispatch import env
from krait.runner.attention_metadata import StepMetadata


def dual_batch_min_rows() -> int:
    """Smallest decode graph split in two (`KRAIT_DUAL_BATCH`; 0: never)."""
    return int(env("KRAIT_DUAL_BATCH", "0"))


@functools.cache
def side_stream(device_index: int) -> torch.cuda.Stream:
    """The second half's stream, one per device (cuBLAS keeps a workspace per stream)."""
    return torch.cuda.Stream(device=device_index)


def split_decode_meta(meta: StepMetadata, lo: int, hi: int) -> StepMetadata:
    """The metadata of rows [lo, hi) of a decode batch (one token a row): views of `meta`'s
    tensors, so that a graph's replay, which refills `meta` in place, refills both halves."""
    n = hi - lo
    attn = meta.attn
    if attn is not None:
        attn = dataclasses.replace(
            attn,
            num_reqs=min(max(attn.num_reqs - lo, 0), n),
            num_tokens=min(max(attn.num_tokens - lo, 0), n),
            query_start_loc=attn.query_start_loc[: n + 1],  # arange: the same leading values
            seq_lens=attn.seq_lens[lo:hi],
            block_table=attn.block_table[lo:hi],
            slot_mapping=attn.slot_mapping[lo:hi],
            max_query_len=1,
        )
    mamba = meta.mamba
    if mamba is not None:
        if mamba.num_prefills or mamba.num_accepted_tokens is not None:
            raise ValueError("dual batch: decode rows without speculation only")
        mamba = dataclasses.replace(
            mamba,
            num_decodes=min(max(mamba.num_decodes - lo, 0), n),
            num_decode_tokens=n,
            state_indices=mamba.state_indices[lo:hi],
            device_i32=None,
        )
    return dataclasses.replace(meta, attn=attn, mamba=mamba)


def dual_forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: StepMetadata) -> torch.Tensor:
    """model(input_ids, positions, meta) as two half-batches; the second on `side_stream` (on
    CUDA). Returns the hidden states of every row [N, H]."""
    n = input_ids.shape[0]
    h = n // 2
    first, second = split_decode_meta(meta, 0, h), split_decode_meta(meta, h, n)
    if input_ids.device.type != "cuda":
        return torch.cat([model(input_ids[:h], positions[:h], first),
                          model(input_ids[h:], positions[h:], second)])
    here = torch.cuda.current_stream()
    side = side_stream(input_ids.device.index)
    side.wait_stream(here)
    out_first = model(input_ids[:h], positions[:h], first)
    with torch.cuda.stream(side):
        out_second = model(input_ids[h:], positions[h:], second)
    here.wait_stream(side)
    return torch.cat([out_first, out_second])
