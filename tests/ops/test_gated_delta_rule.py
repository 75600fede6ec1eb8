"""gated_delta_chunk (prefill), gated_delta_update (decode) and gated_delta_verify (speculative
rows): the torch references against Hugging Face's Qwen3-Next functions, the Triton kernels
(through the interpreter on CPU) against the references, chunk and verify == token-by-token
updates."""

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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


def _gate_inputs(n, dtype, seed=7):
    gen = torch.Generator().manual_seed(seed)
    a = (torch.randn(n, HV, generator=gen) * 8).to(dtype)  # softplus past 20 and below -15
    b = (torch.randn(n, HV, generator=gen) * 3).to(dtype)
    A_log = (torch.rand(HV, generator=gen) * 3 - 1).to(dtype)
    dt_bias = torch.randn(HV, generator=gen).to(dtype)
    return a, b, A_log, dt_bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_update_forms_the_gates_from_a_and_b(dtype):
    """A_log, dt_bias given: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) (rounded
    to b's dtype) in the kernel == the gates formed in torch, then the plain update."""
    q, k, v, _, _, states = _inputs(5, dtype=dtype, seed=6)
    a, b, A_log, dt_bias = _gate_inputs(5, dtype)
    slots = torch.tensor([4, -1, 0, 2, 5], dtype=torch.int32)
    g, beta = gdu.gdn_gate_ref(a, b, A_log, dt_bias)
    assert g.dtype == torch.float32 and beta.dtype == dtype
    want_states = states.clone()
    want = gdu.gated_delta_update_ref(q, k, v, g, beta, want_states, slots)
    for impl in IMPLS:
        got_states = states.clone()
        got = UPDATE[impl](q, k, v, a, b, got_states, slots, A_log=A_log, dt_bias=dt_bias)
        rows = slots >= 0  # bf16 outputs: a rounding flip (summation order) is 1 ulp
        tol = 1e-5 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(got[rows].float(), want[rows].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)


def test_verify_forms_the_gates_from_a_and_b():
    lens = [3, 2]
    q, k, v, _, _, states = _inputs(sum(lens), num_slots=8, seed=8)
    a, b, A_log, dt_bias = _gate_inputs(sum(lens), torch.float32, seed=9)
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32)
    slots = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)
    idx = torch.tensor([1, 0], dtype=torch.int32)
    num_accepted = torch.tensor([2, 3], dtype=torch.int32)
    g, beta = gdu.gdn_gate_ref(a, b, A_log, dt_bias)
    want_states = states.clone()
    want = gdv.gated_delta_verify_ref(q, k, v, g, beta, want_states, qsl, slots, num_accepted,
                                      idx)
    for impl in IMPLS:
        got_states = states.clone()
        got = VERIFY[impl](q, k, v, a, b, got_states, qsl, slots, num_accepted, idx,
                           A_log=A_log, dt_bias=dt_bias)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_states, want_states, atol=1e-5, rtol=1e-5)


