"""TensorParallelGroup: rank, world size and the four collectives tensor parallelism needs.

A group of one (`TensorParallelGroup.single()`) is what a ModelRunner built without the
engine gets: every collective is then the identity and no process group exists, so the
single-process path needs no store and no `torch.distributed` set-up at all.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class ShardingError(ValueError):
    """A model dimension cannot be split evenly over the tensor-parallel ranks."""


def shard_range(total: int, rank: int, world_size: int, what: str) -> tuple[int, int]:
    """(start, size) of `rank`'s equal share of `total`; `what` names the dimension."""
    if total % world_size:
        raise ShardingError(
            f"{what} ({total}) is not divisible by tensor_parallel_size {world_size}; "
            f"choose a tensor-parallel size that divides {total}"
        )
    size = total // world_size
    return rank * size, size


class TensorParallelGroup:
    """One rank's view of its tensor-parallel group.

    `group` is the torch.distributed process group (None with a single rank); `device` is
    where collective buffers live (NCCL needs CUDA tensors, gloo CPU ones).
    """

    def __init__(
        self,
        rank: int = 0,
        world_size: int = 1,
        group: dist.ProcessGroup | None = None,
        device: torch.device | str = "cpu",
    ):
        if world_size > 1 and group is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a process group")
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = torch.device(device)

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> TensorParallelGroup:
        return cls(0, 1, None, device)

    @property
    def is_first(self) -> bool:
        """Rank 0 samples and answers the engine."""
        return self.rank == 0

    def __repr__(self) -> str:
        return f"TensorParallelGroup(rank={self.rank}, world_size={self.world_size})"

    # -- collectives (identity with one rank) ------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place; returns it."""
        if self.world_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_to_first(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """Concatenate every rank's `x` along `dim` on rank 0; other ranks get None.

        Rank 0 alone samples, so the full logits are only needed there.
        """
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first else None
        # group_dst / group_src: ranks inside the group (a pipeline stage's group does not
        # start at global rank 0).
        dist.gather(x, parts, group=self.group, group_dst=0)
        return torch.cat(parts, dim=dim) if self.is_first else None

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's `x` on every rank (in place on the others)."""
        if self.world_size > 1:
            dist.broadcast(x, group=self.group, group_src=0)
        return x

    def min_across(self, value: int) -> int:
        """The smallest `value` of all ranks (e.g. KV blocks every rank can hold)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
