"""Load-time weight sharding: a parameter's `tp_spec` says which ranges of the checkpoint tensor
this rank holds, and `read_shard` reads just those (through safetensors' `get_slice`, so a rank
never materialises the full tensor)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from krait.distributed import parallel_state as ps


@dataclass(frozen=True)
class ShardSpec:
    """The local tensor along `dim` is the concatenation of the checkpoint tensor's ranges
    `pieces` [(start, length), ...] along `dim` (`dim` may be negative), zero-padded to the
    parameter's size (a vocabulary shard past the vocabulary's end). `full` is the checkpoint's
    size along `dim`; no pieces: the rank holds zeros (a row-parallel bias off rank 0)."""

    dim: int
    full: int
    pieces: tuple[tuple[int, int], ...]


def even_pieces(segments: list[int], tp: int | None = None, rank: int | None = None
                ) -> tuple[tuple[int, int], ...]:
    """Each segment (consecutive ranges of `segments`' sizes) split evenly: this rank's range of
    every segment, in order."""
    tp = ps.get_tp_size() if tp is None else tp
    rank = ps.get_tp_rank() if rank is None else rank
    out, start = [], 0
    for size in segments:
        n = size // tp
        out.append((start + rank * n, n))
        start += size
    return tuple(out)


def set_spec(param: torch.nn.Parameter | None, spec: ShardSpec | None) -> None:
    if param is not None and spec is not None:
        param.tp_spec = spec


class LazyTensor:
    """A checkpoint tensor not read yet (a safetensors slice): `shape`, `read(index)`, `full()`."""

    def __init__(self, sl) -> None:
        self._sl = sl
        self.shape = torch.Size(sl.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    def read(self, index: tuple) -> torch.Tensor:
        return self._sl[index]

    def full(self) -> torch.Tensor:
        return self._sl[:]


def materialize(src) -> torch.Tensor:
    return src.full() if isinstance(src, LazyTensor) else src


def read_shard(src, spec: ShardSpec | None, local_shape: torch.Size | tuple) -> torch.Tensor:
    """This rank's part of checkpoint tensor `src` (a tensor or a LazyTensor) under `spec`, with
    the parameter's `local_shape`. ValueError when the checkpoint's shape does not fit."""
    if spec is None:
        t = materialize(src)
        if tuple(t.shape) != tuple(local_shape):
            raise ValueError(f"has shape {tuple(t.shape)}, the model expects {tuple(local_shape)}")
        return t
    nd = len(src.shape)
    dim = spec.dim % nd
    want = list(local_shape)
    want[dim] = spec.full
    if list(src.shape) != want:
        raise ValueError(f"has shape {tuple(src.shape)}, the model expects {tuple(want)} "
                         "(before sharding)")
    parts = []
    for start, length in spec.pieces:
        idx = [slice(None)] * nd
        idx[dim] = slice(start, start + length)
        parts.append(src.read(tuple(idx)) if isinstance(src, LazyTensor) else src[tuple(idx)])
    have = sum(p.shape[dim] for p in parts)
    if have < local_shape[dim]:
        pad = list(local_shape)
        pad[dim] = local_shape[dim] - have
        dtype = parts[0].dtype if parts else torch.float32
        parts.append(torch.zeros(pad, dtype=dtype))
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def load_param(param: torch.Tensor, src) -> None:
    """Copies checkpoint tensor `src` into `param`, sharded by `param.tp_spec` when it has one."""
    spec = getattr(param, "tp_spec", None)
    if spec is None and not isinstance(src, LazyTensor):
        if param.shape != src.shape:
            raise ValueError(f"has shape {tuple(src.shape)}, the model expects "
                             f"{tuple(param.shape)}")
        param.data.copy_(src)
        return
    param.data.copy_(read_shard(src, spec, param.shape))
