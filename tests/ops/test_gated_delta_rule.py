"""gated_delta_chunk (prefill), gated_delta_update (decode) and gated_delta_verify (speculative
rows): the torch references against Hugging Face's Qwen3-Next functions, the Triton kernels
(through the interpreter on CPU) against the references, chunk and verify == token-by-token
updates."""

import pytest
import torch
import torch.nn.functional as F

from krait.ops import gated_delta_chunk as gdc
from krait.ops import gated_delta_update as gdu
from krait.ops import gated_delta_verify as gdv

CHUNK = {"ref": gdc.gated_delta_chunk_ref, "triton": gdc.gated_delta_chunk_triton}
UPDATE = {"ref": gdu.gated_delta_update_ref, "triton": gdu.gated_delta_update_triton}
IMPLS = ["ref", "triton"]
HK, HV, K, V = 2, 6, 16, 24  # uneven: 3 value heads a key head, V not a power of two


def _inputs(T, num_slots=6, dtype=torch.float32, seed=0, hk=HK, hv=HV, kd=K, vd=V):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(T, hk, kd, generator=gen).to(dtype)  # [T, Hk, K]
    k = torch.randn(T, hk, kd, generator=gen).to(dtype)
    v = torch.randn(T, hv, vd, generator=gen).to(dtype)  # [T, Hv, V]
    a = torch.randn(T, hv, generator=gen)
    A = torch.rand(hv, generator=gen) * 8 + 0.1  # some heads decay fast
    g = -A * F.softplus(a)  # [T, Hv] float32, <= 0
    beta = torch.rand(T, hv, generator=gen).to(dtype)
    states = torch.randn(num_slots, hv, kd, vd, generator=gen) * 0.3  # [slots, Hv, K, V]
    return q, k, v, g, beta, states


def _hf_chunk(q, k, v, g, beta, init):
    """HF's chunked torch implementation on one sequence: (o [L, Hv, V], final state)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    o, S = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], chunk_size=16,
        initial_state=None if init is None else init[None], output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    return o[0], S[0]


LENS = [1, 5, 17, 40, 0, 3]
SLOTS = [3, 0, -1, 5, 2, 1]
INIT = [1, 0, 1, 1, 0, 0]


@pytest.mark.parametrize("impl", IMPLS)
def test_chunk_matches_hf(impl):
    T = sum(LENS)
    q, k, v, g, beta, states = _inputs(T)
    qsl = torch.tensor([0, *torch.tensor(LENS).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.tensor(SLOTS, dtype=torch.int32)
    init = torch.tensor(INIT, dtype=torch.int32)
    got_states = states.clone()
    o = CHUNK[impl](q, k, v, g, beta, got_states, qsl, slots, init)
    touched = set()
    for b, (slot, has) in enumerate(zip(SLOTS, INIT)):
        s, e = int(qsl[b]), int(qsl[b + 1])
        if slot < 0 or e == s:
            continue
        touched.add(slot)
        want_o, want_s = _hf_chunk(q[s:e], k[s:e], v[s:e], g[s:e], beta[s:e],
                                   states[slot] if has else None)
        torch.testing.assert_close(o[s:e], want_o, atol=2e-4, rtol=2e-4)
        torch.testing.assert_close(got_states[slot], want_s, atol=2e-4, rtol=2e-4)
    for slot in set(range(states.shape[0])) - touched:
        assert torch.equal(got_states[slot], states[slot])  # untouched slots


def test_chunk_triton_matches_ref_bf16():
    lens = [20, 7]
    q, k, v, g, beta, states = _inputs(sum(lens), dtype=torch.bfloat16, seed=3, kd=32, vd=16)
    qsl = torch.tensor([0, 20, 27], dtype=torch.int32)
    slots = torch.tensor([1, 4], dtype=torch.int32)
    init = torch.tensor([1, 0], dtype=torch.int32)
    s_ref, s_tri = states.clone(), states.clone()
    o_ref = gdc.gated_delta_chunk_ref(q, k, v, g, beta, s_ref, qsl, slots, init)
    o_tri = gdc.gated_delta_chunk_triton(q, k, v, g, beta, s_tri, qsl, slots, init)
    assert o_tri.dtype == torch.bfloat16
    torch.testing.assert_close(o_tri.float(), o_ref.float(), atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("impl", IMPLS)
def test_update_matches_chunk_token_by_token(impl):
    """A sequence through one chunk call == the same tokens through single-token updates."""
    L = 6
    q, k, v, g, beta, states = _inputs(L, seed=1)
    slot = 2
    ref_states = states.clone()
    o_chunk = gdc.gated_delta_chunk_ref(
        q, k, v, g, beta, ref_states, torch.tensor([0, L], dtype=torch.int32),
        torch.tensor([slot], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    got_states = states.clone()
    idx = torch.tensor([slot], dtype=torch.int32)
    for t in range(L):
        o = UPDATE[impl](q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1],
                         got_states, idx)
        torch.testing.assert_close(o[0], o_chunk[t], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, ref_states, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", IMPLS)
def test_update_skips_minus_one_rows(impl):
    q, k, v, g, beta, states = _inputs(4, seed=2)
    slots = torch.tensor([4, -1, 0, -1], dtype=torch.int32)
    want_states = states.clone()
    want = gdu.gated_delta_update_ref(q, k, v, g, beta, want_states, slots)
    got_states = states.clone()
    got = UPDATE[impl](q, k, v, g, beta, got_states, slots)
    rows = slots >= 0
    torch.testing.assert_close(got[rows], want[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_states[[1, 2, 3, 5]], states[[1, 2, 3, 5]])


VERIFY = {"ref": gdv.gated_delta_verify_ref, "triton": gdv.gated_delta_verify_triton}


@pytest.mark.parametrize("impl", IMPLS)
def test_verify_matches_token_by_token_updates(impl):
    """Rows of 1 + k tokens starting from column num_accepted - 1: outputs and the state after
    every position equal sequential updates; -1 rows (idx_mapping or slots) are skipped."""
    lens = [3, 1, 2, 3]
    S = 3
    q, k, v, g, beta, states = _inputs(sum(lens), num_slots=12, seed=4)
    qsl = torch.tensor([0, 3, 4, 6, 9], dtype=torch.int32)
    slots = torch.tensor([[0, 1, 2], [3, 4, 5], [6, 7, 8], [-1, -1, -1]], dtype=torch.int32)
    idx = torch.tensor([2, 0, -1, 1], dtype=torch.int32)
    num_accepted = torch.tensor([3, 1, 2], dtype=torch.int32)  # by request row
    got_states = states.clone()
    o = VERIFY[impl](q, k, v, g, beta, got_states, qsl, slots, num_accepted, idx)
    want_states = states.clone()
    for r, req in enumerate(idx.tolist()):
        if req < 0 or slots[r, 0] < 0:
            continue
        scratch = states[slots[r, num_accepted[req] - 1]].clone()[None]
        for j in range(lens[r]):
            t = int(qsl[r]) + j
            want = gdu.gated_delta_update_ref(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1],
                                              beta[t:t + 1], scratch,
                                              torch.tensor([0], dtype=torch.int32))
            torch.testing.assert_close(o[t], want[0], atol=1e-5, rtol=1e-5)
            want_states[slots[r, j]] = scratch[0]
    assert S == slots.shape[1]
    torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)
