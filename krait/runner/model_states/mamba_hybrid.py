"""MambaHybridModelState: models with recurrent-state layers (Mamba2, Gated DeltaNet), alone or
beside attention."""

from __future__ import annotations

import numpy as np
import torch

from krait.config import EngineConfig, resolve_dtype
from krait.layers.mamba2 import MambaMetadata
from krait.ops._dispatch import use_triton
from krait.ops.num_accepted import fill_num_accepted, fill_replay_ctl
from krait.runner.attention_metadata import StepMetadata
from krait.runner.input_batch import InputBatch, host_to_device, to_device
from krait.runner.model_states.default import DefaultModelState


class MambaHybridModelState(DefaultModelState):
    """Adds per-request state slots (conv + recurrent state of every Mamba2 or Gated DeltaNet
    layer) to the KV cache.

    A running request owns 1 slot without speculative decoding (1 + k with k draft tokens;
    for an all-Mamba2 model, columns 1..k are conv-only slots: `conv_only_columns`).
    Slots are reset when (re)assigned. `num_accepted_tokens`, `replay_ctl` and the Mamba2
    layers' kept inputs (`ssm_replay`: their state update's deferred commit) exist only with
    speculation on."""

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        super().__init__(model, config)
        # every layer with per-request state: Mamba2 mixers and Gated DeltaNet layers alike
        # (a conv window + a recurrent state per slot)
        self.mamba_layers = [m for m in model.modules() if getattr(m, "has_recurrent_state", False)]
        chunk_sizes = {m.chunk_layout_size for m in self.mamba_layers} - {None}
        if len(chunk_sizes) > 1:
            raise ValueError(f"mamba layers disagree on chunk_size: {sorted(chunk_sizes)}")
        # the Mamba2 SSD chunk the per-step chunk layout is built for (None: no Mamba2 layers)
        self.chunk_size = chunk_sizes.pop() if chunk_sizes else None
        spec = config.speculative
        self.num_spec_tokens = spec.num_speculative_tokens if spec is not None else 0
        self.slots_per_request = 1 + self.num_spec_tokens
        ssm = config.cache.mamba_ssm_cache_dtype
        self.ssm_dtype = config.model.dtype if ssm == "auto" else resolve_dtype(ssm, None, config.device)
        self._ssm_dtype_auto = ssm == "auto"
        self.conv_dtype = config.model.dtype
        self.num_accepted_tokens: torch.Tensor | None = None
        self.replay_ctl: torch.Tensor | None = None
        self.max_reqs = config.scheduler.max_num_seqs
        if spec is not None:
            # int32 per request row; 1 is the neutral count
            self.num_accepted_tokens = torch.ones(
                self.max_reqs, dtype=torch.int32, device=self.device
            )
            # int32 per request row: the Mamba2 state update's kept tokens (0: none)
            self.replay_ctl = torch.zeros(self.max_reqs, dtype=torch.int32, device=self.device)
        self._state_indices_np = None
        self._step_drafts: torch.Tensor | None = None
        # with speculation on and every recurrent layer a Mamba2 mixer (its SSM state committed
        # once a step from slot column 0: the deferred commit), a request's columns 1..k keep
        # conv windows alone: they come from a pool of conv-only slots (ids past the full
        # slots'), with no SSM state behind them
        self.conv_only_columns = self.num_spec_tokens if self._replay_layers() and all(
            hasattr(m, "replay_shapes") for m in self.mamba_layers) else 0
        self.num_ssm_slots = 0  # slots with an SSM state: ids [0, num_ssm_slots)

    # -- cache sizing and allocation -----------------------------------------------------
    def layer_ssm_dtype(self, m: torch.nn.Module) -> torch.dtype:
        """A layer's recurrent-state dtype: `mamba_ssm_cache_dtype` when set, else the layer's
        own preference (`recurrent_state_dtype`: float32 for Gated DeltaNet), else the model's."""
        own = getattr(m, "recurrent_state_dtype", None)
        return own if (self._ssm_dtype_auto and own is not None) else self.ssm_dtype

    def state_bytes_per_slot(self) -> int:
        c = torch.empty((), dtype=self.conv_dtype).element_size()
        total = 0
        for m in self.mamba_layers:
            conv, ssm = m.state_shapes()
            s = torch.empty((), dtype=self.layer_ssm_dtype(m)).element_size()
            total += int(np.prod(conv)) * c + int(np.prod(ssm)) * s
        # the kept inputs belong to request rows, not slots: their share of each request's slots
        replay = self._replay_bytes()
        if not replay:
            return total
        # a request's full slots: 1 beside conv-only ones, else all of its slots
        full = 1 if self.conv_only_columns else self.slots_per_request
        return total + -(-replay // (self.max_reqs * full))

    def conv_bytes_per_slot(self) -> int:
        c = torch.empty((), dtype=self.conv_dtype).element_size()
        return sum(int(np.prod(m.state_shapes()[0])) * c for m in self.mamba_layers)

    def _replay_layers(self) -> list[torch.nn.Module]:
        """The layers whose state update defers its commit (Mamba2 mixers), with speculation
        on; none otherwise."""
        if getattr(self, "replay_ctl", None) is None:  # (also a sizing-only instance)
            return []
        return [m for m in self.mamba_layers if hasattr(m, "replay_shapes")]

    def _replay_bytes(self) -> int:
        size = torch.empty((), dtype=self.conv_dtype).element_size()
        return sum(int(np.prod(shape)) * size for m in self._replay_layers()
                   for shape in m.replay_shapes(self.max_reqs, self.slots_per_request))

    def allocate_caches(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        """`num_slots` full slots (conv window and SSM state: ids [0, num_slots)) and
        `num_conv_slots` conv-only ones (ids past them)."""
        super().allocate_caches(num_blocks, num_slots)
        self.num_ssm_slots = num_slots
        for m in self.mamba_layers:
            conv, ssm = m.state_shapes()
            (dim, taps) = conv
            # stored channel-last [slots, taps, dim] and bound as its [slots, dim, taps] view: the
            # ops follow strides, and a decode step's conv update then reads and writes each tap
            # of many channels with 16-byte accesses (dim-major rows of 3 taps forced 2-byte ones)
            m.conv_state = torch.zeros(
                (num_slots + num_conv_slots, taps, dim), dtype=self.conv_dtype, device=self.device
            ).transpose(1, 2)
            m.ssm_state = torch.zeros((num_slots, *ssm), dtype=self.layer_ssm_dtype(m),
                                      device=self.device)
        for m in self._replay_layers():  # in the model dtype, as the state update's inputs
            kept = [torch.zeros(shape, dtype=self.conv_dtype, device=self.device)
                    for shape in m.replay_shapes(self.max_reqs, self.slots_per_request)]
            m.ssm_replay = (*kept, self.replay_ctl)

    # -- requests -----------------------------------------------------------------------
    def add_requests(self, new: list[tuple[int, list[int]]],
                     restores: list[int] | None = None) -> None:
        """Resets the new requests' slots, so nothing of an earlier owner leaks: every layer's
        slot rows zeroed by one multi-tensor launch per state dtype (on the GPU), not two
        launches a layer (a hybrid's 48 layers took ~100 launches of host time before each new
        request's prefill). `restores[i] >= 0`: request i hit the prefix cache and its first
        slot starts from that state snapshot instead (a copy, never shared)."""
        if not any(ss for _, ss in new):
            return
        restores = restores or [-1] * len(new)
        zeroed = [s for (_, ss), r in zip(new, restores) for s in (ss[1:] if r >= 0 else ss)]
        if zeroed:
            torch._foreach_zero_(self._slot_rows(zeroed))
        copies = [(r, ss[0]) for (_, ss), r in zip(new, restores) if r >= 0]
        if copies:
            self.copy_states(copies)
        if self.num_accepted_tokens is not None:
            rows = host_to_device([i for i, _ in new], self.device, torch.long)
            self.num_accepted_tokens.index_fill_(0, rows, 1)
            self.replay_ctl.index_fill_(0, rows, 0)

    def _slot_rows(self, slots: list[int]) -> list[torch.Tensor]:
        """Each layer's conv and SSM state rows of these slots, contiguous views (the conv
        state is bound as a transposed view)."""
        conv = [m.conv_state.transpose(1, 2)[s] for m in self.mamba_layers for s in slots]
        ssm = [m.ssm_state[s] for m in self.mamba_layers for s in slots
               if s < self.num_ssm_slots]  # conv-only slots have none
        return conv + ssm

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copies every layer's state of slot `src` into slot `dst` for each (src, dst): prefix
        caching's snapshots (saved after a step's forward, restored into a fresh slot)."""
        if pairs:
            src, dst = zip(*pairs)
            torch._foreach_copy_(self._slot_rows(list(dst)), self._slot_rows(list(src)))

    # -- per step ---------------------------------------------------------------------
    def prepare_attn(
        self, batch: InputBatch, for_capture: bool = False, into: StepMetadata | None = None
    ) -> StepMetadata:
        attn = self.attention_metadata(batch, for_capture) if self.attn_layers else None
        mamba = self.mamba_metadata(batch, into.mamba if into is not None else None)
        return StepMetadata(attn=attn, mamba=mamba)

    def mamba_metadata(self, batch: InputBatch, into: MambaMetadata | None = None) -> MambaMetadata:
        """`into`: a CUDA graph's captured metadata of the same layout, refilled in place."""
        n, npad = batch.num_reqs, batch.num_reqs_padded
        nd = batch.num_decodes
        slots = np.full(npad, -1, dtype=np.int32)
        states = self.request_states
        slots[:n] = states.state_slots[batch.idx_mapping_np[:n], 0]
        qsl = batch.query_start_loc_np
        npf = n - nd
        if npf:
            # a prefill graph's spare rows (no tokens, slot -1) count as prefill rows, so that
            # its metadata has one shape whatever the step's real row count
            npf = npad - nd
            pqsl = (qsl[nd : npad + 1] - qsl[nd]).astype(np.int32)
            has_init = batch.num_computed_tokens_np[nd:npad] > 0
            num_prefill_tokens = int(qsl[n] - qsl[nd])
            num_decode_tokens = int(qsl[nd])
        else:
            pqsl = np.zeros(1, dtype=np.int32)
            has_init = np.zeros(0, dtype=bool)
            num_prefill_tokens = 0
            num_decode_tokens = batch.num_tokens_padded  # padded decode rows carry slot -1
        dev = self.device
        arrays = [slots, pqsl, has_init.astype(np.int32)]
        if self.num_accepted_tokens is not None:
            arrays += self._verify_arrays(batch, npad - npf)
        views, flat = to_device(
            arrays, np.int32, dev, tag="mamba", flat=True,
            out=into.device_i32 if into is not None else None, skip_unchanged=True,
        )
        slots_t, pqsl_t, init_t = views[:3]
        meta = MambaMetadata(
            num_decodes=nd,
            num_prefills=npf,
            num_decode_tokens=num_decode_tokens,
            num_prefill_tokens=num_prefill_tokens,
            state_indices=slots_t,
            prefill_query_start_loc=pqsl_t,
            prefill_has_initial_state=init_t,
            device_i32=flat,
        )
        if npf and use_triton(slots_t):  # what the Triton launchers take, once a step
            from krait.ops.causal_conv1d import token_to_seq
            from krait.ops.mamba_ssd import chunk_layout

            # sized for the padded tokens (a prefill graph's bucket: those past the last row
            # are in no sequence and no chunk), so that one layout serves every step of a bucket
            padded = batch.num_tokens_padded - num_decode_tokens
            meta.prefill_token_seq = token_to_seq(meta.prefill_query_start_loc, padded)
            if self.chunk_size is not None:
                meta.prefill_chunk_layout = chunk_layout(
                    meta.prefill_query_start_loc, meta.prefill_state_indices, self.chunk_size,
                    padded,
                )
        if self.num_accepted_tokens is not None:
            meta.num_accepted_tokens = self.num_accepted_tokens
            (meta.num_decode_draft_tokens, meta.decode_query_start_loc,
             meta.decode_state_slots) = views[3:]
            meta.decode_idx_mapping = batch.idx_mapping[: npad - npf]
            # the step's draft counts, for its postprocess_state (device memory a graph's
            # next refill overwrites only after that, in stream order)
            self._step_drafts = meta.num_decode_draft_tokens
        return meta

    def _verify_arrays(self, batch: InputBatch, ndec: int) -> list[np.ndarray]:
        """Speculative decoding's decode-row inputs: draft counts [num_reqs_padded] (-1 for
        rows that are not decode rows, 0 for a decode row without drafts), the decode rows'
        query_start_loc [ndec + 1] and their slots [ndec, 1 + k] (-1 for padding rows). `ndec`
        counts padded decode rows (CUDA graphs) too."""
        n, nd = batch.num_reqs, batch.num_decodes
        draft = np.full(batch.num_reqs_padded, -1, dtype=np.int32)
        ndraft = batch.num_draft_tokens_per_req
        draft[:nd] = ndraft[:nd] if ndraft is not None else 0
        draft[n:ndec] = 0  # a decode graph's padding rows
        qsl = batch.query_start_loc_np[: ndec + 1].astype(np.int32)
        slots = np.full((ndec, self.slots_per_request), -1, dtype=np.int32)
        slots[:nd] = self.request_states.state_slots[batch.idx_mapping_np[:nd]]
        return [draft, qsl, slots]

    def postprocess_state(
        self,
        idx_mapping: torch.Tensor,
        num_sampled: torch.Tensor | int,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> None:
        """Records each row's accepted count (0 -> 1; -1 rows skipped) and the Mamba2 state
        update's control words (`fill_replay_ctl`, from this step's draft counts). Without
        speculative decoding every step accepts exactly one position: nothing to record."""
        if self.num_accepted_tokens is None:
            return
        fill_num_accepted(self.num_accepted_tokens, idx_mapping, num_sampled)
        if self._step_drafts is not None and isinstance(num_sampled, torch.Tensor):
            fill_replay_ctl(self.replay_ctl, idx_mapping, num_sampled.to(torch.int32),
                            self._step_drafts)
