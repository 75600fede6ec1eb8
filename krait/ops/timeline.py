"""Per-program timestamps of the decode chain's kernels: where a step's time goes inside the PDL
chain, which a profiler does not show (it times each kernel, not how the chain's kernels overlap
under PDL), nor does removing a kernel (what it costs, not why).

With KRAIT_TIMELINE=1, every launch of an instrumented kernel made while a CUDA graph is being
captured gets a slice of one device buffer, [programs, 4] int64 (launches outside a capture
write to a scratch slice, unrecorded), and each of its programs
writes the GPU's global timer (ns) there at ENTRY (its first instruction, with the id of the SM
it runs on in slot SM), WAITED (its PDL wait returned: the kernel before has finished and its
writes are visible), LOOPED (where a kernel marks the end of its main loop, before its
epilogue) and EXIT. `RECORDS` lists
the launches in stream order (name, offset into the buffer, programs);
`scripts/timeline_decode.py` replays a decode graph and prints them. A diagnostic: off, the
kernels compile exactly as without it (TL is a constexpr)."""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from krait.envs import get

# the stamps of a program's record (constexpr globals: kernels read them)
ENTRY, WAITED, EXIT = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)
SM, LOOPED = tl.constexpr(3), tl.constexpr(4)
_SLOTS = 8  # int64 a program: ENTRY, WAITED, EXIT, SM, LOOPED, spare
_SCRATCH = 1 << 18  # the buffer's first slots: where launches outside a capture write
_CAPACITY = 1 << 22  # int64 slots: 32 MiB, ~1M programs

RECORDS: list[tuple[str, int, int]] = []  # (kernel, first slot, programs), in launch order
_buffer: torch.Tensor | None = None
_next = _SCRATCH


@triton.jit
def stamp(TL: tl.constexpr, tl_ptr, WHICH: tl.constexpr):
    """Writes the global timer at slot WHICH of this program's record (a no-op unless TL)."""
    if TL:
        pid = (tl.program_id(2) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(0) \
            + tl.program_id(0)
        now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer; // $1", "=l,r", [pid],
                                        dtype=tl.int64, is_pure=False, pack=1)
        tl.store(tl_ptr + pid.to(tl.int64) * 8 + WHICH, now)
        if WHICH == ENTRY:
            sm = tl.inline_asm_elementwise("mov.u32 $0, %smid; // $1", "=r,r", [pid],
                                           dtype=tl.int32, is_pure=False, pack=1)
            tl.store(tl_ptr + pid.to(tl.int64) * 8 + SM, sm.to(tl.int64))


def timeline_args(name: str, grid: tuple[int, ...], device: torch.device) -> dict:
    """Launch keywords of an instrumented kernel with KRAIT_TIMELINE=1 on CUDA: while a graph
    is captured, TL and a new record's slice (until the buffer is full); outside a capture TL
    and a scratch slice nobody reads, so that the stamping variant of each kernel is compiled
    by the warm-up runs before a capture, never inside one (grids too large for the scratch
    get TL False). Otherwise TL False."""
    global _buffer, _next
    if get("KRAIT_TIMELINE") != "1" or device.type != "cuda":
        return {"TL": False}
    if _buffer is None:
        _buffer = torch.zeros(_CAPACITY, dtype=torch.int64, device=device)
    programs = math.prod(grid)
    if not torch.cuda.is_current_stream_capturing():
        if programs * _SLOTS > _SCRATCH:
            return {"TL": False}
        return {"TL": True, "tl_ptr": _buffer[:programs * _SLOTS]}
    if _next + programs * _SLOTS > _CAPACITY:
        return {"TL": False}
    view = _buffer[_next:_next + programs * _SLOTS]
    RECORDS.append((name, _next, programs))
    _next += programs * _SLOTS
    return {"TL": True, "tl_ptr": view}


def read() -> list[dict]:
    """Every record as {name, programs, entry, waited, looped, exit, sm}: int64 tensors on the
    CPU (ns; the SM's id for sm; 0 where a program did not write the slot), in launch order."""
    if _buffer is None:
        return []
    host = _buffer.cpu()
    out = []
    for name, first, programs in RECORDS:
        rec = host[first:first + programs * _SLOTS].view(programs, _SLOTS)
        out.append({"name": name, "programs": programs, "entry": rec[:, ENTRY.value],
                    "waited": rec[:, WAITED.value], "looped": rec[:, LOOPED.value],
                    "exit": rec[:, EXIT.value], "sm": rec[:, SM.value]})
    return out


def clear() -> None:
    """Zeroes the stamps (the records stay: they belong to captured graphs)."""
    if _buffer is not None:
        with torch.inference_mode():  # the buffer is born inside the engine's inference mode
            _buffer.zero_()
