"""The Gated DeltaNet mixer (Qwen3-Next's `linear_attention` layers) over packed varlen batches
with per-request state slots, beside the Mamba2 mixer: the same slots, metadata and step layout
(decode rows first, then prefill rows; see `MambaMetadata`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from krait.distributed import parallel_state as ps
from krait.distributed.sharding import ShardSpec, set_spec
from krait.layers.linear import MergedLinear, RowParallelLinear, conv_linear
from krait.layers.mamba2 import MambaMetadata
from krait.ops import linear as plan
from krait.ops._dispatch import use_triton
from krait.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from krait.ops.causal_conv1d_verify import causal_conv1d_verify
from krait.ops.gated_delta_chunk import gated_delta_chunk
from krait.ops.gated_delta_update import gated_delta_update, gdn_gate_ref
from krait.ops.gated_delta_verify import gated_delta_verify
from krait.ops.gated_rms_norm import gated_rms_norm
from krait.runner.piecewise_graphs import mixer_call, piecewise_forward


@dataclass(frozen=True)
class GatedDeltaNetDims:
    hidden_size: int
    num_k_heads: int
    num_v_heads: int  # a multiple of num_k_heads
    head_k_dim: int
    head_v_dim: int
    conv_width: int
    eps: float
    activation: str = "silu"

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim


def gdn_tp_layout(d: GatedDeltaNetDims, tp: int, rank: int) -> tuple[GatedDeltaNetDims, dict]:
    """This TP rank's mixer: its dims (Hk / tp key heads and the Hv / tp value heads they own,
    contiguous after `regroup_qkvz`) and the checkpoint ranges it holds (after the regroup) of
    in_proj's shard 0 rows [q | k | v | z] and shard 1 rows [b | a], the conv channels
    [q | k | v] and the per-value-head vectors (A_log, dt_bias). The norm weight (one head's)
    is replicated; out_proj is row-parallel (the rank's value heads are its columns)."""
    hk, hv = d.num_k_heads // tp, d.num_v_heads // tp
    lk, lv = hk * d.head_k_dim, hv * d.head_v_dim
    kd, vd = d.key_dim, d.value_dim
    local = dataclasses.replace(d, num_k_heads=hk, num_v_heads=hv)
    q, k, v = (rank * lk, lk), (kd + rank * lk, lk), (2 * kd + rank * lv, lv)
    pieces = {
        "qkvz": (q, k, v, (2 * kd + vd + rank * lv, lv)),
        "ba": ((rank * hv, hv), (d.num_v_heads + rank * hv, hv)),
        "conv": (q, k, v),
        "heads": ((rank * hv, hv),),
    }
    return local, pieces


class GatedDeltaNet(torch.nn.Module):
    """HF `Qwen3NextGatedDeltaNet` semantics: in_proj -> [q | k | v | z | b | a]; causal conv
    (silu) on q, k, v; g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b); the gated delta
    rule with l2-normed q, k; per-head RMSNorm of the output, gated by silu(z); out_proj.

    in_proj holds HF's in_proj_qkvz (shard 0) and in_proj_ba (shard 1) with their rows regrouped
    from HF's per-key-head interleave into whole q, k, v, z (and b, a) blocks
    (`regroup_qkvz`, `regroup_ba` at load time), so the conv input is one contiguous slice.
    The runner binds `conv_state` [num_slots, conv_dim, width - 1] and `ssm_state`
    [num_slots, Hv, head_k_dim, head_v_dim] (float32 unless the cache dtype says otherwise).

    Under TP `d` is the whole mixer's dims and `self.d` this rank's (`gdn_tp_layout`: whole key
    heads with their value heads, so every kernel, the decode fusions included, runs on the
    rank's heads as on a smaller model's); out_proj is row-parallel and all-reduces."""

    has_recurrent_state = True
    chunk_layout_size = None  # no Mamba2 SSD chunk layout
    recurrent_state_dtype = torch.float32

    def __init__(self, d: GatedDeltaNetDims) -> None:
        super().__init__()
        if d.num_v_heads % d.num_k_heads:
            raise ValueError(f"GatedDeltaNet: {d.num_v_heads} value heads do not divide into "
                             f"{d.num_k_heads} key heads")
        full = d
        tp = ps.get_tp_size()
        pieces = None
        if tp > 1:
            if d.num_k_heads % tp:
                raise ValueError(f"GatedDeltaNet: tensor_parallel_size={tp} does not divide "
                                 f"{d.num_k_heads} key heads (linear_num_key_heads)")
            d, pieces = gdn_tp_layout(full, tp, ps.get_tp_rank())
        self.d = d
        specs = None
        if pieces is not None:
            specs = [ShardSpec(0, 2 * full.key_dim + 2 * full.value_dim, pieces["qkvz"]),
                     ShardSpec(0, 2 * full.num_v_heads, pieces["ba"])]
        self.in_proj = MergedLinear(d.hidden_size, [2 * d.key_dim + 2 * d.value_dim,
                                                    2 * d.num_v_heads], specs=specs)
        self.conv1d_weight = torch.nn.Parameter(torch.empty(d.conv_dim, 1, d.conv_width))
        self.dt_bias = torch.nn.Parameter(torch.ones(d.num_v_heads))
        self.A_log = torch.nn.Parameter(torch.empty(d.num_v_heads))
        self.norm_weight = torch.nn.Parameter(torch.ones(d.head_v_dim))
        self.out_proj = RowParallelLinear(full.value_dim, d.hidden_size)
        if pieces is not None:
            set_spec(self.conv1d_weight, ShardSpec(0, full.conv_dim, pieces["conv"]))
            for p in (self.dt_bias, self.A_log):
                set_spec(p, ShardSpec(0, full.num_v_heads, pieces["heads"]))
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d = self.d
        return (d.conv_dim, d.conv_width - 1), (d.num_v_heads, d.head_k_dim, d.head_v_dim)

    def forward(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. Decode steps on the Triton path take the fusions:
        the output norm in the delta rule's launch, and for one row the conv in in_proj's
        GEMV epilogue where krait/ops/linear.py's plan takes it."""
        d = self.d
        if (meta.num_prefills == 0 and meta.num_accepted_tokens is None and use_triton(x)
                and not piecewise_forward()):
            conv = self._conv_epilogue(x, meta)
            proj = (self.in_proj(x) if conv is None
                    else conv_linear(x, self.in_proj.weight, self.in_proj.bias, conv))
            qkv, z, b, a = proj.split(self._proj_sizes(), dim=-1)
            gated = mixer_call(self._decode, (qkv, z, a, b), meta, "mamba", conv is not None)
            return self.out_proj(gated)
        qkv, z, b, a = self.in_proj(x).split(self._proj_sizes(), dim=-1)
        # the gates' raw inputs: the decode update forms g and beta in its kernel
        core = mixer_call(self._mix, (qkv, a, b), meta, "mamba")  # [T, Hv * V]
        # each head's RMSNorm, then the silu(z) gate, in one kernel (z a strided view)
        gated = gated_rms_norm(core, z, self.norm_weight, d.eps, d.head_v_dim, gate_after=True)
        return self.out_proj(gated)

    def _proj_sizes(self) -> list[int]:
        """in_proj's outputs: [q | k | v (the conv's channels) | z | b | a]."""
        d = self.d
        return [d.conv_dim, d.value_dim, d.num_v_heads, d.num_v_heads]

    def _conv_epilogue(self, x: torch.Tensor, meta: MambaMetadata) -> tuple | None:
        """The conv's decode step as the one-row in_proj GEMV's epilogue takes it (its channels
        are in_proj's first conv_dim outputs), or None where the plan does not."""
        d = self.d
        if x.shape[0] != 1 or not plan.conv_epilogue(1, *self.in_proj.weight.shape,
                                                     d.conv_width):
            return None
        return (0, self.conv1d_weight.squeeze(1), None, self.conv_state,
                meta.decode_state_indices[:1], d.activation is not None)

    def _decode(self, qkv: torch.Tensor, z: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                meta: MambaMetadata, convolved: bool = False) -> torch.Tensor:
        """A decode step's rows (every row one token; padding rows carry slot -1 and come out
        0): conv (unless in_proj's epilogue did it: `convolved`), the delta rule and the gated
        output norm in its launch: [T, Hv * V]."""
        d = self.d
        n = qkv.shape[0]
        idx = meta.decode_state_indices[:n]
        conv = qkv if convolved else causal_conv1d_update(
            qkv, self.conv_state, self.conv1d_weight.squeeze(1), None, idx, d.activation)
        q, k, v = self._split(conv)
        return gated_delta_update(q, k, v, a, b, self.ssm_state, idx, A_log=self.A_log,
                                  dt_bias=self.dt_bias,
                                  norm=(z, self.norm_weight, d.eps)).reshape(n, -1)

    def _mix(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             meta: MambaMetadata) -> torch.Tensor:
        """Conv and delta rule of decode rows then prefill rows, reading and writing the state
        slots: [T, Hv * V] (rows past both, padding, are 0). a, b [T, Hv]: the gates' inputs
        (g = -exp(A_log) softplus(a + dt_bias) float32, beta = sigmoid(b) in the model dtype,
        as HF rounds it: formed in the decode and verify kernels, in torch for prefill)."""
        nd = meta.num_decode_tokens
        T = qkv.shape[0]
        out = qkv.new_zeros(T, self.d.value_dim)  # [T, Hv * V]
        gates = dict(A_log=self.A_log, dt_bias=self.dt_bias)
        if nd and meta.num_accepted_tokens is not None:
            out[:nd] = self._verify(qkv[:nd], a[:nd], b[:nd], meta).reshape(nd, -1)
        elif nd:
            idx = meta.decode_state_indices[:nd]
            conv = causal_conv1d_update(qkv[:nd], self.conv_state, self.conv1d_weight.squeeze(1),
                                        None, idx, self.d.activation)
            q, k, v = self._split(conv)
            out[:nd] = gated_delta_update(q, k, v, a[:nd], b[:nd], self.ssm_state, idx,
                                          **gates).reshape(nd, -1)
        if meta.num_prefills:
            end = nd + meta.num_prefill_tokens
            conv = causal_conv1d_fn(
                qkv[nd:end], self.conv1d_weight.squeeze(1), None, self.conv_state,
                meta.prefill_query_start_loc, meta.prefill_state_indices,
                meta.prefill_has_initial_state, self.d.activation, meta.prefill_token_seq,
            )
            q, k, v = self._split(conv)
            g, beta = gdn_gate_ref(a[nd:end], b[nd:end], self.A_log, self.dt_bias)
            o = gated_delta_chunk(q, k, v, g, beta, self.ssm_state,
                                  meta.prefill_query_start_loc, meta.prefill_state_indices,
                                  meta.prefill_has_initial_state,
                                  token_seq=meta.prefill_token_seq)
            out[nd:end] = o.reshape(end - nd, -1)
        return out

    def _verify(self, qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                meta: MambaMetadata) -> torch.Tensor:
        """Speculative decoding's decode rows (1 + k tokens each): conv and delta rule from the
        slot of the last accepted position, the state after every position kept in the row's
        slots (as the Mamba2 verify ops do): o [num_decode_tokens, Hv, V]."""
        rows = (meta.decode_query_start_loc, meta.decode_state_slots, meta.num_accepted_tokens,
                meta.decode_idx_mapping)
        conv = causal_conv1d_verify(qkv, self.conv_state, self.conv1d_weight.squeeze(1), None,
                                    *rows, self.d.activation)
        q, k, v = self._split(conv)
        return gated_delta_verify(q, k, v, a, b, self.ssm_state, *rows, A_log=self.A_log,
                                  dt_bias=self.dt_bias)

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The conv output [n, conv_dim] as q, k [n, Hk, K] and v [n, Hv, V] views."""
        d = self.d
        n = conv.shape[0]
        q, k, v = conv.split([d.key_dim, d.key_dim, d.value_dim], dim=-1)
        return (q.view(n, d.num_k_heads, d.head_k_dim), k.view(n, d.num_k_heads, d.head_k_dim),
                v.view(n, d.num_v_heads, d.head_v_dim))


def regroup_qkvz(w: torch.Tensor, d: GatedDeltaNetDims) -> torch.Tensor:
    """HF's in_proj_qkvz rows, grouped per key head as [q (K), k (K), v (r V), z (r V)] for
    r = Hv / Hk, -> [all q | all k | all v | all z] (value heads keep their order)."""
    r = d.num_v_heads // d.num_k_heads
    parts = w.view(d.num_k_heads, -1, w.shape[-1]).split(
        [d.head_k_dim, d.head_k_dim, r * d.head_v_dim, r * d.head_v_dim], dim=1)
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts], dim=0)


def regroup_ba(w: torch.Tensor, d: GatedDeltaNetDims) -> torch.Tensor:
    """HF's in_proj_ba rows, [b (r), a (r)] per key head, -> [all b | all a]."""
    r = d.num_v_heads // d.num_k_heads
    parts = w.view(d.num_k_heads, 2 * r, w.shape[-1]).split([r, r], dim=1)
    return torch.cat([p.reshape(-1, w.shape[-1]) for p in parts], dim=0)
