"""EAGLE-1 and EAGLE-3 heads (speculative_config method "eagle" / "eagle3") end to end.

A tiny random Llama target and tiny random heads saved in the public layouts (config.json with
the heads' architectures + safetensors: fc over [embedding, hidden], EAGLE-3's midlayer, draft
vocabulary and d2t). Greedy outputs with a head are HF transformers' tokens (logprobs within
1e-3) under chunked prefill and few sequences. Random heads' drafts are mostly rejected, so the
head itself is checked against a plain-torch forward written here: every proposal krait makes
equals the reference head's greedy continuation given HF's hidden states of the target
(EAGLE-1: after the final norm; EAGLE-3: the inputs of layers 2, L // 2 and L - 3). That only
holds when the hidden states handed over after prefill chunks and partly accepted verify steps,
the head's KV across calls and the feeding back of its own outputs are all right."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch

from krait import LLM, SamplingParams
from krait.config import EngineConfig
from tests.models.test_spec_decode_parity import NUM_LOGPROBS, Reference, assert_matches
from tests.utils import (
    TINY_VOCAB,
    device_options,
    hf_greedy,
    make_tiny_hybrid,
    make_tiny_llama,
    record_proposals,
)

MAX_NEW = 10
K = 3
TARGET_LAYERS = 7  # EAGLE-3 reads the inputs of layers 2, 3 and 4
H = 64
DRAFT_VOCAB = 384
PROMPTS = [
    [7, 8, 9] * 3,
    [11],
    [3 + (7 * j + 13 * j * j) % 500 for j in range(23)],
    [21, 22],
    [5 + (11 * j) % 400 for j in range(12)],
]
CONFIGS = {
    "defaults": {},
    "chunked_7_seqs_3": dict(max_num_batched_tokens=7, max_num_seqs=3),
    # a verify row of 1 + K tokens takes the whole budget: the other row waits, drafted already
    "budget_4_seqs_2": dict(max_num_batched_tokens=K + 1, max_num_seqs=2),
    # a pool too small for every request at once: the target preempts and recomputes
    "preemption": dict(block_size=4, num_kv_blocks=14, max_model_len=56),
}
ARCHS = {"eagle": "LlamaForCausalLMEagle", "eagle3": "LlamaForCausalLMEagle3"}


def make_head(path: Path, method: str, seed: int = 1, hidden_size: int = H,
              vocab_size: int = TINY_VOCAB, arch: str | None = None,
              max_position_embeddings: int = 256) -> str:
    """A random head in the public layout; no embed_tokens (the target's), EAGLE-1 no lm_head."""
    import transformers as tf
    from safetensors.torch import save_file

    eagle3 = method == "eagle3"
    extra = {"draft_vocab_size": DRAFT_VOCAB} if eagle3 else {}
    cfg = tf.LlamaConfig(
        architectures=[arch or ARCHS[method]], vocab_size=vocab_size, hidden_size=hidden_size,
        intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2, **extra)
    path.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(path)
    g = torch.Generator().manual_seed(seed)

    def w(*shape: int, scale: float = 0.15) -> torch.Tensor:
        return torch.randn(shape, generator=g) * scale

    def norm() -> torch.Tensor:
        return 1 + w(hidden_size, scale=0.1)

    p = "midlayer." if eagle3 else "layers.0."
    qkv_in = 2 * hidden_size if eagle3 else hidden_size
    t = {
        p + "self_attn.q_proj.weight": w(64, qkv_in), p + "self_attn.k_proj.weight": w(32, qkv_in),
        p + "self_attn.v_proj.weight": w(32, qkv_in), p + "self_attn.o_proj.weight": w(hidden_size, 64),
        p + "mlp.gate_proj.weight": w(128, hidden_size), p + "mlp.up_proj.weight": w(128, hidden_size),
        p + "mlp.down_proj.weight": w(hidden_size, 128),
        p + "input_layernorm.weight": norm(), p + "post_attention_layernorm.weight": norm(),
    }
    if eagle3:
        # the draft vocabulary: every target id but a random 128, in order
        keep = torch.randperm(vocab_size, generator=g)[:DRAFT_VOCAB].sort().values
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[keep] = True
        t |= {p + "hidden_norm.weight": norm(), "fc.weight": w(hidden_size, 3 * hidden_size),
              "norm.weight": norm(), "lm_head.weight": w(DRAFT_VOCAB, hidden_size, scale=0.5),
              "d2t": keep - torch.arange(DRAFT_VOCAB), "t2d": t2d}
    else:
        t |= {"fc.weight": w(hidden_size, 2 * hidden_size), "fc.bias": w(hidden_size)}
    save_file({k: v.contiguous() for k, v in t.items()}, str(path / "model.safetensors"))
    return str(path)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Reference:
    model_dir = make_tiny_llama(tmp_path_factory.mktemp("target"), num_hidden_layers=TARGET_LAYERS)
    tokens, _, rows = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    return Reference(model_dir, tokens, rows)


@pytest.fixture(scope="module")
def heads(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("heads")
    return {m: make_head(root / m, m) for m in ARCHS}


def generate_and_match(llm: LLM, target: Reference) -> None:
    """Greedy generation of PROMPTS (MAX_NEW tokens, logprobs): HF's tokens, logprobs close."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True,
                            logprobs=NUM_LOGPROBS)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for i, out in enumerate(outs):
        assert_matches(target, i, out.outputs[0], n=MAX_NEW)


def make_llm(target: Reference, method: str, head: str, **options) -> LLM:
    spec = {"method": method, "model": head, "num_speculative_tokens": K}
    return LLM(target.model_dir, **device_options(), speculative_config=spec, **options)


# -- the reference head: plain torch --------------------------------------------------------
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """x [T, heads, d] at positions 0..T-1, rotate-half (neox) layout."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = (torch.arange(x.shape[0], dtype=torch.float64)[:, None] * inv)[:, None]  # [T, 1, d/2]
    cos, sin = f.cos().float(), f.sin().float()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def _layer(W: dict, p: str, x_attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """Causal GQA attention over x_attn (4 heads, 2 kv heads of 16), + residual, norm, MLP,
    + residual."""
    T = x_attn.shape[0]
    q = _rope((x_attn @ W[p + "self_attn.q_proj.weight"].T).view(T, 4, 16))
    k = _rope((x_attn @ W[p + "self_attn.k_proj.weight"].T).view(T, 2, 16)).repeat_interleave(2, 1)
    v = (x_attn @ W[p + "self_attn.v_proj.weight"].T).view(T, 2, 16).repeat_interleave(2, 1)
    s = torch.einsum("thd,shd->hts", q, k) / 4.0
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    a = torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, 64)
    h = a @ W[p + "self_attn.o_proj.weight"].T + residual
    x = _rms(h, W[p + "post_attention_layernorm.weight"])
    m = torch.nn.functional.silu(x @ W[p + "mlp.gate_proj.weight"].T) * (x @ W[p + "mlp.up_proj.weight"].T)
    return m @ W[p + "mlp.down_proj.weight"].T + h


def reference_drafts(method: str, W: dict, embed: torch.Tensor, lm_head: torch.Tensor,
                     tokens: list[int], target_hidden: torch.Tensor, k: int) -> list[int]:
    """The head's greedy drafts after target tokens `tokens` (n of them), given the target's
    hidden states at positions 0..n-2 ([n-1, H] or [n-1, 3H]): head position p takes token
    p + 1 and hidden p; later steps take the head's own output."""
    ids = list(tokens[1:])
    if method == "eagle3":
        hs = target_hidden @ W["fc.weight"].T
    else:
        hs = target_hidden
    out = []
    for _ in range(k):
        e = embed[torch.tensor(ids)]
        if method == "eagle3":
            p = "midlayer."
            x = torch.cat([_rms(e, W[p + "input_layernorm.weight"]), _rms(hs, W[p + "hidden_norm.weight"])], -1)
            y = _layer(W, p, x, hs)
            d = int((_rms(y[-1], W["norm.weight"]) @ W["lm_head.weight"].T).argmax())
            tok = d + int(W["d2t"][d])
        else:
            x = torch.cat([e, hs], -1) @ W["fc.weight"].T + W["fc.bias"]
            y = _layer(W, "layers.0.", x, x)  # the first layer has no input_layernorm
            tok = int((y[-1] @ lm_head.T).argmax())
        out.append(tok)
        ids.append(tok)
        hs = torch.cat([hs, y[-1:]])
    return out


def _check_proposals(method: str, head: str, target: Reference, seen: list) -> int:
    """Every recorded (target tokens, drafts) pair against the reference head; returns the
    number of drafts checked."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=torch.float32).eval()
    W = load_file(str(Path(head) / "model.safetensors"))
    embed = hf.model.embed_tokens.weight.detach()
    lm_head = hf.lm_head.weight.detach()
    L = TARGET_LAYERS
    checked = 0
    with torch.no_grad():
        full = {}  # the hidden states over each prompt's whole greedy sequence
        for i, p in enumerate(PROMPTS):
            ids = torch.tensor([p + target.tokens[i]])
            out = hf.model(ids, output_hidden_states=True)
            hs = out.hidden_states
            full[i] = (out.last_hidden_state[0] if method == "eagle"
                       else torch.cat([hs[2][0], hs[L // 2][0], hs[L - 3][0]], -1))
        for tokens, drafts in seen:
            i = next(i for i, p in enumerate(PROMPTS)
                     if tokens == (p + target.tokens[i])[: len(tokens)] and len(tokens) > len(p))
            want = reference_drafts(method, W, embed, lm_head, tokens,
                                    full[i][: len(tokens) - 1], len(drafts))
            assert drafts == want, (i, len(tokens), drafts, want)
            checked += len(drafts)
    return checked


def _scripted(target: Reference, tokens: list[int], step: int) -> list[int]:
    """HF's next K tokens after `tokens`, the first `step % (K + 1)` right, the rest wrong."""
    i = next(i for i, p in enumerate(PROMPTS)
             if tokens[: len(p)] == p and len(tokens) > len(p))
    out = len(tokens) - len(PROMPTS[i])
    want = (target.tokens[i] + [0] * (K + 1))[out : out + K]
    right = step % (K + 1)
    return want[:right] + [(t + 1) % 500 for t in want[right:]]


@pytest.mark.parametrize("verified", ["head", "scripted"])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("method", list(ARCHS))
def test_eagle_is_lossless_and_proposes_the_heads_drafts(target, heads, method: str,
                                                         config: str, verified: str) -> None:
    """verified="head": the target verifies the head's drafts (random heads': nearly all
    rejected). "scripted": it verifies HF's continuation instead, right for 0..K tokens in turn,
    so the head catches up after partly accepted verify steps; its own proposals are still
    recorded and checked."""
    llm = make_llm(target, method, heads[method], **CONFIGS[config])
    drafter = llm.llm_engine.runner.drafter
    seen = record_proposals(drafter, partial(_scripted, target) if verified == "scripted" else None)
    added = []
    add = llm.llm_engine.scheduler.add_request
    llm.llm_engine.scheduler.add_request = lambda r: (added.append(r), add(r))
    generate_and_match(llm, target)
    engine = llm.llm_engine
    stats = engine.get_stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    assert stats["spec_decode_num_drafts"] > 0 and drafted > 0
    if verified == "scripted":
        assert 0 < accepted < drafted, (accepted, drafted)
    assert drafter.num_lost == 0
    assert _check_proposals(method, heads[method], target, seen) >= len(PROMPTS) * K
    if config == "preemption":
        assert sum(r.num_preemptions for r in added) > 0, "the pool was meant to force preemption"
    elif config != "defaults":  # catch-ups split by the budget
        assert drafter.num_catch_up_steps > len(PROMPTS)
    if config == "budget_4_seqs_2":  # rows skipped by the scheduler reuse their first draft
        assert drafter.num_reused_first_drafts > 0
    engine.step()  # the runner hears of the last finished requests in the next step
    assert not drafter._seqs and not drafter._pending
    assert drafter.kv.num_free_blocks == drafter.kv.num_usable_blocks


def test_eagle1_head_named_by_its_base_architecture(target, tmp_path) -> None:
    """The EAGLE-1 releases' config.json names LlamaForCausalLM: with method "eagle" that is
    the EAGLE-1 head. Its positional limit (16 here) does not cap the target's max_model_len:
    the head is used past it."""
    head = make_head(tmp_path / "base_arch", "eagle", arch="LlamaForCausalLM",
                     max_position_embeddings=16)
    llm = make_llm(target, "eagle", head)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS[:2]], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == target.tokens[:2]
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0


def test_sampled_rows_verify_eagle_drafts(target, heads) -> None:
    """Temperature rows verify the head's drafts through the rejection sampler (point masses)."""
    llm = make_llm(target, "eagle3", heads["eagle3"])
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=3, max_tokens=MAX_NEW,
                            ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == MAX_NEW for o in outs)
    assert llm.llm_engine.get_stats()["spec_decode_num_draft_tokens"] > 0


