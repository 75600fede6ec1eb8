"""What keeps GPU memory allocated after an engine is deleted (GPU).

Builds an engine on a shipped config (random weights), generates a few tokens, deletes it and
collects, then lists what the caching allocator still holds: the CUDA tensors the garbage
collector can see (largest first, with the types of the objects referring to them), the
CUDA graphs still alive, and the allocator's segments by size.

PYTHONPATH=. python3 scripts/find_gpu_holders.py [--config granite-4.0-h-micro] [--top 15]
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch


def _referrer_names(obj, skip: set[int]) -> list[str]:
    names = []
    for r in gc.get_referrers(obj):
        if id(r) in skip:
            continue
        kind = type(r).__name__
        if isinstance(r, dict):
            keys = [k for k, v in r.items() if v is obj][:2]
            kind = f"dict[{', '.join(map(str, keys))}]"
        names.append(kind)
    return names[:4]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", default="granite-4.0-h-micro")
    p.add_argument("--top", type=int, default=15)
    args = p.parse_args()
    from krait.bench.offline import CONFIG_DIR
    from krait.config import EngineConfig
    from krait.engine.engine import LLMEngine
    from krait.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(CONFIG_DIR / args.config), load_format="dummy", max_model_len=2048,
        max_num_seqs=8))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("r0", {"prompt_token_ids": list(range(1, 65))}, params)
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    print(f"with the engine: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated")
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    print(f"after deleting it: {torch.cuda.memory_allocated() / 2**30:.2f} GiB allocated, "
          f"{torch.cuda.memory_reserved() / 2**30:.2f} GiB reserved")
    objs = gc.get_objects()
    skip = {id(objs)}
    tensors = [o for o in objs if isinstance(o, torch.Tensor) and o.is_cuda]
    graphs = [o for o in objs if isinstance(o, torch.cuda.CUDAGraph)]
    seen_storage = set()
    rows = []
    for t in tensors:
        key = t.untyped_storage().data_ptr()
        if key in seen_storage:
            continue
        seen_storage.add(key)
        rows.append((t.untyped_storage().nbytes(), t))
    rows.sort(key=lambda r: -r[0])
    total = sum(n for n, _ in rows)
    print(f"{len(rows)} CUDA storages the GC sees, {total / 2**30:.3f} GiB; "
          f"{len(graphs)} CUDA graphs alive")
    skip.add(id(rows))
    skip.add(id(tensors))
    for n, t in rows[: args.top]:
        print(f"  {n / 2**20:9.1f} MiB {t.dtype} {list(t.shape)} <- "
              f"{_referrer_names(t, skip)}")
    for g in graphs[:5]:
        print(f"  graph <- {_referrer_names(g, skip)}")
    segs = torch.cuda.memory_snapshot()
    live = sorted(((b["size"], s["segment_type"]) for s in segs for b in s["blocks"]
                   if b["state"] == "active_allocated"), reverse=True)
    print(f"{len(live)} allocated blocks; largest: "
          + ", ".join(f"{sz / 2**20:.1f} MiB ({kind})" for sz, kind in live[:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
