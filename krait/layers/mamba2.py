"""The Mamba2 mixer over packed varlen batches with per-request state slots."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from krait.distributed import parallel_state as ps
from krait.distributed.sharding import ShardSpec, set_spec
from krait.layers.linear import (
    ColumnParallelLinear,
    Linear,
    RowParallelLinear,
    conv_linear,
    gated_norm_linear,
)
from krait.ops import linear as plan
from krait.ops._dispatch import use_triton
from krait.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from krait.ops.gated_rms_norm import gated_rms_norm
from krait.ops.mamba_ssd import mamba_chunk_scan
from krait.ops.selective_state_update import (
    gated_part_size,
    selective_state_update,
    selective_state_update_triton,
)
from krait.runner.piecewise_graphs import mixer_call


@dataclass
class MambaMetadata:
    """Per step, built by MambaHybridModelState. Decode rows come first in the batch, one token
    each; prefill rows (any chunk of a prompt, a final chunk of one token included) follow."""

    num_decodes: int
    num_prefills: int
    num_decode_tokens: int
    num_prefill_tokens: int
    state_indices: torch.Tensor  # int32 [num_reqs_padded]: slot of each row, -1 = padding
    prefill_query_start_loc: torch.Tensor  # int32 [num_prefills + 1], from 0
    prefill_has_initial_state: torch.Tensor  # int32 (0/1) [num_prefills]
    # only with speculative decoding (invariant 3); None otherwise
    num_accepted_tokens: torch.Tensor | None = None  # int32 [max_reqs], by req_state_idx
    num_decode_draft_tokens: torch.Tensor | None = None  # int32 [num_reqs_padded], -1: not decode
    # decode rows as a verify batch (1 + drafts tokens each): int32 [decode rows + 1] from 0,
    # each row's slots int32 [decode rows, 1 + k] (the state after each position goes to its
    # column; the row starts from column num_accepted - 1), and its req_state_idx (-1: padding)
    decode_query_start_loc: torch.Tensor | None = None
    decode_state_slots: torch.Tensor | None = None
    decode_idx_mapping: torch.Tensor | None = None
    # per-step precomputations shared by every layer (GPU kernels); None: each op computes its own
    prefill_token_seq: torch.Tensor | None = None  # int32 [num_prefill_tokens]
    prefill_chunk_layout: tuple | None = None  # mamba_ssd.chunk_layout(...) for chunk_size
    # int32, flat: state_indices, prefill_query_start_loc and prefill_has_initial_state are views
    # of it (a decode graph's replay refills it in one copy)
    device_i32: torch.Tensor | None = None

    @property
    def decode_state_indices(self) -> torch.Tensor:
        # padded decode rows (CUDA graphs) carry -1 and are skipped by the ops
        return self.state_indices[: self.state_indices.shape[0] - self.num_prefills]

    @property
    def prefill_state_indices(self) -> torch.Tensor:
        n = self.state_indices.shape[0]
        return self.state_indices[n - self.num_prefills :]


@dataclass(frozen=True)
class Mamba2Dims:
    hidden_size: int
    num_heads: int
    head_dim: int
    n_groups: int
    d_state: int
    d_conv: int
    chunk_size: int
    eps: float
    use_conv_bias: bool = True
    use_bias: bool = False
    norm_group_size: int | None = None  # default intermediate // n_groups
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    activation: str = "silu"

    @property
    def intermediate(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.d_state


def time_step_limit(cfg) -> tuple[float, float]:
    """The config's dt clamp, tolerating a missing key and the JSON encodings of infinity."""
    lim = getattr(cfg, "time_step_limit", None)
    if not lim:
        return (0.0, float("inf"))
    lo, hi = (float(v["__float__"]) if isinstance(v, dict) else float(v) for v in lim)
    return (lo, hi)