def test_eagle3_target_keeps_aux_hidden_only_when_asked(target, heads) -> None:
    llm = make_llm(target, "eagle3", heads["eagle3"])
    assert llm.llm_engine.runner.model.aux_hidden_layers == (2, 3, 4)
    plain = LLM(target.model_dir, **device_options())
    plain.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(max_tokens=2), use_tqdm=False)
    model = plain.llm_engine.runner.model
    assert model.aux_hidden_layers == () and model.aux_hidden is None


def test_refusals_name_the_field(target, heads, tmp_path) -> None:
    def spec(method="eagle", model=heads["eagle"]):
        return {"method": method, "model": model, "num_speculative_tokens": K}

    with pytest.raises(ValueError, match=r"speculative_config\.model.*eagle"):
        LLM(target.model_dir, **device_options(),
            speculative_config={"method": "eagle", "num_speculative_tokens": K})
    # (tensor parallelism is served: tests/distributed/test_tp_spec.py)
    for key, opts in (("pipeline_parallel_size", dict(pipeline_parallel_size=2)),
                      ("enable_prefix_caching", dict(enable_prefix_caching=True))):
        with pytest.raises(ValueError, match=key):
            EngineConfig.from_kwargs(target.model_dir, **device_options(),
                                     speculative_config=spec(), **opts)
    hybrid = make_tiny_hybrid(tmp_path / "mamba2", "mamba2")
    with pytest.raises(ValueError, match=r"speculative_config\.method='eagle'.*Llama-family"):
        LLM(hybrid, **device_options(), speculative_config=spec())
    with pytest.raises(ValueError, match=r"speculative_config\.model.*hidden_size is 32"):
        LLM(target.model_dir, **device_options(),
            speculative_config=spec(model=make_head(tmp_path / "h32", "eagle", hidden_size=32)))
    with pytest.raises(ValueError, match=r"speculative_config\.model.*vocab_size"):
        LLM(target.model_dir, **device_options(),
            speculative_config=spec(model=make_head(tmp_path / "v520", "eagle", vocab_size=520)))
    with pytest.raises(ValueError, match=r"speculative_config\.model.*not an 'eagle3' head"):
        LLM(target.model_dir, **device_options(), speculative_config=spec("eagle3"))


