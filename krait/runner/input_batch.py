"""InputBatch: the flat inputs of one model step, built each step from RequestStates."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np
import torch

from krait.ops.spec_commit import apply_rejections


@dataclass
class InputBatch:
    num_reqs: int  # real rows; rows [num_reqs, num_reqs_padded) are padding
    num_reqs_padded: int
    num_tokens: int  # real tokens
    num_tokens_padded: int
    req_ids: list[str]
    idx_mapping: torch.Tensor  # int32 [num_reqs_padded]: batch row -> req_state_idx, -1 = padding
    idx_mapping_np: np.ndarray
    query_start_loc: torch.Tensor  # int32 [num_reqs_padded + 1]
    query_start_loc_np: np.ndarray
    seq_lens: torch.Tensor  # int32 [num_reqs_padded]
    seq_lens_cpu_upper_bound: np.ndarray  # int32 [num_reqs_padded]
    num_computed_tokens_np: np.ndarray  # int32 [num_reqs_padded]
    num_scheduled_tokens_np: np.ndarray  # int32 [num_reqs_padded]
    is_prefilling: np.ndarray  # bool [num_reqs_padded]
    num_decodes: int  # decode rows come first in the batch
    num_draft_tokens_per_req: np.ndarray | None  # None without speculative decoding
    input_ids: torch.Tensor  # int64 [num_tokens_padded]
    positions: torch.Tensor  # int64 [num_tokens_padded]
    slot_mapping: torch.Tensor  # int64 [num_tokens_padded], -1 for padding tokens
    # int32 [num_reqs_padded, width]: width covers this step's longest row (not max_model_len),
    # except for CUDA-graph capture batches, which take the full table width
    block_table: torch.Tensor
    logits_indices: torch.Tensor  # int64 [num_reqs]: last scheduled token of each row
    # int32, flat: idx_mapping, query_start_loc, seq_lens and the rows' computed counts are views
    # of it (device-side preparation only), then with `rejections` the rows' known rejections
    # and spec_delta; a decode graph's replay refills it in one copy
    device_i32: torch.Tensor | None = None
    # asynchronous speculative steps: int32 [num_reqs_padded] on the device, the positions each
    # row's host counters are ahead of the true ones (krait/ops/spec_commit.py); else None
    spec_delta: torch.Tensor | None = None


def build_input_batch(
    states,
    req_ids: list[str],
    num_scheduled: list[int],
    block_size: int,
    device: torch.device,
    num_reqs_padded: int | None = None,
    num_tokens_padded: int | None = None,
    pad_decode: bool = False,
    full_block_table: bool = False,
    tables=None,
    into: InputBatch | None = None,
    pad_tokens_per_row: int = 1,
    rejections: tuple[torch.Tensor, np.ndarray] | None = None,
) -> InputBatch:
    """Gathers the step's rows from RequestStates (`states`) into flat tensors.

    `req_ids` must already be ordered decode rows first. Padding rows get idx_mapping -1 and
    the null block; with `pad_decode` (CUDA-graph decode batches) each holds one token of
    sequence length 1 whose KV write is skipped (slot -1), else they hold no token. With `tables`
    (DeviceTables, on the GPU) the token inputs and the step's block table are built on the device
    from the persistent tables; otherwise in numpy from `states`.

    `into` (with `tables`): a CUDA graph's captured batch of the same padded size, every token
    in a row: the device tensors are written into its buffers, so the replay copies nothing.
    `pad_tokens_per_row`: tokens of each `pad_decode` padding row (1 + k in a speculative
    verify graph).
    `rejections` (with `tables`; asynchronous speculative steps): (the device's rejected
    positions per request row, the host's known part of them): the rows' counters are corrected
    on the device before the inputs are gathered (krait/ops/spec_commit.py), their known part
    sent in the same copy as the other per-row inputs (an `into` batch must have been built
    with rejections too, for the room)."""
    num_reqs = len(req_ids)
    num_reqs_padded = num_reqs_padded or num_reqs
    idx = np.full(num_reqs_padded, -1, dtype=np.int32)
    idx[:num_reqs] = [states.index[r] for r in req_ids]
    sched = np.zeros(num_reqs_padded, dtype=np.int32)
    sched[:num_reqs] = num_scheduled
    if pad_decode:
        sched[num_reqs:] = pad_tokens_per_row
    qsl = np.zeros(num_reqs_padded + 1, dtype=np.int32)
    np.cumsum(sched, out=qsl[1:])
    num_tokens = int(qsl[num_reqs])
    num_tokens_padded = num_tokens_padded or num_tokens

    computed = np.zeros(num_reqs_padded, dtype=np.int32)
    computed[:num_reqs] = states.num_computed_tokens[idx[:num_reqs]]
    seq_lens = computed + sched  # padded decode rows: length 1 over the null block
    is_prefilling = np.zeros(num_reqs_padded, dtype=bool)
    is_prefilling[:num_reqs] = computed[:num_reqs] < states.num_prompt_tokens[idx[:num_reqs]]
    num_decodes = int(np.count_nonzero(~is_prefilling[:num_reqs]))

    full = states.block_table.shape[1]
    width = full if full_block_table else min(-(-int(seq_lens.max(initial=1)) // block_size), full)
    device_i32 = spec_delta = None
    if tables is not None:
        from krait.ops.prepare_inputs import prepare_inputs

        out = None
        if into is not None:
            if (into.num_reqs_padded, into.num_tokens_padded) != (
                num_reqs_padded, num_tokens_padded
            ) or qsl[-1] != num_tokens_padded:
                raise ValueError("into: a captured batch of the same rows, every token in a row")
            out = (into.input_ids, into.positions, into.slot_mapping, into.block_table)
        arrays = [idx, qsl, seq_lens, computed]
        if rejections is not None:  # in the same copy: each row's known rejections, its delta
            known = rejections[1]
            known_b = np.where(idx >= 0, known[np.maximum(idx, 0)], 0)  # [num_reqs_padded]
            arrays += [known_b, np.zeros(num_reqs_padded, dtype=np.int32)]
        views, device_i32 = to_device(
            arrays, np.int32, device, flat=True,
            out=into.device_i32 if into is not None else None,
        )
        idx_t, qsl_t, seq_lens_t, computed_t = views[:4]
        if rejections is not None:
            known_t, spec_delta = views[4:]  # int32 [num_reqs_padded] each
            apply_rejections(idx_t, known_t, rejections[0], computed_t, seq_lens_t, spec_delta)
        if into is not None:  # decode graphs: the logits of every row (verify graphs: unused)
            logits_indices_t = _row_indices(num_reqs_padded, device)[:num_reqs]
        else:
            (logits_indices_t,) = to_device(
                [qsl[1 : num_reqs + 1].astype(np.int64) - 1], np.int64, device
            )
        input_ids_t, positions_t, slot_mapping_t, block_table_t = prepare_inputs(
            idx_t, qsl_t, computed_t, tables.token_ids, tables.block_table, block_size, width,
            num_tokens_padded, out=out,
        )
    else:
        (idx_t, qsl_t, seq_lens_t, block_table_t, input_ids_t, positions_t, slot_mapping_t,
         logits_indices_t) = _host_inputs(
            states, idx, qsl, computed, sched, seq_lens, num_reqs, num_tokens, num_tokens_padded,
            block_size, width, device,
        )
    return InputBatch(
        num_reqs=num_reqs,
        num_reqs_padded=num_reqs_padded,
        num_tokens=num_tokens,
        num_tokens_padded=num_tokens_padded,
        req_ids=req_ids,
        idx_mapping=idx_t,
        idx_mapping_np=idx,
        query_start_loc=qsl_t,
        query_start_loc_np=qsl,
        seq_lens=seq_lens_t,
        seq_lens_cpu_upper_bound=seq_lens,
        num_computed_tokens_np=computed,
        num_scheduled_tokens_np=sched,
        is_prefilling=is_prefilling,
        num_decodes=num_decodes,
        num_draft_tokens_per_req=None,
        input_ids=input_ids_t,
        positions=positions_t,
        slot_mapping=slot_mapping_t,
        block_table=block_table_t,
        logits_indices=logits_indices_t,
        device_i32=device_i32,
        spec_delta=spec_delta,
    )


_ROWS: dict[torch.device, torch.Tensor] = {}


def _row_indices(n: int, device: torch.device) -> torch.Tensor:
    """int64 [0, n) on `device`, from a cached tensor (no launch once it is long enough)."""
    t = _ROWS.get(device)
    if t is None or t.numel() < n:
        t = _ROWS[device] = torch.arange(max(n, 256), dtype=torch.int64, device=device)
    return t[:n]


class _Staging:
    """A ring of STAGING_RING pinned host buffers, each one's last host-to-device copy tracked
    by an event, so that none is rewritten while a copy out of it may still be running. The
    copies queue behind the step before them: with one buffer, a second copy of the same tag
    in a step (a draft model's chain after the target's verify step) made the host wait for
    the first, i.e. for the device's previous work; the ring lets the host run that far ahead
    before it waits."""

    def __init__(self) -> None:
        self.bufs: list[torch.Tensor | None] = [None] * STAGING_RING
        self.events: list[torch.cuda.Event | None] = [None] * STAGING_RING
        self.next = 0  # the ring's buffer the next copy takes
        # (the `out` tensor, weakly, and the host values last copied into it): for skip_unchanged
        self.last: tuple[weakref.ref, np.ndarray] | None = None


STAGING_RING = 4


_STAGING: dict[tuple[str, str], _Staging] = {}


def _host_inputs(
    states, idx, qsl, computed, sched, seq_lens, num_reqs, num_tokens, num_tokens_padded,
    block_size, width, device,
):
    """The token inputs and the step's block table gathered in numpy, moved in two copies."""
    real = idx[:num_reqs]
    row_of_token = np.repeat(np.arange(num_reqs, dtype=np.int64), sched[:num_reqs])
    pos = computed[:num_reqs].astype(np.int64)[row_of_token] + (
        np.arange(num_tokens, dtype=np.int64) - qsl[:num_reqs].astype(np.int64)[row_of_token]
    )
    positions = np.zeros(num_tokens_padded, dtype=np.int64)
    positions[:num_tokens] = pos
    input_ids = np.zeros(num_tokens_padded, dtype=np.int64)
    input_ids[:num_tokens] = states.token_ids[real[row_of_token], pos]
    block_table = np.zeros((len(idx), width), dtype=np.int32)
    block_table[:num_reqs] = states.block_table[real, :width]
    slot_mapping = np.full(num_tokens_padded, -1, dtype=np.int64)
    if block_table.shape[1] > 0 and num_tokens:
        blk = block_table[row_of_token, pos // block_size].astype(np.int64)
        slot_mapping[:num_tokens] = blk * block_size + pos % block_size
    i32 = [idx, qsl, seq_lens, block_table]
    i64 = [input_ids, positions, slot_mapping, qsl[1 : num_reqs + 1].astype(np.int64) - 1]
    (idx_t, qsl_t, seq_lens_t, block_table_t) = to_device(i32, np.int32, device)
    (input_ids_t, positions_t, slot_mapping_t, logits_indices_t) = to_device(i64, np.int64, device)
    return (idx_t, qsl_t, seq_lens_t, block_table_t, input_ids_t, positions_t, slot_mapping_t,
            logits_indices_t)


def host_to_device(values, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A small host array or list on `device` without blocking the host. Every host-to-device
    copy inside a step goes through here or `to_device`: a blocking copy would wait for the
    device to finish the step before (docs/async_scheduling.md). The source may be pageable:
    the driver stages it before this returns, so it can be freed at once."""
    t = torch.from_numpy(values) if isinstance(values, np.ndarray) else torch.tensor(values)
    if dtype is not None:
        t = t.to(dtype)
    return t.to(device, non_blocking=True)


def device_to_host(tensors: list[torch.Tensor]) -> list[np.ndarray]:
    """Small device tensors on the host as numpy arrays, with one wait: every copy is queued
    without blocking, then one event is waited for (on CPU: the tensors' own arrays)."""
    if not tensors or not tensors[0].is_cuda:
        return [t.numpy() for t in tensors]
    host = [t.to("cpu", non_blocking=True) for t in tensors]
    event = torch.cuda.Event()
    event.record()
    event.synchronize()
    return [t.numpy() for t in host]


def to_device(
    arrays: list[np.ndarray], dtype, device: torch.device, tag: str = "batch",
    out: torch.Tensor | None = None, flat: bool = False, skip_unchanged: bool = False,
):
    """Moves several small arrays of one dtype to `device` in one copy (through a pinned
    staging buffer per (dtype, tag) on CUDA) and returns views shaped like the arrays.

    `out`: a flat device tensor of at least their total size to copy into (a CUDA graph's
    captured inputs) instead of a new one. `flat`: also return the flat tensor the views share,
    as (views, flat). `skip_unchanged` (with `out`, on CUDA): no copy when this tag's last copy
    went into the same `out` with the same values — for inputs that only this function writes
    and that rarely change between steps (a decode graph's state slots)."""
    sizes = [a.size for a in arrays]
    total = sum(sizes)
    host = np.concatenate([a.reshape(-1) for a in arrays]).astype(dtype, copy=False)
    if device.type == "cuda":
        st = _STAGING.setdefault((np.dtype(dtype).name, tag), _Staging())
        if skip_unchanged and out is not None and st.last is not None and (
            st.last[0]() is out and np.array_equal(st.last[1], host)
        ):
            return _views(out[:total], arrays, sizes, flat)
        st.last = (weakref.ref(out), host.copy()) if skip_unchanged and out is not None else None
        i = st.next
        st.next = (i + 1) % STAGING_RING
        event, buf = st.events[i], st.bufs[i]
        if event is not None:
            event.synchronize()
        if buf is None or buf.numel() < total:
            buf = st.bufs[i] = torch.empty(max(total, 1 << 16),
                                           dtype=torch.from_numpy(host[:0]).dtype,
                                           pin_memory=True)
        buf[:total].numpy()[:] = host
        if out is not None:
            dev = out[:total]
            dev.copy_(buf[:total], non_blocking=True)
        else:
            dev = buf[:total].to(device, non_blocking=True)
        if event is None:
            event = st.events[i] = torch.cuda.Event()
        event.record()
    elif out is not None:
        dev = out[:total]
        dev.copy_(torch.from_numpy(host))
    else:
        dev = torch.from_numpy(host)
    return _views(dev, arrays, sizes, flat)


def _views(dev: torch.Tensor, arrays: list[np.ndarray], sizes: list[int], flat: bool):
    views, off = [], 0
    for a, n in zip(arrays, sizes):
        views.append(dev[off : off + n].view(a.shape))
        off += n
    return (views, dev) if flat else views
