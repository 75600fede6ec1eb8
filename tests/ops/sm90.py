"""Compiles a Triton kernel for the H200 (sm_90) on a machine without a GPU: Triton's front end
(which the interpreter skips: type rules, loop-carried variables) and ptxas run, and the cubin's
register, local-memory (spill) and shared-memory use come back. Used by tests and to size tiles
before spending device time."""

from __future__ import annotations

import atexit
import importlib
import json
import os
import re
import select
import subprocess
import sys
import tempfile
import time
import traceback

import triton


def compile_sm90(module: str, kernel: str, types: dict[str, str], constexprs: dict,
                 num_warps: int = 4, odd: tuple[str, ...] = (),
                 num_stages: int | None = None, maxnreg: int | None = None) -> dict:
    """Kernel `module.kernel`; `types`: Triton type strings by argument name ('*bf16', 'fp32'...),
    unnamed non-constexpr arguments are 'i32'. Pointers and integers are taken as multiples of 16
    (as Triton specializes a real launch with such values: what lets it vectorize loads) except
    the integers named in `odd`; constexpr parameters left out take their defaults; a tensor
    descriptor is typed as Triton mangles it, 'tensordesc<bf16[8, 256]>'. Returns {'regs', 'local', 'shared' (static, from the cubin),
    'dynamic_shared' (what Triton's launch asks for: its buffers, pipeline rings), 'vector_loads',
    'scalar_loads', 'shared_byte_loads', 'pdl', 'wgmma', 'bulk_tensor_copies', 'mbarrier_waits',
    'loop_barriers'} (global loads of 16 bytes and of one element, loads of one byte from shared
    memory, grid-dependency waits, Hopper's warpgroup MMA, TMA copies and mbarrier waits, in the
    PTX; barriers inside innermost loops). `num_stages`: the launch option (Triton's default
    when None; its software pipelining multiplies a loop's shared-memory buffers); `maxnreg`:
    the launch option capping registers a thread (none when None). Runs in a child process: under TRITON_INTERPRET=1
    (the test suite) kernels are not compilable; one child serves this process's compiles (its
    start, importing torch and krait, cost more than most compiles)."""
    spec = [module, kernel, types, constexprs, num_warps, list(odd), num_stages, maxnreg]
    return _compiler().compile(spec)


_RESULT = "sm90-result "


class _Compiler:
    """A `python -m tests.ops.sm90 --serve` child: a JSON spec a line in, a result line out."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        self.stderr = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.ops.sm90", "--serve"],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.stderr, text=True, env=env, bufsize=1)

    def compile(self, spec: list, timeout: float = 600) -> dict:
        self.proc.stdin.write(json.dumps(spec) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            left = max(0.0, deadline - time.monotonic())
            if not select.select([self.proc.stdout], [], [], left)[0]:
                self.close()
                raise RuntimeError(f"sm_90 compile of {spec[0]}.{spec[1]} timed out")
            line = self.proc.stdout.readline()
            if not line:  # the child died
                self.close()
                self.stderr.seek(0)
                raise RuntimeError(f"sm_90 compile of {spec[0]}.{spec[1]} failed:\n"
                                   f"{self.stderr.read()[-4000:]}")
            if _RESULT in line:  # (after whatever the compile printed without a newline)
                out = json.loads(line[line.index(_RESULT) + len(_RESULT):])
                if "error" in out:
                    raise RuntimeError(f"sm_90 compile of {spec[0]}.{spec[1]} failed:\n"
                                       f"{out['error'][-4000:]}")
                return out

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


_child: _Compiler | None = None


def _compiler() -> _Compiler:
    global _child
    if _child is None or _child.proc.poll() is not None:
        _child = _Compiler()
        atexit.register(_child.close)
    return _child


def _serve() -> None:
    for line in sys.stdin:
        try:
            out = _compile_here(*json.loads(line))
        except Exception:
            out = {"error": traceback.format_exc()}
        print(_RESULT + json.dumps(out), flush=True)


def _compile_here(module: str, name: str, types: dict[str, str], constexprs: dict,
                  num_warps: int, odd: list[str], num_stages: int | None = None,
                  maxnreg: int | None = None) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import ASTSource

    kernel = getattr(importlib.import_module(module), name)
    # constexpr parameters not given take their defaults (else they would be typed 'i32')
    constexprs = {**{p.name: p.default for p in kernel.params
                     if p.is_constexpr and p.has_default and p.default is not None}, **constexprs}
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in kernel.arg_names}
    const = {(kernel.arg_names.index(n),): v for n, v in constexprs.items()}
    aligned = [n for n, t in sig.items() if t.startswith("*") or (t == "i32" and n not in odd)]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    options = {"num_warps": num_warps}
    if num_stages is not None:
        options["num_stages"] = num_stages
    if maxnreg is not None:
        options["maxnreg"] = maxnreg
    compiled = triton.compile(ASTSource(kernel, sig, constexprs=const, attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options=options)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                               check=True).stdout
    fields = dict(re.findall(r"(REG|LOCAL|SHARED):(\d+)", usage))
    ptx = compiled.asm["ptx"]
    return {"regs": int(fields["REG"]), "local": int(fields["LOCAL"]),
            "shared": int(fields["SHARED"]), "dynamic_shared": int(compiled.metadata.shared),
            "vector_loads": len(re.findall(r"ld\.global[.\w]*\.v4\.b32", ptx)),
            "scalar_loads": len(re.findall(r"ld\.global(?:\.\w+)*\.b16 ", ptx)),
            "shared_byte_loads": len(re.findall(r"ld\.shared(?:\.\w+)*\.[bsu]8 ", ptx)),
            "pdl": "griddepcontrol.wait" in ptx, "wgmma": "wgmma.mma_async" in ptx,
            "bulk_tensor_copies": ptx.count("cp.async.bulk.tensor"),
            "mbarrier_waits": len(re.findall(r"mbarrier\.try_wait", ptx)),
            "timer_reads": ptx.count("%globaltimer"),
            "loop_barriers": _loop_barriers(ptx)}


def _loop_barriers(ptx: str) -> int:
    """bar.sync instructions inside the innermost loops' bodies (from each loop header to its
    back branch): a layout conversion through shared memory in a streaming loop shows here."""
    count = 0
    for body in re.findall(r"Inner Loop Header(.*?)\bbra(?:\.uni)?\s+\$L__BB\d+_\d+;", ptx,
                           re.S):
        count += body.count("bar.sync")
    return count


# an H100/H200 block's shared memory (static + dynamic) at most: 227 KiB
SM90_MAX_SHARED = 232448


def sm90_available() -> bool:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    return os.path.exists(os.path.join(tool, "ptxas")) and os.path.exists(
        os.path.join(tool, "cuobjdump"))


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        _serve()
    else:
        print(json.dumps(_compile_here(*json.loads(sys.argv[1]))))
