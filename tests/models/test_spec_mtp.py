"""Qwen3-Next's multi-token-prediction head (speculative_config method "mtp") end to end.

A tiny random Qwen3-Next target whose checkpoint also holds a random MTP head (`mtp.*`: fc over
the normed [embedding, hidden], one gated-attention decoder layer with the sparse MoE, a final
norm; `mtp_num_hidden_layers` 1 in config.json). Greedy outputs with the head are HF
transformers' tokens (logprobs within 1e-3) under chunked prefill and few sequences. Random
heads' drafts are mostly rejected, so the head itself is checked: every proposal krait makes
equals the greedy continuation of a reference head built from HF's own Qwen3-Next modules (its
decoder layer and zero-centred norms) and given HF's final hidden states of the target. That
only holds when the hidden states handed over after prefill chunks and partly accepted verify
steps, the head's KV across calls and the feeding back of its own outputs are all right."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch

from krait import LLM
from krait.config import SpeculativeConfig
from tests.models.test_spec_decode_parity import Reference
from tests.models.test_spec_eagle import CONFIGS as EAGLE_CONFIGS
from tests.models.test_spec_eagle import (
    MAX_NEW,
    PROMPTS,
    K,
    _scripted,
    generate_and_match,
    use_graphs,
    use_head_graphs,
)
from tests.utils import (
    device_options,
    hf_greedy,
    make_tiny_llama,
    make_tiny_qwen3_next,
    record_proposals,
)

tf = pytest.importorskip("transformers")
if not hasattr(tf, "Qwen3NextForCausalLM"):
    pytest.skip(f"transformers {tf.__version__} has no Qwen3-Next", allow_module_level=True)

# the EAGLE tests' workload: prompts, k, the scripted continuations
CONFIGS = {name: EAGLE_CONFIGS[name] for name in ("defaults", "chunked_7_seqs_3")}

def add_mtp_head(model_dir: str, seed: int = 1) -> None:
    """Writes a random MTP head into the checkpoint (its own safetensors file, which HF's
    loader ignores) and declares it in config.json."""
    from safetensors.torch import save_file
    from transformers.models.qwen3_next import modeling_qwen3_next as hf_mod

    d = Path(model_dir)
    cfg = tf.AutoConfig.from_pretrained(model_dir)
    H = cfg.hidden_size
    torch.manual_seed(seed)
    layer = hf_mod.Qwen3NextDecoderLayer(cfg, 0)  # full attention and the MoE, as layer 0
    g = torch.Generator().manual_seed(seed)
    t = {}
    for name, p in layer.state_dict().items():
        scale = 0.2 if name.endswith("norm.weight") else (0.6 if ".gate." in name else 0.15)
        t["mtp.layers.0." + name] = torch.randn(p.shape, generator=g) * scale
    t["mtp.fc.weight"] = torch.randn(H, 2 * H, generator=g) * 0.15
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        t[f"mtp.{name}.weight"] = torch.randn(H, generator=g) * 0.2  # zero-centred: 1 + w
    save_file({k: v.contiguous() for k, v in t.items()}, str(d / "mtp.safetensors"))
    raw = json.loads((d / "config.json").read_text())
    raw["mtp_num_hidden_layers"] = 1
    (d / "config.json").write_text(json.dumps(raw, indent=1))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Reference:
    model_dir = make_tiny_qwen3_next(tmp_path_factory.mktemp("qwen3_next_mtp"))
    add_mtp_head(model_dir)
    tokens, _, rows = hf_greedy(model_dir, PROMPTS, MAX_NEW)
    return Reference(model_dir, tokens, rows)


def make_llm(target: Reference, **options) -> LLM:
    spec = {"method": "mtp", "num_speculative_tokens": K}
    return LLM(target.model_dir, **device_options(), speculative_config=spec, **options)


class _ReferenceHead:
    """The MTP head from HF's modules and the checkpoint's mtp.* tensors (plain forward over
    the whole sequence each step, a causal mask)."""

    def __init__(self, target: Reference, hf) -> None:
        from safetensors.torch import load_file
        from transformers.models.qwen3_next import modeling_qwen3_next as hf_mod

        cfg = hf.config
        W = load_file(str(Path(target.model_dir) / "mtp.safetensors"))
        self.layer = hf_mod.Qwen3NextDecoderLayer(cfg, 0).eval()
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in W.items()
                                    if k.startswith("mtp.layers.0.")})
        self.norms = {}
        for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
            n = hf_mod.Qwen3NextRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            n.weight.data.copy_(W[f"mtp.{name}.weight"])
            self.norms[name] = n
        self.fc = W["mtp.fc.weight"]
        self.rotary = hf_mod.Qwen3NextRotaryEmbedding(cfg)
        self.embed = hf.model.embed_tokens.weight.detach()
        self.lm_head = hf.lm_head.weight.detach()

    def drafts(self, tokens: list[int], target_hidden: torch.Tensor, k: int) -> list[int]:
        """Greedy drafts after target tokens `tokens` (n), given the target's final hidden
        states at positions 0..n-2: head position p takes token p + 1 and hidden p; later
        steps take the head's own output."""
        ids, hs, out = list(tokens[1:]), target_hidden, []
        for _ in range(k):
            T = len(ids)
            e = self.norms["pre_fc_norm_embedding"](self.embed[torch.tensor(ids)])
            x = torch.cat([e, self.norms["pre_fc_norm_hidden"](hs)], -1) @ self.fc.T  # [T, H]
            pos = torch.arange(T)[None]
            mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
            y = self.layer(x[None], position_embeddings=self.rotary(x[None], pos),
                           attention_mask=mask, position_ids=pos)[0]
            y = self.norms["norm"](y)
            tok = int((y[-1] @ self.lm_head.T).argmax())
            out.append(tok)
            ids.append(tok)
            hs = torch.cat([hs, y[-1:]])
        return out


