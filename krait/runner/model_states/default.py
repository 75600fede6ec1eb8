"""DefaultModelState: attention-only models (dense decoders)."""

from __future__ import annotations

import numpy as np
import torch

from krait.config import EngineConfig, resolve_kv_cache_dtype
from krait.layers.attention import Attention
from krait.runner.attention_metadata import AttentionMetadata, StepMetadata
from krait.runner.input_batch import InputBatch


class DefaultModelState:
    """Owns the paged KV cache and builds attention metadata each step."""

    slots_per_request = 0
    # accepted-position counts per request row (speculative decoding on hybrid models only)
    num_accepted_tokens: torch.Tensor | None = None

    def __init__(self, model: torch.nn.Module, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.device = config.device
        self.max_model_len = config.model.max_model_len
        self.block_size = config.cache.block_size
        self.attn_layers = [m for m in model.modules() if isinstance(m, Attention)]
        self.kv_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, config.model.dtype)
        self.request_states = None  # RequestStates, bound by the runner once caches exist

    # -- cache sizing and allocation -----------------------------------------------------
    def kv_bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.kv_dtype).element_size()
        return sum(
            2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in self.attn_layers
        )

    def state_bytes_per_slot(self) -> int:
        return 0

    # per-position slots of speculative decoding that hold conv windows alone (0: none)
    conv_only_columns = 0

    def conv_bytes_per_slot(self) -> int:
        """Bytes of a conv-only slot (`conv_only_columns`)."""
        return 0

    def allocate_caches(self, num_blocks: int, num_slots: int, num_conv_slots: int = 0) -> None:
        for a in self.attn_layers:
            shape = (num_blocks, self.block_size, a.num_kv_heads, a.head_dim)
            # [2, num_blocks, block_size, kv_heads, head_dim]; never assumed zero (invariant 6)
            a.kv_cache = torch.empty((2, *shape), dtype=self.kv_dtype, device=self.device)

    # -- per step ---------------------------------------------------------------------
    def attention_metadata(self, batch: InputBatch, for_capture: bool) -> AttentionMetadata:
        if for_capture:
            # a graph serves any batch of its size: size the launch for the worst case
            max_seq_len = self.max_model_len
            sched = batch.num_scheduled_tokens_np[: batch.num_reqs_padded]
        else:
            max_seq_len = int(np.max(batch.seq_lens_cpu_upper_bound[: batch.num_reqs], initial=0))
            sched = batch.num_scheduled_tokens_np[: batch.num_reqs]
        return AttentionMetadata(
            num_reqs=batch.num_reqs,
            num_tokens=batch.num_tokens,
            query_start_loc=batch.query_start_loc,
            seq_lens=batch.seq_lens,
            block_table=batch.block_table,
            slot_mapping=batch.slot_mapping,
            max_query_len=int(np.max(sched, initial=0)),
            max_seq_len=max_seq_len,
        )

    def prepare_attn(
        self, batch: InputBatch, for_capture: bool = False, into: StepMetadata | None = None
    ) -> StepMetadata:
        """The step's metadata. `into`: a CUDA graph's captured metadata, for states that build
        device tensors of their own (the attention metadata holds the batch's tensors)."""
        return StepMetadata(attn=self.attention_metadata(batch, for_capture))

    def add_requests(self, new: list[tuple[int, list[int]]],
                     restores: list[int] | None = None) -> None:
        """Requests arrived (or resumed) this step: (req_state_idx, state slots) each, and
        (recurrent models with prefix caching) the state snapshot each starts from or -1."""

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Copies recurrent state from slot to slot (no state: nothing to copy)."""

    def postprocess_state(
        self,
        idx_mapping: torch.Tensor,
        num_sampled: torch.Tensor | int,
        num_computed_tokens: torch.Tensor | None = None,
    ) -> None:
        """Dense models keep no per-request state beyond the KV cache: nothing to do."""
