"""Process groups and ranks for tensor (TP) and pipeline (PP) parallelism.

Global rank = pp_rank * tp_size + tp_rank: a pipeline stage is tp_size consecutive ranks. The
TP group of a rank is its stage; its PP group is the ranks of every stage with the same
tp_rank (activations travel between them). With tp_size = pp_size = 1 (no `init_distributed`), every collective here is a no-op
that returns its input, so the single-process path makes no collective call."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass
class ParallelState:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: object | None = None
    pp_group: object | None = None
    # global ranks of this rank's PP group, by stage
    pp_ranks: tuple[int, ...] = (0,)

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_output_rank(self) -> bool:
        """The rank that returns the sampled tokens: rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0


_STATE = ParallelState()


def state() -> ParallelState:
    return _STATE


def set_state(new: ParallelState) -> ParallelState:
    """Replaces the process's parallel state (tests build one stage's model in-process with
    groups of None); returns the old one."""
    global _STATE
    old, _STATE = _STATE, new
    return old


def get_tp_size() -> int:
    return _STATE.tp_size


def get_tp_rank() -> int:
    return _STATE.tp_rank


def get_pp_size() -> int:
    return _STATE.pp_size


def get_pp_rank() -> int:
    return _STATE.pp_rank


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, backend: str,
                     timeout_s: float = 600.0) -> ParallelState:
    """Joins the process group (every rank calls it) and builds the TP and PP groups."""
    world = tp_size * pp_size
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    pp_rank, tp_rank = divmod(rank, tp_size)
    tp_group = pp_group = None
    pp_ranks: tuple[int, ...] = (rank,)
    # every rank creates every group, in the same order (torch.distributed's rule)
    for stage in range(pp_size):
        ranks = list(range(stage * tp_size, (stage + 1) * tp_size))
        g = dist.new_group(ranks) if tp_size > 1 else None
        if stage == pp_rank:
            tp_group = g
    for t in range(tp_size):
        ranks = [t + s * tp_size for s in range(pp_size)]
        g = dist.new_group(ranks) if pp_size > 1 else None
        if t == tp_rank:
            pp_group, pp_ranks = g, tuple(ranks)
    new = ParallelState(tp_size, tp_rank, pp_size, pp_rank, tp_group, pp_group, pp_ranks)
    set_state(new)
    return new


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
    set_state(ParallelState())


# -- collectives (no-ops at size 1) ------------------------------------------------------
def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group (in place; returns x). A no-op with one TP rank."""
    if _STATE.tp_size == 1:
        return x
    dist.all_reduce(x, group=_STATE.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenation of every TP rank's x along `dim`, in rank order (x itself at size 1)."""
    if _STATE.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(_STATE.tp_size)]
    dist.all_gather(parts, x, group=_STATE.tp_group)
    return torch.cat(parts, dim=dim)


def pp_send(x: torch.Tensor, to_stage: int) -> None:
    """Sends x to the same TP rank of stage `to_stage` (NCCL: queued on the GPU stream; gloo:
    returns once the receiver has it)."""
    dist.send(x.contiguous(), dst=_STATE.pp_ranks[to_stage])


def host_blocking_sends() -> bool:
    """Whether a send blocks the host until it is received (gloo's do; NCCL's are queued)."""
    return dist.is_initialized() and dist.get_backend() == "gloo"


def pp_recv(x: torch.Tensor, from_stage: int) -> torch.Tensor:
    """Receives into x from the same TP rank of stage `from_stage`; returns x."""
    dist.recv(x, src=_STATE.pp_ranks[from_stage])
    return x
