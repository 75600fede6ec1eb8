"""Roofline times: the bytes a step must move over measured copy bandwidth, and for prefill
also its FLOPs over the measured matrix rate."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Ceilings:
    copy_bytes_per_s: float  # read + write counted
    matmul_flops_per_s: float


def measure_ceilings(device: torch.device) -> Ceilings:
    """A 1 GiB device copy and an 8192^3 bf16 matmul, timed with events (medians of 10)."""
    if device.type != "cuda":
        return Ceilings(copy_bytes_per_s=20e9, matmul_flops_per_s=1e12)
    src = torch.empty(1 << 29, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_s = median_time(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    mm_s = median_time(lambda: a @ b)
    return Ceilings(2 * (1 << 30) / copy_s, 2 * 8192**3 / mm_s)


def median_time(fn, reps: int = 10, warmup: int = 3) -> float:
    """Median seconds of `fn` on the current CUDA stream (CUDA events), after `warmup` calls."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return sorted(times)[len(times) // 2]


@dataclass
class ModelBytes:
    dense_weight_bytes: int  # read once per step whatever the batch (embeddings excluded)
    expert_bytes_per_layer: list[tuple[int, int, int]]  # (num_experts, top_k, bytes per expert)
    kv_bytes_per_token: int  # all attention layers, K and V
    state_bytes_per_seq: int  # all recurrent layers, conv + SSM
    active_params: int  # per token, for FLOPs
    attn_flops_per_token_pair: int  # 4 * heads * head_dim summed over attention layers


def model_bytes(model: torch.nn.Module, model_state) -> ModelBytes:
    from krait.layers.attention import Attention

    moe_layers = [m for m in model.modules() if hasattr(m, "w13") and hasattr(m, "w2")]
    expert_params = {id(p) for m in moe_layers for p in (m.w13, m.w2)}
    embed_ids = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    lm_head = getattr(model, "lm_head", None)
    lm_id = id(lm_head.weight) if lm_head is not None else None
    dense = 0
    params = 0
    seen = set()
    for p in model.parameters():
        if id(p) in seen or id(p) in expert_params:
            continue
        seen.add(id(p))
        if id(p) in embed_ids and id(p) != lm_id:
            continue
        dense += p.numel() * p.element_size()
        params += p.numel()
    if lm_id is not None and lm_id not in seen:
        dense += lm_head.weight.numel() * lm_head.weight.element_size()
        params += lm_head.weight.numel()
    experts = []
    for m in moe_layers:
        e = m.w13.shape[0]
        per = (m.w13[0].numel() + m.w2[0].numel()) * m.w13.element_size()
        k = int(m.top_k)
        experts.append((e, k, per))
        params += k * (m.w13[0].numel() + m.w2[0].numel())
    attn = [m for m in model.modules() if isinstance(m, Attention)]
    elem = torch.empty((), dtype=model_state.kv_dtype).element_size()
    kv = sum(2 * a.num_kv_heads * a.head_dim * elem for a in attn)
    return ModelBytes(
        dense_weight_bytes=dense,
        expert_bytes_per_layer=experts,
        kv_bytes_per_token=kv,
        state_bytes_per_seq=model_state.state_bytes_per_slot(),
        active_params=params,
        attn_flops_per_token_pair=sum(4 * a.num_heads * a.head_dim for a in attn),
    )


def decode_bytes(mb: ModelBytes, batch: int, context: int) -> float:
    """Bytes one decode step moves: weights once (experts: the expected number touched), each
    sequence's KV read (and one token written), recurrent state read and written."""
    total = float(mb.dense_weight_bytes)
    for e, k, per in mb.expert_bytes_per_layer:
        touched = e * (1.0 - (1.0 - k / e) ** batch)
        total += touched * per
    total += batch * mb.kv_bytes_per_token * (context + 1)
    total += batch * 2 * mb.state_bytes_per_seq
    return total


def prefill_cost(mb: ModelBytes, prompt_len: int) -> tuple[float, float]:
    """(bytes, flops) of one prompt's prefill: all weights once, KV written, state written;
    2 * active params per token plus causal attention."""
    by = float(mb.dense_weight_bytes) + sum(e * per for e, _, per in mb.expert_bytes_per_layer)
    by += prompt_len * mb.kv_bytes_per_token + mb.state_bytes_per_seq
    flops = 2.0 * mb.active_params * prompt_len
    flops += mb.attn_flops_per_token_pair * prompt_len * (prompt_len + 1) / 2
    return by, flops


def roofline_seconds(c: Ceilings, bytes_: float, flops: float = 0.0) -> float:
    return max(bytes_ / c.copy_bytes_per_s, flops / c.matmul_flops_per_s)


def workload_seconds(c: Ceilings, mb: ModelBytes, num_prompts: int, input_len: int,
                     output_len: int, max_batch: int) -> float:
    """The least time any engine could take for an offline workload on this machine: prompts
    in waves of at most `max_batch` rows, each wave's prefills at their roofline (one prompt
    at a time: weights once per prompt, its FLOPs), then its `output_len - 1` decode steps
    (the first token comes from the prefill) each at the bytes it moves at its context."""
    total = 0.0
    for start in range(0, num_prompts, max(max_batch, 1)):
        rows = min(max_batch, num_prompts - start)
        by, fl = prefill_cost(mb, input_len)
        total += rows * roofline_seconds(c, by, fl)
        for i in range(1, output_len):
            total += roofline_seconds(c, decode_bytes(mb, rows, input_len + i))
    return total
