"""HF parity on the GPU: tiny random checkpoints (built here with transformers), HF on CPU in
float32 as the oracle, krait on CUDA in float32 with CUDA graphs, default and chunked prefill.

PYTHONPATH=. python3 scripts/gpu_parity.py [arch ...]"""

from __future__ import annotations

import sys
import tempfile
import traceback

from krait import LLM, SamplingParams
from krait.models.registry import supported_architectures
from tests.utils import hf_greedy, make_tiny_hybrid, make_tiny_llama

DENSE = ["llama", "qwen3", "qwen2", "mistral"]
HYBRID = {
    "mamba2": "Mamba2ForCausalLM",
    "bamba": "BambaForCausalLM",
    "granitemoehybrid": "GraniteMoeHybridForCausalLM",
    "nemotronh": "NemotronHForCausalLM",
    "falconh1": "FalconH1ForCausalLM",
}


def check(arch: str, tmp: str) -> bool:
    if arch in HYBRID and HYBRID[arch] not in supported_architectures():
        print(f"{arch}: not registered, skipped")
        return True
    d = (make_tiny_llama if arch in DENSE else make_tiny_hybrid)(f"{tmp}/{arch}", arch=arch)
    prompts = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([1, 5, 17, 33, 60])]
    want, want_lp, _ = hf_greedy(d, prompts, 24)
    ok = True
    for label, kw in [("graphs", {}), ("chunked", {"max_num_batched_tokens": 7}),
                      ("eager", {"enforce_eager": True})]:
        llm = LLM(d, device="cuda", dtype="float32", **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1),
                            use_tqdm=False)
        for o, w, wl in zip(outs, want, want_lp):
            got = o.outputs[0].token_ids
            lp = [e[t].logprob for e, t in zip(o.outputs[0].logprobs, got)]
            err = max(abs(a - b) for a, b in zip(lp, wl)) if got == w else float("nan")
            good = got == w and err < 1e-3
            ok &= good
            if not good:
                print(f"  {arch}/{label}: MISMATCH got {got[:10]} want {w[:10]} lp err {err}")
        print(f"{arch}/{label}: {'ok' if ok else 'FAIL'}")
        del llm
    return ok


def main() -> int:
    archs = sys.argv[1:] or DENSE[:2] + list(HYBRID)
    bad = []
    with tempfile.TemporaryDirectory() as tmp:
        for a in archs:
            try:
                if not check(a, tmp):
                    bad.append(a)
            except Exception:
                traceback.print_exc()
                bad.append(a)
    print("GPU parity:", "all ok" if not bad else f"FAILED: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
