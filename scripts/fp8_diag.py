"""Where krait's fp8 KV write and torch's conversion disagree on this GPU (diagnostic)."""

import torch
import triton
import triton.language as tl

from krait.ops.kv_write import to_cache, to_cache_ref


@triton.jit
def _conv(x_ptr, y_ptr, n, MODE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    if MODE == 0:
        y = to_cache(x, y_ptr)
    else:
        y = tl.clamp(x, -448.0, 448.0).to(tl.float8e4nv)
    tl.store(y_ptr + offs, y, mask=offs < n)


def main() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(1 << 22, generator=g) * s for s in (1.0, 100.0, 1e-2)]).cuda()
    want = to_cache_ref(x, torch.float8_e4m3fn).view(torch.uint8)
    want_cpu = to_cache_ref(x.cpu(), torch.float8_e4m3fn).view(torch.uint8).cuda()
    print("torch cuda vs cpu mismatches:", int((want != want_cpu).sum()))
    for mode in (0, 1):
        y = torch.empty(x.numel(), dtype=torch.float8_e4m3fn, device="cuda")
        _conv[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), MODE=mode, BLOCK=1024)
        bad = (y.view(torch.uint8) != want).nonzero().flatten()
        print(f"mode {mode}: {bad.numel()} mismatches of {x.numel()}")
        for i in bad[:12].tolist():
            print(f"  x={x[i].item()!r} got={y[i].float().item()!r} "
                  f"want={want[i].view(torch.float8_e4m3fn).float().item()!r}")


if __name__ == "__main__":
    main()
