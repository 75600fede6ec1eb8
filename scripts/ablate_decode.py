"""What each kernel class costs inside the batch-1 decode chain: the step's graph time with that
class's launches removed, against the full step, in one process per arm.

With PDL the kernels of a step overlap (each one's launch and first loads run under the tail of
the one before), so a profiler's per-kernel times (taken with KRAIT_PDL=0) overstate what
removing or speeding up a kernel saves. Here each arm replaces the named Triton kernels with a
launcher that does nothing (their outputs stay uninitialised: the timings are meaningful, the
tokens are not) and runs `krait bench latency` on the rest.

PYTHONPATH=. python3 scripts/ablate_decode.py --skip attn -- --config qwen3-0.6b \
    --batch-sizes 1 --prompt-lens ""
(GPU; --skip none gives the full step; the bench's JSON goes to stdout as usual)
"""

from __future__ import annotations

import argparse
import importlib
import sys

# kernel classes: (module, kernel) pairs whose launches an arm removes
CLASSES: dict[str, list[tuple[str, str]]] = {
    "none": [],
    "gemv": [("krait.ops.gemv", "_gemv_kernel")],
    "attn": [("krait.ops.paged_attention", "_decode_split_kernel"),
             ("krait.ops.paged_attention", "_decode_combine_kernel"),
             ("krait.ops.paged_attention", "_paged_attention_kernel")],
    "combine": [("krait.ops.paged_attention", "_decode_combine_kernel")],
    "rope": [("krait.ops.rope_kv_write", "_rope_kv_write_kernel")],
    "norm": [("krait.ops.rms_norm", "_rms_norm_kernel")],
    "ssu": [("krait.ops.selective_state_update", "_ssu_kernel")],
    "conv": [("krait.ops.causal_conv1d", "_conv_update_kernel")],
}


class _NoLaunch:
    """Stands in for a Triton kernel: `kernel[grid](...)` launches nothing."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def skip(names: list[str]) -> None:
    """Replaces the kernels of the named classes in their modules (before any engine exists)."""
    for name in names:
        for module, kernel in CLASSES[name]:
            setattr(importlib.import_module(module), kernel, _NoLaunch())


def main() -> int:
    argv = sys.argv[1:]
    rest = argv[argv.index("--") + 1:] if "--" in argv else []
    ours = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip", default="none", help=f"comma-separated of {sorted(CLASSES)}")
    args = p.parse_args(ours)
    names = [n for n in args.skip.split(",") if n]
    unknown = [n for n in names if n not in CLASSES]
    if unknown:
        p.error(f"unknown kernel classes {unknown}")
    skip(names)
    from krait.cli import main as cli_main

    cli_main(["bench", "latency", *rest])  # exits with the bench's status
    return 0


if __name__ == "__main__":
    sys.exit(main())
