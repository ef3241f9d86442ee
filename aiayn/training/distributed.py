"""torch.distributed as torchrun sets it up: who am I, how many are we, sum this.

One process (no torchrun, or --nproc-per-node 1) runs without a process group at all, so
the single-process path has no distributed code in it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    local_rank: int = 0
    size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world_from_env() -> World:
    """Rank and size from the variables torchrun exports (RANK, LOCAL_RANK, WORLD_SIZE),
    checked: whole numbers, 0 <= RANK < WORLD_SIZE, LOCAL_RANK >= 0 (a rank outside the world
    would wait for its process group for ever)."""
    values = {}
    for name, default in (("RANK", 0), ("LOCAL_RANK", 0), ("WORLD_SIZE", 1)):
        text = os.environ.get(name, str(default))
        try:
            values[name] = int(text)
        except ValueError:
            raise ValueError(f"environment variable {name}={text!r}: not a whole number; "
                             "torchrun sets it (unset it to run one process)") from None
    rank, local, size = values["RANK"], values["LOCAL_RANK"], values["WORLD_SIZE"]
    if size < 1 or not 0 <= rank < size or local < 0:
        raise ValueError(f"environment variables RANK={rank}, LOCAL_RANK={local}, "
                         f"WORLD_SIZE={size}: need WORLD_SIZE >= 1, 0 <= RANK < WORLD_SIZE and "
                         "LOCAL_RANK >= 0; torchrun sets them (unset them to run one process)")
    return World(rank, local, size)


def init(world: World, device: torch.device) -> None:
    """Join the process group: NCCL between GPUs, gloo between CPU processes."""
    if world.distributed and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=world.rank, world_size=world.size)


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: list[float], device: torch.device, world: World) -> list[float]:
    """Sum a few numbers over all processes (float64, so token counts stay exact)."""
    if not world.distributed:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_sum_(t: torch.Tensor, world: World) -> torch.Tensor:
    """Sum a tensor over all processes, in place, without waiting for the result on the
    host (NCCL queues it on the GPU); returns it."""
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def broadcast_values(values: list[float], device: torch.device, world: World) -> list[float]:
    """Rank 0's decisions and clock readings (bools read as 0/1), for every rank, in one
    collective."""
    if not world.distributed:
        return [float(v) for v in values]
    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    dist.broadcast(t, src=0)
    return t.tolist()
