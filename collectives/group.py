"""A named process group as seen from one rank: its members, this rank's index, and the two
process groups behind it (the device group for tensors on the compute device, and a gloo control
group for host-side agreement)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from collectives.recorder import CollectiveRecorder


@dataclass(frozen=True, eq=False)
class Group:
    """One named group on one rank.

    ``rank`` is this process's index inside the group (0..size-1), ``ranks`` the global ranks of
    the members in group order. ``device_pg`` carries tensors on ``device`` (NCCL on GPUs, gloo on
    CPU); ``control_pg`` is always gloo and carries small host-side agreements. Both are ``None``
    for a size-1 group, where every collective is a no-op.
    """

    name: str
    ranks: tuple[int, ...]
    rank: int
    device: torch.device
    device_pg: Optional[dist.ProcessGroup] = None
    control_pg: Optional[dist.ProcessGroup] = None
    recorder: Optional["CollectiveRecorder"] = field(default=None, repr=False)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def global_rank(self) -> int:
        return self.ranks[self.rank]

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @staticmethod
    def single(device: torch.device | str = "cpu", name: str = "single") -> "Group":
        """A size-1 group: no process group, every collective a no-op (tp=1, one process)."""
        return Group(name=name, ranks=(0,), rank=0, device=torch.device(device))