def _check_proposals(target: Reference, seen: list) -> int:
    hf = tf.AutoModelForCausalLM.from_pretrained(target.model_dir, dtype=torch.float32).eval()
    hf.config._attn_implementation = "eager"
    checked = 0
    with torch.no_grad():
        head = _ReferenceHead(target, hf)
        full = {i: hf.model(torch.tensor([p + target.tokens[i]])).last_hidden_state[0]
                for i, p in enumerate(PROMPTS)}
        for tokens, drafts in seen:
            i = next(i for i, p in enumerate(PROMPTS)
                     if tokens == (p + target.tokens[i])[: len(tokens)] and len(tokens) > len(p))
            want = head.drafts(tokens, full[i][: len(tokens) - 1], len(drafts))
            assert drafts == want, (i, len(tokens), drafts, want)
            checked += len(drafts)
    return checked


@pytest.mark.parametrize("verified", ["head", "scripted"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_mtp_is_lossless_and_proposes_the_heads_drafts(target, config: str,
                                                       verified: str) -> None:
    """verified="head": the target verifies the head's drafts; "scripted": HF's continuation
    right for 0..K tokens in turn, so the head catches up after partly accepted verify steps
    (its own proposals are still recorded and checked)."""
    llm = make_llm(target, **CONFIGS[config])
    drafter = llm.llm_engine.runner.drafter
    seen = record_proposals(drafter, partial(_scripted, target) if verified == "scripted" else None)
    generate_and_match(llm, target)
    stats = llm.llm_engine.get_stats()
    drafted = stats["spec_decode_num_draft_tokens"]
    accepted = stats["spec_decode_num_accepted_tokens"]
    assert stats["spec_decode_num_drafts"] > 0 and drafted > 0
    if verified == "scripted":
        assert 0 < accepted < drafted, (accepted, drafted)
    assert drafter.num_lost == 0
    assert _check_proposals(target, seen) >= len(PROMPTS) * K
    # the head shares the target's embedding and lm_head: no copies
    head = drafter.head
    assert head.embed_tokens is llm.llm_engine.runner.model.embed_tokens
    assert head.lm_head is llm.llm_engine.runner.model.lm_head


def test_mtp_refusals_name_the_field(target, tmp_path) -> None:
    spec = {"method": "mtp", "num_speculative_tokens": K}
    assert SpeculativeConfig.from_dict(spec).method == "mtp"
    llama = make_tiny_llama(tmp_path / "llama")
    with pytest.raises(ValueError, match="Qwen3-Next targets"):
        LLM(llama, **device_options(), speculative_config=spec)
    bare = make_tiny_qwen3_next(tmp_path / "bare")  # no head in the checkpoint
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        LLM(bare, **device_options(), speculative_config=spec)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(target.model_dir, **device_options(), speculative_config=spec,
            enable_prefix_caching=True)


def test_mtp_through_verify_graphs(target) -> None:
    """The target's decode and verify graphs (record=False) hand the head their hidden states:
    outputs stay HF's and every proposal is the reference head's."""
    llm = make_llm(target)
    replays = use_graphs(llm)
    seen = record_proposals(llm.llm_engine.runner.drafter)
    generate_and_match(llm, target)
    assert replays, "expected verify steps through the graphs"
    assert _check_proposals(target, seen) >= len(PROMPTS) * K


def test_mtp_head_through_its_decode_graphs(target) -> None:
    """The head's one-token steps and one-position catch-ups replay its own decode graphs
    (record=False): outputs stay HF's and every proposal is the reference head's."""
    llm = make_llm(target)
    use_graphs(llm)
    drafter = llm.llm_engine.runner.drafter
    tally = use_head_graphs(drafter)
    seen = record_proposals(drafter)
    generate_and_match(llm, target)
    assert tally["catch_up"] > 0 and tally["one_token"] > 0, tally
    assert _check_proposals(target, seen) >= len(PROMPTS) * K
