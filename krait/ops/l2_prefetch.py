"""Fire-and-forget L2 prefetch of a tensor's bytes: `l2_prefetch(w)` asks the GPU to pull `w`
into L2 and returns; nothing waits for the data to land.

Meant for a side stream inside a decode CUDA graph: while the small kernels of one projection
run, the next projection's weight is pulled into L2, so DRAM stays busy through the launch and
ramp-up of each batch-1 kernel (qwen3-0.6b projections of 4-8 MB take 5-6 us for 1-2 us of data,
docs/benchmarks.md) and the kernel that reads it finds it in L2. What fits is bounded by the L2:
`l2_cache_bytes` (the device properties' L2_cache_size, the H200's included). Each lane of the
kernel issues one PTX `prefetch.global.L2` for one 128-byte line (`::evict_last` on request,
sm_80+); `bulk=True` issues sm_90's `cp.async.bulk.prefetch.L2` over 8 KB chunks instead (an
A/B alternative). A hint only: it reads nothing back and writes nothing, so results never
change.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from krait.ops._dispatch import cdiv, interpreting, next_pow2

LINE_BYTES = 128
BLOCK = 1024  # lanes (lines) per chunk: 4 warps of 8 lines a thread
MAX_PROGRAMS = 132  # the H200's SM count: one program an SM at most
BULK_CHUNK, BULK_BLOCK = 8192, 128  # the bulk form: bytes a lane, lanes a program


@triton.jit
def _l2_prefetch_kernel(ptr, num_lines, head, LINES_PER_PROGRAM: tl.constexpr,
                        BLOCK: tl.constexpr, EVICT_LAST: tl.constexpr = False):
    # line i starts at ptr - head + 128 i (head: ptr's offset into its 128-byte line); line 0
    # is addressed at ptr itself, so no address falls outside the tensor
    base = ptr.to(tl.pointer_type(tl.int8))
    first = tl.program_id(0) * LINES_PER_PROGRAM
    stop = tl.minimum(first + LINES_PER_PROGRAM, num_lines)
    lanes = tl.arange(0, BLOCK)
    for start in range(first, stop, BLOCK):
        # inline asm cannot be masked: lanes past the end prefetch the last line again
        line = tl.minimum(start + lanes, num_lines - 1)
        addr = base + tl.maximum(line.to(tl.int64) * 128 - head, 0)
        if EVICT_LAST:
            tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)
        else:
            tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;",
                                      "=r,l", [addr], dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _l2_prefetch_bulk_kernel(ptr, nbytes, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    # sm_90's bulk (TMA) prefetch: one instruction a lane for CHUNK bytes; ptr and nbytes are
    # multiples of 16. Lanes past the end prefetch the last chunk again
    base = ptr.to(tl.pointer_type(tl.int8))
    offs = (tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)).to(tl.int64) * CHUNK
    offs = tl.minimum(offs, (nbytes - 1) // CHUNK * CHUNK)
    size = tl.minimum(nbytes - offs, CHUNK).to(tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
                              "=r,l,r", [base + offs, size], dtype=tl.int32, is_pure=False,
                              pack=1)


def prefetch_grid(nbytes: int, head: int = 0) -> tuple[int, int, int]:
    """(programs, lines_per_program, num_lines) covering `nbytes` that start `head` bytes into a
    128-byte line: at most MAX_PROGRAMS programs, each over a power-of-two multiple of BLOCK
    lines (few recompiles)."""
    num_lines = cdiv(head + nbytes, LINE_BYTES)
    target = min(MAX_PROGRAMS, cdiv(num_lines, BLOCK))
    lines_per_program = next_pow2(cdiv(cdiv(num_lines, target), BLOCK)) * BLOCK
    return cdiv(num_lines, lines_per_program), lines_per_program, num_lines


def l2_prefetch(t: Tensor, max_bytes: int | None = None, evict_last: bool = False,
                bulk: bool = False) -> None:
    """Asks the GPU to pull the first min(t.nbytes, max_bytes) bytes of the contiguous tensor `t`
    into L2, on the current stream, without waiting. A no-op off CUDA, under the interpreter
    (which cannot run inline PTX) and for zero bytes. `evict_last`: the lines are kept in L2
    ahead of others; `bulk` (sm_90+): `cp.async.bulk.prefetch.L2` of 8 KB chunks instead of a
    prefetch per line, for a 16-byte-aligned start (else the per-line form), leaving out a tail
    of under 16 bytes and ignoring `evict_last`."""
    if not t.is_contiguous():
        raise ValueError("l2_prefetch needs a contiguous tensor")
    nbytes = t.nbytes if max_bytes is None else min(t.nbytes, max_bytes)
    if not t.is_cuda or nbytes <= 0 or interpreting():
        return
    if bulk and t.data_ptr() % 16 == 0 and nbytes >= 16:
        nbytes -= nbytes % 16
        grid = (cdiv(nbytes, BULK_CHUNK * BULK_BLOCK),)
        _l2_prefetch_bulk_kernel[grid](t, nbytes, CHUNK=BULK_CHUNK, BLOCK=BULK_BLOCK, num_warps=4)
        return
    head = t.data_ptr() % LINE_BYTES
    programs, lines_per_program, num_lines = prefetch_grid(nbytes, head)
    _l2_prefetch_kernel[(programs,)](t, num_lines, head, LINES_PER_PROGRAM=lines_per_program,
                                     BLOCK=BLOCK, EVICT_LAST=evict_last, num_warps=4)


def l2_cache_bytes(device: torch.device | str | int) -> int:
    """The L2 cache size of a CUDA device in bytes (0 for any other device)."""
    device = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if device.type != "cuda":
        return 0
    return torch.cuda.get_device_properties(device).L2_cache_size
