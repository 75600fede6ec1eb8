"""`to_device`: one staged copy for several arrays, and `skip_unchanged` (GPU only: the staging
path is CUDA's)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from krait.runner.input_batch import to_device

pytestmark = pytest.mark.gpu


def _copies(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.key == "aten::copy_")


def test_skip_unchanged_copies_only_new_values() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    out = torch.full((16,), -7, dtype=torch.int32, device=dev)
    a, b = np.arange(3, dtype=np.int32), np.array([[5, 6]], dtype=np.int32)

    def put(x, y, into):
        return to_device([x, y], np.int32, dev, tag="test_skip", out=into, flat=True,
                         skip_unchanged=True)

    assert _copies(lambda: put(a, b, out)) == 1
    (va, vb), flat = put(a, b, out)  # the same values into the same buffer: no copy
    assert _copies(lambda: put(a, b, out)) == 0
    assert flat.data_ptr() == out.data_ptr() and vb.shape == (1, 2)
    assert va.tolist() == [0, 1, 2] and vb.tolist() == [[5, 6]]
    b2 = np.array([[5, 9]], dtype=np.int32)
    assert _copies(lambda: put(a, b2, out)) == 1  # a changed value
    assert out[:5].tolist() == [0, 1, 2, 5, 9]
    other = torch.zeros_like(out)
    assert _copies(lambda: put(a, b2, other)) == 1  # another buffer with the same values
    assert other[:5].tolist() == [0, 1, 2, 5, 9]
    # a copy without skip_unchanged forgets the memo: the next one copies again
    to_device([a, b2], np.int32, dev, tag="test_skip", out=out)
    assert _copies(lambda: put(a, b2, out)) == 1


def test_copies_of_one_tag_queue_without_waiting() -> None:
    """A ring of staging buffers: STAGING_RING copies of one tag queued behind busy device
    work leave the host free (the work is still running after them), and the copies past the
    ring, which reuse its buffers, still deliver their own values."""
    from krait.runner.input_batch import STAGING_RING

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    dev = torch.device("cuda")
    outs = [torch.full((4,), -1, dtype=torch.int32, device=dev) for _ in range(3 * STAGING_RING)]
    torch.cuda._sleep(2_000_000_000)  # ~1 s of device work ahead of the copies
    busy = torch.cuda.Event()
    busy.record()
    for j in range(STAGING_RING):
        to_device([np.full(4, j, dtype=np.int32)], np.int32, dev, tag="test_ring", out=outs[j])
    assert not busy.query()  # the host did not wait for the device
    for j in range(STAGING_RING, len(outs)):
        to_device([np.full(4, j, dtype=np.int32)], np.int32, dev, tag="test_ring", out=outs[j])
    torch.cuda.synchronize()
    assert [o.tolist() for o in outs] == [[j] * 4 for j in range(len(outs))]
