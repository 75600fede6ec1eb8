"""The L2 prefetch hint (krait/ops/l2_prefetch.py): a no-op off CUDA, a grid that covers every
128-byte line of the range and, on a GPU, a launch (eager and inside a graph, on a side stream)
that leaves everything unchanged. Its PTX is checked in test_sm90_compile.py."""

import pytest
import torch

from krait.ops import l2_prefetch as lp


def test_cpu_tensor_is_a_no_op():
    t = torch.randn(1000, dtype=torch.bfloat16)
    before = t.clone()
    assert lp.l2_prefetch(t) is None
    assert lp.l2_prefetch(t, max_bytes=0) is None
    assert lp.l2_prefetch(t, max_bytes=100, evict_last=True, bulk=True) is None
    assert lp.l2_prefetch(torch.empty(0)) is None
    assert torch.equal(t, before)
    assert lp.l2_cache_bytes("cpu") == 0 == lp.l2_cache_bytes(t.device)


def test_needs_a_contiguous_tensor():
    with pytest.raises(ValueError, match="contiguous"):
        lp.l2_prefetch(torch.zeros(8, 8).t())


@pytest.mark.parametrize("nbytes", [1, 2, 127, 128, 129, 128 * 1024, 128 * 1024 + 1,
                                    3 << 20, 4 << 20, 8 << 20, 12 << 20, 67_108_864,
                                    67_108_864 + 6, 1 << 31])
@pytest.mark.parametrize("head", [0, 2, 126])
def test_grid_covers_every_line(nbytes, head):
    programs, per_program, num_lines = lp.prefetch_grid(nbytes, head)
    # every byte of [head, head + nbytes) lies on one of the lines
    assert num_lines == -(-(head + nbytes) // lp.LINE_BYTES)
    assert (head + nbytes - 1) // lp.LINE_BYTES < num_lines
    assert programs * per_program >= num_lines > (programs - 1) * per_program
    assert 1 <= programs <= lp.MAX_PROGRAMS
    chunks = per_program // lp.BLOCK
    assert per_program % lp.BLOCK == 0 and chunks & (chunks - 1) == 0


def test_grid_fills_the_sms_for_big_tensors():
    # 64 MB: 524288 lines, 4096 a program -> 128 programs
    assert lp.prefetch_grid(64 << 20) == (128, 4096, 524288)
    assert lp.prefetch_grid(100) == (1, lp.BLOCK, 1)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("evict_last,bulk", [(False, False), (True, False), (False, True)])
def test_prefetch_leaves_tensors_unchanged_gpu(evict_last, bulk):
    big = torch.randn(32 << 20, device="cuda", dtype=torch.bfloat16)  # 64 MB
    tiny = torch.randn(3, device="cuda", dtype=torch.bfloat16)
    odd = big[1:1001]  # starts 2 bytes into a line
    copies = [t.clone() for t in (big, tiny, odd)]
    for t in (big, tiny, odd):
        lp.l2_prefetch(t, evict_last=evict_last, bulk=bulk)
        lp.l2_prefetch(t, max_bytes=1000, evict_last=evict_last, bulk=bulk)
    torch.cuda.synchronize()
    for t, c in zip((big, tiny, odd), copies):
        assert torch.equal(t, c)
    assert lp.l2_cache_bytes(big.device) > 0


@pytest.mark.gpu
@cuda
def test_prefetch_on_a_side_stream_in_a_graph_gpu():
    w = torch.randn(8192, 2048, device="cuda", dtype=torch.bfloat16)  # 32 MB
    w_copy = w.clone()
    x = torch.randn(4096, device="cuda")
    y = torch.empty_like(x)
    lp.l2_prefetch(w)  # compiles outside the capture
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        main = torch.cuda.current_stream()
        side.wait_stream(main)
        with torch.cuda.stream(side):
            lp.l2_prefetch(w)
        torch.mul(x, 2.0, out=y)
        main.wait_stream(side)
    for _ in range(3):
        y.zero_()
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, x * 2.0) and torch.equal(w, w_copy)
