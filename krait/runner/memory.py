"""GPU memory sizing: how much of the card the KV blocks and state slots may take."""

from __future__ import annotations

import logging

import torch

from krait.config import EngineConfig

logger = logging.getLogger(__name__)

# Room kept for CUDA graphs, the sampler's [batch, vocab] temporaries and allocator slack.
_RESERVE_BYTES = 1 << 30
_PIECEWISE_MARGIN = 1.25


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
    # piecewise graphs keep their own pool: about the activations of a forward of their
    # largest bucket (taken as linear in the tokens), with a margin
    piecewise = runner.piecewise_max_tokens()
    piecewise_bytes = int((peak - temp_cache) * min(1.0, piecewise / max_tokens)
                          * _PIECEWISE_MARGIN) if piecewise else 0
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
