"""Shared by the distributed tests: tiny checkpoints, the workload (chunked prefill, preemption)
and the single-process reference it is compared with."""

from __future__ import annotations

import math

import pytest

from krait import LLM, SamplingParams
from krait.distributed import executor as executor_mod
from tests.utils import make_tiny_hybrid, make_tiny_llama, make_tiny_qwen3_next

# small steps (chunked prefill) and few blocks (preemption)
ENGINE = dict(device="cpu", dtype="float32", block_size=4, max_num_batched_tokens=8,
              num_kv_blocks=14, max_model_len=40, max_num_seqs=4)
PROMPTS = [{"prompt_token_ids": [3 + (7 * j + k) % 500 for j in range(n)]}
           for k, n in ((0, 5), (1, 13), (2, 19), (3, 9))]
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=0)


def make_model(root, name: str) -> str:
    if name in ("llama", "qwen3"):
        return make_tiny_llama(root / name, arch=name)
    if name == "qwen3next":
        # tp=2 splits its 4 query heads, replicates its 1 KV head, and splits the GDN layers'
        # 2 key heads (3 value heads each); full attention first and last, GDN between, MoE
        # layers with a shared expert and a dense MLP layer (layer 2)
        import transformers as tf

        if not hasattr(tf, "Qwen3NextForCausalLM"):
            pytest.skip(f"transformers {tf.__version__} has no Qwen3-Next")
        return make_tiny_qwen3_next(root / name, num_attention_heads=4)
    return make_tiny_hybrid(root / name, name)


def run(model_dir: str, preemptions: list | None = None, prompts: list = PROMPTS,
        on_engine=None, params: SamplingParams = PARAMS, **kw):
    """(token ids, chosen-token logprobs) per prompt; counts the scheduler's preemptions.
    `on_engine(engine)` runs before generating (a test's probes)."""
    executor_mod.COLLECTIVE_TIMEOUT_S = 60.0  # a stuck collective fails the test fast
    llm = LLM(model_dir, **{**ENGINE, **kw})
    if on_engine is not None:
        on_engine(llm.llm_engine)
    sched = llm.llm_engine.scheduler
    if preemptions is not None:
        orig = sched._preempt

        def counted(req):
            preemptions.append(req.request_id)
            return orig(req)

        sched._preempt = counted
    try:
        outs = llm.generate(prompts, params, use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    return [(o.outputs[0].token_ids,
              [d[t].logprob for d, t in zip(o.outputs[0].logprobs or [], o.outputs[0].token_ids)])
            for o in outs]


def assert_same(ref, got, tol: float = 1e-4) -> None:
    for (rt, rl), (gt, gl) in zip(ref, got):
        assert rt == gt
        assert all(math.isclose(a, b, abs_tol=tol) for a, b in zip(rl, gl)), (rl, gl)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("dist_models")
    cache: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = make_model(root, name)
        return cache[name]

    return get
