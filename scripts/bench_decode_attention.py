"""A decode batch's attention alone on the GPU: µs a call of `paged_attention` (the split-KV
kernel and its combine when the batch splits) and of `rope_paged_attention` (rope + KV write
then attention, or the fold: KRAIT_DECODE_ROPE_FOLD), each replayed from a CUDA graph of 20
calls, with the output's error against the torch reference. The calls cycle through copies of
the KV cache, together past the L2 cache (--cold-bytes), as in a whole model, where the layers'
weights flush it between attention layers (session 18: with one copy, a few MB that stayed in
L2, the rope fold read 20% slower at 8 rows and 32k keys; the whole model was 1% faster).

PYTHONPATH=. python3 scripts/bench_decode_attention.py [--rows 1,8,32] [--context 1024]
    [--heads 16,8,128] [--max-model-len 1077] [--cold-bytes 268435456] [--json out.json]
(Without CUDA it runs the kernels once through the interpreter, in float32: a smoke test,
e.g. `--rows 1,3 --context 40 --heads 4,2,32 --max-model-len 64`.)

Defaults: qwen3-0.6b's attention (16 query heads, 8 kv heads, head dim 128, q/k norm). Session
17 found with it that loading q before the newest key's reload cost 4-warp programs 64% at 8
rows (14.7 -> 24.1 µs) while the whole-model benchmarks only showed a 16% slower step."""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

# run as a script without CUDA: the kernels through the interpreter (set before Triton loads);
# imported (the tests), it leaves the environment alone: KRAIT_TRITON_CPU left set in a test
# worker sent every later test's engine through the interpreter (CI 12 -> 45 min, session 17)
if __name__ == "__main__" and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("KRAIT_TRITON_CPU", "1")

from krait.ops.paged_attention import decode_num_splits, paged_attention, paged_attention_ref  # noqa: E402
from krait.ops.rope_attention import rope_paged_attention  # noqa: E402
from krait.ops.rope_kv_write import rope_kv_write_ref  # noqa: E402


def _graph_us(fns: list, calls: int = 20, reps: int = 20) -> float:
    """µs a call, replayed from a CUDA graph of `calls` calls that cycle through `fns` (on
    CPU: the first called, once)."""
    if not torch.cuda.is_available():  # a smoke run through the interpreter
        t0 = time.perf_counter()
        fns[0]()
        return (time.perf_counter() - t0) * 1e6
    for fn in fns:
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(calls):
            fns[i % len(fns)]()
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / (calls * reps)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def bench_rows(rows: int, context: int, heads: tuple[int, int, int], max_model_len: int,
               block_size: int = 16, cold_bytes: int = 0) -> dict:
    """One decode batch of `rows` rows, each `context` keys plus this step's; the timed calls
    cycle through enough copies of the KV cache (at most 20) to move `cold_bytes` (0: one)."""
    cuda = torch.cuda.is_available()
    dev, dt = torch.device("cuda" if cuda else "cpu"), torch.bfloat16 if cuda else torch.float32
    hq, hkv, d = heads
    per_row = -(-(context + 1) // block_size)
    k_cache = torch.randn(rows * per_row + 1, block_size, hkv, d, device=dev, dtype=dt)
    v_cache = torch.randn_like(k_cache)
    block_table = torch.arange(1, rows * per_row + 1, device=dev, dtype=torch.int32)
    block_table = block_table.view(rows, per_row)  # [rows, blocks a row]
    qsl = torch.arange(rows + 1, device=dev, dtype=torch.int32)
    seq_lens = torch.full((rows,), context + 1, device=dev, dtype=torch.int32)
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, device=dev, dtype=dt)  # [rows, q | k | v]
    q = qkv[:, : hq * d].view(rows, hq, d)
    k = qkv[:, hq * d: (hq + hkv) * d].view(rows, hkv, d)
    v = qkv[:, (hq + hkv) * d:].view(rows, hkv, d)
    positions = torch.full((rows,), context, device=dev, dtype=torch.int64)
    slots = block_table[:, context // block_size].long() * block_size + context % block_size
    ang = torch.rand(max_model_len, d // 2, device=dev) * 6
    cos_sin = torch.cat([ang.cos(), ang.sin()], dim=-1)  # [positions, D]
    qw = torch.rand(d, device=dev, dtype=dt) + 0.5
    kw = torch.rand(d, device=dev, dtype=dt) + 0.5
    scale = d ** -0.5
    attn = (qsl, seq_lens, block_table, 1, max_model_len, scale)
    rope = (q, k, v, positions, cos_sin, True, qw, kw, 1e-6)

    rotated = q.contiguous()
    want = paged_attention_ref(rotated, k_cache, v_cache, *attn)
    cache_bytes = 2 * k_cache.numel() * k_cache.element_size()
    copies = min(20, max(1, -(-cold_bytes // cache_bytes)))
    kv = [(k_cache, v_cache)] + [(k_cache.clone(), v_cache.clone()) for _ in range(copies - 1)]
    out = {"rows": rows, "splits": decode_num_splits(rows, hkv, max_model_len, dev),
           "cache_copies": copies,
           "attention_err": _rel_err(paged_attention(rotated, k_cache, v_cache, *attn), want),
           "attention_us": _graph_us([lambda kc=kc, vc=vc: paged_attention(rotated, kc, vc, *attn)
                                      for kc, vc in kv])}
    caches = [k_cache.clone(), v_cache.clone()]
    want_q = rope_kv_write_ref(*rope, caches[0], caches[1], slots)
    want = paged_attention_ref(want_q, caches[0], caches[1], *attn)
    got = rope_paged_attention(*rope, k_cache, v_cache, slots, *attn)
    out["rope_attention_err"] = _rel_err(got, want)
    out["rope_attention_us"] = _graph_us(
        [lambda kc=kc, vc=vc: rope_paged_attention(*rope, kc, vc, slots, *attn) for kc, vc in kv])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--heads", default="16,8,128", help="query heads, kv heads, head dim")
    ap.add_argument("--max-model-len", type=int, default=1077)
    ap.add_argument("--cold-bytes", type=int, default=256 << 20,
                    help="KV bytes the timed calls cycle through (past the L2); 0: one cache")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    heads = tuple(int(x) for x in args.heads.split(","))
    results = []
    print(" rows splits copies  attention us  rope+attention us  errors")
    for rows in (int(r) for r in args.rows.split(",")):
        r = bench_rows(rows, args.context, heads, args.max_model_len, cold_bytes=args.cold_bytes)
        results.append(r)
        print(f"{rows:5d} {r['splits']:6d} {r['cache_copies']:6d} {r['attention_us']:13.2f} "
              f"{r['rope_attention_us']:18.2f}"
              f"  {r['attention_err']:.1e} {r['rope_attention_err']:.1e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