def mamba_tp_layout(d: Mamba2Dims, tp: int, rank: int) -> tuple[Mamba2Dims, dict]:
    """This TP rank's mixer: its dims (heads split; groups split, or with fewer groups than
    ranks the one group its heads use, replicated) and the checkpoint ranges it holds of
    in_proj's rows [z | x | B | C | dt], the conv channels [x | B | C], the per-head vectors and
    the norm weight. The gated norm stays exact where groups split (it normalises per group);
    with replicated groups a group spans several ranks and the norm sums its squares across
    them (`Mamba2Mixer._cross_rank_gated_norm`)."""
    H, P, G, N, inter = d.num_heads, d.head_dim, d.n_groups, d.d_state, d.intermediate
    heads = H // tp
    li = heads * P
    groups = max(1, G // tp)
    g0 = (rank * heads) // (H // G)  # the first group this rank's heads use
    gn = G * N
    local = dataclasses.replace(d, num_heads=heads, n_groups=groups,
                                norm_group_size=d.norm_group_size or inter // G)
    pieces = {
        "in_proj": ((rank * li, li), (inter + rank * li, li), (2 * inter + g0 * N, groups * N),
                    (2 * inter + gn + g0 * N, groups * N), (2 * inter + 2 * gn + rank * heads,
                                                            heads)),
        "conv": ((rank * li, li), (inter + g0 * N, groups * N), (inter + gn + g0 * N, groups * N)),
        "heads": ((rank * heads, heads),),
        "channels": ((rank * li, li),),
        "group": g0,
    }
    return local, pieces


class Mamba2Mixer(torch.nn.Module):
    """HF Mamba2Mixer semantics: in_proj -> [gate | xBC | dt]; causal conv on xBC; SSD scan;
    gated RMSNorm; out_proj. The runner binds `conv_state` [num_slots, conv_dim, d_conv - 1] and
    `ssm_state` [num_slots, heads, head_dim, d_state]. Under TP `d` is the whole mixer's dims and
    `self.d` this rank's (`mamba_tp_layout`); out_proj is row-parallel (`reduce_output=False`
    leaves its all-reduce to the caller)."""

    has_recurrent_state = True

    @property
    def chunk_layout_size(self) -> int:
        """The SSD chunk the model state builds the per-step chunk layout for."""
        return self.d.chunk_size

    def __init__(self, d: Mamba2Dims, reduce_output: bool = True) -> None:
        super().__init__()
        full = d
        tp = ps.get_tp_size()
        pieces = None
        self.cross_rank_norm = False
        if tp > 1:
            d, pieces = mamba_tp_layout(full, tp, ps.get_tp_rank())
            self.cross_rank_norm = full.n_groups < tp
            self._tp_group, self._full_groups = pieces["group"], full.n_groups
        self.d = d
        in_full = full.intermediate + full.conv_dim + full.num_heads
        if pieces is None:
            self.in_proj = Linear(d.hidden_size, in_full, d.use_bias)
        else:
            self.in_proj = ColumnParallelLinear(d.hidden_size, in_full, d.use_bias,
                                                pieces=pieces["in_proj"])
        # stored as HF's Conv1d weight [conv_dim, 1, d_conv]
        self.conv1d_weight = torch.nn.Parameter(torch.empty(d.conv_dim, 1, d.d_conv))
        self.conv1d_bias = torch.nn.Parameter(torch.empty(d.conv_dim)) if d.use_conv_bias else None
        self.dt_bias = torch.nn.Parameter(torch.empty(d.num_heads))
        self.A_log = torch.nn.Parameter(torch.empty(d.num_heads))
        self.D = torch.nn.Parameter(torch.empty(d.num_heads))
        self.norm_weight = torch.nn.Parameter(torch.ones(d.intermediate))
        self.out_proj = RowParallelLinear(full.intermediate, d.hidden_size, d.use_bias,
                                          reduce=reduce_output)
        if pieces is not None:
            conv = ShardSpec(0, full.conv_dim, pieces["conv"])
            set_spec(self.conv1d_weight, conv)
            set_spec(self.conv1d_bias, conv)
            for p in (self.dt_bias, self.A_log, self.D):
                set_spec(p, ShardSpec(0, full.num_heads, pieces["heads"]))
            set_spec(self.norm_weight, ShardSpec(0, full.intermediate, pieces["channels"]))
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        # with speculative decoding: (kept x, kept dt, kept B, replay_ctl), `replay_shapes`
        self.ssm_replay: tuple[torch.Tensor, ...] | None = None
        self._A: torch.Tensor | None = None  # -exp(A_log) in float32, computed once

    def neg_A(self) -> torch.Tensor:
        if self._A is None or self._A.device != self.A_log.device:
            self._A = -torch.exp(self.A_log.detach().float())
        return self._A

    def state_shapes(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        d = self.d
        return (d.conv_dim, d.d_conv - 1), (d.num_heads, d.head_dim, d.d_state)

    def replay_shapes(self, max_reqs: int, tokens: int) -> tuple[tuple[int, ...], ...]:
        """Speculative decoding's kept inputs of the state update (`selective_state_verify`'s
        deferred commit), for max_reqs request rows of at most `tokens` tokens a step: x
        [2, R, S, H, P], dt [2, R, S, H], B [2, R, S, G, N]; the runner binds them as
        `ssm_replay` (with the request rows' control words)."""
        d = self.d
        lead = (2, max_reqs, tokens)
        return (*lead, d.num_heads, d.head_dim), (*lead, d.num_heads), (*lead, d.n_groups,
                                                                         d.d_state)

    def forward(self, x: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]. A lone decode row on the Triton path takes the fusions
        krait/ops/linear.py plans: the conv in in_proj's GEMV epilogue, the gated norm in
        out_proj's GEMV prologue (from the state update's sums of squares)."""
        d = self.d
        group = self._norm_group()
        conv = None
        if self.cross_rank_norm:
            y, gate = self.scan(x, meta)
            return self.out_proj(self._cross_rank_gated_norm(y, gate))
        if (x.shape[0] == 1 and meta.num_prefills == 0 and meta.num_accepted_tokens is None
                and use_triton(x)):
            conv = self._conv_epilogue(meta)
            part = gated_part_size(d.head_dim, d.d_state)
            if plan.gated_norm_prologue(1, *self.out_proj.weight.shape, group, part):
                gate, xbc, dt = self._project(x, conv)
                packed = mixer_call(self._decode_gated, (xbc, dt, gate), meta, "mamba", part,
                                    conv is not None)
                return self.out_proj.finish(gated_norm_linear(
                    packed, self.out_proj.weight, self.out_proj.bias, self.norm_weight, group,
                    d.eps, part))
        gate, xbc, dt = self._project(x, conv)
        y = mixer_call(self._ssm, (xbc, dt), meta, "mamba", conv is not None)
        return self.out_proj(gated_rms_norm(y, gate, self.norm_weight, d.eps, group))

    def _cross_rank_gated_norm(self, y: torch.Tensor, gate: torch.Tensor | None
                               ) -> torch.Tensor:
        """The gated RMSNorm when a norm group spans several TP ranks (fewer groups than
        ranks): each rank's sum of squares goes into its column of a [T, tp] all-reduce, and a
        rank normalises by its group's ranks' total (`gated_rms_norm_ref`'s arithmetic)."""
        d = self.d
        tp, rank = ps.get_tp_size(), ps.get_tp_rank()
        h = y.float()
        if gate is not None:
            h = h * F.silu(gate.float())
        sums = h.new_zeros(h.shape[0], tp)
        sums[:, rank] = h.square().sum(-1)
        ps.tp_all_reduce(sums)
        per_group = tp // self._full_groups  # ranks sharing a group
        lo = self._tp_group * per_group
        var = sums[:, lo : lo + per_group].sum(-1, keepdim=True) / d.norm_group_size
        h = h * torch.rsqrt(var + d.eps)
        return (self.norm_weight.float() * h.to(y.dtype).float()).to(y.dtype)

    def _norm_group(self) -> int:
        """Channels a group of the gated RMSNorm spans."""
        return self.d.norm_group_size or self.d.intermediate // self.d.n_groups

    def _conv_epilogue(self, meta: MambaMetadata) -> tuple | None:
        """The conv's decode step as the one-row in_proj GEMV's epilogue takes it
        (`gemv_triton(conv=...)`), or None where the plan does not (`plan.conv_epilogue`)."""
        d = self.d
        if not plan.conv_epilogue(1, *self.in_proj.weight.shape, d.d_conv):
            return None
        return (d.intermediate, self.conv1d_weight.squeeze(1), self.conv1d_bias,
                self.conv_state, meta.decode_state_indices[:1], d.activation is not None)

    def _decode_gated(self, xbc: torch.Tensor, dt: torch.Tensor, gate: torch.Tensor,
                      meta: MambaMetadata, part: int, convolved: bool = False) -> torch.Tensor:
        """One decode row's conv (unless in_proj's epilogue did it: `convolved`) and state
        update, handing the gated norm's input over instead of y: packed [1, I + I / part]
        float32 = [y * silu(gate) | sums of its squares over runs of `part` channels]
        (`gated_norm_linear` takes it)."""
        d = self.d
        inter = d.intermediate
        idx = meta.decode_state_indices[:1]
        xbc_d = xbc if convolved else causal_conv1d_update(
            xbc, self.conv_state, self.conv1d_weight.squeeze(1), self.conv1d_bias, idx,
            d.activation,
        )
        xs, B, C = self._split_xbc(xbc_d)
        packed = torch.empty(1, inter + inter // part, dtype=torch.float32,
                             device=xbc.device)  # [1, I + I / part]
        selective_state_update_triton(
            self.ssm_state, xs, dt, self.neg_A(), B, C, self.D, self.dt_bias, idx, True,
            d.time_step_limit, gate=gate, g_out=packed[:, :inter], parts_out=packed[:, inter:],
        )
        return packed

    def scan(self, x: torch.Tensor, meta: MambaMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """in_proj, causal conv and SSM over decode rows then prefill rows, reading and writing
        the state slots: returns (y [T, intermediate], gate [T, intermediate])."""
        gate, xbc, dt = self._project(x)
        return mixer_call(self._ssm, (xbc, dt), meta, "mamba"), gate

    def _ssm(self, xbc: torch.Tensor, dt: torch.Tensor, meta: MambaMetadata,
             convolved: bool = False) -> torch.Tensor:
        """The conv and the SSM of every row (the step's sequence mixer): y [T, intermediate].
        `convolved`: one decode row whose conv ran in in_proj's epilogue."""
        nd = meta.num_decode_tokens
        y_dec = self._decode_ssm(xbc, dt, meta, convolved) if nd else None
        y_pre = self._prefill_ssm(xbc, dt, meta) if meta.num_prefills else None
        return self._join(xbc, nd, y_dec, y_pre)

    def _project(self, x: torch.Tensor, conv: tuple | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """in_proj split into (gate [T, I], xBC [T, conv_dim], dt [T, heads]) views (with
        `conv`, xBC comes convolved from the GEMV's epilogue)."""
        d = self.d
        if conv is not None:
            proj = conv_linear(x, self.in_proj.weight, self.in_proj.bias, conv)
        else:
            proj = self.in_proj(x)
        return proj.split([d.intermediate, d.conv_dim, d.num_heads], dim=-1)

    def _decode_ssm(self, xbc: torch.Tensor, dt: torch.Tensor, meta: MambaMetadata,
                    convolved: bool = False) -> torch.Tensor:
        """Conv update (unless in_proj's epilogue did it: `convolved`) and state update of the
        decode rows: y [num_decode_tokens, heads, P]."""
        d = self.d
        nd = meta.num_decode_tokens
        if meta.num_accepted_tokens is not None:
            return self._verify_ssm(xbc[:nd], dt[:nd], meta)
        idx = meta.decode_state_indices[:nd]
        xbc_d = xbc[:nd] if convolved else causal_conv1d_update(
            xbc[:nd], self.conv_state, self.conv1d_weight.squeeze(1), self.conv1d_bias, idx,
            d.activation,
        )
        xs, B, C = self._split_xbc(xbc_d)
        return selective_state_update(
            self.ssm_state, xs, dt[:nd], self.neg_A(), B, C, self.D, self.dt_bias, idx, True,
            d.time_step_limit,
        )

    def _verify_ssm(self, xbc: torch.Tensor, dt: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Speculative decoding's decode rows (1 + k tokens each): the conv from the slot of
        the last accepted position (the conv state after every position kept in the row's
        slots), the state update with its deferred commit (the accepted tokens of the step
        before replayed onto the committed state in slot column 0, this step's inputs kept):
        y [num_decode_tokens, heads, P]."""
        from krait.ops.causal_conv1d_verify import causal_conv1d_verify
        from krait.ops.selective_state_verify import selective_state_verify

        d = self.d
        rows = (meta.decode_query_start_loc, meta.decode_state_slots, meta.num_accepted_tokens,
                meta.decode_idx_mapping)
        xbc_d = causal_conv1d_verify(xbc, self.conv_state, self.conv1d_weight.squeeze(1),
                                     self.conv1d_bias, *rows, d.activation)
        xs, B, C = self._split_xbc(xbc_d)
        return selective_state_verify(
            self.ssm_state, xs, dt, self.neg_A(), B, C, self.D, self.dt_bias,
            meta.decode_query_start_loc, meta.decode_state_slots, meta.decode_idx_mapping,
            self.ssm_replay, True, d.time_step_limit)

    def _prefill_ssm(self, xbc: torch.Tensor, dt: torch.Tensor, meta: MambaMetadata) -> torch.Tensor:
        """Varlen conv and chunked scan of the prefill rows: y [num_prefill_tokens, heads, P]."""
        d = self.d
        nd = meta.num_decode_tokens
        end = nd + meta.num_prefill_tokens
        xbc_p = causal_conv1d_fn(
            xbc[nd:end], self.conv1d_weight.squeeze(1), self.conv1d_bias, self.conv_state,
            meta.prefill_query_start_loc, meta.prefill_state_indices,
            meta.prefill_has_initial_state, d.activation, meta.prefill_token_seq,
        )
        xs, B, C = self._split_xbc(xbc_p)
        return mamba_chunk_scan(
            xs, dt[nd:end], self.neg_A(), B, C, self.D, self.dt_bias, self.ssm_state,
            meta.prefill_query_start_loc, meta.prefill_state_indices,
            meta.prefill_has_initial_state, d.chunk_size, True, d.time_step_limit,
            meta.prefill_chunk_layout,
        )

    def _join(
        self, xbc: torch.Tensor, nd: int, y_dec: torch.Tensor | None, y_pre: torch.Tensor | None
    ) -> torch.Tensor:
        """Decode rows then prefill rows as [T, intermediate] (T = xbc's rows, its dtype); rows
        past both (padding) are 0."""
        T, inter = xbc.shape[0], self.d.intermediate
        parts = [p.reshape(-1, inter) for p in (y_dec, y_pre) if p is not None]
        if len(parts) == 1 and parts[0].shape[0] == T:
            return parts[0]  # the common case: no copy
        y = xbc.new_zeros(T, inter)  # [T, intermediate]
        if y_dec is not None:
            y[:nd] = parts[0]
        if y_pre is not None:
            y[nd : nd + parts[-1].shape[0]] = parts[-1]
        return y

    def _split_xbc(self, xbc: torch.Tensor):
        d = self.d
        n = xbc.shape[0]
        xs, B, C = xbc.split([d.intermediate, d.n_groups * d.d_state, d.n_groups * d.d_state], -1)
        return (
            xs.reshape(n, d.num_heads, d.head_dim),
            B.reshape(n, d.n_groups, d.d_state),
            C.reshape(n, d.n_groups, d.d_state),
        )


def mixer_weight_name(name: str, fragment: str = ".mixer.") -> str:
    """Maps HF mixer tensor names (conv1d.weight/bias, norm.weight) under `fragment` onto
    Mamba2Mixer's parameter names; other names pass through."""
    if fragment not in name:
        return name
    head, tail = name.split(fragment, 1)
    tail = _MIXER_RENAMES.get(tail, tail)
    return head + fragment + tail


_MIXER_RENAMES = {
    "conv1d.weight": "conv1d_weight",
    "conv1d.bias": "conv1d_bias",
    "norm.weight": "norm_weight",
}
