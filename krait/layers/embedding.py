"""Vocabulary-parallel embedding and LM head: each TP rank holds ceil(V / tp) rows of the
vocabulary (the last shard zero-padded). The embedding sums the ranks' masked lookups in one
all-reduce; the head gathers every rank's logits, so every rank holds the full [T, V] logits
and samples the same tokens. With one TP rank both are the plain layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from krait.distributed import parallel_state as ps
from krait.distributed.sharding import ShardSpec, set_spec
from krait.layers.linear import Linear


def _vocab_shard(vocab: int) -> tuple[int, int, int]:
    """(rows a rank holds, its first token id, real rows) for this TP rank."""
    tp, rank = ps.get_tp_size(), ps.get_tp_rank()
    shard = -(-vocab // tp)
    lo = rank * shard
    return shard, lo, max(0, min(shard, vocab - lo))


class VocabParallelEmbedding(torch.nn.Embedding):
    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        self.tp_size = ps.get_tp_size()
        shard, self.vocab_start, real = _vocab_shard(vocab_size)
        super().__init__(shard if self.tp_size > 1 else vocab_size, hidden_size)
        self.vocab_size = vocab_size
        if self.tp_size > 1:
            set_spec(self.weight, ShardSpec(0, vocab_size, ((self.vocab_start, real),)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return ps.tp_all_reduce(out)


class ParallelLMHead(Linear):
    """The output projection over this rank's vocabulary rows; forward returns every rank's
    logits gathered: [T, V]."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        self.tp_size_ = ps.get_tp_size()
        shard, lo, real = _vocab_shard(vocab_size)
        super().__init__(hidden_size, shard if self.tp_size_ > 1 else vocab_size)
        self.vocab_size = vocab_size
        if self.tp_size_ > 1:
            set_spec(self.weight, ShardSpec(0, vocab_size, ((lo, real),)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().forward(x)
        if self.tp_size_ == 1:
            return logits
        return ps.tp_all_gather(logits, dim=-1)[:, : self.vocab_size]


class MissingModule(torch.nn.Module):
    """Stands in for a module another pipeline stage holds: no parameters. Called, it returns
    an empty tensor (the embedding of a stage that receives its input instead)."""

    def __init__(self, recurrent: bool = False) -> None:
        super().__init__()
        self.holds_recurrent_state = recurrent

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return torch.empty(0)
