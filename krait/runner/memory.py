"""GPU memory sizing: how much of the card the KV blocks and state slots may take."""

from __future__ import annotations

import logging

import torch

from krait.config import EngineConfig

logger = logging.getLogger(__name__)

# Room kept for CUDA graphs, the sampler's [batch, vocab] temporaries and allocator slack.
_RESERVE_BYTES = 1 << 30
# the piecewise graphs' pool over the activation peak of one eager forward at its largest
# bucket (measured 3.0-3.7x on the H200: docs/benchmarks.md)
_PIECEWISE_MARGIN = 4.0
# the prefill graphs in the same pool, on top of the pieces' (measured 2.6-5.8x the peak)
_PREFILL_GRAPHS_MARGIN = 6.0


def profile_free_memory(runner, config: EngineConfig) -> int:
    """Runs a dummy forward at `max_num_batched_tokens` over a one-block, one-slot cache and
    returns the bytes left for the cache under `gpu_memory_utilization` of the card."""
    ms = runner.model_state
    runner.initialize_cache(2 if ms.kv_bytes_per_block() else 0, 1 if ms.slots_per_request else 0)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    temp_cache = torch.cuda.memory_allocated()
    max_tokens = config.scheduler.max_num_batched_tokens
    runner.profile_run(max_tokens)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    # piecewise graphs keep their own pool: the activations of a forward of their largest
    # bucket, with a margin for the pool's segments and the mixers' static buffers
    piecewise = runner.piecewise_max_tokens()
    piecewise_bytes = 0
    if piecewise:
        piecewise_peak = peak  # the forward above, when it was already that size
        if piecewise < max_tokens:
            torch.cuda.reset_peak_memory_stats()
            runner.profile_run(piecewise)
            torch.cuda.synchronize()
            piecewise_peak = torch.cuda.max_memory_allocated()
        margin = _PIECEWISE_MARGIN + _PREFILL_GRAPHS_MARGIN
        piecewise_bytes = int((piecewise_peak - temp_cache) * margin)
    # speculative verify graphs keep [rows * (1 + k), vocab] logits per capture size in the
    # graph pool (sizes share it, the largest dominates): twice the largest, for its float copies
    k = runner.num_spec_tokens
    if k and not config.enforce_eager:
        elem = torch.empty((), dtype=config.model.dtype).element_size()
        piecewise_bytes += 2 * config.scheduler.max_num_seqs * (1 + k) * config.model.vocab_size * elem
    free, total = torch.cuda.mem_get_info()
    non_torch = (total - free) - torch.cuda.memory_reserved()
    ms.allocate_caches(0, 0)  # drop the temporary cache
    temp_cache -= torch.cuda.memory_allocated()
    torch.cuda.empty_cache()
    budget = int(
        total * config.cache.gpu_memory_utilization - (peak - temp_cache) - non_torch
        - _RESERVE_BYTES - piecewise_bytes
    )
    logger.info(
        "memory: total %.1f GiB, peak model use %.2f GiB, other %.2f GiB, piecewise graphs "
        "%.2f GiB, cache budget %.2f GiB", total / 2**30, (peak - temp_cache) / 2**30,
        non_torch / 2**30, piecewise_bytes / 2**30, budget / 2**30,
    )
    return max(budget, 0)
