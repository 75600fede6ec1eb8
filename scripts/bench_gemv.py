"""cuBLAS (F.linear) vs krait's decode GEMV (krait/ops/gemv.py) at the projection shapes of the
shipped configs, M = 1, 4, 8. Each variant is timed as a CUDA-graph replay over enough weight
copies to miss the 50 MB L2, like a decode step that reads every weight once.

PYTHONPATH=. python3 scripts/bench_gemv.py [--quick|--forms|--tma]
(GPU; --quick: one row, no sweep; --forms: one row, each prologue and epilogue against the
plain GEMV; --tma: one row, the default GEMV against the TMA-streamed prototype
krait/ops/gemv_tma.py over a small config grid, ~3 min; without a GPU --tma lists its configs)"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from krait.ops.gemv import default_config, gemv_triton

# (N, K) of the decode projections: qwen3-0.6b, mamba2-1.3b, granite-4.0-h-micro
SHAPES = {
    "qwen3 qkv": (4096, 1024), "qwen3 o": (1024, 2048), "qwen3 gate_up": (6144, 1024),
    "qwen3 down": (1024, 3072), "mamba2 in_proj": (8512, 2048), "mamba2 out_proj": (2048, 4096),
    "granite qkv": (3072, 2048), "granite gate_up": (16384, 2048), "granite down": (2048, 8192),
}
CANDIDATES = [dict(BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, num_warps=w)
              for bn, bk, sk, w in itertools.product([8, 16], [256, 512], [1, 2, 4, 8], [4, 8])]


def weight_copies(n: int, k: int, dev: torch.device) -> list[torch.Tensor]:
    """Enough bf16 [n, k] weights (at least 4) to fill 400 MB: a graph cycling through them
    reads each from DRAM, as a decode step reads every weight once."""
    return [torch.randn(n, k, device=dev, dtype=torch.bfloat16)
            for _ in range(max(4, (400 << 20) // (n * k * 2)))]


def time_us(fn, weights) -> float:
    """Median µs per call of fn(w) over a graph that cycles through all weight copies."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for w in weights[:2]:
            fn(w)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for w in weights:
            fn(w)
    times = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / len(weights))
    return sorted(times)[len(times) // 2]


def previous_default(m: int, n: int, k: int, num_sms: int = 132) -> dict[str, int]:
    """The one-row config before session 4 (4 warps, K split to cover the SMs four times): the
    `--quick` A/B's baseline."""
    block_k = max(64, min(512, triton_pow2(k)))
    tiles, split = -(-n // 8), 1
    while tiles * split < 4 * num_sms and k // (2 * split) >= 2 * block_k and split < 16:
        split *= 2
    return dict(BLOCK_M=1, BLOCK_N=8, BLOCK_K=block_k, SPLIT_K=split, num_warps=4)


def quick() -> None:
    """One row only: cuBLAS, the default config and the previous default, no sweep (~30 s)."""
    dev = torch.device("cuda")
    print(f"{'shape':16} {'cuBLAS us':>9} {'default us':>10} {'previous us':>11}  default config")
    for name, (n, k) in SHAPES.items():
        weights = weight_copies(n, k, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        prev = previous_default(1, n, k)
        ref = F.linear(x.float(), weights[0].float())
        for cfg in (None, prev):  # both configs must be right before their times mean anything
            err = (gemv_triton(x, weights[0], config=cfg).float() - ref).norm() / ref.norm()
            if err > 1e-2:
                print(f"   {name}: wrong result with {cfg or 'the default'} (rel err {err:.3g})")
        t = [time_us(lambda w, x=x: F.linear(x, w), weights),
             time_us(lambda w, x=x: gemv_triton(x, w), weights),
             time_us(lambda w, x=x, c=prev: gemv_triton(x, w, config=c), weights)]
        print(f"{name:16} {t[0]:9.2f} {t[1]:10.2f} {t[2]:11.2f}  {default_config(1, n, k)}",
              flush=True)
        del weights


def forms() -> None:
    """One row: what each prologue and epilogue adds to the plain GEMV, µs a call (~1 min).
    NORM: the input normalized from its producer's partial sums; RESIDUAL_NORM: the residual added and each tile's squares
    summed; CONV: mamba2's in_proj convolving its xBC columns; the fused add-RMSNorm kernel
    the fold replaces, for scale."""
    from krait.ops.rms_norm import fused_add_rms_norm_triton

    dev, bf = torch.device("cuda"), torch.bfloat16
    # name: (N, K, x dtype, norm group, partial run)
    shapes = {"qwen3 qkv": (4096, 1024, bf, 1024, 8), "qwen3 o": (1024, 2048, bf, 0, 0),
              "qwen3 down": (1024, 3072, bf, 0, 0), "qwen3 gate_up": (6144, 1024, bf, 1024, 8),
              "mamba2 in_proj": (8512, 2048, bf, 2048, 8),
              "mamba2 out_proj": (2048, 4096, torch.float32, 4096, 16),
              "granite down": (2048, 8192, bf, 0, 0)}
    print(f"{'shape':16} {'arm':22} {'us':>7} {'TB/s':>5}")
    for name, shape in shapes.items():
        _forms_of(name, *shape)
    for hidden in (1024, 2048):
        xs = [torch.randn(1, hidden, device=dev, dtype=bf) for _ in range(64)]
        nw = torch.randn(hidden, device=dev, dtype=bf)
        t = time_us(lambda r, nw=nw: fused_add_rms_norm_triton(r, r, nw, 1e-5), xs)
        print(f"{'add+RMSNorm':16} {hidden:<22} {t:7.2f}", flush=True)


def _forms_of(name: str, n: int, k: int, xdt: torch.dtype, group: int, run: int) -> None:
    dev, bf = torch.device("cuda"), torch.bfloat16
    nbytes = n * k * 2
    weights = weight_copies(n, k, dev)
    x = torch.randn(1, k, device=dev, dtype=xdt)
    xb = x.to(bf)
    gate_up = name.endswith("gate_up")
    arms = {"plain": lambda w: gemv_triton(xb, w, silu_mul_out=gate_up)}
    if group:
        nw = torch.randn(k, device=dev, dtype=bf)
        parts = torch.rand(1, k // run, device=dev)
        arms["norm"] = lambda w: gemv_triton(x, w, norm=(nw, parts, group, 1e-5, run),
                                             silu_mul_out=gate_up)
    if not group or name.startswith("mamba2 out"):
        res = torch.randn(1, n, device=dev, dtype=bf)
        arms["residual_norm"] = lambda w: gemv_triton(xb, w, residual=res)
    if name == "mamba2 in_proj":
        d = 4096 + 2 * 128  # xBC: d_inner + 2 * d_state, after z
        cw, cb = torch.randn(d, 4, device=dev, dtype=bf), torch.randn(d, device=dev, dtype=bf)
        states = torch.zeros(4, d, 3, device=dev, dtype=bf)
        slots = torch.zeros(1, dtype=torch.int32, device=dev)
        arms["conv"] = lambda w: gemv_triton(xb, w, conv=(4096, cw, cb, states, slots, True))
    for label, fn in arms.items():
        t = time_us(fn, weights)
        print(f"{name:16} {label:22} {t:7.2f} {nbytes / t / 1e6:5.2f}", flush=True)


# the TMA prototype's grid: boxes of BLOCK_N x BLOCK_K, STAGES - 1 of them in flight a program
TMA_GRID = [dict(BLOCK_N=bn, BLOCK_K=bk, STAGES=st, num_warps=w)
            for bn, bk, st, w in itertools.product([8, 16, 32], [128, 256], [2, 3, 4, 6], [4, 8])]
TMA_MAX_SHARED = 200 << 10  # bytes a program: prune rings above this


def tma_shared_bytes(cfg: dict, itemsize: int = 2) -> int:
    """Shared memory of a gemv_tma config: the pipeliner's ring of STAGES - 1 weight boxes and x
    tiles (Triton 3.6's count at sm_90, tests/ops/test_gemv_tma.py, plus a little)."""
    return (cfg["STAGES"] - 1) * (cfg["BLOCK_N"] + 1) * cfg["BLOCK_K"] * itemsize + 1024


def tma_configs(n: int, k: int, num_sms: int = 132) -> list[dict]:
    """The gemv_tma configs for shape (N, K): the grid less rings over
    TMA_MAX_SHARED and boxes wider than K; each split over K as the default GEMV splits
    (while its slices stream more than 2048 columns and its tiles cover the SMs fewer than four
    times) and also while its wider tiles number fewer than the SMs, at least two boxes a
    slice."""
    out = []
    for c in TMA_GRID:
        if tma_shared_bytes(c) > TMA_MAX_SHARED or c["BLOCK_K"] > k:
            continue
        tiles, split = -(-n // c["BLOCK_N"]), 1
        while ((k // split > 2048 or tiles * split < num_sms) and tiles * split < 4 * num_sms
               and split < 16 and k // (2 * split) >= 2 * c["BLOCK_K"]):
            split *= 2
        out.append(dict(c, SPLIT_K=split))
    return out


def tma() -> None:
    """One row: the default GEMV against gemv_tma. Every config of tma_configs, then the fastest
    with its L2 prefetch before the PDL wait (session 14 also tried a persistent grid on the
    three fastest: never the best, removed). Configs that fail to compile or give wrong results are
    printed and skipped."""
    if not torch.cuda.is_available():
        for name, (n, k) in SHAPES.items():
            cfgs = tma_configs(n, k)
            print(f"{name:16} N={n:5} K={k:5} {len(cfgs)} configs, splits "
                  f"{sorted({c['SPLIT_K'] for c in cfgs})}, max shared "
                  f"{max(tma_shared_bytes(c) for c in cfgs) >> 10} KB")
        print("no CUDA device: configs listed, nothing timed")
        return
    from krait.ops.gemv_tma import gemv_tma

    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    failed: set[str] = set()
    rows = []
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = weight_copies(n, k, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = F.linear(x.float(), weights[0].float())
        t_default = time_us(lambda w, x=x: gemv_triton(x, w), weights)

        def run(cfg: dict, name=name, x=x, ref=ref, weights=weights) -> float | None:
            if str(cfg) in failed:  # failed to compile or launch at an earlier shape
                return None
            try:
                y = gemv_tma(x, weights[0], config=cfg)
            except Exception as e:  # noqa: BLE001 - a config that cannot run is skipped
                failed.add(str(cfg))
                print(f"   {name}: skipped {cfg}: {type(e).__name__}: {str(e)[:160]}",
                      flush=True)
                return None
            err = float((y.float() - ref).norm() / ref.norm())
            if err > 1e-2:
                print(f"   {name}: wrong result with {cfg} (rel err {err:.3g})", flush=True)
                return None
            return time_us(lambda w: gemv_tma(x, w, config=cfg), weights)

        timed = [(t, c) for c in tma_configs(n, k, num_sms) if (t := run(c)) is not None]
        timed.sort(key=lambda tc: tc[0])
        if not timed:
            print(f"{name:16} no TMA config ran", flush=True)
            continue
        best_t, best = timed[0]
        t_nopf = run(dict(best, PREFETCH_LINES=None))  # with the L2 prefetch under PDL
        rows.append((name, t_default, best_t, t_nopf, best))
        gbs = lambda t, nb=nbytes: nb / t / 1e3  # noqa: E731
        print(f"{name:16} default {t_default:7.2f} us {gbs(t_default):6.0f} GB/s | TMA "
              f"{best_t:7.2f} us {gbs(best_t):6.0f} GB/s (with the L2 prefetch "
              f"{t_nopf or float('nan'):7.2f} us)  {best}", flush=True)
        del weights
    print(f"\n{'shape':16} {'default us':>10} {'GB/s':>6} {'TMA us':>8} {'GB/s':>6} "
          f"{'L2-pf us':>8}  best TMA config")
    for name, t_default, best_t, t_nopf, best in rows:
        nb = SHAPES[name][0] * SHAPES[name][1] * 2
        print(f"{name:16} {t_default:10.2f} {nb / t_default / 1e3:6.0f} {best_t:8.2f} "
              f"{nb / best_t / 1e3:6.0f} {t_nopf or float('nan'):8.2f}  {best}")


def main() -> None:
    dev = torch.device("cuda")
    print(f"{'shape':16} {'M':>2} {'cuBLAS us':>9} {'TB/s':>5} {'krait us':>9} {'TB/s':>5} "
          f"{'best us':>8} {'TB/s':>5}  best config")
    for name, (n, k) in SHAPES.items():
        nbytes = n * k * 2
        weights = weight_copies(n, k, dev)
        for m in (1, 4, 8):
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            ref = F.linear(x.float(), weights[0].float())
            t_cublas = time_us(lambda w, x=x: F.linear(x, w), weights)
            t_default = time_us(lambda w, x=x: gemv_triton(x, w), weights)
            best = (t_default, default_config(m, n, k))
            for c in CANDIDATES:
                cfg = dict(c, BLOCK_M=triton_pow2(m))
                if cfg["BLOCK_M"] * cfg["BLOCK_N"] * cfg["BLOCK_K"] > 16384:
                    continue
                if k // cfg["SPLIT_K"] < cfg["BLOCK_K"]:
                    continue
                y = gemv_triton(x, weights[0], config=cfg)
                if ((y.float() - ref).norm() / ref.norm()) > 1e-2:
                    print(f"   wrong result with {cfg}")
                    continue
                t = time_us(lambda w, x=x, cfg=cfg: gemv_triton(x, w, config=cfg), weights)
                if t < best[0]:
                    best = (t, cfg)
            tb = lambda t, nb=nbytes: nb / t / 1e6  # noqa: E731
            print(f"{name:16} {m:>2} {t_cublas:9.2f} {tb(t_cublas):5.2f} {t_default:9.2f} "
                  f"{tb(t_default):5.2f} {best[0]:8.2f} {tb(best[0]):5.2f}  {best[1]}", flush=True)
        del weights


def triton_pow2(m: int) -> int:
    return 1 << (m - 1).bit_length()


if __name__ == "__main__":
    import sys

    if "--quick" in sys.argv[1:]:
        quick()
    elif "--forms" in sys.argv[1:]:
        forms()
    elif "--tma" in sys.argv[1:]:
        tma()
    else:
        main()
