"""Private: this process in a torchrun group, and the batches it takes.

Under torchrun (``RANK``/``WORLD_SIZE`` set) rank ``r`` of ``W`` takes the contiguous batches
``[r * B // W, (r + 1) * B // W)`` of ``B``, so rank 0's rows, then rank 1's, ... are the rows of a
single-process run, in its order. The group (gloo) is used for coordination only: agreeing on
failures before any file is written, and barriers around the join of the part manifests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch.distributed as dist

from hookscope.errors import ExtractError

__all__ = ["Ranks"]


@dataclass
class Ranks:
    """This process in a torchrun group (rank 0 of 1 when alone)."""

    rank: int
    world_size: int
    owns_group: bool

    @staticmethod
    def start() -> Ranks:
        """Join the torch.distributed group that torchrun's environment describes (gloo)."""
        if dist.is_available() and dist.is_initialized():
            return Ranks(dist.get_rank(), dist.get_world_size(), False)
        if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return Ranks(0, 1, False)
        if not dist.is_available():
            raise ExtractError("WORLD_SIZE > 1 but this torch has no torch.distributed")
        dist.init_process_group("gloo")
        return Ranks(dist.get_rank(), dist.get_world_size(), True)

    def batch_range(self, count: int | None) -> tuple[int, int | None]:
        """Return this rank's contiguous batch range ``[start, stop)``."""
        if self.world_size == 1:
            return 0, None
        if count is None:
            raise ExtractError("under torchrun the data must have a length (a Dataset, or a "
                               "DataLoader over one) so that each rank can take its part")
        return self.rank * count // self.world_size, (self.rank + 1) * count // self.world_size

    def agree(self, error: BaseException | None) -> None:
        """Raise on every rank if any rank failed (its own error, or which rank failed)."""
        if self.world_size > 1:
            found: list[str | None] = [None] * self.world_size
            dist.all_gather_object(found, None if error is None else str(error))
            failed = [(r, m) for r, m in enumerate(found) if m is not None]
            if failed and error is None:
                raise ExtractError(f"rank {failed[0][0]} failed before writing: {failed[0][1]}")
        if error is not None:
            raise error

    def share(self, found: str | None, fresh: str) -> str:
        """Return one value for every rank: the first rank's ``found`` that is not ``None``
        (what an earlier run left), else rank 0's ``fresh``."""
        if self.world_size == 1:
            return found or fresh
        gathered: list[str | None] = [None] * self.world_size
        dist.all_gather_object(gathered, found)
        shared: list[str | None] = [next((g for g in gathered if g), fresh)]
        dist.broadcast_object_list(shared, src=0)
        return str(shared[0])

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def stop(self) -> None:
        if self.owns_group:
            dist.destroy_process_group()