def use_graphs(llm: LLM) -> list[int]:
    """The target's decode and verify graphs in their record=False form (the captured bodies
    run eagerly over the captured buffers: the graph dataflow without a GPU); returns the
    verify-graph replays' row counts as they happen."""
    from krait.runner.cuda_graphs import CudaGraphRunner

    runner = llm.llm_engine.runner
    runner.cuda_graphs = CudaGraphRunner(runner, record=False)
    runner.cuda_graphs.capture_all()
    runner.verify_graphs = CudaGraphRunner(runner, record=False, tokens_per_row=1 + K)
    runner.verify_graphs.capture_all()
    replays: list[int] = []
    real = runner.verify_graphs.run
    runner.verify_graphs.run = lambda b: (replays.append(b.num_reqs), real(b))[1]
    return replays


def use_head_graphs(drafter) -> dict[str, int]:
    """The head's own decode graphs in their record=False form; returns the tally of its steps
    as they run: graph replays during the catch-up and during the one-token steps, eager
    forwards."""
    drafter.capture_graphs(record=False)
    runner = drafter.runner
    tally = {"catch_up": 0, "one_token": 0, "eager": 0}
    phase = ["one_token"]
    replay, forward, catch_up = runner.cuda_graphs.run, runner.forward, drafter._catch_up

    def replaying(batch):
        tally[phase[0]] += 1
        return replay(batch)

    def eager(batch):
        tally["eager"] += 1
        return forward(batch)

    def catching_up(*args):
        phase[0] = "catch_up"
        try:
            return catch_up(*args)
        finally:
            phase[0] = "one_token"

    runner.cuda_graphs.run, runner.forward, drafter._catch_up = replaying, eager, catching_up
    return tally


