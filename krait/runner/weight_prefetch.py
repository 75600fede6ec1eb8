"""L2 weight prefetch inside decode CUDA graphs (opt-in: `KRAIT_L2_PREFETCH=1`).

At batch 1 a decode step reads every projection's weight once, but DRAM sits idle through the
small kernels between projections (norms, rotary, attention, the Mamba conv and state update)
and through each projection's own launch and ramp-up: qwen3-0.6b's 4-12 MB projections take
5-6 us for 1-3 us of data, mamba2's in_proj streams at 3.0 TB/s of the 4.1 the copy reaches
(docs/benchmarks.md). While a decode graph is captured, every projection's weight is pulled
into L2 (krait/ops/l2_prefetch.py) by a kernel on a side stream that starts when the kernel
before the `lead`-th previous projection has finished: the prefetch of W_j runs during
projection j-1 and the small kernels after it, and projection j finds its weight in L2.

Knobs: `KRAIT_L2_PREFETCH` = 0 (default: off) or the lead in projections (1, 2, ...);
`KRAIT_L2_PREFETCH_MB`: bytes of each weight prefetched at most (default: half the L2, so the
weight being read and the next one both fit); `KRAIT_L2_PREFETCH_MODE` = line (default: one
`prefetch.global.L2` a 128-byte line), evict_last, or bulk (sm_90's bulk prefetch).

Only capture installs the hook; a prefetch is a hint and never changes results.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import Tensor

from krait.ops._dispatch import env
from krait.ops.l2_prefetch import l2_cache_bytes, l2_prefetch
from krait.ops.linear import set_weight_hook


def prefetch_lead() -> int:
    """KRAIT_L2_PREFETCH as a lead in projections (0: off)."""
    value = env("KRAIT_L2_PREFETCH", "0") or "0"
    lead = int(value) if value.isdigit() else -1
    if lead < 0:
        raise ValueError(f"KRAIT_L2_PREFETCH must be a non-negative integer, got {value!r}")
    return lead


class WeightPrefetch:
    """Schedules one L2 prefetch per projection while installed (`capturing()`).

    `noted` lists, per projection in call order, (weight, bytes prefetched, index of the
    projection whose launch point it waits for, or -1 for none): the schedule, also kept on
    CPU, where no stream or kernel is involved."""

    def __init__(self, device: torch.device, lead: int, max_bytes: int | None = None,
                 mode: str | None = None) -> None:
        if lead < 1:
            raise ValueError(f"WeightPrefetch needs a lead of at least 1, got {lead}")
        self.device = device
        self.lead = lead
        if max_bytes is None:
            mb = env("KRAIT_L2_PREFETCH_MB")
            max_bytes = int(float(mb) * 2**20) if mb else l2_cache_bytes(device) // 2 or 1 << 24
        self.max_bytes = max_bytes
        self.mode = mode or env("KRAIT_L2_PREFETCH_MODE", "line")
        if self.mode not in ("line", "evict_last", "bulk"):
            raise ValueError(f"KRAIT_L2_PREFETCH_MODE must be line, evict_last or bulk, "
                             f"got {self.mode!r}")
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.noted: list[tuple[Tensor, int, int]] = []
        self._events: list[torch.cuda.Event] = []

    @contextlib.contextmanager
    def capturing(self) -> Iterator[None]:
        """Installs the projection hook for one captured forward; joins the side stream back
        into the current one at the end (a capture must end on its own stream)."""
        self.noted, self._events = [], []
        previous = set_weight_hook(self._note)
        try:
            yield
        finally:
            set_weight_hook(previous)
            if self.side is not None:
                torch.cuda.current_stream(self.device).wait_stream(self.side)
            self._events = []

    def _note(self, weight: Tensor) -> None:
        j = len(self.noted)
        trigger = max(j - self.lead, -1)
        nbytes = min(weight.nbytes, self.max_bytes) if trigger >= 0 else 0
        self.noted.append((weight, nbytes, trigger))
        if self.side is None:
            return
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))  # before projection j's launch
        self._events.append(event)
        if trigger < 0 or not weight.is_contiguous():
            return
        self.side.wait_event(self._events[trigger])
        with torch.cuda.stream(self.side):
            l2_prefetch(weight, nbytes, evict_last=self.mode == "evict_last",
                        bulk=self.mode == "bulk")


def weight_prefetch_for(device: torch.device) -> WeightPrefetch | None:
    """The prefetcher KRAIT_L2_PREFETCH asks for on `device`, or None (off)."""
    lead = prefetch_lead()
    return WeightPrefetch(device, lead) if lead else None
