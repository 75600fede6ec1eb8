"""Greedy parity with Hugging Face for NemotronH (Mamba2 / NoPE attention / relu2 MLP / routed
MoE blocks) and FalconH1 (parallel Mamba2 + attention with muP multipliers)."""

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from krait import LLM, SamplingParams
from tests.utils import TINY_VOCAB, hf_greedy, make_tiny_hybrid

MAX_TOKENS = 32
PROMPT_LENS = [1, 6, 13, 22, 31, 40, 51, 60]
TOP_LOGPROBS = 3


def _layers_block_type_accepted() -> bool:
    import transformers as tf

    return "layers_block_type" in getattr(tf.NemotronHConfig, "__dataclass_fields__", {})


def _perturb_router_bias(model_dir: str, seed: int) -> None:
    """HF initialises e_score_correction_bias to zeros; give it values so that routing by
    biased scores and weighting by unbiased ones is exercised."""
    path = next(Path(model_dir).glob("*.safetensors"))
    tensors = load_file(str(path))
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if name.endswith("e_score_correction_bias"):
            tensors[name] = torch.rand(t.shape, generator=gen) * 0.2
    save_file(tensors, str(path), metadata={"format": "pt"})


def _to_pattern_config(model_dir: str) -> None:
    """Rewrites config.json the way released checkpoints carry the layout: a
    `hybrid_override_pattern` string and no `layers_block_type`."""
    path = Path(model_dir) / "config.json"
    cfg = json.loads(path.read_text())
    chars = {"linear_attention": "M", "full_attention": "*", "mlp": "-", "moe": "E"}
    types = cfg.pop("layers_block_type")
    cfg["hybrid_override_pattern"] = "".join(chars[t] for t in types)
    cfg["num_hidden_layers"] = len(types)
    path.write_text(json.dumps(cfg, indent=2))


def build_nemotronh_pattern(path: Path) -> str:
    d = make_tiny_hybrid(path, "nemotronh", hybrid_override_pattern="M*-EM")
    _perturb_router_bias(d, 1)
    _to_pattern_config(d)
    return d


def build_nemotronh_blocks(path: Path) -> str:
    if not _layers_block_type_accepted():
        pytest.skip("this transformers' NemotronHConfig has no layers_block_type")
    d = make_tiny_hybrid(
        path, "nemotronh", hybrid_override_pattern=None,
        layers_block_type=["linear_attention", "moe", "full_attention", "linear_attention", "mlp"],
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
        routed_scaling_factor=2.5, norm_topk_prob=False, moe_latent_size=32,
    )
    _perturb_router_bias(d, 2)
    return d


CASES = {
    "nemotronh_pattern": build_nemotronh_pattern,
    "nemotronh_blocks": build_nemotronh_blocks,
    "falconh1": lambda path: make_tiny_hybrid(path, "falconh1"),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny tensors gain nothing from intra-op threads, and lose a lot on a busy machine
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, TINY_VOCAB) for _ in range(n)] for n in PROMPT_LENS]


@pytest.fixture(scope="module", params=list(CASES))
def oracle(request, tmp_path_factory, one_thread):
    model_dir = CASES[request.param](tmp_path_factory.mktemp(request.param))
    tokens, _, rows = hf_greedy(model_dir, prompts(), MAX_TOKENS)
    return request.param, model_dir, tokens, rows


def run_krait(model_dir: str, prompt_list: list[list[int]], max_tokens: int, **engine_kw):
    llm = LLM(model_dir, **engine_kw)
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    outs = llm.generate([{"prompt_token_ids": p} for p in prompt_list], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], [o.outputs[0].logprobs for o in outs]