@pytest.mark.parametrize("verified", ["head", "scripted"])
@pytest.mark.parametrize("method", list(ARCHS))
def test_head_steps_through_its_decode_graphs(target, heads, method: str, verified: str) -> None:
    """The head's one-token steps, and its catch-ups of one position a row (every draft
    rejected), replay the head's decode graphs (record=False: the side input through each
    graph's buffer); longer catch-ups run eagerly. Outputs stay HF's and every proposal is the
    reference head's, also after partly accepted verify steps ("scripted")."""
    llm = make_llm(target, method, heads[method])
    use_graphs(llm)
    drafter = llm.llm_engine.runner.drafter
    tally = use_head_graphs(drafter)
    seen = record_proposals(drafter, partial(_scripted, target) if verified == "scripted" else None)
    generate_and_match(llm, target)
    assert tally["one_token"] > 0 and tally["eager"] > 0, tally  # (prefills run eagerly)
    if verified == "head":  # every draft rejected: one position a row to catch up
        assert tally["catch_up"] > 0, tally
    assert drafter.num_lost == 0
    assert _check_proposals(method, heads[method], target, seen) >= len(PROMPTS) * K


@pytest.mark.parametrize("method", list(ARCHS))
def test_eagle_through_verify_graphs(target, heads, method: str) -> None:
    """With the target's steps in decode and verify graphs, the head still gets every kept
    position's hidden states (the graph's output; EAGLE-3 the layers' inputs it keeps): the
    outputs stay HF's and every proposal is the reference head's."""
    llm = make_llm(target, method, heads[method])
    replays = use_graphs(llm)
    seen = record_proposals(llm.llm_engine.runner.drafter)
    generate_and_match(llm, target)
    assert replays, "expected verify steps through the graphs"
    assert llm.llm_engine.runner.drafter.num_lost == 0
    assert _check_proposals(method, heads[method], target, seen) >= len(PROMPTS) * K
