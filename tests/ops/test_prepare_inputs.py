import numpy as np
import pytest
import torch

from krait.ops.prepare_inputs import prepare_inputs_ref, prepare_inputs_triton


def _case(seed: int, with_blocks: bool = True):
    g = np.random.default_rng(seed)
    R, L, bs = 6, 64, 4
    W = L // bs if with_blocks else 0
    token_table = torch.from_numpy(g.integers(0, 500, (R, L)).astype(np.int32))
    block_table = torch.from_numpy(g.permutation(R * W).reshape(R, W).astype(np.int32) + 1)
    # rows: a decode row, a prefill chunk from the middle, a fresh prefill, two padding rows
    idx = np.array([3, 0, 5, -1, -1], dtype=np.int32)
    computed = np.array([40, 9, 0, 0, 0], dtype=np.int32)
    sched = np.array([1, 13, 22, 1, 0], dtype=np.int32)
    qsl = np.concatenate([[0], np.cumsum(sched)]).astype(np.int32)
    num_tokens = int(qsl[-1]) + 3  # padded tail tokens
    width = 11 if with_blocks else 0
    args = (torch.from_numpy(idx), torch.from_numpy(qsl), torch.from_numpy(computed),
            token_table, block_table, bs, width, num_tokens)
    return args, (idx, computed, sched, qsl, token_table.numpy(), block_table.numpy(), bs)


@pytest.mark.parametrize("with_blocks", [True, False])
def test_triton_matches_reference(with_blocks):
    args, _ = _case(0, with_blocks)
    for a, b in zip(prepare_inputs_ref(*args), prepare_inputs_triton(*args)):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_reference_semantics():
    args, (idx, computed, sched, qsl, tt, bt, bs) = _case(1)
    input_ids, positions, slots, step_bt = prepare_inputs_ref(*args)
    for b in range(len(idx)):
        for t in range(qsl[b], qsl[b + 1]):
            pos = computed[b] + t - qsl[b]
            assert positions[t] == pos
            if idx[b] < 0:
                assert input_ids[t] == 0 and slots[t] == -1
            else:
                assert input_ids[t] == tt[idx[b], pos]
                assert slots[t] == bt[idx[b], pos // bs] * bs + pos % bs
        want = bt[idx[b], :11] if idx[b] >= 0 else np.zeros(11)
        assert step_bt[b].tolist() == list(want)
    tail = slice(int(qsl[-1]), None)
    assert slots[tail].eq(-1).all() and input_ids[tail].eq(0).all()
