"""The runner's input preparation on the device: from the persistent per-request tables
(token ids and block table, indexed by req_state_idx) and the step's per-row counters, build the
flat token inputs and the step's block table.

For batch row b with r = idx_mapping[b] and tokens t in [qsl[b], qsl[b+1]):
  positions[t] = num_computed[b] + t - qsl[b]
  input_ids[t] = token_table[r, positions[t]]                  (0 when r == -1)
  slot_mapping[t] = block_table[r, pos // bs] * bs + pos % bs   (-1 when r == -1)
  step_block_table[b, :width] = block_table[r, :width]          (0 when r == -1: the null block)
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import use_triton


@triton.jit
def _prepare_inputs_kernel(
    idx_ptr, qsl_ptr, computed_ptr, token_table_ptr, block_table_ptr,
    input_ids_ptr, positions_ptr, slot_ptr, bt_out_ptr,
    block_size, width, stride_tt, stride_bt, stride_bo,
    HAS_BLOCKS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_W: tl.constexpr,
):
    b = tl.program_id(0)
    r = tl.load(idx_ptr + b)
    start = tl.load(qsl_ptr + b)
    end = tl.load(qsl_ptr + b + 1)
    c = tl.load(computed_ptr + b)
    live = r >= 0
    r64 = tl.maximum(r, 0).to(tl.int64)
    for t0 in range(start, end, BLOCK_T):
        t = t0 + tl.arange(0, BLOCK_T)
        m = t < end
        pos = c + (t - start)
        tok = tl.load(token_table_ptr + r64 * stride_tt + pos, mask=m & live, other=0)
        if HAS_BLOCKS:
            blk = tl.load(block_table_ptr + r64 * stride_bt + pos // block_size, mask=m & live,
                          other=0)
            slot = tl.where(live, blk.to(tl.int64) * block_size + pos % block_size, -1)
        else:  # no attention layers: no KV to write
            slot = tl.full([BLOCK_T], -1, tl.int64)
        tl.store(input_ids_ptr + t, tok.to(tl.int64), mask=m)
        tl.store(positions_ptr + t, pos.to(tl.int64), mask=m)
        tl.store(slot_ptr + t, slot, mask=m)
    for w0 in range(0, width, BLOCK_W):
        w = w0 + tl.arange(0, BLOCK_W)
        m = w < width
        blk = tl.load(block_table_ptr + r64 * stride_bt + w, mask=m & live, other=0)
        tl.store(bt_out_ptr + b * stride_bo + w, blk, mask=m)


def prepare_inputs_triton(
    idx_mapping: Tensor, query_start_loc: Tensor, num_computed: Tensor,
    token_table: Tensor, block_table: Tensor, block_size: int, width: int, num_tokens: int,
    out: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Triton launcher of `prepare_inputs`."""
    dev = idx_mapping.device
    rows = idx_mapping.shape[0]
    if out is not None:
        input_ids, positions, slots, bt_full = out
        bt = bt_full[:, :width]
    else:
        input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)  # [T]
        positions = torch.zeros(num_tokens, dtype=torch.int64, device=dev)  # [T]
        slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)  # [T]
        bt = torch.empty(rows, width, dtype=torch.int32, device=dev)  # [B, width]
    if rows:
        _prepare_inputs_kernel[(rows,)](
            idx_mapping, query_start_loc, num_computed, token_table, block_table,
            input_ids, positions, slots, bt,
            block_size, width, token_table.stride(0), block_table.stride(0), max(bt.stride(0), 1),
            HAS_BLOCKS=block_table.shape[1] > 0, BLOCK_T=256, BLOCK_W=128,
        )
    return input_ids, positions, slots, bt


def prepare_inputs_ref(
    idx_mapping: Tensor, query_start_loc: Tensor, num_computed: Tensor,
    token_table: Tensor, block_table: Tensor, block_size: int, width: int, num_tokens: int,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Torch reference of `prepare_inputs`."""
    dev = idx_mapping.device
    qsl = query_start_loc.long()
    lens = qsl[1:] - qsl[:-1]
    total = int(qsl[-1])
    row = torch.repeat_interleave(torch.arange(len(lens), device=dev), lens)  # [total]
    pos = num_computed.long()[row] + torch.arange(total, device=dev) - qsl[:-1][row]
    r = idx_mapping.long()[row]
    live = r >= 0
    rc = r.clamp(min=0)
    input_ids = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    positions = torch.zeros(num_tokens, dtype=torch.int64, device=dev)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64, device=dev)
    positions[:total] = pos
    if total:
        input_ids[:total] = torch.where(live, token_table[rc, pos].long(), 0)
        if block_table.shape[1]:
            blk = block_table[rc, (pos // block_size).clamp(max=block_table.shape[1] - 1)].long()
            slots[:total] = torch.where(live, blk * block_size + pos % block_size, -1)
    live_rows = idx_mapping >= 0
    bt = block_table[idx_mapping.long().clamp(min=0), :width]
    bt = torch.where(live_rows[:, None], bt, torch.zeros_like(bt))
    return input_ids, positions, slots, bt.contiguous()


def prepare_inputs(
    idx_mapping: Tensor, query_start_loc: Tensor, num_computed: Tensor,
    token_table: Tensor, block_table: Tensor, block_size: int, width: int, num_tokens: int,
    out: tuple[Tensor, Tensor, Tensor, Tensor] | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """idx_mapping int32 [B] (-1 = padding), query_start_loc int32 [B + 1], num_computed int32 [B],
    token_table int32 [R, max_model_len], block_table int32 [R, max_blocks]; returns input_ids,
    positions, slot_mapping (int64 [num_tokens]; tokens past query_start_loc[-1] are padding: 0,
    0, -1) and the step's block table int32 [B, width].

    `out` (input_ids, positions, slot_mapping, a block table of >= width columns): write there
    instead (a CUDA graph's captured inputs; the leading `width` columns of the table). Every
    token must then belong to a row: padding tokens are not filled."""
    if use_triton(idx_mapping):
        return prepare_inputs_triton(idx_mapping, query_start_loc, num_computed, token_table,
                                     block_table, block_size, width, num_tokens, out)
    result = prepare_inputs_ref(idx_mapping, query_start_loc, num_computed, token_table,
                                block_table, block_size, width, num_tokens)
    if out is None:
        return result
    for dst, src in zip(out[:3], result[:3]):
        dst.copy_(src)
    out[3][:, :width].copy_(result[3])
    return (*out[:3], out[3][:, :width])