def test_prefill_windows_cut_at_sequence_starts():
    """The Triton prefill's windows are the packed batch's BT-token windows (16 interpreted):
    sequences that start and end inside a window, one spanning three, a skipped one between
    them, a token_seq passed in (longer than the batch, as a prefill graph's bucket has it).
    Padding tokens (past the last sequence, as a graph bucket pads them, and the skipped row's)
    hold NaN: nothing of them may reach the live rows."""
    from krait.ops.causal_conv1d import token_to_seq

    lens = [2, 3, 37, 4, 9]
    slots = torch.tensor([0, 1, 2, -1, 3], dtype=torch.int32)
    init = torch.tensor([1, 0, 1, 1, 1], dtype=torch.int32)
    T = sum(lens)
    pad = 7  # padding tokens after the last sequence
    q, k, v, g, beta, states = _inputs(T + pad, seed=10)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    live = torch.ones(T + pad, dtype=torch.bool)
    live[qsl[3]:qsl[4]] = False  # the skipped row's outputs are unspecified
    live[T:] = False
    for t in (q, k, v, g, beta):
        t[~live] = float("nan")
    s_ref, s_tri = states.clone(), states.clone()
    want = gdc.gated_delta_chunk_ref(q, k, v, g, beta, s_ref, qsl, slots, init)
    got = gdc.gated_delta_chunk_triton(q, k, v, g, beta, s_tri, qsl, slots, init,
                                       token_seq=token_to_seq(qsl, T + pad + 4))
    torch.testing.assert_close(got[live], want[live], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_tri, s_ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("lowp", [False, True])
def test_prefill_blocked_solve_at_the_real_window(lowp):
    """The launcher's real tiles under the interpreter: 64-token windows whose triangular solve
    merges four 16 x 16 diagonal-block inverses (the interpreted default, 32, merges two), over
    sequences that end on, just before and just after window boundaries, span several, and a
    skipped and an empty one between them. lowp: bf16 inputs with bf16 scratch (w, u, the
    chunk states), as compiled for the device (the interpreter's bf16 rounding truncates: the
    bound is loose, a wrong term would be O(1))."""
    lens = [64, 1, 63, 130, 0, 65, 60]
    slots = torch.tensor([0, 1, 2, 3, 4, -1, 5], dtype=torch.int32)
    init = torch.tensor([1, 0, 1, 1, 1, 1, 0], dtype=torch.int32)
    T = sum(lens)
    dtype = torch.bfloat16 if lowp else torch.float32
    q, k, v, g, beta, states = _inputs(T, num_slots=8, dtype=dtype, seed=5, kd=32, vd=24)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    s_ref, s_tri = states.clone(), states.clone()
    want = gdc.gated_delta_chunk_ref(q, k, v, g, beta, s_ref, qsl, slots, init)
    got = gdc.gated_delta_chunk_triton(q, k, v, g, beta, s_tri, qsl, slots, init,
                                       config=dict(BT=64, BC=16, LOWP=lowp))
    live = torch.ones(T, dtype=torch.bool)
    live[qsl[5]:qsl[6]] = False
    if not lowp:
        torch.testing.assert_close(got[live], want[live], atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(s_tri, s_ref, atol=1e-4, rtol=1e-4)
        return
    x, y = got[live].float(), want[live].float()
    assert ((x - y).norm() / y.norm()).item() < 3e-2
    assert ((s_tri - s_ref).norm() / s_ref.norm()).item() < 1e-2
    torch.testing.assert_close(x, y, atol=3e-2, rtol=3e-2)
    assert torch.equal(s_tri[[6, 7]], states[[6, 7]])  # untouched slots


@pytest.mark.parametrize("lens,bt", [([20, 7], 32), ([64, 1, 63, 130, 0, 65, 60], 64)])
def test_prefill_wu_lowp_stays_close_to_the_ref(lens, bt):
    """WU_LOWP: the prep kernel's w and u products on bf16 operands (Tinv, the scaled k and
    v), as fla's recompute_w_u, with bf16 scratch: still close to the float32 reference (the
    interpreter's bf16 casts truncate: loose bounds, a wrong term would be O(1)), and not the
    float32 products' result (the operands were cast)."""
    n = len(lens)
    q, k, v, g, beta, states = _inputs(sum(lens), num_slots=n + 2, dtype=torch.bfloat16, seed=3,
                                       kd=32, vd=24)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.arange(n, dtype=torch.int32)
    init = (torch.arange(n) % 2).to(torch.int32)
    s_ref = states.clone()
    want = gdc.gated_delta_chunk_ref(q, k, v, g, beta, s_ref, qsl, slots, init).float()
    got = {}
    for wu in (False, True):
        s_tri = states.clone()
        o = gdc.gated_delta_chunk_triton(q, k, v, g, beta, s_tri, qsl, slots, init,
                                         config=dict(BT=bt, BC=16, LOWP=True, WU_LOWP=wu))
        assert o.dtype == torch.bfloat16
        got[wu] = o.float(), s_tri
    o, s_tri = got[True]
    assert not torch.equal(o, got[False][0])
    assert ((o - want).norm() / want.norm()).item() < 3e-2
    assert ((s_tri - s_ref).norm() / s_ref.norm()).item() < 1e-2
    torch.testing.assert_close(o, want, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(s_tri, s_ref, atol=3e-2, rtol=3e-2)


@triton.jit
def _seq_of_rows_kernel(qsl_ptr, out_ptr, num_seqs, n, STEPS: tl.constexpr, BLOCK: tl.constexpr):
    rows = tl.arange(0, BLOCK)
    tl.store(out_ptr + rows, gdc.seq_of_rows(qsl_ptr, rows, num_seqs, STEPS), mask=rows < n)


@pytest.mark.parametrize("lens", [[5], [0, 3, 0, 0, 4, 1, 0], [2, 0, 1, 1, 7, 0, 3, 2, 0]])
def test_seq_of_rows_is_token_to_seq(lens):
    """The kernels' binary search over query_start_loc == token_to_seq, tokens past the last
    sequence (num_seqs) and empty sequences (at the ends, in runs) included."""
    from krait.ops.causal_conv1d import token_to_seq

    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    n = int(qsl[-1]) + 5
    out = torch.full((n,), -7, dtype=torch.int32)
    _seq_of_rows_kernel[(1,)](qsl, out, len(lens), n, STEPS=len(lens).bit_length(), BLOCK=32)
    assert torch.equal(out, token_to_seq(qsl, n))


@pytest.mark.parametrize("bt", [32, 64])
def test_prefill_without_token_seq_equals_with_it(bt):
    """SEQ_FROM_QSL (the default without a token_seq): the kernels' search over
    query_start_loc gives the outputs and states of the loaded token_seq exactly, over
    sequences with empty ones between and at the ends, a -1 slot and NaN padding after the
    last sequence; and close to the reference."""
    from krait.ops.causal_conv1d import token_to_seq

    lens = [0, 3, 40, 0, 0, 17, 5, 70, 1, 0]  # 10 sequences: a 4-step search
    slots = torch.tensor([0, 1, 2, 3, 4, -1, 5, 6, 7, 8], dtype=torch.int32)
    init = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1, 1, 0], dtype=torch.int32)
    T = sum(lens)
    pad = 9
    q, k, v, g, beta, states = _inputs(T + pad, num_slots=10, seed=11)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    live = torch.ones(T + pad, dtype=torch.bool)
    live[qsl[5]:qsl[6]] = False
    live[T:] = False
    for t in (q, k, v, g, beta):
        t[~live] = float("nan")
    cfg = dict(BT=bt, BC=16)
    s_seq, s_qsl = states.clone(), states.clone()
    o_seq = gdc.gated_delta_chunk_triton(q, k, v, g, beta, s_seq, qsl, slots, init,
                                         token_seq=token_to_seq(qsl, T + pad), config=cfg)
    o_qsl = gdc.gated_delta_chunk_triton(q, k, v, g, beta, s_qsl, qsl, slots, init,
                                         config=dict(cfg, SEQ_FROM_QSL=True))
    assert torch.equal(o_qsl[live], o_seq[live])
    assert torch.equal(s_qsl, s_seq)
    s_ref = states.clone()
    want = gdc.gated_delta_chunk_ref(q, k, v, g, beta, s_ref, qsl, slots, init)
    torch.testing.assert_close(o_qsl[live], want[live], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(s_qsl, s_ref, atol=1e-4, rtol=1e-4)


# ----------------------------------------------------------------------------- GPU, real size
# Qwen3-Next-80B's GDN: 16 key heads, 32 value heads, K = V = 128; bf16 activations, float32
# state; the Triton kernels against the torch references on the device (gpu_check.sh gdn and
# kernels).
R_HK, R_HV, R_K, R_V = 16, 32, 128, 128


def _real_inputs(T, num_slots, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    kw = dict(device="cuda", generator=gen)
    q = torch.randn(T, R_HK, R_K, **kw).bfloat16()
    k = torch.randn(T, R_HK, R_K, **kw).bfloat16()
    v = torch.randn(T, R_HV, R_V, **kw).bfloat16()
    a = torch.randn(T, R_HV, **kw).bfloat16()
    b = torch.randn(T, R_HV, **kw).bfloat16()
    A_log = (torch.rand(R_HV, **kw) * 3 - 4).bfloat16()  # slow decays: state kept long
    dt_bias = torch.randn(R_HV, **kw).bfloat16()
    states = torch.randn(num_slots, R_HV, R_K, R_V, **kw) * 0.1  # float32
    return q, k, v, a, b, A_log, dt_bias, states


def _close_bf16(got, want, states_got, states_want):
    """bf16 outputs and float32 states: elementwise within loose bounds, and in norm within 1%
    (a wrong head, block or token shows in both)."""
    for x, y in ((got.float(), want.float()), (states_got, states_want)):
        torch.testing.assert_close(x, y, atol=5e-2, rtol=5e-2)
        assert ((x - y).norm() / y.norm()).item() < 1e-2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("batch", [1, 64])
def test_update_real_size(batch):
    q, k, v, a, b, A_log, dt_bias, states = _real_inputs(batch, batch + 8)
    slots = torch.randperm(batch + 8, device="cuda")[:batch].to(torch.int32)
    if batch > 1:
        slots[7] = -1
    rows = slots >= 0
    s_ref, s_tri, s_gate = states.clone(), states.clone(), states.clone()
    g, beta = gdu.gdn_gate_ref(a, b, A_log, dt_bias)
    ref = gdu.gated_delta_update_ref(q, k, v, g, beta, s_ref, slots)
    tri = gdu.gated_delta_update_triton(q, k, v, g, beta, s_tri, slots)
    _close_bf16(tri[rows], ref[rows], s_tri, s_ref)
    fused = gdu.gated_delta_update_triton(q, k, v, a, b, s_gate, slots, A_log=A_log,
                                          dt_bias=dt_bias)
    _close_bf16(fused[rows], ref[rows], s_gate, s_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_verify_real_size():
    rows, cols = 64, 4  # 1 + k = 4 tokens a row, some rows shorter
    lens = [4 if r % 3 else 2 for r in range(rows)]
    T = sum(lens)
    q, k, v, a, b, A_log, dt_bias, states = _real_inputs(T, rows * cols + 4, seed=1)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                       device="cuda")
    slots = torch.arange(rows * cols, dtype=torch.int32, device="cuda").view(rows, cols)
    idx = torch.arange(rows, dtype=torch.int32, device="cuda")
    idx[5] = -1
    num_accepted = (torch.arange(rows, device="cuda") % cols + 1).to(torch.int32)
    s_ref, s_tri = states.clone(), states.clone()
    g, beta = gdu.gdn_gate_ref(a, b, A_log, dt_bias)
    ref = gdv.gated_delta_verify_ref(q, k, v, g, beta, s_ref, qsl, slots, num_accepted, idx)
    tri = gdv.gated_delta_verify_triton(q, k, v, a, b, s_tri, qsl, slots, num_accepted, idx,
                                        A_log=A_log, dt_bias=dt_bias)
    live = torch.ones(T, dtype=torch.bool, device="cuda")
    live[int(qsl[5]):int(qsl[6])] = False
    _close_bf16(tri[live], ref[live], s_tri, s_ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lens", [[8192], [1000, 37, 2500, 64, 600]])
def test_chunk_real_size(lens):
    """An 8k-token prefill (one sequence) and a varlen batch of five, bf16 with bf16 scratch
    (w, u, the chunk states) and their products on the tensor cores, against the float32
    token-by-token reference (a few seconds on the device for 8k tokens)."""
    T = sum(lens)
    q, k, v, a, b, A_log, dt_bias, states = _real_inputs(T, len(lens) + 2, seed=2)
    g, beta = gdu.gdn_gate_ref(a, b, A_log, dt_bias)
    qsl = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                       device="cuda")
    slots = torch.arange(1, len(lens) + 1, dtype=torch.int32, device="cuda")
    init = (torch.arange(len(lens), device="cuda") % 2).to(torch.int32)
    s_ref, s_tri = states.clone(), states.clone()
    tri = gdc.gated_delta_chunk_triton(q, k, v, g, beta, s_tri, qsl, slots, init)
    ref = gdc.gated_delta_chunk_ref(q, k, v, g, beta, s_ref, qsl, slots, init)
    _close_bf16(tri, ref, s_tri, s_ref)
