"""HF parity on the GPU: krait on CUDA in float32 (CUDA graphs, chunked prefill, eager, one
request at a time) against Hugging Face transformers on CPU in float32.

The oracle is best computed here, with the project's transformers, and carried to the device
machine: its older transformers gives other tokens for the Mamba-family models.

    PYTHONPATH=. python3 scripts/gpu_parity.py make .parity        # here: checkpoints + HF outputs
    PYTHONPATH=. python3 scripts/gpu_parity.py check .parity       # device machine (carry .parity)

PARITY_MODES=spec,spec_chunked picks modes (default: all), PARITY_FIXTURES=nemotronh,qwen3
fixtures (default: every one made), in the order given.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

from tests.utils import hf_greedy, make_tiny_hybrid, make_tiny_llama

DENSE = ["llama", "qwen3"]
HYBRID = ["mamba2", "bamba", "granitemoehybrid", "nemotronh", "falconh1"]
NUM_TOKENS = 24
PROMPTS = [[(7 * i + 3 * j) % 500 + 5 for j in range(n)] for i, n in enumerate([1, 5, 17, 33, 60])]


# one Mamba norm group, as the shipped mamba2/granite/bamba configs have (the tiny defaults have
# two): the gated norm over the whole width in one group
ONE_GROUP = {"mamba2-g1": ("mamba2", {"n_groups": 1}),
             "granitemoehybrid-g1": ("granitemoehybrid", {"mamba_n_groups": 1})}
# granite-4.0-h-micro's shape: no routed experts (dense shared-MLP layers)
DENSE_GRANITE = {"granitemoehybrid-dense": ("granitemoehybrid",
                                            {"num_local_experts": 0, "mamba_n_groups": 1})}


# engine settings each model is checked under; "batch1": one request at a time, every decode
# step one row (the GEMV, TMA, epilogue and fused-kernel paths of batch 1, graphed)
# "spec": speculative decoding (ngram drafts, k = 3: verify steps of 1 + k tokens a row)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
MODES = {"graphs": {}, "chunked": {"max_num_batched_tokens": 7}, "eager": {"enforce_eager": True},
         "batch1": {"max_num_seqs": 1},
         # few rows: fewer decode and verify graphs to capture
         "spec": {"speculative_config": NGRAM, "max_num_seqs": 8},
         "spec_chunked": {"speculative_config": NGRAM, "max_num_batched_tokens": 7,
                          "max_num_seqs": 8},
         # the checkpoint as its own draft model: every draft accepted, the accept path runs
         "spec_self": {"speculative_config": {"model": "SELF", "num_speculative_tokens": 3},
                       "max_num_seqs": 8}}
DEFAULT_MODES = "graphs,chunked,eager,batch1,spec,spec_chunked,spec_self"  # or PARITY_MODES=


def make(root: Path) -> None:
    fixtures = {a: (a, {}) for a in DENSE + HYBRID} | ONE_GROUP | DENSE_GRANITE
    for name, (arch, overrides) in fixtures.items():
        if arch in DENSE:
            d = make_tiny_llama(root / name, arch=arch)
        else:
            d = make_tiny_hybrid(root / name, arch=arch, **overrides)
        tokens, lps, _ = hf_greedy(d, PROMPTS, NUM_TOKENS)
        (root / name / "reference.json").write_text(json.dumps({"tokens": tokens, "logprobs": lps}))
        print(f"{name}: fixture written")


def check_arch(d: Path) -> bool:
    from krait import LLM, SamplingParams

    ref = json.loads((d / "reference.json").read_text())
    ok = True
    for label, kw in MODES.items():
        if label not in os.environ.get("PARITY_MODES", DEFAULT_MODES).split(","):
            continue
        device = os.environ.get("KRAIT_PARITY_DEVICE", "cuda")  # "cpu" for a dry run here
        spec = kw.get("speculative_config")
        if spec is not None and spec.get("model") == "SELF":
            kw = {**kw, "speculative_config": {**spec, "model": str(d)}}
        llm = LLM(str(d), device=device, dtype="float32", **kw)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                            SamplingParams(temperature=0, max_tokens=NUM_TOKENS, ignore_eos=True,
                                           logprobs=1), use_tqdm=False)
        good = True
        for o, want, want_lp in zip(outs, ref["tokens"], ref["logprobs"]):
            got = o.outputs[0].token_ids
            lp = [e[t].logprob for e, t in zip(o.outputs[0].logprobs, got)]
            err = max(abs(a - b) for a, b in zip(lp, want_lp)) if got == want else float("nan")
            if not (got == want and err < 1e-3):
                good = False
                print(f"  {d.name}/{label}: got {got[:10]} want {want[:10]} logprob err {err}")
        print(f"{d.name}/{label}: {'ok' if good else 'FAIL'}")
        ok &= good
        del llm
    return ok


def check(root: Path) -> int:
    bad = []
    made = sorted(p.name for p in root.iterdir() if (p / "reference.json").exists())
    picked = os.environ.get("PARITY_FIXTURES")
    names = picked.split(",") if picked else made
    if missing := sorted(set(names) - set(made)):
        print(f"no such fixtures in {root}: {missing} (made: {made})")
        return 1
    for d in (root / n for n in names):
        try:
            if not check_arch(d):
                bad.append(d.name)
        except Exception:
            traceback.print_exc()
            bad.append(d.name)
    print("GPU parity:", "all ok" if not bad else f"FAILED: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    cmd, root = sys.argv[1], Path(sys.argv[2])
    if cmd == "make":
        make(root)
    else:
        sys.exit(check(root))
