"""Exp(1) noise for seeded sampling rows: row b's noise depends only on seeds[b] (already mixed
with the output position) and the vocabulary size, whatever else is in the batch.

The Triton kernel draws every seeded row in one launch from Philox (`tl.rand`); the torch
reference seeds one generator per row. They give different (equally valid) streams, so a seed
reproduces its text on the same device type.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, use_triton


@triton.jit
def _seeded_exponential_kernel(q_ptr, seeds_ptr, vocab, stride_q, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    seed = tl.load(seeds_ptr + row)
    if seed >= 0:
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        u = tl.rand(seed, offs)
        noise = -tl.log(tl.maximum(u, 1.0e-20))
        tl.store(q_ptr + row.to(tl.int64) * stride_q + offs, noise, mask=offs < vocab)


def seeded_exponential_triton(q: Tensor, seeds: Tensor) -> None:
    """q [B, V] float32 (rows with seed -1 are left as they are); seeds int64 [B]."""
    rows, vocab = q.shape
    if rows == 0:
        return
    block = 4096
    _seeded_exponential_kernel[(rows, cdiv(vocab, block))](
        q, seeds, vocab, q.stride(0), BLOCK=block
    )


def seeded_exponential_ref(q: Tensor, seeds: Tensor) -> None:
    gen = None
    for i, seed in enumerate(seeds.tolist()):
        if seed < 0:
            continue
        if gen is None:
            gen = torch.Generator(device=q.device)
        gen.manual_seed(seed)
        q[i].exponential_(generator=gen)


def seeded_exponential(q: Tensor, seeds: Tensor) -> None:
    """Overwrites the rows of q [B, V] float32 whose seeds[b] (int64, non-negative) is set with
    Exp(1) noise drawn from that seed alone; rows with seed -1 keep their values."""
    if use_triton(q):
        seeded_exponential_triton(q, seeds)
    else:
        seeded_exponential_ref(q, seeds)
