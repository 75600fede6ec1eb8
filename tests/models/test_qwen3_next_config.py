"""The shipped Qwen3-Next-80B bench config (`krait bench latency --config qwen3-next-80b-a3b-8l`,
8 layers: 6 Gated DeltaNet, 2 attention) builds — on the meta device: its 512 experts a layer
are ~13 B parameters, more than a CPU test box holds — read through transformers'
Qwen3NextConfig and, as on a transformers without it (the GPU machine's may lack it), through
the plain PretrainedConfig that `read_hf_config` falls back to; and the decode roofline counts
the GDN layers' float32 state, read and written a step."""

from __future__ import annotations

import pytest
import torch

from krait.bench.offline import CONFIG_DIR

CFG = CONFIG_DIR / "qwen3-next-80b-a3b-8l"


def _read(without_hf_class: bool, monkeypatch):
    import transformers

    from krait.config import read_hf_config

    if without_hf_class:
        real = transformers.AutoConfig.for_model

        def for_model(model_type, *a, **kw):
            if model_type == "qwen3_next":
                raise ValueError("Unrecognized model identifier: qwen3_next")
            return real(model_type, *a, **kw)

        monkeypatch.setattr(transformers.AutoConfig, "for_model", for_model)
    return read_hf_config(CFG)


def _build(cfg):
    from krait.models.registry import get_model_class

    with torch.device("meta"):
        return get_model_class(cfg)(cfg)


@pytest.mark.parametrize("without_hf_class", [False, True])
def test_bench_config_builds(without_hf_class, monkeypatch):
    from krait.layers.gated_deltanet import GatedDeltaNet

    cfg = _read(without_hf_class, monkeypatch)
    assert (type(cfg).__name__.lower() == "pretrainedconfig") == without_hf_class
    model = _build(cfg)
    gdn = [m for m in model.modules() if isinstance(m, GatedDeltaNet)]
    assert len(gdn) == 6 and sum(layer.self_attn is not None for layer in model.layers) == 2
    d = gdn[0].d
    assert (d.num_k_heads, d.num_v_heads, d.head_k_dim, d.head_v_dim, d.conv_width) == (
        16, 32, 128, 128, 4)
    assert gdn[0].state_shapes() == ((2 * 16 * 128 + 32 * 128, 3), (32, 128, 128))
    attn = model.layers[3].self_attn
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (16, 2, 256)
    assert attn.rotary.rot_dim == 64  # partial_rotary_factor 0.25 of 256
    assert model.layers[0].mlp.experts.w13.shape[0] == 512


def test_decode_roofline_counts_the_gdn_state(monkeypatch):
    from krait.bench.roofline import decode_bytes, model_bytes
    from krait.runner.model_states.mamba_hybrid import MambaHybridModelState

    model = _build(_read(False, monkeypatch))
    ms = MambaHybridModelState.__new__(MambaHybridModelState)  # the sizing part alone
    ms.mamba_layers = [m for m in model.modules() if getattr(m, "has_recurrent_state", False)]
    ms.conv_dtype, ms.ssm_dtype, ms._ssm_dtype_auto = torch.bfloat16, torch.bfloat16, True
    ms.kv_dtype = torch.bfloat16
    mb = model_bytes(model, ms)
    # per sequence: 6 layers of a bf16 conv window (8192 channels x 3) and a float32 state
    per_seq = 6 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)
    assert mb.state_bytes_per_seq == per_seq  # 12.1 MiB: 2 MiB of state a layer
    # the KV of the 2 attention layers (2 KV heads of 256) a token
    assert mb.kv_bytes_per_token == 2 * 2 * 2 * 256 * 2
    # each of the 8 MoE layers: 512 experts, 10 routes a token (the router's top-k)
    assert [(e, k) for e, k, _ in mb.expert_bytes_per_layer] == [(512, 10)] * 8
    no_state = type(mb)(**{**mb.__dict__, "state_bytes_per_seq": 0})
    for batch in (1, 64):  # read and written every step
        assert decode_bytes(mb, batch, 1024) - decode_bytes(no_state, batch, 1024) == (
            2 * batch * per_seq)