def assert_matches(name, tokens, logprobs, hf_tokens, hf_rows) -> None:
    """Same tokens; every logprob krait reports (chosen and top-k) within 1e-3 of HF's."""
    for i, (got, want) in enumerate(zip(tokens, hf_tokens)):
        assert got == want, f"{name} prompt {i} (len {PROMPT_LENS[i]}): {got} != {want}"
    worst = 0.0
    for steps, rows in zip(logprobs, hf_rows):
        assert len(steps) == len(rows)
        for step, row in zip(steps, rows):
            assert len(step) >= TOP_LOGPROBS
            for tok, lp in step.items():
                worst = max(worst, abs(lp.logprob - row[tok].item()))
    assert worst < 1e-3, f"{name}: logprob differs by {worst}"


@pytest.mark.parametrize("budget", [None, 7], ids=["default", "chunked7"])
def test_greedy_matches_hf(oracle, budget):
    name, model_dir, hf_tokens, hf_rows = oracle
    kw = {} if budget is None else {"max_num_batched_tokens": budget}
    tokens, logprobs = run_krait(model_dir, prompts(), MAX_TOKENS, **kw)
    assert_matches(name, tokens, logprobs, hf_tokens, hf_rows)


@pytest.mark.parametrize("norm_before_gate", [True, False], ids=["norm_gate", "gate_norm"])
def test_falconh1_mamba_rms_norm(tmp_path, one_thread, norm_before_gate):
    """FalconH1's optional gated norm in the mixer, both orders (the default config has none)."""
    model_dir = make_tiny_hybrid(
        tmp_path, "falconh1", mamba_rms_norm=True, mamba_norm_before_gate=norm_before_gate
    )
    short = prompts()[1:4]
    hf_tokens, _, hf_rows = hf_greedy(model_dir, short, 4)
    tokens, logprobs = run_krait(model_dir, short, 4, max_num_batched_tokens=7)
    assert_matches("falconh1 rms_norm", tokens, logprobs, hf_tokens, hf_rows)


def test_nemotronh_router_matches_hf():
    """Group-limited sigmoid routing against HF's router, over many tokens."""
    import transformers as tf
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from krait.models.nemotron_h import NemotronHRouter

    torch.manual_seed(0)
    for n_group, topk_group, norm in [(1, 1, True), (4, 2, False), (8, 3, True)]:
        cfg = tf.NemotronHConfig(
            hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=n_group,
            topk_group=topk_group, norm_topk_prob=norm, routed_scaling_factor=1.5,
        )
        hf = NemotronHTopkRouter(cfg)
        ours = NemotronHRouter(cfg)
        with torch.no_grad():
            hf.weight.normal_()
            hf.e_score_correction_bias.uniform_(0, 0.3)
            ours.weight.copy_(hf.weight)
            ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
            x = torch.randn(200, 32)  # [tokens, hidden]
            _, hf_w, hf_ids = hf(x)
            w, ids = ours(x)
        assert ids.dtype == torch.int32 and w.dtype == torch.float32
        hf_order, order = hf_ids.sort(-1), ids.long().sort(-1)
        assert torch.equal(hf_order.values, order.values), (n_group, topk_group)
        torch.testing.assert_close(
            w.gather(1, order.indices), hf_w.gather(1, hf_order.indices), rtol=1e-6, atol=1e-6
        )


def test_nemotronh_layer_kinds():
    """The layout from a bare pattern string (configs transformers does not convert), from
    `layers_block_type` in the old and the new spelling, and a refusal of unknown kinds."""
    from types import SimpleNamespace

    from krait.models.nemotron_h import nemotron_h_layer_kinds

    want = ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "moe"]
    assert nemotron_h_layer_kinds(SimpleNamespace(hybrid_override_pattern="M-M*-ME")) == want
    new = ["linear_attention", "mlp", "linear_attention", "full_attention", "mlp",
           "linear_attention", "moe"]
    old = ["mamba", "mlp", "mamba", "attention", "mlp", "mamba", "moe"]
    for types in (new, old):
        cfg = SimpleNamespace(layers_block_type=types, hybrid_override_pattern="MMMMMMM")
        assert nemotron_h_layer_kinds(cfg) == want
    with pytest.raises(ValueError, match="unknown layer types"):
        nemotron_h_layer_kinds(SimpleNamespace(hybrid_override_pattern="M*X"))
